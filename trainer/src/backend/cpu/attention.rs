//! Causal self-attention on the CPU, multi-head or grouped-query, and the rotary position
//! embedding, both optionally within documents (`docs`: each row's document start, see
//! `AttnInputs`). Saves the softmax probabilities `[B, NH, T, T]` for backward: fine for
//! the reference, which is why the CUDA backend uses a tiled (flash-style) kernel instead.

use super::CpuBackend;
use crate::backend::{check_doc_starts, AmaxSink, AttentionOps, AttnInputs, AttnShape, BResult, BackendError};

/// The first key row `row` attends (its position within its sequence if `docs` is `None`:
/// 0).
fn first_key(docs: Option<&[u32]>, row: usize) -> usize {
    docs.map_or(0, |d| d[row] as usize)
}

/// `qkv[B,T,qkv_width]` (query heads, key heads, value heads per row) → `out[B,T,C]`;
/// `att[B,NH,T,T]` saved. Query head `h` reads key/value head `h / group`. With `docs`
/// (`[B·T]` document starts) the query at position `q` attends keys `docs[q]..=q` only.
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], docs: Option<&[u32]>, s: AttnShape) {
    let AttnShape { b, t, c, nh, .. } = s;
    let (hs, w, g) = (s.hs(), s.qkv_width(), s.group());
    let scale = 1.0 / (hs as f32).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            let (ko, vo) = (s.k_off() + (h / g) * hs, s.v_off() + (h / g) * hs);
            for ti in 0..t {
                let lo = first_key(docs, bi * t + ti);
                let q = &qkv[(bi * t + ti) * w + h * hs..][..hs];
                let a = &mut att[((bi * nh + h) * t + ti) * t..][..t];
                let mut max = f32::NEG_INFINITY;
                for t2 in lo..=ti {
                    let k = &qkv[(bi * t + t2) * w + ko..][..hs];
                    let dot: f32 = q.iter().zip(k).map(|(x, y)| x * y).sum::<f32>() * scale;
                    a[t2] = dot;
                    max = max.max(dot);
                }
                let mut sum = 0.0f32;
                for x in a[lo..=ti].iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                for x in a[lo..=ti].iter_mut() {
                    *x *= inv;
                }
                a[..lo].fill(0.0);
                a[ti + 1..].fill(0.0);
                let o = &mut out[(bi * t + ti) * c + h * hs..][..hs];
                o.fill(0.0);
                for t2 in lo..=ti {
                    let v = &qkv[(bi * t + t2) * w + vo..][..hs];
                    let p = a[t2];
                    for (oo, vv) in o.iter_mut().zip(v) {
                        *oo += p * vv;
                    }
                }
            }
        }
    }
}

/// `dqkv` overwritten from `dout`, using the saved probabilities; a key/value head's
/// gradient is the sum over its group's query heads, in head order. `docs` as the forward had.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    docs: Option<&[u32]>,
    s: AttnShape,
) {
    let AttnShape { b, t, c, nh, .. } = s;
    let (hs, w, g) = (s.hs(), s.qkv_width(), s.group());
    let scale = 1.0 / (hs as f32).sqrt();
    dqkv.fill(0.0);
    let mut datt = vec![0.0f32; t];
    for bi in 0..b {
        for h in 0..nh {
            let (ko, vo) = (s.k_off() + (h / g) * hs, s.v_off() + (h / g) * hs);
            for ti in 0..t {
                let lo = first_key(docs, bi * t + ti);
                let a = &att[((bi * nh + h) * t + ti) * t..][..t];
                let dy = &dout[(bi * t + ti) * c + h * hs..][..hs];
                // through out = Σ p·v
                for t2 in lo..=ti {
                    let voff = (bi * t + t2) * w + vo;
                    let v = &qkv[voff..][..hs];
                    datt[t2] = dy.iter().zip(v).map(|(x, y)| x * y).sum();
                    let p = a[t2];
                    for (dv, g) in dqkv[voff..voff + hs].iter_mut().zip(dy) {
                        *dv += p * g;
                    }
                }
                // through softmax
                let dot: f32 = (lo..=ti).map(|t2| a[t2] * datt[t2]).sum();
                let qoff = (bi * t + ti) * w + h * hs;
                for t2 in lo..=ti {
                    let dpre = a[t2] * (datt[t2] - dot) * scale;
                    let koff = (bi * t + t2) * w + ko;
                    for j in 0..hs {
                        dqkv[qoff + j] += dpre * qkv[koff + j];
                        dqkv[koff + j] += dpre * qkv[qoff + j];
                    }
                }
            }
        }
    }
}

