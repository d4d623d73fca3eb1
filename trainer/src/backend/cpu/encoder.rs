//! Token (+ position) embedding on the CPU, positions optionally within documents.

use super::attention::docs_of;
use super::{at, CpuBackend};
use crate::backend::{BResult, EmbedInputs, EmbedLocs, EncoderOps, Loc, SeqShape, WeightGrads, Weights};

/// The learned position of row `row` (`ti` its position in its sequence): within its
/// document when `docs` says where documents start.
fn position(docs: Option<&[u32]>, row: usize, ti: usize) -> usize {
    docs.map_or(ti, |d| ti - d[row] as usize)
}

/// `out = wte[tok] (+ wpe[p])`; an empty `wpe` adds no positions; `p` the row's position
/// within its sequence, or within its document with `docs` (checked starts).
pub fn encoder_forward(out: &mut [f32], tokens: &[u32], docs: Option<&[u32]>, wte: &[f32], wpe: &[f32], s: SeqShape) {
    let SeqShape { b, t, c } = s;
    for bi in 0..b {
        for ti in 0..t {
            let row = bi * t + ti;
            let tok = tokens[row] as usize;
            let o = &mut out[row * c..(row + 1) * c];
            o.copy_from_slice(&wte[tok * c..(tok + 1) * c]);
            if !wpe.is_empty() {
                let p = position(docs, row, ti);
                for (o, w) in o.iter_mut().zip(&wpe[p * c..(p + 1) * c]) {
                    *o += w;
                }
            }
        }
    }
}

/// `dwte[tok] += dout` (`dwpe[p] += dout` unless `dwpe` is empty), in row order
/// (deterministic); `p` as in [`encoder_forward`].
pub fn encoder_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    docs: Option<&[u32]>,
    s: SeqShape,
) {
    let SeqShape { b, t, c } = s;
    for bi in 0..b {
        for ti in 0..t {
            let row = bi * t + ti;
            let tok = tokens[row] as usize;
            let d = &dout[row * c..(row + 1) * c];
            for (w, g) in dwte[tok * c..(tok + 1) * c].iter_mut().zip(d) {
                *w += g;
            }
            if !dwpe.is_empty() {
                let p = position(docs, row, ti);
                for (w, g) in dwpe[p * c..(p + 1) * c].iter_mut().zip(d) {
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
        x: EmbedInputs<'_, Self>,
        p: Weights<'_, Self, EmbedLocs>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        let docs = docs_of("encoder_fwd", x.docs, b, t)?;
        let wpe = at(p.buf, p.at.wpe.unwrap_or(Loc::new(0, 0)));
        encoder_forward(&mut out[..b * t * c], &x.tokens[..b * t], docs, at(p.buf, p.at.wte), wpe, s);
        Ok(())
    }
    fn encoder_bwd(
        &self,
        g: WeightGrads<'_, Self, EmbedLocs>,
        dout: &Vec<f32>,
        x: EmbedInputs<'_, Self>,
        s: SeqShape,
    ) -> BResult<()> {
        let SeqShape { b, t, c } = s;
        let docs = docs_of("encoder_bwd", x.docs, b, t)?;
        // No position table: an empty one just after the token table (disjoint from it).
        let (wte, wpe) = (g.at.wte, g.at.wpe.unwrap_or(Loc::new(g.at.wte.end(), 0)));
        let (wte_g, wpe_g) = super::two_mut(g.buf, wte, wpe);
        if g.fresh {
            // Written, not added to: a scatter leaves the rows of absent tokens as they were.
            wte_g.fill(0.0);
            wpe_g.fill(0.0);
        }
        encoder_backward(wte_g, wpe_g, &dout[..b * t * c], &x.tokens[..b * t], docs, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::doc_starts;

    /// With document starts, a packed document's rows get the positions (and position
    /// gradients) it would get alone at the start of a sequence; zeros are the plain op.
    #[test]
    fn positions_restart_per_document() {
        let (t, c, v) = (6usize, 2usize, 5usize);
        let s = SeqShape { b: 1, t, c };
        let wte: Vec<f32> = (0..v * c).map(|i| i as f32).collect();
        let wpe: Vec<f32> = (0..t * c).map(|i| 100.0 * (i + 1) as f32).collect();
        let tokens = [1u32, 2, 3, 4, 0, 1];
        let docs = doc_starts(&[2, 4], t, t);
        let mut packed = vec![0.0; t * c];
        encoder_forward(&mut packed, &tokens, Some(&docs), &wte, &wpe, s);
        let mut alone = vec![0.0; 4 * c];
        encoder_forward(&mut alone, &tokens[2..], None, &wte, &wpe, SeqShape { b: 1, t: 4, c });
        assert_eq!(&packed[2 * c..], &alone[..]);
        let mut plain = vec![0.0; t * c];
        encoder_forward(&mut plain, &tokens, None, &wte, &wpe, s);
        let mut zeros = vec![0.0; t * c];
        encoder_forward(&mut zeros, &tokens, Some(&[0; 6]), &wte, &wpe, s);
        assert_eq!(plain, zeros);
        assert_ne!(plain, packed);
        // Backward: position 0 gathers the first row of both documents.
        let dout: Vec<f32> = (0..t * c).map(|i| (i + 1) as f32).collect();
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        encoder_backward(&mut dwte, &mut dwpe, &dout, &tokens, Some(&docs), s);
        assert_eq!(&dwpe[..c], &[1.0 + 5.0, 2.0 + 6.0]);
        assert_eq!(&dwpe[4 * c..], &[0.0; 4]);
    }

    #[test]
    fn bad_document_starts_are_refused() {
        let s = SeqShape { b: 1, t: 3, c: 1 };
        let wte = vec![0.0f32; 4];
        let (tokens, docs) = (vec![0u32; 3], vec![0u32, 2, 2]);
        let p = Weights::new(&wte, EmbedLocs { wte: Loc::all(4), wpe: None });
        let mut out = vec![0.0; 3];
        let e = CpuBackend::new().encoder_fwd(&mut out, EmbedInputs { tokens: &tokens, docs: Some(&docs) }, p, s);
        assert!(e.unwrap_err().to_string().contains("encoder_fwd"));
    }
}
