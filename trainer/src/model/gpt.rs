//! GPT-2 forward and backward for one micro-batch, over any [`Backend`], driving the
//! ZeRO engine's per-unit schedule (gather → compute → release; backward → reduce).
//!
//! Activation buffers are allocated once for the micro-batch size. With activation
//! checkpointing a block keeps only its input (the residual stream entering it, which is
//! always kept) and its forward is recomputed into a shared scratch set during backward.

use crate::backend::{AttnShape, BResult, Backend, F64Pair, Loc};
use crate::config::{ActivationCheckpointing, ModelConfig};
use crate::model::layout::{BlockLocs, ModelLayout};
use crate::zero::{Category, Engine, EngineComm, MemoryLedger};
use crate::TrainError;

/// Activations one block saves for its backward.
struct BlockActs<B: Backend> {
    ln1: B::Buf,
    ln1_mean: B::F32,
    ln1_rstd: B::F32,
    qkv: B::Buf,
    atty: B::Buf,
    att_saved: B::F32,
    resid2: B::Buf,
    ln2: B::Buf,
    ln2_mean: B::F32,
    ln2_rstd: B::F32,
    /// MLP hidden pre-activation. GELU(fch) is not saved: backward recomputes it
    /// (one cheap element-wise pass) to save 4·C values per token per layer.
    fch: B::Buf,
}

/// Backward scratch shared by all blocks.
struct GradScratch<B: Backend> {
    /// Gradient of the residual stream, updated in place block by block.
    dres: B::Buf,
    dln: B::Buf,
    dbig1: B::Buf,
    dbig2: B::Buf,
    dqkv: B::Buf,
}

/// The model's activation memory for a fixed micro-batch.
pub struct Gpt<B: Backend> {
    cfg: ModelConfig,
    locs: BlockLocs,
    b: usize,
    ckpt: ActivationCheckpointing,
    /// Residual stream entering each block, plus the final one: `n_layer + 1` buffers.
    resid: Vec<B::Buf>,
    /// Saved-activation sets; `act_slot[l]` says which one block `l` uses (checkpointed
    /// blocks share the last set, which is recomputed in backward).
    acts: Vec<BlockActs<B>>,
    act_slot: Vec<usize>,
    tmp: B::Buf,
    /// GELU output of the block being computed (forward), shared by all blocks.
    gelu_out: B::Buf,
    recompute_out: B::Buf,
    lnf: B::Buf,
    lnf_mean: B::F32,
    lnf_rstd: B::F32,
    logits: B::Buf,
    losses: B::F32,
    /// Loss summed over the micro-steps since the last [`Gpt::take_mean_loss`], as an
    /// `F64Pair` on the device: reading it every micro-step would stall the device.
    loss_acc: B::F32,
    loss_micro: usize,
    tokens: B::Tokens,
    targets: B::Tokens,
    g: GradScratch<B>,
}

