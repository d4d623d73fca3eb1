//! The CPU backend: plain-Rust f32 reference implementation of every operation.
//!
//! This is the reference the CUDA kernels are checked against (as llm.c keeps
//! `train_gpt2.c` beside `train_gpt2.cu`), and the backend CPU ranks train with.
//! Every role (`Buf`, `Grad`, `F32`) is a `Vec<f32>`. One file per op; this file only
//! wires them into the [`Backend`] trait.

mod adamw;
mod attention;
mod comm;
mod cross_entropy;
mod encoder;
mod gelu;
mod layernorm;
mod matmul;

pub use adamw::adamw_segment;
pub use attention::{attention_backward, attention_forward};
pub use comm::HostComm;
pub use cross_entropy::cross_entropy_forward_backward;
pub use encoder::{encoder_backward, encoder_forward};
pub use gelu::{gelu_backward, gelu_forward};
pub use layernorm::{layernorm_backward, layernorm_forward, LN_EPS};
pub use matmul::{matmul_backward, matmul_forward};

use super::{AdamWStep, AttnShape, BResult, Backend, BackendError, ElemBytes, F64Pair, Loc};

/// The f32 CPU backend. Stateless: matrixmultiply reads its thread count from
/// `MATMUL_NUM_THREADS` (the launcher divides the cores between ranks).
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend;

