//! Memory and copies: allocation, host transfers, the fp32 → compute-precision cast, and
//! the buffer-to-buffer operations the ZeRO engine needs (zeroing, gradient accumulation).

use super::{BResult, Device, Loc};

/// What a token-id buffer holds: the embedding's inputs (a backend may prepare the
/// embedding backward's grouping with them, as CUDA does at upload), the loss's targets, or
/// where each row's document starts in sequences of `seq_len` tokens (attention's
/// [`AttnInputs::docs`](super::AttnInputs::docs); CUDA checks them at upload with
/// [`check_doc_starts`](super::check_doc_starts), the CPU at each op).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRole {
    Inputs,
    Targets,
    DocStarts { seq_len: usize },
}

pub trait MemoryOps: Device {
    fn alloc_buf(&self, n: usize, what: &str) -> BResult<Self::Buf>;
    fn alloc_grad(&self, n: usize, what: &str) -> BResult<Self::Grad>;
    fn alloc_f32(&self, n: usize, what: &str) -> BResult<Self::F32>;
    fn alloc_tokens(&self, n: usize, role: TokenRole) -> BResult<Self::Tokens>;
    fn upload_tokens(&self, host: &[u32], dst: &mut Self::Tokens) -> BResult<()>;
    /// Host f32 → compute buffer at `off` (rounded to compute precision).
    fn upload_buf(&self, host: &[f32], dst: &mut Self::Buf, off: usize) -> BResult<()>;
    /// Host f32 → `F32` buffer at `off`.
    fn upload_f32(&self, host: &[f32], dst: &mut Self::F32, off: usize) -> BResult<()>;
    fn download_f32(&self, src: &Self::F32, at: Loc) -> BResult<Vec<f32>>;
    fn download_buf(&self, src: &Self::Buf, at: Loc) -> BResult<Vec<f32>>;
    fn download_grad(&self, src: &Self::Grad, at: Loc) -> BResult<Vec<f32>>;
    /// Round fp32 master values into the compute-precision buffer.
    fn cast_to_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::F32, at: Loc) -> BResult<()>;
    fn zero_buf(&self, buf: &mut Self::Buf, at: Loc) -> BResult<()>;
    fn zero_grad(&self, buf: &mut Self::Grad, at: Loc) -> BResult<()>;
    /// `dst[doff..] += src[at]` (accumulating a reduced gradient shard).
    fn add_grad(&self, dst: &mut Self::Grad, doff: usize, src: &Self::Grad, at: Loc) -> BResult<()>;
    /// Copy within compute buffers.
    fn copy_buf(&self, dst: &mut Self::Buf, doff: usize, src: &Self::Buf, at: Loc) -> BResult<()>;
}