impl<B: Backend> Gpt<B> {
    /// Allocate activations for micro-batch `b` (sequences of `cfg.seq_len`).
    pub fn new(
        be: &B,
        layout: &ModelLayout,
        b: usize,
        ckpt: ActivationCheckpointing,
        ledger: &mut MemoryLedger,
    ) -> BResult<Gpt<B>> {
        let cfg = layout.cfg.clone();
        let (t, c, l) = (cfg.seq_len, cfg.n_embd, cfg.n_layer);
        let n = b * t;
        let sz = be.elem_bytes();
        let shape = AttnShape { b, t, c, nh: cfg.n_head };
        let mut buf = |len: usize, what: &str, cat: Category| -> BResult<B::Buf> {
            ledger.alloc(cat, len * sz.buf);
            be.alloc_buf(len, what)
        };
        let resid =
            (0..=l).map(|_| buf(n * c, "residual stream", Category::Activations)).collect::<BResult<Vec<_>>>()?;
        let tmp = buf(n * c, "block scratch", Category::Activations)?;
        let gelu_out = buf(n * 4 * c, "gelu output", Category::Activations)?;
        let recompute_out = buf(n * c, "recompute scratch", Category::Activations)?;
        let lnf = buf(n * c, "final layernorm", Category::Activations)?;
        let logits = buf(n * cfg.vocab_size, "logits", Category::Activations)?;
        let g = GradScratch {
            dres: buf(n * c, "residual gradient", Category::Activations)?,
            dln: buf(n * c, "gradient scratch", Category::Activations)?,
            dbig1: buf(n * 4 * c, "gradient scratch", Category::Activations)?,
            dbig2: buf(n * 4 * c, "gradient scratch", Category::Activations)?,
            dqkv: buf(n * 3 * c, "qkv gradient", Category::Activations)?,
        };
        let mut f32buf = |len: usize, what: &str| -> BResult<B::F32> {
            ledger.alloc(Category::Activations, len * sz.f32);
            be.alloc_f32(len, what)
        };
        let lnf_mean = f32buf(n, "layernorm stats")?;
        let lnf_rstd = f32buf(n, "layernorm stats")?;
        let losses = f32buf(n, "per-token losses")?;
        let mut loss_acc = f32buf(2, "loss sum")?;
        be.upload_f32(&[0.0, 0.0], &mut loss_acc, 0)?;
        // One saved set per non-checkpointed block, plus one shared set if any block is checkpointed.
        let mut act_slot = Vec::with_capacity(l);
        let mut n_sets = 0;
        for layer in 0..l {
            if ckpt.is_checkpointed(layer) {
                act_slot.push(usize::MAX);
            } else {
                act_slot.push(n_sets);
                n_sets += 1;
            }
        }
        if act_slot.contains(&usize::MAX) {
            for s in act_slot.iter_mut().filter(|s| **s == usize::MAX) {
                *s = n_sets;
            }
            n_sets += 1;
        }
        let saved_len = be.attention_saved_len(shape);
        let mut acts = Vec::with_capacity(n_sets);
        for _ in 0..n_sets {
            let mut bb = |len: usize, what: &str| -> BResult<B::Buf> {
                ledger.alloc(Category::Activations, len * sz.buf);
                be.alloc_buf(len, what)
            };
            let ln1 = bb(n * c, "ln1")?;
            let qkv = bb(n * 3 * c, "qkv")?;
            let atty = bb(n * c, "attention output")?;
            let resid2 = bb(n * c, "residual")?;
            let ln2 = bb(n * c, "ln2")?;
            let fch = bb(n * 4 * c, "mlp hidden")?;
            let mut ff = |len: usize, what: &str| -> BResult<B::F32> {
                ledger.alloc(Category::Activations, len * sz.f32);
                be.alloc_f32(len, what)
            };
            acts.push(BlockActs {
                ln1,
                ln1_mean: ff(n, "ln1 mean")?,
                ln1_rstd: ff(n, "ln1 rstd")?,
                qkv,
                atty,
                att_saved: ff(saved_len, "attention softmax state")?,
                resid2,
                ln2,
                ln2_mean: ff(n, "ln2 mean")?,
                ln2_rstd: ff(n, "ln2 rstd")?,
                fch,
            });
        }
        ledger.alloc(Category::Workspace, 2 * n * 4);
        let tokens = be.alloc_tokens(n)?;
        let targets = be.alloc_tokens(n)?;
        Ok(Gpt {
            cfg,
            locs: layout.block,
            b,
            ckpt,
            resid,
            acts,
            act_slot,
            tmp,
            gelu_out,
            recompute_out,
            lnf,
            lnf_mean,
            lnf_rstd,
            logits,
            losses,
            loss_acc,
            loss_micro: 0,
            tokens,
            targets,
            g,
        })
    }

    fn shape(&self) -> AttnShape {
        AttnShape { b: self.b, t: self.cfg.seq_len, c: self.cfg.n_embd, nh: self.cfg.n_head }
    }

    /// Mean loss per token over the micro-steps run since the last call (one device read).
    pub fn take_mean_loss(&mut self, be: &B) -> BResult<f64> {
        let n = self.b * self.cfg.seq_len;
        let pair = be.download_f32(&self.loss_acc, Loc::all(2))?;
        let mean = F64Pair::join(&pair) / (self.loss_micro.max(1) * n) as f64;
        be.upload_f32(&[0.0, 0.0], &mut self.loss_acc, 0)?;
        self.loss_micro = 0;
        Ok(mean)
    }

    /// [`Gpt::step_micro`], then its mean loss (waits for the device: evaluation and tests).
    pub fn step_micro_loss<C: EngineComm<B>>(
        &mut self,
        be: &B,
        eng: &mut Engine<B>,
        comm: &mut C,
        inputs: &[u32],
        targets: &[u32],
        dloss_scale: Option<f32>,
    ) -> Result<f64, TrainError> {
        self.step_micro(be, eng, comm, inputs, targets, dloss_scale)?;
        Ok(self.take_mean_loss(be)?)
    }

