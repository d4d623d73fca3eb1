//! Llama forward and backward for one micro-batch, over any [`Backend`]: the
//! [`DecoderModel`] hooks the shared schedule (`model/schedule.rs`) calls per unit.
//!
//! A block is `h = x + o(attn(rope(qkv(rms1(x)))))`, `out = h + down(swiglu(gate_up(rms2(h))))`.
//! RoPE rotates the query and key heads of the `qkv` buffer in place, so the attention
//! (forward and backward) reads them rotated and the backward rotates their gradient
//! back. As in GPT-2, activation buffers are allocated once for the micro-batch size;
//! a checkpointed block keeps only its input (and with `checkpointing.keep_attention` its
//! attention output and softmax state) and recomputes its forward up to the MLP's
//! gate/up projection before its backward. The SwiGLU output, the down projection's
//! input, is recomputed by the backward from the gate/up values unless
//! (`checkpointing.keep_gelu`: the MLP's activation output) the block kept the forward's.
//!
//! With `data.document_mask` every micro-batch brings its document starts (`BatchTokens`):
//! attention stays within documents and RoPE turns each token by its position in its document.

use super::layout::{BlockLocs, EmbedUnitLocs};
use crate::backend::{
    dswiglu_then_bwd, matmul_bwd_or_kept, rope_table, AmaxSink, AttnInputs, AttnShape, BResult, Backend, Device,
    DswigluOf, Loc, MatShape, RmsSaved, Rows, SeqShape, UnitGrads, Weights,
};
use crate::config::ActivationCheckpointing;
use crate::model::block::{no_norm_output, norm_in_cast, BlockCtx, BlockNorm};
use crate::model::checkpointing::{ActSlots, KeptAttention, Pass};
use crate::model::head::LossHead;
use crate::model::schedule::DecoderModel;
use crate::model::{
    clear_block_sinks, fp8_kept_inputs, keeps_codes, mlp_out_keeps_codes, prepare_precision, BatchTokens, MicroBatch,
    ModelLayout, ModelOptions,
};
use crate::zero::{Category, MemoryLedger};

/// Activations one block saves for its backward.
struct BlockActs<B: Device> {
    /// The norms' outputs; `None` where every block of the set applies the norm in its FP8
    /// layer's cast (`Llama::norm_in_cast`): nothing writes or reads them there.
    ln1: Option<B::Buf>,
    rstd1: B::F32,
    /// `[N, (nh + 2·nkv)·hs]`, query and key heads rotated.
    qkv: B::Buf,
    atty: B::Buf,
    att_saved: B::F32,
    resid2: B::Buf,
    ln2: Option<B::Buf>,
    rstd2: B::F32,
    /// The MLP's gate and up projections, `[N, 2F]`.
    gate_up: B::Buf,
    /// SwiGLU(gate_up) as the forward made it (`checkpointing.keep_gelu`, blocks not
    /// checkpointed; in FP8, where down keeps the codes of it instead, not kept here).
    act: Option<B::Buf>,
}

/// Scratch shared by all blocks: the forward's and, in the backward, the recomputed
/// SwiGLU output; the residual projections' output where they are not fused.
struct Scratch<B: Device> {
    tmp: B::Buf,
    act: B::Buf,
}

/// Backward scratch shared by all blocks.
struct GradScratch<B: Device> {
    /// Gradient of the residual stream, updated in place block by block.
    dres: B::Buf,
    dln: B::Buf,
    dact: B::Buf,
    dgate_up: B::Buf,
    dqkv: B::Buf,
}

/// The shapes of one micro-batch.
#[derive(Debug, Clone, Copy)]
struct Shapes {
    attn: AttnShape,
    /// The MLP width F.
    f: usize,
    eps: f32,
}

/// Llama's activation memory for a fixed micro-batch, and its per-unit computations.
pub struct Llama<B: Backend> {
    embed: EmbedUnitLocs,
    block: BlockLocs,
    s: Shapes,
    tied: bool,
    ckpt: ActivationCheckpointing,
    /// Residual stream entering each block, plus the final one: `n_layer + 1` buffers.
    resid: Vec<B::Buf>,
    acts: Vec<BlockActs<B>>,
    act_slot: Vec<usize>,
    /// Per FP8 layer: whether its forward keeps its input's codes (`model::fp8_kept_inputs`).
    fp8_kept: Vec<bool>,
    kept: Vec<Option<KeptAttention<B>>>,
    scratch: Scratch<B>,
    /// RoPE's cosines and sines for positions `0..T` ([`rope_table`]).
    rope: B::F32,
    lnf: B::Buf,
    rstdf: B::F32,
    head: LossHead<B>,
    /// Input ids and, with `document_mask`, each row's document start.
    tokens: BatchTokens<B>,
    g: GradScratch<B>,
}

