//! Memory and copies on the GPU (twin of cpu/memory.rs; kernels in memory.cu): the
//! allocations go through the stream-ordered pool, transfers through cudarc, and the
//! fp32 → bf16 cast and the gradient accumulation are element-wise kernels.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::kernels::{no_big_smem, no_defines, KernelFile};
use super::launch::{bad, check, check_loc};
use super::{CudaBackend, DeviceTokens, EmbeddingPlan};
use crate::backend::{check_doc_starts, BResult, Loc, MemoryOps, TokenRole};

pub(super) const KERNELS: KernelFile = KernelFile {
    name: "memory",
    src: include_str!("memory.cu"),
    functions: &["cast_f32_bf16", "add_f32"],
    big_smem: no_big_smem,
    defines: no_defines,
};

/// fp32 values per thread per grid-stride turn where the pointers are aligned (one 16-byte
/// word); the kernels fall back to one at a time otherwise.
const PER_THREAD: usize = 4;

impl CudaBackend {
    /// `dst[..n] += src[..n]` on raw pointers (also the padded GEMM's gradient fold-in).
    ///
    /// # Safety
    /// Both pointers must address at least `n` floats.
    pub(super) unsafe fn add_f32(&self, dst: u64, src: u64, n: usize) -> BResult<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_elementwise("add_f32", &[dst, src], n, PER_THREAD) }
    }

    /// `dst[..n] = 0` on a raw pointer (a fresh gradient no row reached).
    ///
    /// # Safety
    /// `dst` must address at least `n` floats.
    pub(super) unsafe fn zero_f32(&self, dst: u64, n: usize) -> BResult<()> {
        // SAFETY: forwarded from the caller.
        let r = unsafe { cudarc::driver::result::memset_d8_async(dst, 0, n * 4, self.stream.cu_stream()) };
        r.map_err(|e| self.err("zeroing a gradient", e))
    }

    /// `dst[..n] = src[..n]` on raw pointers (the padded GEMM's fresh gradient).
    ///
    /// # Safety
    /// Both pointers must address at least `n` floats, not overlapping.
    pub(super) unsafe fn copy_f32(&self, dst: u64, src: u64, n: usize) -> BResult<()> {
        // SAFETY: forwarded from the caller.
        let r = unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, n * 4, self.stream.cu_stream()) };
        r.map_err(|e| self.err("copying a gradient", e))
    }
}