fn alloc(n: usize, what: &str) -> BResult<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory {
        device: "host".into(),
        bytes: n * 4,
        what: what.to_string(),
    })?;
    v.resize(n, 0.0);
    Ok(v)
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Grad = Vec<f32>;
    type F32 = Vec<f32>;
    type Tokens = Vec<u32>;

    fn name(&self) -> String {
        "cpu".into()
    }
    fn elem_bytes(&self) -> ElemBytes {
        ElemBytes { buf: 4, grad: 4, f32: 4 }
    }
    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Vec<f32>> {
        alloc(n, what)
    }
    fn alloc_tokens(&self, n: usize) -> BResult<Vec<u32>> {
        Ok(vec![0; n])
    }
    fn upload_tokens(&self, host: &[u32], dst: &mut Vec<u32>) -> BResult<()> {
        dst[..host.len()].copy_from_slice(host);
        Ok(())
    }
    fn upload_buf(&self, host: &[f32], dst: &mut Vec<f32>, off: usize) -> BResult<()> {
        dst[off..off + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn upload_f32(&self, host: &[f32], dst: &mut Vec<f32>, off: usize) -> BResult<()> {
        dst[off..off + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn download_f32(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn download_buf(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn download_grad(&self, src: &Vec<f32>, at: Loc) -> BResult<Vec<f32>> {
        Ok(src[at.off..at.end()].to_vec())
    }
    fn cast_to_buf(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }
    fn zero_buf(&self, buf: &mut Vec<f32>, at: Loc) -> BResult<()> {
        buf[at.off..at.end()].fill(0.0);
        Ok(())
    }
    fn zero_grad(&self, buf: &mut Vec<f32>, at: Loc) -> BResult<()> {
        buf[at.off..at.end()].fill(0.0);
        Ok(())
    }
    fn add_grad(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        for (d, s) in dst[doff..doff + at.len].iter_mut().zip(&src[at.off..at.end()]) {
            *d += *s;
        }
        Ok(())
    }
    fn grad_sumsq_into(&self, buf: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, slot: usize) -> BResult<()> {
        let s: f64 = buf[at.off..at.end()].iter().map(|&x| (x as f64) * (x as f64)).sum();
        dst[2 * slot..2 * slot + 2].copy_from_slice(&F64Pair::split(s));
        Ok(())
    }
    fn sum_into(&self, src: &Vec<f32>, at: Loc, dst: &mut Vec<f32>, slot: usize) -> BResult<()> {
        let s: f64 = src[at.off..at.end()].iter().map(|&x| x as f64).sum();
        let prev = F64Pair::join(&dst[2 * slot..2 * slot + 2]);
        dst[2 * slot..2 * slot + 2].copy_from_slice(&F64Pair::split(prev + s));
        Ok(())
    }
    fn copy_buf(&self, dst: &mut Vec<f32>, doff: usize, src: &Vec<f32>, at: Loc) -> BResult<()> {
        dst[doff..doff + at.len].copy_from_slice(&src[at.off..at.end()]);
        Ok(())
    }

    fn encoder_fwd(
        &self,
        out: &mut Vec<f32>,
        tokens: &Vec<u32>,
        params: &Vec<f32>,
        wte: Loc,
        wpe: Loc,
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        encoder_forward(
            &mut out[..b * t * c],
            &tokens[..b * t],
            &params[wte.off..wte.end()],
            &params[wpe.off..wpe.end()],
            b,
            t,
            c,
        );
        Ok(())
    }
    fn encoder_bwd(
        &self,
        grads: &mut Vec<f32>,
        dwte: Loc,
        dwpe: Loc,
        dout: &Vec<f32>,
        tokens: &Vec<u32>,
        b: usize,
        t: usize,
        c: usize,
    ) -> BResult<()> {
        let (wte_g, wpe_g) = two_mut(grads, dwte, dwpe);
        encoder_backward(wte_g, wpe_g, &dout[..b * t * c], &tokens[..b * t], b, t, c);
        Ok(())
    }
    fn layernorm_fwd(
        &self,
        out: &mut Vec<f32>,
        mean: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        w: Loc,
        bias: Loc,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        layernorm_forward(
            &mut out[..n * c],
            &mut mean[..n],
            &mut rstd[..n],
            &inp[..n * c],
            &params[w.off..w.end()],
            &params[bias.off..bias.end()],
            n,
            c,
        );
        Ok(())
    }
    fn layernorm_bwd(
        &self,
        dinp: &mut Vec<f32>,
        grads: &mut Vec<f32>,
        dw: Loc,
        db: Loc,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        w: Loc,
        mean: &Vec<f32>,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) -> BResult<()> {
        let (dw_g, db_g) = two_mut(grads, dw, db);
        layernorm_backward(
            &mut dinp[..n * c],
            dw_g,
            db_g,
            &dout[..n * c],
            &inp[..n * c],
            &params[w.off..w.end()],
            &mean[..n],
            &rstd[..n],
            n,
            c,
        );
        Ok(())
    }
    fn matmul_fwd(
        &self,
        out: &mut Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        w: Loc,
        bias: Option<Loc>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        matmul_forward(
            &mut out[..n * oc],
            &inp[..n * c],
            &params[w.off..w.end()],
            bias.map(|b| &params[b.off..b.end()]),
            n,
            c,
            oc,
        );
        Ok(())
    }
    fn matmul_bwd(
        &self,
        dinp: &mut Vec<f32>,
        grads: &mut Vec<f32>,
        dw: Loc,
        dbias: Option<Loc>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        params: &Vec<f32>,
        w: Loc,
        n: usize,
        c: usize,
        oc: usize,
    ) -> BResult<()> {
        let (dw_g, db_g) = match dbias {
            Some(db) => {
                let (a, b) = two_mut(grads, dw, db);
                (a, Some(b))
            }
            None => (&mut grads[dw.off..dw.end()], None),
        };
        matmul_backward(
            &mut dinp[..n * c],
            dw_g,
            db_g,
            &dout[..n * oc],
            &inp[..n * c],
            &params[w.off..w.end()],
            n,
            c,
            oc,
        );
        Ok(())
    }
    fn attention_saved_len(&self, s: AttnShape) -> usize {
        s.b * s.nh * s.t * s.t
    }
    fn attention_fwd(&self, out: &mut Vec<f32>, saved: &mut Vec<f32>, qkv: &Vec<f32>, s: AttnShape) -> BResult<()> {
        let n = s.b * s.t;
        attention_forward(&mut out[..n * s.c], &mut saved[..self.attention_saved_len(s)], &qkv[..n * 3 * s.c], s);
        Ok(())
    }
    fn attention_bwd(
        &self,
        dqkv: &mut Vec<f32>,
        dout: &Vec<f32>,
        qkv: &Vec<f32>,
        _out: &Vec<f32>,
        saved: &Vec<f32>,
        s: AttnShape,
    ) -> BResult<()> {
        let n = s.b * s.t;
        attention_backward(
            &mut dqkv[..n * 3 * s.c],
            &dout[..n * s.c],
            &qkv[..n * 3 * s.c],
            &saved[..self.attention_saved_len(s)],
            s,
        );
        Ok(())
    }
    fn gelu_fwd(&self, out: &mut Vec<f32>, inp: &Vec<f32>, n: usize) -> BResult<()> {
        gelu_forward(&mut out[..n], &inp[..n]);
        Ok(())
    }
    fn gelu_bwd(&self, dinp: &mut Vec<f32>, inp: &Vec<f32>, dout: &Vec<f32>, n: usize) -> BResult<()> {
        gelu_backward(&mut dinp[..n], &inp[..n], &dout[..n]);
        Ok(())
    }
    fn residual_fwd(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>, n: usize) -> BResult<()> {
        for ((o, x), y) in out[..n].iter_mut().zip(&a[..n]).zip(&b[..n]) {
            *o = x + y;
        }
        Ok(())
    }
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Vec<f32>,
        losses: &mut Vec<f32>,
        targets: &Vec<u32>,
        n: usize,
        v: usize,
        dloss_scale: f32,
    ) -> BResult<()> {
        cross_entropy_forward_backward(&mut logits[..n * v], &mut losses[..n], &targets[..n], n, v, dloss_scale);
        Ok(())
    }
    fn adamw(
        &self,
        params: &mut Vec<f32>,
        poff: usize,
        master: &mut Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
        moff: usize,
        grads: &Vec<f32>,
        goff: usize,
        len: usize,
        h: AdamWStep,
    ) -> BResult<()> {
        let r = moff..moff + len;
        adamw_segment(&mut master[r.clone()], &mut m[r.clone()], &mut v[r], &grads[goff..goff + len], h);
        params[poff..poff + len].copy_from_slice(&master[moff..moff + len]);
        Ok(())
    }
    fn synchronize(&self) -> BResult<()> {
        Ok(())
    }
}

/// Two disjoint mutable views into one buffer (e.g. a weight's and a bias's gradient).
fn two_mut(buf: &mut [f32], a: Loc, b: Loc) -> (&mut [f32], &mut [f32]) {
    assert!(a.end() <= b.off || b.end() <= a.off, "overlapping tensors {a:?} {b:?}");
    if a.off < b.off {
        let (lo, hi) = buf.split_at_mut(b.off);
        (&mut lo[a.off..a.end()], &mut hi[..b.len])
    } else {
        let (lo, hi) = buf.split_at_mut(a.off);
        (&mut hi[..a.len], &mut lo[b.off..b.end()])
    }
}
