//! Token + position embedding on the CPU.

use super::{at, two_mut, CpuBackend};
use crate::backend::{BResult, EmbedLocs, EncoderOps, SeqShape, WeightGrads, Weights};

pub fn encoder_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], s: SeqShape) {
    let SeqShape { b, t, c } = s;
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
pub fn encoder_backward(dwte: &mut [f32], dwpe: &mut [f32], dout: &[f32], tokens: &[u32], s: SeqShape) {
    let SeqShape { b, t, c } = s;
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

impl EncoderOps for CpuBackend {
    fn encoder_fwd(
        &self,
        out: &mut Vec<f32>,
        tokens: &Vec<u32>,
        p: Weights<'_, Self, EmbedLocs>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        encoder_forward(&mut out[..b * t * c], &tokens[..b * t], at(p.buf, p.at.wte), at(p.buf, p.at.wpe), s);
        Ok(())
    }
    fn encoder_bwd(
        &self,
        g: WeightGrads<'_, Self, EmbedLocs>,
        dout: &Vec<f32>,
        tokens: &Vec<u32>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        let (wte_g, wpe_g) = two_mut(g.buf, g.at.wte, g.at.wpe);
        if g.fresh {
            // Written, not added to: a scatter leaves the rows of absent tokens as they were.
            wte_g.fill(0.0);
            wpe_g.fill(0.0);
        }
        encoder_backward(wte_g, wpe_g, &dout[..b * t * c], &tokens[..b * t], s);
        Ok(())
    }
}
