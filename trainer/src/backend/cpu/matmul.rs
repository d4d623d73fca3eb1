//! Linear layer on the CPU: `out = inp · Wᵀ + b` and its backward, through matrixmultiply's sgemm.

/// `out[n,oc] = inp[n,c] · w[oc,c]ᵀ + bias[oc]`.
pub fn matmul_forward(out: &mut [f32], inp: &[f32], w: &[f32], bias: Option<&[f32]>, n: usize, c: usize, oc: usize) {
    // SAFETY: the slices have exactly the lengths the strides address (checked below).
    assert!(out.len() == n * oc && inp.len() == n * c && w.len() == oc * c);
    unsafe {
        matrixmultiply::sgemm(
            n,
            c,
            oc,
            1.0,
            inp.as_ptr(),
            c as isize,
            1,
            w.as_ptr(),
            1,
            c as isize,
            0.0,
            out.as_mut_ptr(),
            oc as isize,
            1,
        );
    }
    if let Some(bias) = bias {
        for row in out.chunks_exact_mut(oc) {
            for (o, b) in row.iter_mut().zip(bias) {
                *o += b;
            }
        }
    }
}

/// `dinp = dout · w` (overwrite), `dw += doutᵀ · inp`, `dbias += Σ_rows dout`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) {
    assert!(
        dinp.len() == n * c && dw.len() == oc * c && dout.len() == n * oc && inp.len() == n * c && w.len() == oc * c
    );
    // SAFETY: lengths checked above match the strides.
    unsafe {
        matrixmultiply::sgemm(
            n,
            oc,
            c,
            1.0,
            dout.as_ptr(),
            oc as isize,
            1,
            w.as_ptr(),
            c as isize,
            1,
            0.0,
            dinp.as_mut_ptr(),
            c as isize,
            1,
        );
        matrixmultiply::sgemm(
            oc,
            n,
            c,
            1.0,
            dout.as_ptr(),
            1,
            oc as isize,
            inp.as_ptr(),
            c as isize,
            1,
            1.0,
            dw.as_mut_ptr(),
            c as isize,
            1,
        );
    }
    if let Some(db) = dbias {
        for row in dout.chunks_exact(oc) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
}