/// Rotate the query and key heads of `qkv[B·T, qkv_width]` in place by the angles of
/// `table` ([`crate::backend::attention::rope_table`]) at each row's position in its
/// sequence, or with `docs` in its document; `inverse` rotates back (the backward, applied
/// to their gradients).
pub fn rope_rotate(qkv: &mut [f32], table: &[f32], docs: Option<&[u32]>, s: AttnShape, inverse: bool) {
    let (hs, w, t) = (s.hs(), s.qkv_width(), s.t);
    let half = hs / 2;
    let (cos, sin) = table.split_at(t * half);
    for (row, x) in qkv.chunks_exact_mut(w).enumerate() {
        let p = row % t - first_key(docs, row);
        let (cp, sp) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        // Query heads, then key heads: contiguous at the start of the row.
        for head in x[..(s.nh + s.nkv) * hs].chunks_exact_mut(hs) {
            let (lo, hi) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b, c) = (lo[i], hi[i], cp[i]);
                let sn = if inverse { -sp[i] } else { sp[i] };
                // transformers: q·cos + rotate_half(q)·sin, rotate_half(q) = [-q_hi, q_lo]
                lo[i] = a * c - b * sn;
                hi[i] = b * c + a * sn;
            }
        }
    }
}

/// The document starts of `b` sequences of `t` rows as the reference reads them, checked
/// ([`check_doc_starts`]); `op` names the op in the error.
pub(super) fn docs_of<'a>(op: &str, docs: Option<&'a Vec<u32>>, b: usize, t: usize) -> BResult<Option<&'a [u32]>> {
    let Some(d) = docs else { return Ok(None) };
    let n = b * t;
    if d.len() < n {
        return Err(BackendError::Device(format!("{op}: {} document starts for {n} rows", d.len())));
    }
    check_doc_starts(&d[..n], t).map_err(|e| BackendError::Device(format!("{op}: {e}")))?;
    Ok(Some(&d[..n]))
}

