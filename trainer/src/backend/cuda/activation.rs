//! Element-wise activations on the GPU (twin of cpu/activation.rs; kernels in
//! activation.cu): GELU and its backward, SwiGLU and its backward, the residual add. Each
//! moves 8 bf16 values (one 16-byte word) per thread and turn where the pointers allow it
//! (SwiGLU: and the width F is a multiple of 8, so rows are whole words).

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{check, to_i32};
use super::CudaBackend;
use crate::backend::{ActivationOps, AmaxSink, BResult, Rows};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "activation",
    src: include_str!("activation.cu"),
    functions: &["gelu_fwd", "gelu_bwd", "residual_fwd", "swiglu_fwd", "swiglu_bwd"],
    big_smem: no_big_smem,
    defines: no_defines,
};

/// bf16 values per thread per grid-stride turn (one 16-byte word).
const PER_THREAD: usize = 8;

impl ActivationOps for CudaBackend {
    fn gelu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, n: usize, amax: Option<AmaxSink>) -> BResult<()> {
        check("gelu_fwd out", out.len(), 0, n)?;
        check("gelu_fwd inp", inp.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let ptrs = [self.ptr_mut(out, 0), self.ptr(inp, 0), self.fp8_sink(amax)?];
        // SAFETY: ranges checked above; the sink is a scale slot's amax word, or 0.
        unsafe { self.launch_elementwise("gelu_fwd", &ptrs, n, PER_THREAD) }
    }
    fn gelu_bwd(&self, d: &mut Self::Buf, inp: &Self::Buf, n: usize, amax: Option<AmaxSink>) -> BResult<()> {
        check("gelu_bwd d", d.len(), 0, n)?;
        check("gelu_bwd inp", inp.len(), 0, n)?;
        if n == 0 {
            return Ok(());
        }
        let ptrs = [self.ptr_mut(d, 0), self.ptr(inp, 0), self.fp8_sink(amax)?];
        // SAFETY: ranges checked above; the sink is a scale slot's amax word, or 0.
        unsafe { self.launch_elementwise("gelu_bwd", &ptrs, n, PER_THREAD) }
    }
    fn residual_fwd(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize) -> BResult<()> {
        check("residual_fwd out", out.len(), 0, n)?;
        check("residual_fwd a", a.len(), 0, n)?;
        check("residual_fwd b", b.len(), 0, n)?;
        let ptrs = [self.ptr_mut(out, 0), self.ptr(a, 0), self.ptr(b, 0)];
        // SAFETY: ranges checked above.
        unsafe { self.launch_elementwise("residual_fwd", &ptrs, n, PER_THREAD) }
    }
    fn swiglu_fwd(&self, out: &mut Self::Buf, inp: &Self::Buf, r: Rows, amax: Option<AmaxSink>) -> BResult<()> {
        let Rows { n, c: f } = r;
        check("swiglu_fwd out", out.len(), 0, n * f)?;
        check("swiglu_fwd inp [gate | up]", inp.len(), 0, n * 2 * f)?;
        if n == 0 || f == 0 {
            return Ok(());
        }
        let fi = to_i32("swiglu F", f)?;
        let ptrs = [self.ptr_mut(out, 0), self.ptr(inp, 0), self.fp8_sink(amax)?];
        // SAFETY: ranges checked above: out holds the N*F outputs, inp the N rows of 2F; the
        // sink is a scale slot's amax word, or 0.
        unsafe { self.launch_elementwise_with("swiglu_fwd", &ptrs, n * f, PER_THREAD, &[fi]) }
    }
    fn swiglu_bwd(
        &self,
        dinp: &mut Self::Buf,
        inp: &Self::Buf,
        dout: &Self::Buf,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()> {
        let Rows { n, c: f } = r;
        check("swiglu_bwd dinp", dinp.len(), 0, n * 2 * f)?;
        check("swiglu_bwd inp [gate | up]", inp.len(), 0, n * 2 * f)?;
        check("swiglu_bwd dout", dout.len(), 0, n * f)?;
        if n == 0 || f == 0 {
            return Ok(());
        }
        let fi = to_i32("swiglu F", f)?;
        let ptrs = [self.ptr_mut(dinp, 0), self.ptr(inp, 0), self.ptr(dout, 0), self.fp8_sink(amax)?];
        // SAFETY: ranges checked above: dinp and inp hold N rows of 2F, dout the N*F
        // gradients the kernel walks; the sink is a scale slot's amax word, or 0.
        unsafe { self.launch_elementwise_with("swiglu_bwd", &ptrs, n * f, PER_THREAD, &[fi]) }
    }
}