    /// Forward up to the per-token losses, which are added to the loss sum on the device
    /// (see [`Gpt::take_mean_loss`]). With `dloss_scale = Some(s)` the head's backward is
    /// also run (dlogits scaled by `s`) and the whole backward follows, accumulating
    /// parameter gradients in the engine.
    pub fn step_micro<C: EngineComm<B>>(
        &mut self,
        be: &B,
        eng: &mut Engine<B>,
        comm: &mut C,
        inputs: &[u32],
        targets: &[u32],
        dloss_scale: Option<f32>,
    ) -> Result<(), TrainError> {
        let s = self.shape();
        let (t, c, v, l) = (s.t, s.c, self.cfg.vocab_size, self.cfg.n_layer);
        let n = s.b * t;
        be.upload_tokens(inputs, &mut self.tokens)?;
        be.upload_tokens(targets, &mut self.targets)?;
        let e = eng.layout.embed;
        // Units in the order this micro-step gathers them; stage 3 starts the next
        // `zero.prefetch_blocks` all-gathers early so they overlap compute.
        let order = gather_order(l, dloss_scale.is_some());
        let mut pos = 0usize;

        // ---- forward ----
        gather_at(be, eng, comm, &order, &mut pos)?;
        be.encoder_fwd(&mut self.resid[0], &self.tokens, eng.params(0), e.wte, e.wpe, s.b, t, c)?;
        eng.release(0);
        for layer in 0..l {
            let u = ModelLayout::block_unit(layer);
            gather_at(be, eng, comm, &order, &mut pos)?;
            let (x, rest) = self.resid.split_at_mut(layer + 1);
            let acts = &mut self.acts[self.act_slot[layer]];
            block_forward(
                be,
                eng.params(u),
                &self.locs,
                s,
                &x[layer],
                &mut rest[0],
                acts,
                &mut self.tmp,
                &mut self.gelu_out,
            )?;
            eng.release(u);
        }
        gather_at(be, eng, comm, &order, &mut pos)?;
        {
            let p = eng.params(0);
            be.layernorm_fwd(
                &mut self.lnf,
                &mut self.lnf_mean,
                &mut self.lnf_rstd,
                &self.resid[l],
                p,
                e.lnf_w,
                e.lnf_b,
                n,
                c,
            )?;
            be.matmul_fwd(&mut self.logits, &self.lnf, p, e.wte, None, n, c, v)?;
        }
        be.cross_entropy_fwd_bwd(&mut self.logits, &mut self.losses, &self.targets, n, v, dloss_scale.unwrap_or(0.0))?;
        be.sum_into(&self.losses, Loc::all(n), &mut self.loss_acc, 0)?;
        self.loss_micro += 1;
        let Some(_) = dloss_scale else {
            eng.release(0);
            return Ok(());
        };

        // ---- backward ----
        {
            let (p, gr) = eng.params_and_grads(be, 0)?;
            // logits now hold dlogits.
            be.matmul_bwd(&mut self.g.dln, gr, e.wte, None, &self.logits, &self.lnf, p, e.wte, n, c, v)?;
            be.zero_buf(&mut self.g.dres, Loc::all(n * c))?;
            be.layernorm_bwd(
                &mut self.g.dres,
                gr,
                e.lnf_w,
                e.lnf_b,
                &self.g.dln,
                &self.resid[l],
                p,
                e.lnf_w,
                &self.lnf_mean,
                &self.lnf_rstd,
                n,
                c,
            )?;
        }
        eng.release(0);
        for layer in (0..l).rev() {
            let u = ModelLayout::block_unit(layer);
            gather_at(be, eng, comm, &order, &mut pos)?;
            let slot = self.act_slot[layer];
            if self.ckpt.is_checkpointed(layer) {
                block_forward(
                    be,
                    eng.params(u),
                    &self.locs,
                    s,
                    &self.resid[layer],
                    &mut self.recompute_out,
                    &mut self.acts[slot],
                    &mut self.tmp,
                    &mut self.gelu_out,
                )?;
            }
            let (p, gr) = eng.params_and_grads(be, u)?;
            block_backward(be, p, gr, &self.locs, s, &self.resid[layer], &self.acts[slot], &mut self.g)?;
            eng.unit_backward_done(be, comm, u)?;
            eng.release(u);
        }
        let gr = eng.grads(be, 0)?;
        be.encoder_bwd(gr, e.wte, e.wpe, &self.g.dres, &self.tokens, s.b, t, c)?;
        eng.unit_backward_done(be, comm, 0)?;
        Ok(())
    }
}

/// Units in the order one micro-step uses them: embedding, blocks, head (unit 0 again),
/// then — with backward — the blocks in reverse.
fn gather_order(n_layer: usize, backward: bool) -> Vec<usize> {
    let mut order: Vec<usize> = std::iter::once(0).chain((0..n_layer).map(ModelLayout::block_unit)).collect();
    order.push(0);
    if backward {
        order.extend((0..n_layer).rev().map(ModelLayout::block_unit));
    }
    order
}