impl AttentionOps for CpuBackend {
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        s.b * s.nh * s.t * s.t
    }
    fn attention_fwd(
        &self,
        out: &mut Vec<f32>,
        saved: &mut Vec<f32>,
        x: AttnInputs<'_, Self>,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let n = s.b * s.t;
        let docs = docs_of("attention_fwd", x.docs, s.b, s.t)?;
        let att = &mut saved[..self.attention_saved_len(s)];
        attention_forward(&mut out[..n * s.c], att, &x.qkv[..n * s.qkv_width()], docs, s);
        self.leave_amax(amax, &out[..n * s.c])
    }
    fn attention_bwd(
        &self,
        dqkv: &mut Vec<f32>,
        dout: &Vec<f32>,
        x: AttnInputs<'_, Self>,
        _out: &Vec<f32>,
        saved: &Vec<f32>,
        s: AttnShape,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let (n, w) = (s.b * s.t, s.qkv_width());
        let docs = docs_of("attention_bwd", x.docs, s.b, s.t)?;
        attention_backward(
            &mut dqkv[..n * w],
            &dout[..n * s.c],
            &x.qkv[..n * w],
            &saved[..self.attention_saved_len(s)],
            docs,
            s,
        );
        self.leave_amax(amax, &dqkv[..n * w])
    }
    fn rope_fwd(&self, qkv: &mut Vec<f32>, table: &Vec<f32>, docs: Option<&Vec<u32>>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        let docs = docs_of("rope_fwd", docs, s.b, s.t)?;
        rope_rotate(&mut qkv[..n * s.qkv_width()], &table[..s.t * s.hs()], docs, s, false);
        Ok(())
    }
    fn rope_bwd(&self, dqkv: &mut Vec<f32>, table: &Vec<f32>, docs: Option<&Vec<u32>>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        let docs = docs_of("rope_bwd", docs, s.b, s.t)?;
        rope_rotate(&mut dqkv[..n * s.qkv_width()], &table[..s.t * s.hs()], docs, s, true);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{doc_starts, rope_table};

    fn randn(seed: u64, n: usize) -> Vec<f32> {
        (0..n as u64).map(|i| crate::rng::normal(seed, 7, i) as f32).collect()
    }

    /// Forward and backward through RoPE (optional) then attention on the CPU backend:
    /// (out, dqkv before RoPE's backward is applied: the gradient of qkv as given).
    fn run(qkv: &[f32], dout: &[f32], docs: Option<&Vec<u32>>, s: AttnShape, rope: bool) -> (Vec<f32>, Vec<f32>) {
        let be = CpuBackend::new();
        let (n, w) = (s.b * s.t, s.qkv_width());
        let table = rope_table(s.t, s.hs(), 10_000.0, None);
        let mut x = qkv.to_vec();
        if rope {
            be.rope_fwd(&mut x, &table, docs, s).unwrap();
        }
        let (mut out, mut att) = (vec![0.0; n * s.c], vec![0.0; be.attention_saved_len(s)]);
        be.attention_fwd(&mut out, &mut att, AttnInputs { qkv: &x, docs }, s, None).unwrap();
        let mut dqkv = vec![0.0; n * w];
        be.attention_bwd(&mut dqkv, &dout.to_vec(), AttnInputs { qkv: &x, docs }, &out, &att, s, None).unwrap();
        if rope {
            be.rope_bwd(&mut dqkv, &table, docs, s).unwrap();
        }
        (out, dqkv)
    }

    /// Documents (batch row, first position, length) of `docs` over sequences of `t`.
    fn documents(docs: &[u32], t: usize) -> Vec<(usize, usize, usize)> {
        let mut out: Vec<(usize, usize, usize)> = Vec::new();
        for (row, &d) in docs.iter().enumerate() {
            let (b, p) = (row / t, row % t);
            match out.last_mut() {
                Some(last) if last.0 == b && last.1 == d as usize => last.2 += 1,
                _ => out.push((b, p, 1)),
            }
        }
        out
    }

    /// A packed batch (documents of 5, 1, 4, 3 tokens; one crossing into the second sequence;
    /// then 1, 6) with grouped-query heads, through RoPE and attention with the mask, equals
    /// each document run alone as a sequence of its own — output and every gradient, to the
    /// bit (the same products in the same order) — and without RoPE too.
    #[test]
    fn packed_documents_equal_documents_alone() {
        let (t, b, nh, nkv, hs) = (13usize, 2usize, 4usize, 2usize, 8usize);
        let s = AttnShape { b, t, c: nh * hs, nh, nkv };
        let docs = doc_starts(&[5, 1, 4, 9, 1, 6], t, b * t);
        assert_eq!(&docs[..t], &[0, 0, 0, 0, 0, 5, 6, 6, 6, 6, 10, 10, 10]);
        assert_eq!(&docs[t..], &[0, 0, 0, 0, 0, 0, 6, 7, 7, 7, 7, 7, 7]);
        let (w, n) = (s.qkv_width(), b * t);
        let (qkv, dout) = (randn(1, n * w), randn(2, n * s.c));
        let docs_buf = docs.clone();
        for rope in [false, true] {
            let (out, dqkv) = run(&qkv, &dout, Some(&docs_buf), s, rope);
            let parts = documents(&docs, t);
            assert_eq!(parts.len(), 7);
            for (bi, p0, len) in parts {
                let rows = (bi * t + p0)..(bi * t + p0 + len);
                let one = AttnShape { b: 1, t: len, ..s };
                let (o1, d1) =
                    run(&qkv[rows.start * w..rows.end * w], &dout[rows.start * s.c..rows.end * s.c], None, one, rope);
                let what = format!("rope {rope}: document at batch row {bi}, position {p0}, length {len}");
                assert_eq!(&out[rows.start * s.c..rows.end * s.c], &o1[..], "out, {what}");
                assert_eq!(&dqkv[rows.start * w..rows.end * w], &d1[..], "dqkv, {what}");
            }
        }
    }

    /// Document starts of zeros (one document per sequence) give the unmasked bits.
    #[test]
    fn zero_document_starts_are_plain_causal_attention() {
        let s = AttnShape { b: 2, t: 9, c: 16, nh: 2, nkv: 1 };
        let (n, w) = (s.b * s.t, s.qkv_width());
        let (qkv, dout) = (randn(3, n * w), randn(4, n * s.c));
        let zeros = vec![0u32; n];
        for rope in [false, true] {
            assert_eq!(run(&qkv, &dout, Some(&zeros), s, rope), run(&qkv, &dout, None, s, rope));
        }
    }

    /// RoPE with document starts turns a token by its position in its document: a packed
    /// document's rows equal the document alone at the start of a sequence, and its
    /// backward undoes it.
    #[test]
    fn rope_restarts_positions_per_document() {
        let (t, b) = (10usize, 1usize);
        let s = AttnShape { b, t, c: 3 * 8, nh: 3, nkv: 1 };
        let w = s.qkv_width();
        let table = rope_table(t, s.hs(), 10_000.0, None);
        let docs = doc_starts(&[3, 7], t, t);
        let x = randn(5, t * w);
        let mut packed = x.clone();
        CpuBackend::new().rope_fwd(&mut packed, &table, Some(&docs), s).unwrap();
        let mut alone = x[3 * w..].to_vec();
        let s7 = AttnShape { t: 7, ..s };
        CpuBackend::new().rope_fwd(&mut alone, &rope_table(7, s.hs(), 10_000.0, None), None, s7).unwrap();
        assert_eq!(&packed[3 * w..], &alone[..]);
        // Position 0 of the second document is not turned at all; position 3 of the sequence is.
        assert_eq!(&packed[3 * w..4 * w], &x[3 * w..4 * w]);
        let mut plain = x.clone();
        CpuBackend::new().rope_fwd(&mut plain, &table, None, s).unwrap();
        assert_ne!(&plain[3 * w..4 * w], &x[3 * w..4 * w]);
        CpuBackend::new().rope_bwd(&mut packed, &table, Some(&docs), s).unwrap();
        for (a, b) in packed.iter().zip(&x) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    /// Finite differences of L = Σ out·dout through masked RoPE and attention (grouped
    /// heads, documents of 2, 3 and 1 tokens and one across the sequence boundary) against
    /// the backward, for every element of qkv.
    #[test]
    fn masked_attention_and_rope_gradient_check() {
        let (t, b) = (6usize, 2usize);
        let s = AttnShape { b, t, c: 2 * 4, nh: 2, nkv: 1 };
        let (n, w) = (b * t, s.qkv_width());
        let docs = doc_starts(&[2, 3, 1, 4], t, n);
        let qkv: Vec<f32> = randn(6, n * w).iter().map(|x| 0.5 * x).collect();
        let dout = randn(7, n * s.c);
        let (_, grad) = run(&qkv, &dout, Some(&docs), s, true);
        let loss = |x: &[f32]| -> f64 {
            let (out, _) = run(x, &dout, Some(&docs), s, true);
            out.iter().zip(&dout).map(|(o, d)| *o as f64 * *d as f64).sum()
        };
        let eps = 1e-2f32;
        for i in 0..n * w {
            let (mut up, mut down) = (qkv.clone(), qkv.clone());
            up[i] += eps;
            down[i] -= eps;
            let fd = (loss(&up) - loss(&down)) / (2.0 * eps as f64);
            let err = (fd - grad[i] as f64).abs() / (1.0 + fd.abs());
            assert!(
                err < 2e-3,
                "element {i} (row {}, column {}): backward {} vs finite difference {fd}",
                i / w,
                i % w,
                grad[i]
            );
        }
    }

    #[test]
    fn document_starts_are_checked() {
        assert!(check_doc_starts(&doc_starts(&[5, 1, 4, 9, 1, 6], 13, 26), 13).is_ok());
        assert!(check_doc_starts(&[0, 0, 2, 0, 1, 1], 3).is_ok());
        assert!(check_doc_starts(&[0, 0, 1, 0], 4).unwrap_err().contains("row 2"));
        assert!(check_doc_starts(&[0, 1, 1, 1, 4], 5).is_ok());
        assert!(check_doc_starts(&[0, 1, 1, 1, 0], 5).unwrap_err().contains("row 4"));
        assert!(check_doc_starts(&[0, 0, 0, 1, 0, 0], 3).unwrap_err().contains("first token"));
        assert!(check_doc_starts(&[0, 0, 0], 2).is_err());
        let bad = vec![0u32, 0, 3, 3];
        let s = AttnShape { b: 1, t: 4, c: 4, nh: 1, nkv: 1 };
        let mut x = vec![0.0; 4 * s.qkv_width()];
        let table = rope_table(4, 4, 10_000.0, None);
        let e = CpuBackend::new().rope_fwd(&mut x, &table, Some(&bad), s).unwrap_err().to_string();
        assert!(e.contains("rope_fwd") && e.contains("row 2"), "{e}");
    }
}
