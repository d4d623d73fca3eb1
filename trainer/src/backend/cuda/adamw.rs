//! AdamW on the GPU (twin of cpu/adamw.rs; kernel in adamw.cu): fp32 master weights and
//! moments updated in place, the result rounded into the bf16 parameters.

use cudarc::driver::PushKernelArg;

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{cfg, check, BLOCK};
use super::CudaBackend;
use crate::backend::{AdamWOps, AdamWSegment, AdamWStep, AdamWTensors, BResult};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "adamw",
    src: include_str!("adamw.cu"),
    functions: &["adamw"],
    big_smem: no_big_smem,
    defines: no_defines,
};

impl AdamWOps for CudaBackend {
    fn adamw(&self, mut t: AdamWTensors<'_, Self>, segs: &[AdamWSegment], h: AdamWStep) -> BResult<()> {
        // Exactly as cpu/adamw.rs computes them.
        let (bc1, bc2) = h.bias_corrections();
        let f = self.f("adamw")?;
        for s in segs {
            if let Some(p) = t.params.as_deref() {
                check("adamw params", p.len(), s.poff, s.len)?;
            }
            check("adamw master", t.master.len(), s.moff, s.len)?;
            check("adamw m", t.m.len(), s.moff, s.len)?;
            check("adamw v", t.v.len(), s.moff, s.len)?;
            check("adamw grads", t.grads.len(), s.goff, s.len)?;
            if s.len == 0 {
                continue;
            }
            let wd = if s.decay { h.weight_decay } else { 0.0 };
            let (p, w, mp, vp, g, n) = (
                // Null: no compute copy to round into (the kernel skips the write).
                t.params.as_deref_mut().map_or(0, |p| self.ptr_mut(p, s.poff)),
                self.ptr_mut(t.master, s.moff),
                self.ptr_mut(t.m, s.moff),
                self.ptr_mut(t.v, s.moff),
                self.ptr(t.grads, s.goff),
                s.len as i64,
            );
            let mut lb = self.stream.launch_builder(f);
            lb.arg(&p)
                .arg(&w)
                .arg(&mp)
                .arg(&vp)
                .arg(&g)
                .arg(&n)
                .arg(&h.lr)
                .arg(&h.beta1)
                .arg(&h.beta2)
                .arg(&h.eps)
                .arg(&wd)
                .arg(&bc1)
                .arg(&bc2)
                .arg(&h.grad_scale);
            // SAFETY: ranges checked above.
            unsafe { lb.launch(cfg((self.grid_for(s.len), 1, 1), (BLOCK, 1, 1), 0)) }
                .map_err(|e| self.launch_err("adamw", e))?;
        }
        Ok(())
    }
}