/// Gather `order[*pos]` (waiting for its prefetch if one is in flight), then start the
/// all-gathers of the next `eng.prefetch` units, and advance `pos`.
fn gather_at<B: Backend, C: EngineComm<B>>(
    be: &B,
    eng: &mut Engine<B>,
    comm: &mut C,
    order: &[usize],
    pos: &mut usize,
) -> Result<(), TrainError> {
    eng.gather(be, comm, order[*pos])?;
    for &next in order.iter().skip(*pos + 1).take(eng.prefetch) {
        eng.prefetch_unit(be, comm, next)?;
    }
    *pos += 1;
    Ok(())
}

/// One transformer block forward: `out = x + attn(ln1(x)) + mlp(ln2(..))`.
#[allow(clippy::too_many_arguments)]
fn block_forward<B: Backend>(
    be: &B,
    p: &B::Buf,
    k: &BlockLocs,
    s: AttnShape,
    x: &B::Buf,
    out: &mut B::Buf,
    a: &mut BlockActs<B>,
    tmp: &mut B::Buf,
    gelu_out: &mut B::Buf,
) -> BResult<()> {
    let c = s.c;
    let n = s.b * s.t;
    be.layernorm_fwd(&mut a.ln1, &mut a.ln1_mean, &mut a.ln1_rstd, x, p, k.ln1_w, k.ln1_b, n, c)?;
    be.matmul_fwd(&mut a.qkv, &a.ln1, p, k.qkv_w, Some(k.qkv_b), n, c, 3 * c)?;
    be.attention_fwd(&mut a.atty, &mut a.att_saved, &a.qkv, s)?;
    be.matmul_fwd(tmp, &a.atty, p, k.proj_w, Some(k.proj_b), n, c, c)?;
    be.residual_fwd(&mut a.resid2, x, tmp, n * c)?;
    be.layernorm_fwd(&mut a.ln2, &mut a.ln2_mean, &mut a.ln2_rstd, &a.resid2, p, k.ln2_w, k.ln2_b, n, c)?;
    be.matmul_gelu_fwd(&mut a.fch, gelu_out, &a.ln2, p, k.fc_w, k.fc_b, n, c, 4 * c)?;
    be.matmul_fwd(tmp, gelu_out, p, k.fc2_w, Some(k.fc2_b), n, 4 * c, c)?;
    be.residual_fwd(out, &a.resid2, tmp, n * c)?;
    Ok(())
}

/// One block backward: on entry `g.dres` holds dL/d(out); on exit dL/d(x).
#[allow(clippy::too_many_arguments)]
fn block_backward<B: Backend>(
    be: &B,
    p: &B::Buf,
    gr: &mut B::Grad,
    k: &BlockLocs,
    s: AttnShape,
    x: &B::Buf,
    a: &BlockActs<B>,
    g: &mut GradScratch<B>,
) -> BResult<()> {
    let c = s.c;
    let n = s.b * s.t;
    // MLP: recompute GELU(fch) into dbig2 (not saved in forward), then backprop through fc2 and GELU.
    be.gelu_fwd(&mut g.dbig2, &a.fch, n * 4 * c)?;
    be.matmul_bwd_dgelu(&mut g.dbig1, gr, k.fc2_w, k.fc2_b, &g.dres, &mut g.dbig2, &a.fch, p, k.fc2_w, n, 4 * c, c)?;
    be.matmul_bwd(&mut g.dln, gr, k.fc_w, Some(k.fc_b), &g.dbig1, &a.ln2, p, k.fc_w, n, c, 4 * c)?;
    // dres += through ln2 (the residual branch already carries dres itself)
    be.layernorm_bwd(&mut g.dres, gr, k.ln2_w, k.ln2_b, &g.dln, &a.resid2, p, k.ln2_w, &a.ln2_mean, &a.ln2_rstd, n, c)?;
    // attention
    be.matmul_bwd(&mut g.dln, gr, k.proj_w, Some(k.proj_b), &g.dres, &a.atty, p, k.proj_w, n, c, c)?;
    be.attention_bwd(&mut g.dqkv, &g.dln, &a.qkv, &a.atty, &a.att_saved, s)?;
    be.matmul_bwd(&mut g.dln, gr, k.qkv_w, Some(k.qkv_b), &g.dqkv, &a.ln1, p, k.qkv_w, n, c, 3 * c)?;
    be.layernorm_bwd(&mut g.dres, gr, k.ln1_w, k.ln1_b, &g.dln, x, p, k.ln1_w, &a.ln1_mean, &a.ln1_rstd, n, c)?;
    Ok(())
}
