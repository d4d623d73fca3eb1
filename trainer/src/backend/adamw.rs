//! The AdamW update (decoupled weight decay) of fp32 master weights, with the result
//! rounded into the compute-precision parameters. One call covers a list of segments
//! (the tensors of a unit this rank owns), so a backend may update them in one launch.

use super::{BResult, Device};

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decay applied to segments with `decay = true`.
    pub weight_decay: f32,
    /// 1-based optimizer step, for bias correction.
    pub t: u64,
    /// Multiplies the gradient before use (global-norm clipping factor).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The bias corrections `1 − β1ᵗ`, `1 − β2ᵗ`, the same bits wherever they are computed.
    /// (Not `powi`: LLVM evaluates it differently when `t` is a compile-time constant after
    /// inlining than when it is not, which made two callers disagree in the last bits.)
    pub fn bias_corrections(&self) -> (f32, f32) {
        (1.0 - pow_exact(self.beta1, self.t), 1.0 - pow_exact(self.beta2, self.t))
    }
}

/// `b^t` by squaring, multiplications in a fixed order (floating-point multiplication is
/// not reordered by the compiler, so every caller gets the same bits).
fn pow_exact(b: f32, t: u64) -> f32 {
    let (mut r, mut x, mut e) = (1.0f32, b, t);
    while e > 0 {
        if e & 1 == 1 {
            r *= x;
        }
        x *= x;
        e >>= 1;
    }
    r
}

/// The buffers one AdamW call reads and writes.
pub struct AdamWTensors<'a, B: Device + ?Sized> {
    /// Compute-precision parameters receiving the rounded result, if any are kept.
    pub params: Option<&'a mut B::Buf>,
    pub master: &'a mut B::F32,
    pub m: &'a mut B::F32,
    pub v: &'a mut B::F32,
    pub grads: &'a B::Grad,
}

/// One contiguous run of elements: `params[poff..]` (when there are params),
/// `master/m/v[moff..]`, `grads[goff..]`, `len` long, with or without weight decay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdamWSegment {
    pub poff: usize,
    pub moff: usize,
    pub goff: usize,
    pub len: usize,
    pub decay: bool,
    /// The FP8 layer ([`Fp8Layer::index`](super::Fp8Layer::index)) whose weight this segment
    /// is part of, when the update is to leave that weight's amax for its FP8 casts: the
    /// largest |value| of the rounded parameters written goes into the layer's weight slot,
    /// which then skips its own amax pass in the parameter version the step begins
    /// ([`MatmulOps::fp8_weights_changed`](super::MatmulOps::fp8_weights_changed) with
    /// `by_step`). The segments of one call naming a layer are its whole weight (one
    /// tensor, or several fused: Llama's q, k, v). Only with `params` (the rounded values
    /// are what the GEMMs read).
    pub fp8_layer: Option<usize>,
}

impl AdamWSegment {
    /// A segment that leaves no FP8 amax.
    pub const fn plain(poff: usize, moff: usize, goff: usize, len: usize, decay: bool) -> AdamWSegment {
        AdamWSegment { poff, moff, goff, len, decay, fp8_layer: None }
    }

    /// Where the segments of `segs` naming FP8 layer `layer` are its `len` values as one run
    /// of the parameters (in any order): that run's start. Where the step writes the layer's
    /// cached weight ([`Fp8Layers::step_codes`](super::Fp8Layers::step_codes)), it is the
    /// matrix the backends quantize; `None` (pieces apart, or not all of it) leaves the cache to
    /// the weight's first use.
    pub fn fp8_weight_run(segs: &[AdamWSegment], layer: usize, len: usize) -> Option<usize> {
        let mut mine: Vec<&AdamWSegment> = segs.iter().filter(|s| s.len > 0 && s.fp8_layer == Some(layer)).collect();
        mine.sort_by_key(|s| s.poff);
        let first = mine.first()?.poff;
        let mut end = first;
        for s in mine {
            if s.poff != end {
                return None;
            }
            end += s.len;
        }
        (end - first == len).then_some(first)
    }
}

pub trait AdamWOps: Device {
    /// AdamW over every segment of `segs`.
    fn adamw(&self, t: AdamWTensors<'_, Self>, segs: &[AdamWSegment], h: AdamWStep) -> BResult<()>;
}