impl<B: Backend> Llama<B> {
    /// Allocate activations for micro-batch `opts.micro_batch` (sequences of `seq_len`),
    /// counted in `ledger`.
    pub fn new(be: &B, layout: &ModelLayout, opts: &ModelOptions, ledger: &mut MemoryLedger) -> BResult<Llama<B>> {
        let (b, ckpt_cfg) = (opts.micro_batch, &opts.checkpointing);
        let ckpt = ckpt_cfg.activations;
        let cfg = &layout.cfg;
        let (_, locs) = super::layout::layout(cfg);
        let (t, c, l) = (cfg.seq_len, cfg.n_embd, cfg.n_layer);
        let f = cfg.intermediate_size.unwrap_or(0);
        let attn = AttnShape { b, t, c, nh: cfg.n_head, nkv: cfg.kv_heads() };
        let (n, w) = (b * t, attn.qkv_width());
        let sz = be.elem_bytes();
        let mut buf = |len: usize, what: &str| -> BResult<B::Buf> {
            ledger.alloc(Category::Activations, len * sz.buf);
            be.alloc_buf(len, what)
        };
        let resid = (0..=l).map(|_| buf(n * c, "residual stream")).collect::<BResult<Vec<_>>>()?;
        let scratch = Scratch { tmp: buf(n * c, "block scratch")?, act: buf(n * f, "swiglu output")? };
        let lnf = buf(n * c, "final norm")?;
        let g = GradScratch {
            dres: buf(n * c, "residual gradient")?,
            dln: buf(n * c, "gradient scratch")?,
            dact: buf(n * f, "swiglu gradient")?,
            dgate_up: buf(n * 2 * f, "gate/up gradient")?,
            dqkv: buf(n * w, "qkv gradient")?,
        };
        let mut f32buf = |len: usize, what: &str| -> BResult<B::F32> {
            ledger.alloc(Category::Activations, len * sz.f32);
            be.alloc_f32(len, what)
        };
        let rstdf = f32buf(n, "final norm rstd")?;
        let slots = ActSlots::new(ckpt, l);
        let saved_len = be.attention_saved_len(attn);
        // qkv, o, gate/up, down (the head stays bf16: LossHead).
        let linears = locs.block.linears(cfg).map(|(_, c, oc)| (c, oc));
        let fp8_kept = fp8_kept_inputs(opts, n, &linears, l);
        let down_codes = mlp_out_keeps_codes(&fp8_kept, linears.len());
        // Where each block's qkv and gate/up apply their norm in their cast (`model::norm_in_cast`:
        // the layer keeps its input's codes and its producer leaves the amax), that norm's
        // output is never written.
        let norm_cast = |layer: usize, k: usize| keeps_codes(&fp8_kept, layer, k);
        let set_needs = |set: usize, k: usize| (0..l).any(|layer| slots.slot[layer] == set && !norm_cast(layer, k));
        let mut acts = Vec::with_capacity(slots.sets);
        for set in 0..slots.sets {
            let mut bb = |len: usize, what: &str| -> BResult<B::Buf> {
                ledger.alloc(Category::Activations, len * sz.buf);
                be.alloc_buf(len, what)
            };
            let ln1 = if set_needs(set, 0) { Some(bb(n * c, "rms1")?) } else { None };
            let (qkv, atty, resid2) = (bb(n * w, "qkv")?, bb(n * c, "attention output")?, bb(n * c, "residual")?);
            let ln2 = if set_needs(set, 2) { Some(bb(n * c, "rms2")?) } else { None };
            let gate_up = bb(n * 2 * f, "gate/up")?;
            let act = if ckpt_cfg.keep_gelu.keeps() && !slots.is_shared(set) && !down_codes {
                Some(bb(n * f, "kept swiglu output")?)
            } else {
                None
            };
            let mut ff = |len: usize, what: &str| -> BResult<B::F32> {
                ledger.alloc(Category::Activations, len * sz.f32);
                be.alloc_f32(len, what)
            };
            acts.push(BlockActs {
                ln1,
                rstd1: ff(n, "rms1 rstd")?,
                qkv,
                atty,
                att_saved: ff(saved_len, "attention softmax state")?,
                resid2,
                ln2,
                rstd2: ff(n, "rms2 rstd")?,
                gate_up,
                act,
            });
        }
        let kept = KeptAttention::for_blocks(be, ckpt_cfg, l, n * c, saved_len, ledger)?;
        let table = rope_table(t, attn.hs(), cfg.rope_theta(), cfg.rope_scaling);
        ledger.alloc(Category::Workspace, table.len() * sz.f32);
        let mut rope = be.alloc_f32(table.len(), "rope table")?;
        be.upload_f32(&table, &mut rope, 0)?;
        let head = LossHead::new(be, n, c, cfg.vocab_size, opts.loss_chunk_rows, ledger)?;
        let tokens = BatchTokens::new(be, b, t, opts.document_mask, ledger)?;
        prepare_precision(be, opts, n, &linears, l, &fp8_kept, ledger)?;
        Ok(Llama {
            embed: locs.embed,
            block: locs.block.with_precision(opts.precision, opts.fp8_bf16_layers),
            s: Shapes { attn, f, eps: cfg.rms_norm_eps() as f32 },
            tied: cfg.tied(),
            ckpt,
            resid,
            acts,
            act_slot: slots.slot,
            fp8_kept,
            kept,
            scratch,
            rope,
            lnf,
            rstdf,
            head,
            tokens,
            g,
        })
    }

