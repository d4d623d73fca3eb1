//! The loss on the GPU (twin of cpu/cross_entropy.rs; kernel in cross_entropy.cu): one
//! block per row computes the row's loss and overwrites its logits with their gradient.

use cudarc::driver::PushKernelArg;

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, cfg, check, to_i32};
use super::CudaBackend;
use crate::backend::{BResult, CrossEntropyOps, LossRows};

/// Threads per row (a block): see cross_entropy.cu for what was measured.
const THREADS: u32 = 512;

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "cross_entropy",
    src: include_str!("cross_entropy.cu"),
    functions: &["cross_entropy_fwd_bwd"],
    big_smem: no_big_smem,
    defines: no_defines,
};

impl CrossEntropyOps for CudaBackend {
    fn cross_entropy_fwd_bwd(
        &self,
        logits: &mut Self::Buf,
        losses: &mut Self::F32,
        targets: &Self::Tokens,
        rows: LossRows,
        dloss_scale: f32,
    ) -> BResult<()> {
        let (targets, LossRows { n, v, first }) = (&targets.dev, rows);
        check("cross_entropy logits", logits.len(), 0, n * v)?;
        check("cross_entropy losses", losses.len(), first, n)?;
        check("cross_entropy targets", targets.len(), first, n)?;
        if n == 0 {
            return Ok(());
        }
        if v == 0 {
            return Err(bad("cross_entropy: empty vocabulary".into()));
        }
        let blocks = u32::try_from(n).map_err(|_| bad(format!("cross_entropy: {n} rows is too many")))?;
        let (lg, ls, tg, vi) =
            (self.ptr_mut(logits, 0), self.ptr_mut(losses, first), self.ptr(targets, first), to_i32("V", v)?);
        let f = self.f("cross_entropy_fwd_bwd")?;
        let mut lb = self.stream.launch_builder(f);
        lb.arg(&lg).arg(&ls).arg(&tg).arg(&vi).arg(&dloss_scale);
        // SAFETY: one block per row, rows < n; targets >= V give a NaN loss, no access.
        unsafe { lb.launch(cfg((blocks, 1, 1), (THREADS, 1, 1), 0)) }
            .map_err(|e| self.launch_err("cross_entropy_fwd_bwd", e))?;
        Ok(())
    }
}
