//! Linear layer on the CPU: `out = inp · Wᵀ + b` and its backward, through matrixmultiply's sgemm.
//! The fused GELU variants run the trait's default composition.
//!
//! A layer in [`Precision::Fp8`](crate::backend::Precision) (and an eligible shape) is the
//! reference of the CUDA backend's FP8 GEMMs: its operands are quantized per tensor as
//! `backend/fp8.rs` says (e4m3 input and weight, e5m2 output gradient) and dequantized, in
//! per-call scratch, and the GEMM multiplies those values in f32. The bias gradient sums the
//! unquantized output gradient, as the GPU's does.

use super::{at, two_mut, CpuBackend};
use crate::backend::fp8::{fake_quant_into, Fp8Format};
use crate::backend::{BResult, LinearLocs, MatShape, MatmulOps, WeightGrads, Weights};

/// `xs` quantized per tensor to `fmt` and dequantized (the FP8 GEMM's operand values).
fn quantized(xs: &[f32], fmt: Fp8Format) -> Vec<f32> {
    let mut q = vec![0.0; xs.len()];
    fake_quant_into(&mut q, xs, fmt);
    q
}

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
pub fn matmul_backward(
    dinp: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    s: MatShape,
) {
    let MatShape { n, c, oc } = s;
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

impl MatmulOps for CpuBackend {
    fn matmul_fwd(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let (inp, w, bias) = (&inp[..n * c], at(p.buf, p.at.w), p.at.b.map(|b| at(p.buf, b)));
        if p.at.fp8(s) {
            let (xq, wq) = (quantized(inp, Fp8Format::E4M3), quantized(w, Fp8Format::E4M3));
            matmul_forward(&mut out[..n * oc], &xq, &wq, bias, n, c, oc);
            return Ok(());
        }
        matmul_forward(&mut out[..n * oc], inp, w, bias, n, c, oc);
        Ok(())
    }
    fn matmul_bwd(
        &self,
        dinp: &mut Vec<f32>,
        g: WeightGrads<'_, Self, LinearLocs>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        p: Weights<'_, Self, LinearLocs>,
        s: MatShape,
    ) -> BResult<()> {
        let MatShape { n, c, oc } = s;
        let (dw, mut db) = match g.at.b {
            Some(b) => {
                let (dw, db) = two_mut(g.buf, g.at.w, b);
                (dw, Some(db))
            }
            None => (&mut g.buf[g.at.w.off..g.at.w.end()], None),
        };
        if g.fresh {
            // Written, not added to: `+=` onto zeros gives the same bits.
            dw.fill(0.0);
            db.iter_mut().for_each(|d| d.fill(0.0));
        }
        let (dout, inp, w) = (&dout[..n * oc], &inp[..n * c], at(p.buf, p.at.w));
        if p.at.fp8(s) {
            let gq = quantized(dout, Fp8Format::E5M2);
            let (xq, wq) = (quantized(inp, Fp8Format::E4M3), quantized(w, Fp8Format::E4M3));
            matmul_backward(&mut dinp[..n * c], dw, None, &gq, &xq, &wq, s);
            if let Some(db) = db {
                for row in dout.chunks_exact(oc) {
                    for (d, g) in db.iter_mut().zip(row) {
                        *d += g;
                    }
                }
            }
            return Ok(());
        }
        matmul_backward(&mut dinp[..n * c], dw, db, dout, inp, w, s);
        Ok(())
    }
}