    fn rows(&self) -> Rows {
        Rows { n: self.s.attn.b * self.s.attn.t, c: self.s.attn.c }
    }

    fn seq(&self) -> SeqShape {
        SeqShape { b: self.s.attn.b, t: self.s.attn.t, c: self.s.attn.c }
    }

    /// Where the op writing block `layer`'s output gradient (the residual gradient: the norm
    /// backward above it, the block's own down projection reads it first) leaves its amax;
    /// `None` below block 0.
    fn down_grad_sink(&self, layer: Option<usize>) -> Option<AmaxSink> {
        let (n, c) = (self.s.attn.b * self.s.attn.t, self.s.attn.c);
        layer.and_then(|l| self.locs(l).down.grad_sink(MatShape { n, c: self.s.f, oc: c }))
    }

    /// Block `layer`'s locations with its FP8 layers' state.
    fn locs(&self, layer: usize) -> BlockLocs {
        self.block.for_layer(layer, &self.fp8_kept)
    }

    /// The final norm of the last residual stream into `lnf`.
    fn final_norm(&mut self, be: &B, p: &B::Buf) -> BResult<()> {
        let (r, l) = (self.rows(), self.resid.len() - 1);
        be.rmsnorm_fwd(
            &mut self.lnf,
            &mut self.rstdf,
            &self.resid[l],
            Weights::new(p, self.embed.norm),
            r,
            self.s.eps,
            None,
        )
    }
}

impl<B: Backend> DecoderModel<B> for Llama<B> {
    fn load_batch(&mut self, be: &B, batch: &MicroBatch<'_>) -> BResult<()> {
        self.tokens.upload(be, batch)?;
        self.head.load_targets(be, batch.targets)
    }

    fn embed_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()> {
        let s = self.seq();
        be.encoder_fwd(&mut self.resid[0], self.tokens.embed(), Weights::new(p, self.embed.tokens), s)
    }

    fn block_fwd(&mut self, be: &B, layer: usize, p: &B::Buf) -> BResult<()> {
        clear_block_sinks(be, layer)?;
        let k = &self.locs(layer);
        let (x, rest) = self.resid.split_at_mut(layer + 1);
        let acts = &mut self.acts[self.act_slot[layer]];
        let c = BlockCtx { be, p, docs: self.tokens.docs.as_ref(), dres_sink: None, family: "Llama" };
        let blk = Block { c, k, s: self.s, rope: &self.rope };
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        let r = blk.forward(&x[layer], Pass::Full(&mut rest[0]), acts, &mut self.scratch);
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        r
    }

    fn head_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()> {
        self.final_norm(be, p)?;
        self.head.forward(be, &self.lnf, Weights::new(p, self.embed.head))
    }

    fn head_fwd_bwd(&mut self, be: &B, p: &B::Buf, dloss_scale: f32, mut gr: UnitGrads<'_, B>) -> BResult<()> {
        self.final_norm(be, p)?;
        let (r, l, e) = (self.rows(), self.resid.len() - 1, self.embed);
        // Tied: the head is embed_tokens, written here first; the embedding's backward adds.
        let w = Weights::new(p, e.head);
        self.head.forward_backward(be, &self.lnf, w, dloss_scale, gr.first(e.head), &mut self.g.dln)?;
        be.zero_buf(&mut self.g.dres, Loc::all(r.n * r.c))?;
        let saved = RmsSaved { inp: &self.resid[l], rstd: &self.rstdf };
        // The last block's down projection reads this gradient first.
        let sink = self.down_grad_sink(l.checked_sub(1));
        be.rmsnorm_bwd(&mut self.g.dres, gr.first(e.norm), &self.g.dln, saved, Weights::new(p, e.norm), r, sink)
    }

