//! What every decoder model shares: the per-unit schedule one micro-step runs through the
//! ZeRO engine. A family implements [`DecoderModel`] (what each unit computes); this file
//! decides when each unit is gathered, prefetched, released and its gradient reduced:
//!
//! forward: embedding (unit 0) → blocks 1..=L → head (`head_unit`) and loss, whose
//! backward runs with it; then the blocks L..=1 → embedding, each unit's reduction started as soon as
//! its gradient is complete.

use crate::backend::{BResult, Backend, UnitGrads};
use crate::model::{MicroBatch, ModelLayout};
use crate::zero::{Engine, EngineComm};
use crate::TrainError;

/// One model's activations and its per-unit computations for a fixed micro-batch. The
/// schedule hands each hook the parameters (and gradient buffer) of the unit it touches.
pub trait DecoderModel<B: Backend> {
    /// Upload one micro-batch: input and target token ids, and document starts when the
    /// model was built with `document_mask`.
    fn load_batch(&mut self, be: &B, batch: &MicroBatch<'_>) -> BResult<()>;
    /// The embedding (unit 0's parameters) into the residual stream.
    fn embed_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()>;
    /// Block `layer` forward.
    fn block_fwd(&mut self, be: &B, layer: usize, p: &B::Buf) -> BResult<()>;
    /// Final norm, LM head and loss (added to the device-side loss sum): evaluation.
    fn head_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()>;
    /// Final norm, LM head and loss, and their backward scaled by `dloss_scale`: the head
    /// unit's gradients and the start of the residual gradient. One hook, so the logits
    /// can be made and consumed in chunks (`model/head.rs`). Each backward hook writes
    /// every element of its unit when `g.fresh` (the head and the embedding together,
    /// where they share a unit), and adds to it otherwise.
    fn head_fwd_bwd(&mut self, be: &B, p: &B::Buf, dloss_scale: f32, g: UnitGrads<'_, B>) -> BResult<()>;
    /// Block `layer` backward (recomputing its forward first if it is checkpointed).
    fn block_bwd(&mut self, be: &B, layer: usize, p: &B::Buf, g: UnitGrads<'_, B>) -> BResult<()>;
    /// The embedding's backward into unit 0's gradients (after `head_fwd_bwd` where the head
    /// shares unit 0).
    fn embed_bwd(&mut self, be: &B, g: UnitGrads<'_, B>) -> BResult<()>;
    /// Mean loss per token over the micro-steps since the last call (one device read).
    fn take_mean_loss(&mut self, be: &B) -> BResult<f64>;
    /// A recording of [`run_micro`] was replayed: count its loss as `head_fwd` would have.
    fn replayed_micro(&mut self);
    /// The last micro-step's loss of every token, in row order (one device read: tests
    /// compare them token by token, e.g. a packed document against the document alone).
    fn token_losses(&self, be: &B) -> BResult<Vec<f32>>;
}

/// One micro-step: forward to the loss, and with `dloss_scale = Some(s)` the backward,
/// accumulating parameter gradients in the engine. Stage 3 starts the next
/// `zero.prefetch_blocks` all-gathers early so they overlap compute.
pub fn step_micro<B: Backend, C: EngineComm<B>>(
    model: &mut dyn DecoderModel<B>,
    be: &B,
    eng: &mut Engine<B>,
    comm: &mut C,
    batch: &MicroBatch<'_>,
    dloss_scale: Option<f32>,
) -> Result<(), TrainError> {
    model.load_batch(be, batch)?;
    run_micro(model, be, eng, comm, dloss_scale)
}

/// [`step_micro`] after its batch upload: the device work of one micro-step, which a CUDA
/// graph records once and replays (the engine's state is the same before and after it).
pub fn run_micro<B: Backend, C: EngineComm<B>>(
    model: &mut dyn DecoderModel<B>,
    be: &B,
    eng: &mut Engine<B>,
    comm: &mut C,
    dloss_scale: Option<f32>,
) -> Result<(), TrainError> {
    let l = eng.layout.cfg.n_layer;
    let (embed, head) = (ModelLayout::EMBED_UNIT, eng.layout.head_unit);
    let order = gather_order(l, head, dloss_scale.is_some());
    let mut pos = 0usize;
    // Cached FP8 weights are cast again at their first use after the parameters changed:
    // every step's first micro-step (recorded with its casts), and any evaluation before
    // it (which leaves the flag for the training micro-step, whose recording must match).
    if eng.params_changed() {
        be.fp8_weights_changed(eng.params_by_step());
        if dloss_scale.is_some() {
            eng.params_used();
        }
    }

    // ---- forward ----
    gather_at(be, eng, comm, &order, &mut pos)?;
    model.embed_fwd(be, eng.params(embed))?;
    eng.release(embed);
    for layer in 0..l {
        let u = ModelLayout::block_unit(layer);
        gather_at(be, eng, comm, &order, &mut pos)?;
        model.block_fwd(be, layer, eng.params(u))?;
        eng.release(u);
    }
    gather_at(be, eng, comm, &order, &mut pos)?;
    let Some(scale) = dloss_scale else {
        model.head_fwd(be, eng.params(head))?;
        eng.release(head);
        return Ok(());
    };

    // ---- the head's forward and backward, then the blocks' backward ----
    {
        let (p, g) = eng.params_and_grads(be, head)?;
        model.head_fwd_bwd(be, p, scale, g)?;
    }
    if head != embed {
        eng.unit_backward_done(be, comm, head)?;
    }
    eng.release(head);
    for layer in (0..l).rev() {
        let u = ModelLayout::block_unit(layer);
        gather_at(be, eng, comm, &order, &mut pos)?;
        let (p, g) = eng.params_and_grads(be, u)?;
        model.block_bwd(be, layer, p, g)?;
        eng.unit_backward_done(be, comm, u)?;
        eng.release(u);
    }
    model.embed_bwd(be, eng.grads(be, embed)?)?;
    eng.unit_backward_done(be, comm, embed)?;
    Ok(())
}

/// [`step_micro`], then its mean loss (waits for the device: evaluation and tests).
pub fn step_micro_loss<B: Backend, C: EngineComm<B>>(
    model: &mut dyn DecoderModel<B>,
    be: &B,
    eng: &mut Engine<B>,
    comm: &mut C,
    batch: &MicroBatch<'_>,
    dloss_scale: Option<f32>,
) -> Result<f64, TrainError> {
    step_micro(model, be, eng, comm, batch, dloss_scale)?;
    Ok(model.take_mean_loss(be)?)
}

/// Units in the order one micro-step uses them: embedding, blocks, head, then — with
/// backward — the blocks in reverse.
fn gather_order(n_layer: usize, head: usize, backward: bool) -> Vec<usize> {
    let mut order: Vec<usize> =
        std::iter::once(ModelLayout::EMBED_UNIT).chain((0..n_layer).map(ModelLayout::block_unit)).collect();
    order.push(head);
    if backward {
        order.extend((0..n_layer).rev().map(ModelLayout::block_unit));
    }
    order
}

/// Gather `order[*pos]` (waiting for its prefetch if one is in flight), then start the
/// all-gathers of the next prefetched units, and advance `pos`.
fn gather_at<B: Backend, C: EngineComm<B>>(
    be: &B,
    eng: &mut Engine<B>,
    comm: &mut C,
    order: &[usize],
    pos: &mut usize,
) -> Result<(), TrainError> {
    eng.gather(be, comm, order[*pos])?;
    for &next in order.iter().skip(*pos + 1).take(eng.prefetch()) {
        eng.prefetch_unit(be, comm, next)?;
    }
    *pos += 1;
    Ok(())
}
