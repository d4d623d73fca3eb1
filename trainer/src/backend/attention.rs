//! Causal multi-head self-attention over a fused `qkv[N, 3C]` projection.

use super::{BResult, Device};

/// Shapes for one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
}

pub trait AttentionOps: Device {
    /// fp32 elements of saved softmax state `attention_fwd` needs for backward.
    fn attention_saved_len(&self, s: AttnShape) -> usize;
    /// Causal multi-head self-attention: `qkv[N,3C]` → `out[N,C]`.
    fn attention_fwd(&self, out: &mut Self::Buf, saved: &mut Self::F32, qkv: &Self::Buf, s: AttnShape) -> BResult<()>;
    /// `dqkv` overwritten from `dout`.
    fn attention_bwd(
        &self,
        dqkv: &mut Self::Buf,
        dout: &Self::Buf,
        qkv: &Self::Buf,
        out: &Self::Buf,
        saved: &Self::F32,
        s: AttnShape,
    ) -> BResult<()>;
}