    fn block_bwd(&mut self, be: &B, layer: usize, p: &B::Buf, gr: UnitGrads<'_, B>) -> BResult<()> {
        let slot = self.act_slot[layer];
        let dres_sink = self.down_grad_sink(layer.checked_sub(1));
        let c = BlockCtx { be, p, docs: self.tokens.docs.as_ref(), dres_sink, family: "Llama" };
        let blk = Block { c, k: &self.locs(layer), s: self.s, rope: &self.rope };
        let acts = &mut self.acts[slot];
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        let mut r = Ok(());
        if self.ckpt.is_checkpointed(layer) {
            let pass = Pass::Recompute { attention: self.kept[layer].is_none() };
            r = blk.forward(&self.resid[layer], pass, acts, &mut self.scratch);
        }
        if r.is_ok() {
            r = blk.backward(gr, &self.resid[layer], acts, &mut self.scratch, &mut self.g);
        }
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        r
    }

    fn embed_bwd(&mut self, be: &B, mut gr: UnitGrads<'_, B>) -> BResult<()> {
        let at = self.embed.tokens;
        // A tied head wrote embed_tokens already in head_fwd_bwd; otherwise this op is first.
        let (g, s) = (if self.tied { gr.again(at) } else { gr.first(at) }, self.seq());
        be.encoder_bwd(g, &self.g.dres, self.tokens.embed(), s)
    }

    fn take_mean_loss(&mut self, be: &B) -> BResult<f64> {
        self.head.take_mean_loss(be)
    }

    fn replayed_micro(&mut self) {
        self.head.replayed_micro();
    }

    fn token_losses(&self, be: &B) -> BResult<Vec<f32>> {
        self.head.token_losses(be)
    }
}

/// One block's computations: its context (the backend, its gathered parameters, where
/// documents start, where its input gradient's amax goes), where its tensors are, the
/// shapes, and the RoPE table.
struct Block<'a, B: Backend> {
    c: BlockCtx<'a, B>,
    k: &'a BlockLocs,
    s: Shapes,
    rope: &'a B::F32,
}