impl MemoryOps for CudaBackend {
    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Self::Buf> {
        self.alloc(n, what)
    }
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Self::Grad> {
        self.alloc(n, what)
    }
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Self::F32> {
        self.alloc(n, what)
    }
    fn alloc_tokens(&self, n: usize, role: TokenRole) -> BResult<Self::Tokens> {
        let pinned = super::staging::Staging::new(self, n, "token ids")?;
        // Only the embedding's inputs get the backward's grouping (made at each upload).
        let plan = match role {
            TokenRole::Targets | TokenRole::DocStarts { .. } => None,
            TokenRole::Inputs => {
                let plan_len = 3 * n + 2;
                let staged = super::staging::Staging::new(self, plan_len, "the embedding backward plan")?;
                let dev = self.alloc(plan_len, "the embedding backward plan")?;
                self.plan_bytes.set(self.plan_bytes.get() + 4 * plan_len as u64);
                Some(EmbeddingPlan { dev, staged })
            }
        };
        let doc_seq_len = match role {
            TokenRole::DocStarts { seq_len } => Some(seq_len),
            TokenRole::Inputs | TokenRole::Targets => None,
        };
        Ok(DeviceTokens { dev: self.alloc(n, "token ids")?, host: vec![0; n], pinned, plan, doc_seq_len })
    }
    fn upload_tokens(&self, host: &[u32], dst: &mut Self::Tokens) -> BResult<()> {
        check("upload_tokens", dst.dev.len(), 0, host.len())?;
        // Document starts are checked here, on the host, once per upload: the kernels trust them.
        if let Some(t) = dst.doc_seq_len {
            check_doc_starts(host, t).map_err(|e| bad(format!("upload_tokens (document starts): {e}")))?;
        }
        dst.host[..host.len()].copy_from_slice(host);
        dst.pinned.upload(self, host, &mut dst.dev, "token ids")?;
        match dst.plan.as_mut() {
            Some(p) => p.staged.upload(self, &embedding_plan(host), &mut p.dev, "the embedding backward plan"),
            None => Ok(()),
        }
    }
    fn upload_buf(&self, host: &[f32], dst: &mut Self::Buf, off: usize) -> BResult<()> {
        check("upload_buf", dst.len(), off, host.len())?;
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        self.stream
            .memcpy_htod(&v, &mut dst.slice_mut(off..off + host.len()))
            .map_err(|e| self.err("uploading a compute buffer", e))
    }
    fn upload_f32(&self, host: &[f32], dst: &mut Self::F32, off: usize) -> BResult<()> {
        check("upload_f32", dst.len(), off, host.len())?;
        self.stream
            .memcpy_htod(host, &mut dst.slice_mut(off..off + host.len()))
            .map_err(|e| self.err("uploading an fp32 buffer", e))
    }
    fn download_f32(&self, src: &Self::F32, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_f32", src.len(), at)?;
        self.stream.clone_dtoh(&src.slice(at.off..at.end())).map_err(|e| self.err("downloading an fp32 buffer", e))
    }
    fn download_buf(&self, src: &Self::Buf, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_buf", src.len(), at)?;
        let v = self
            .stream
            .clone_dtoh(&src.slice(at.off..at.end()))
            .map_err(|e| self.err("downloading a compute buffer", e))?;
        Ok(v.into_iter().map(|x| x.to_f32()).collect())
    }
    fn download_grad(&self, src: &Self::Grad, at: Loc) -> BResult<Vec<f32>> {
        check_loc("download_grad", src.len(), at)?;
        self.stream.clone_dtoh(&src.slice(at.off..at.end())).map_err(|e| self.err("downloading gradients", e))
    }
    fn cast_to_buf(&self, dst: &mut CudaSlice<bf16>, doff: usize, src: &CudaSlice<f32>, at: Loc) -> BResult<()> {
        check_loc("cast_to_buf source", src.len(), at)?;
        check("cast_to_buf destination", dst.len(), doff, at.len)?;
        let (d, s) = (self.ptr_mut(dst, doff), self.ptr(src, at.off));
        // SAFETY: both ranges checked above.
        unsafe { self.launch_elementwise("cast_f32_bf16", &[d, s], at.len, PER_THREAD) }
    }
    fn zero_buf(&self, buf: &mut Self::Buf, at: Loc) -> BResult<()> {
        check_loc("zero_buf", buf.len(), at)?;
        self.stream
            .memset_zeros(&mut buf.slice_mut(at.off..at.end()))
            .map_err(|e| self.err("zeroing a compute buffer", e))
    }
    fn zero_grad(&self, buf: &mut Self::Grad, at: Loc) -> BResult<()> {
        check_loc("zero_grad", buf.len(), at)?;
        self.stream.memset_zeros(&mut buf.slice_mut(at.off..at.end())).map_err(|e| self.err("zeroing gradients", e))
    }
    fn add_grad(&self, dst: &mut CudaSlice<f32>, doff: usize, src: &CudaSlice<f32>, at: Loc) -> BResult<()> {
        check_loc("add_grad source", src.len(), at)?;
        check("add_grad destination", dst.len(), doff, at.len)?;
        let (d, s) = (self.ptr_mut(dst, doff), self.ptr(src, at.off));
        // SAFETY: both ranges checked above.
        unsafe { self.add_f32(d, s, at.len) }
    }
    fn copy_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::Buf, at: Loc) -> BResult<()> {
        check_loc("copy_buf source", src.len(), at)?;
        check("copy_buf destination", dst.len(), doff, at.len)?;
        self.stream
            .memcpy_dtod(&src.slice(at.off..at.end()), &mut dst.slice_mut(doff..doff + at.len))
            .map_err(|e| self.err("copying a compute buffer", e))
    }
}

/// The embedding backward's grouping of `tokens`' rows by id: `[nb | starts (nb + 1) |
/// ids (nb) | rows (n)]`, rows sorted by (id, row), so each id's rows are summed in order.
fn embedding_plan(tokens: &[u32]) -> Vec<u32> {
    let n = tokens.len();
    let mut rows: Vec<u32> = (0..n as u32).collect();
    rows.sort_by_key(|&r| tokens[r as usize]);
    let mut starts = Vec::new();
    let mut ids = Vec::new();
    for (i, &r) in rows.iter().enumerate() {
        let id = tokens[r as usize];
        if ids.last() != Some(&id) {
            ids.push(id);
            starts.push(i as u32);
        }
    }
    starts.push(n as u32);
    let mut plan = Vec::with_capacity(3 * n + 2);
    plan.push(ids.len() as u32);
    plan.extend_from_slice(&starts);
    plan.extend_from_slice(&ids);
    plan.extend_from_slice(&rows);
    plan
}
