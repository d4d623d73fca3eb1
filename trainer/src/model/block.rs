//! What both families' blocks share: the context one block's computations run in
//! ([`BlockCtx`]: the backend, the block's gathered parameters, where documents start, where
//! its input gradient's amax goes) and the norm before a linear layer
//! ([`BlockCtx::norm_then_linear`]: GPT-2's LayerNorms before qkv and fc, Llama's RMSNorms
//! before qkv and gate/up), which an FP8 layer that keeps its input's codes applies in its
//! input's cast instead of reading the norm's output ([`norm_in_cast`]).

use crate::backend::{
    AmaxSink, BResult, Backend, BackendError, Device, LinearLocs, LnStats, Loc, MatShape, NormLocs, NormOfInput, Rows,
    Weights,
};

/// Whether the layer `lin` (at shape `s`), which reads a norm's output, takes it from the
/// norm's input, the norm applied in its cast: an FP8 layer that keeps its input's codes and
/// whose producer leaves its amax. Then the norm's output is never written (a family's
/// constructor allocates none where [`super::keeps_codes`] says so), and the layer's backward
/// reads the codes it kept.
pub(crate) fn norm_in_cast(lin: LinearLocs, s: MatShape) -> bool {
    lin.keeps_input(s) && lin.input_sink(s).is_some()
}

/// The error of a `family` block that would write or read a norm's output its constructor
/// did not allocate ([`super::keeps_codes`] and [`norm_in_cast`] disagree: a bug).
pub(crate) fn no_norm_output(family: &str) -> BackendError {
    BackendError::Device(format!(
        "a {family} block writes or reads a norm's output that was not allocated because its FP8 layer applies the \
         norm in its cast (a bug: the model's constructor and its blocks disagree on model::norm_in_cast)"
    ))
}

/// A norm whose output a linear layer reads, as [`BlockCtx::norm_then_linear`] runs it: where
/// its output goes (`None` where the family's constructor allocated none, every layer of the
/// set applying the norm in its cast), where its statistics go, and its parameters.
pub(crate) enum BlockNorm<'a, B: Device> {
    /// GPT-2's: `(x − mean)·rstd·w + b` per row.
    LayerNorm { out: Option<&'a mut B::Buf>, mean: &'a mut B::F32, rstd: &'a mut B::F32, at: NormLocs },
    /// Llama's: `x·rstd·w` per row.
    RmsNorm { out: Option<&'a mut B::Buf>, rstd: &'a mut B::F32, w: Loc, eps: f32 },
}

/// The context of one block's computations, as both families' blocks hold it: the backend,
/// the block's gathered parameters, where documents start, where its input gradient's amax
/// goes, and the family's name (for the errors that name a bug).
pub(crate) struct BlockCtx<'a, B: Backend> {
    pub be: &'a B,
    pub p: &'a B::Buf,
    /// Each row's document start (`data.document_mask`), for attention (and Llama's RoPE).
    pub docs: Option<&'a B::Tokens>,
    /// Where the block's first norm's backward leaves the amax of the gradient it writes (the
    /// block below's MLP output layer reads it first: the families' `*_grad_sink`); `None`
    /// for block 0 and in the forward.
    pub dres_sink: Option<AmaxSink>,
    pub family: &'static str,
}

impl<B: Backend> BlockCtx<'_, B> {
    /// The block's parameters at `at`.
    pub fn w<L>(&self, at: L) -> Weights<'_, B, L> {
        Weights::new(self.p, at)
    }

    /// `out = norm(x) · Wᵀ (+ b)`: the norm's output written, then the layer; or, for an FP8
    /// layer that keeps its input's codes ([`norm_in_cast`]), the norm's statistics only (the
    /// cast predicts its scale: no amax of the output), the norm applied by the layer's cast
    /// (`matmul_fwd_of_norm`: the same bits, one pass less).
    pub fn norm_then_linear(
        &self,
        norm: BlockNorm<'_, B>,
        x: &B::Buf,
        out: &mut B::Buf,
        lin: LinearLocs,
        s: MatShape,
    ) -> BResult<()> {
        let (be, r) = (self.be, Rows { n: s.n, c: s.c });
        let sink = lin.input_sink(s);
        match (norm_in_cast(lin, s), norm) {
            // The cast predicts its scale: the norm leaves no amax.
            (true, BlockNorm::LayerNorm { mean, rstd, at, .. }) => {
                be.layernorm_stats(LnStats { mean: &mut *mean, rstd: &mut *rstd }, x, self.w(at), r, None)?;
                let of = NormOfInput::LayerNorm { mean: &*mean, rstd: &*rstd, at };
                be.matmul_fwd_of_norm(out, x, of, self.w(lin.input_amax_from(None)), s)
            }
            (true, BlockNorm::RmsNorm { rstd, w, eps, .. }) => {
                be.rmsnorm_stats(rstd, x, self.w(w), r, eps, None)?;
                let of = NormOfInput::RmsNorm { rstd: &*rstd, w, eps };
                be.matmul_fwd_of_norm(out, x, of, self.w(lin.input_amax_from(None)), s)
            }
            (false, BlockNorm::LayerNorm { out: ln, mean, rstd, at }) => {
                let ln = ln.ok_or_else(|| no_norm_output(self.family))?;
                be.layernorm_fwd(ln, LnStats { mean, rstd }, x, self.w(at), r, sink)?;
                be.matmul_fwd(out, ln, self.w(lin.input_amax_from(sink)), s)
            }
            (false, BlockNorm::RmsNorm { out: ln, rstd, w, eps }) => {
                let ln = ln.ok_or_else(|| no_norm_output(self.family))?;
                be.rmsnorm_fwd(ln, rstd, x, self.w(w), r, eps, sink)?;
                be.matmul_fwd(out, ln, self.w(lin.input_amax_from(sink)), s)
            }
        }
    }
}
