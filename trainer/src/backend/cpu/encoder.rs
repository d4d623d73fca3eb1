//! Token + position embedding on the CPU.

pub fn encoder_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], b: usize, t: usize, c: usize) {
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..(bi * t + ti + 1) * c];
            let e = &wte[tok * c..(tok + 1) * c];
            let p = &wpe[ti * c..(ti + 1) * c];
            for j in 0..c {
                o[j] = e[j] + p[j];
            }
        }
    }
}

/// `dwte[tok] += dout`, `dwpe[t] += dout`, in row order (deterministic).
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    b: usize,
    t: usize,
    c: usize,
) {
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let d = &dout[(bi * t + ti) * c..(bi * t + ti + 1) * c];
            for (w, g) in dwte[tok * c..(tok + 1) * c].iter_mut().zip(d) {
                *w += g;
            }
            for (w, g) in dwpe[ti * c..(ti + 1) * c].iter_mut().zip(d) {
                *w += g;
            }
        }
    }
}