impl<B: Backend> Block<'_, B> {
    /// The RMSNorm at `w` writing `out` (where allocated) and `rstd`, before a linear layer
    /// (`BlockCtx::norm_then_linear`).
    fn rms<'a>(&self, out: Option<&'a mut B::Buf>, rstd: &'a mut B::F32, w: Loc) -> BlockNorm<'a, B> {
        BlockNorm::RmsNorm { out, rstd, w, eps: self.s.eps }
    }

    /// Forward, or what `pass` says of it.
    fn forward(&self, x: &B::Buf, pass: Pass<'_, B>, a: &mut BlockActs<B>, sc: &mut Scratch<B>) -> BResult<()> {
        let (be, k, s) = (self.c.be, self.k, self.s);
        let at = s.attn;
        let (n, c, f) = (at.b * at.t, at.c, s.f);
        // The norms and SwiGLU leave their outputs' amaxes for the FP8 GEMMs that read them next.
        let qkv = MatShape { n, c, oc: at.qkv_width() };
        self.c.norm_then_linear(self.rms(a.ln1.as_mut(), &mut a.rstd1, k.ln1), x, &mut a.qkv, k.qkv, qkv)?;
        be.rope_fwd(&mut a.qkv, self.rope, self.c.docs, at)?;
        // Attention leaves its output's amax for o (where it runs in this pass: a kept output
        // is not rewritten, and o then takes its own amax of it).
        let o = MatShape { n, c, oc: c };
        let sink = if pass.runs_attention() { k.o.input_sink(o) } else { None };
        if pass.runs_attention() {
            be.attention_fwd(&mut a.atty, &mut a.att_saved, AttnInputs { qkv: &a.qkv, docs: self.c.docs }, at, sink)?;
        }
        be.matmul_residual_fwd(&mut a.resid2, x, &a.atty, self.c.w(k.o.input_amax_from(sink)), o, &mut sc.tmp)?;
        let gu = MatShape { n, c, oc: 2 * f };
        let rms2 = self.rms(a.ln2.as_mut(), &mut a.rstd2, k.ln2);
        self.c.norm_then_linear(rms2, &a.resid2, &mut a.gate_up, k.gate_up, gu)?;
        let Pass::Full(out) = pass else { return Ok(()) };
        let down = MatShape { n, c: f, oc: c };
        let sink = k.down.input_sink(down);
        let act = a.act.as_mut().unwrap_or(&mut sc.act);
        be.swiglu_fwd(act, &a.gate_up, Rows { n, c: f }, sink)?;
        let act = a.act.as_ref().unwrap_or(&sc.act);
        be.matmul_residual_fwd(out, &a.resid2, act, self.c.w(k.down.input_amax_from(sink)), down, &mut sc.tmp)
    }

    /// Backward: on entry `g.dres` holds dL/d(out); on exit dL/d(x). Every tensor of the
    /// block is reached by exactly one op, which writes it when `gr` is fresh.
    fn backward(
        &self,
        mut gr: UnitGrads<'_, B>,
        x: &B::Buf,
        a: &mut BlockActs<B>,
        sc: &mut Scratch<B>,
        g: &mut GradScratch<B>,
    ) -> BResult<()> {
        let (be, k, s) = (self.c.be, self.k, self.s);
        let at = s.attn;
        let (n, c, f) = (at.b * at.t, at.c, s.f);
        let r = Rows { n, c };
        // MLP: SwiGLU(gate_up), kept (in FP8 as down's codes of it), or else recomputed
        // (always by the element-wise kernel, so checkpointing does not change the bits).
        // dres's amax: left by the norm backward above (the head's, or the next block's rms1).
        let down = MatShape { n, c: f, oc: c };
        let down_at = k.down.grad_amax_from(k.down.grad_sink(down));
        let act = match a.act.as_ref() {
            Some(kept) => Some(kept),
            None if k.down.keeps_input(down) => None,
            None => {
                be.swiglu_fwd(&mut sc.act, &a.gate_up, Rows { n, c: f }, None)?;
                Some(&sc.act)
            }
        };
        matmul_bwd_or_kept(be, &mut g.dact, gr.first(down_at), &g.dres, act, self.c.w(down_at), down)?;
        // SwiGLU's backward leaves its gradient's amax for gate_up's FP8 backward.
        let gu = MatShape { n, c, oc: 2 * f };
        // Where rms2's output was never written (applied in gate/up's cast), its codes serve.
        let gu_inp = match norm_in_cast(k.gate_up, gu) {
            true => None,
            false => Some(a.ln2.as_ref().ok_or_else(|| no_norm_output("Llama"))?),
        };
        // SwiGLU's backward writes dY and its amax, then the layer.
        let swiglu = DswigluOf { gate_up: &a.gate_up, inp: gu_inp, dy: &mut g.dgate_up };
        dswiglu_then_bwd(be, &mut g.dln, gr.first(k.gate_up), &g.dact, swiglu, self.c.w(k.gate_up), gu)?;
        // dres += through rms2 (the residual branch already carries dres itself), leaving its
        // amax for o's FP8 backward.
        let o = MatShape { n, c, oc: c };
        let sink = k.o.grad_sink(o);
        let saved = RmsSaved { inp: &a.resid2, rstd: &a.rstd2 };
        be.rmsnorm_bwd(&mut g.dres, gr.first(k.ln2), &g.dln, saved, self.c.w(k.ln2), r, sink)?;
        // attention
        let o_at = k.o.grad_amax_from(sink);
        be.matmul_bwd(&mut g.dln, gr.first(o_at), &g.dres, &a.atty, self.c.w(o_at), o)?;
        let att_in = AttnInputs { qkv: &a.qkv, docs: self.c.docs };
        // (No amax sink: RoPE's backward rewrites the query and key gradients after it.)
        be.attention_bwd(&mut g.dqkv, &g.dln, att_in, &a.atty, &a.att_saved, at, None)?;
        be.rope_bwd(&mut g.dqkv, self.rope, self.c.docs, at)?;
        let qkv = MatShape { n, c, oc: at.qkv_width() };
        if norm_in_cast(k.qkv, qkv) {
            be.matmul_bwd_kept(&mut g.dln, gr.first(k.qkv), &g.dqkv, self.c.w(k.qkv), qkv)?;
        } else {
            let ln1 = a.ln1.as_ref().ok_or_else(|| no_norm_output("Llama"))?;
            be.matmul_bwd(&mut g.dln, gr.first(k.qkv), &g.dqkv, ln1, self.c.w(k.qkv), qkv)?;
        }
        let saved = RmsSaved { inp: x, rstd: &a.rstd1 };
        be.rmsnorm_bwd(&mut g.dres, gr.first(k.ln1), &g.dln, saved, self.c.w(k.ln1), r, self.c.dres_sink)
    }
}
