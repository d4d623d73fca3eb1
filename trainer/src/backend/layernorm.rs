//! The norms over the last dimension: LayerNorm (GPT-2) and RMSNorm (Llama).

use super::{AmaxSink, BResult, Device, Loc, WeightGrads, Weights};

/// A LayerNorm's weight and bias, `[C]` each, in a flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormLocs {
    pub w: Loc,
    pub b: Loc,
}

/// `n` rows of `c` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub n: usize,
    pub c: usize,
}

/// The per-row mean and 1/std the forward writes for the backward.
pub struct LnStats<'a, B: Device + ?Sized> {
    pub mean: &'a mut B::F32,
    pub rstd: &'a mut B::F32,
}

/// What the backward reads of its forward: the input and its row statistics.
pub struct LnSaved<'a, B: Device + ?Sized> {
    pub inp: &'a B::Buf,
    pub mean: &'a B::F32,
    pub rstd: &'a B::F32,
}

/// What the RMSNorm backward reads of its forward: the input and its rows' 1/rms.
pub struct RmsSaved<'a, B: Device + ?Sized> {
    pub inp: &'a B::Buf,
    pub rstd: &'a B::F32,
}

pub trait LayerNormOps: Device {
    /// `out = (inp − mean)·rstd·w + b` per row; saves mean and rstd; leaves the amax of
    /// `out` in `amax` where set (for the FP8 GEMM that reads `out` next).
    fn layernorm_fwd(
        &self,
        out: &mut Self::Buf,
        stats: LnStats<'_, Self>,
        inp: &Self::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
    /// [`LayerNormOps::layernorm_fwd`] without its output: the row statistics, and where
    /// `amax` is set the amax of the output it would write, for an FP8 GEMM that applies the
    /// norm in the cast of its input ([`MatmulOps::matmul_fwd_of_norm`](super::MatmulOps::matmul_fwd_of_norm)),
    /// so the output is never written (without `amax`, that cast finds the amax itself: CUDA
    /// predicts its scale).
    fn layernorm_stats(
        &self,
        stats: LnStats<'_, Self>,
        inp: &Self::Buf,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
    /// `dinp += ..`, `dw += ..`, `db += ..`; leaves the amax of the updated `dinp` (the
    /// residual gradient, which an FP8 GEMM's backward reads next) in `amax` where set.
    #[allow(clippy::too_many_arguments)] // the norm's own six, and where its output's amax goes
    fn layernorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, NormLocs>,
        dout: &Self::Buf,
        saved: LnSaved<'_, Self>,
        p: Weights<'_, Self, NormLocs>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;

    /// RMSNorm: `out = inp · rstd · w` per row with `rstd = 1/sqrt(mean(inp²) + eps)`,
    /// computed in fp32; saves `rstd`; leaves the amax of `out` in `amax` where set.
    #[allow(clippy::too_many_arguments)] // the norm's own six, and where its output's amax goes
    fn rmsnorm_fwd(
        &self,
        out: &mut Self::Buf,
        rstd: &mut Self::F32,
        inp: &Self::Buf,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
    /// [`LayerNormOps::rmsnorm_fwd`] without its output: `rstd`, and where `amax` is set the
    /// amax of the output it would write, for an FP8 GEMM that applies the norm in the cast of
    /// its input ([`MatmulOps::matmul_fwd_of_norm`](super::MatmulOps::matmul_fwd_of_norm)).
    fn rmsnorm_stats(
        &self,
        rstd: &mut Self::F32,
        inp: &Self::Buf,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        eps: f32,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
    /// `dinp += ..`, `dw += ..` (written when `g.fresh`); the amax of the updated `dinp` in
    /// `amax` where set.
    #[allow(clippy::too_many_arguments)] // the norm's own six, and where its output's amax goes
    fn rmsnorm_bwd(
        &self,
        dinp: &mut Self::Buf,
        g: WeightGrads<'_, Self, Loc>,
        dout: &Self::Buf,
        saved: RmsSaved<'_, Self>,
        p: Weights<'_, Self, Loc>,
        r: Rows,
        amax: Option<AmaxSink>,
    ) -> BResult<()>;
}
