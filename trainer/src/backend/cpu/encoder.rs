//! Token (+ position) embedding on the CPU.

use super::{at, CpuBackend};
use crate::backend::{BResult, EmbedLocs, EncoderOps, Loc, SeqShape, WeightGrads, Weights};

/// `out = wte[tok] (+ wpe[t])`; an empty `wpe` adds no positions.
pub fn encoder_forward(out: &mut [f32], tokens: &[u32], wte: &[f32], wpe: &[f32], s: SeqShape) {
    let SeqShape { b, t, c } = s;
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let o = &mut out[(bi * t + ti) * c..(bi * t + ti + 1) * c];
            o.copy_from_slice(&wte[tok * c..(tok + 1) * c]);
            if !wpe.is_empty() {
                for (o, p) in o.iter_mut().zip(&wpe[ti * c..(ti + 1) * c]) {
                    *o += p;
                }
            }
        }
    }
}

/// `dwte[tok] += dout` (`dwpe[t] += dout` unless `dwpe` is empty), in row order
/// (deterministic).
pub fn encoder_backward(dwte: &mut [f32], dwpe: &mut [f32], dout: &[f32], tokens: &[u32], s: SeqShape) {
    let SeqShape { b, t, c } = s;
    for bi in 0..b {
        for ti in 0..t {
            let tok = tokens[bi * t + ti] as usize;
            let d = &dout[(bi * t + ti) * c..(bi * t + ti + 1) * c];
            for (w, g) in dwte[tok * c..(tok + 1) * c].iter_mut().zip(d) {
                *w += g;
            }
            if !dwpe.is_empty() {
                for (w, g) in dwpe[ti * c..(ti + 1) * c].iter_mut().zip(d) {
                    *w += g;
                }
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
        let wpe = at(p.buf, p.at.wpe.unwrap_or(Loc::new(0, 0)));
        encoder_forward(&mut out[..b * t * c], &tokens[..b * t], at(p.buf, p.at.wte), wpe, s);
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
        // No position table: an empty one just after the token table (disjoint from it).
        let (wte, wpe) = (g.at.wte, g.at.wpe.unwrap_or(Loc::new(g.at.wte.end(), 0)));
        let (wte_g, wpe_g) = super::two_mut(g.buf, wte, wpe);
        if g.fresh {
            // Written, not added to: a scatter leaves the rows of absent tokens as they were.
            wte_g.fill(0.0);
            wpe_g.fill(0.0);
        }
        encoder_backward(wte_g, wpe_g, &dout[..b * t * c], &tokens[..b * t], s);
        Ok(())
    }
}
