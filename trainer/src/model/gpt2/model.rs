//! GPT-2 forward and backward for one micro-batch, over any [`Backend`]: the
//! [`DecoderModel`] hooks the shared schedule (`model/schedule.rs`) calls per unit.
//!
//! Activation buffers are allocated once for the micro-batch size. With activation
//! checkpointing a block keeps only its input (the residual stream entering it, which is
//! always kept) — and with `checkpointing.keep_attention` its attention output and softmax
//! state — and its forward is recomputed into a shared set before its backward, up to the
//! MLP's GELU (see `Pass`). The GELU output, the second MLP GEMM's input, is recomputed
//! by the backward from the pre-activation unless (`checkpointing.keep_gelu`) the block
//! kept the forward's.
//!
//! With `data.document_mask` every micro-batch brings its document starts (`BatchTokens`):
//! attention stays within documents and the learned positions restart at each.

use super::layout::{BlockLocs, EmbedUnitLocs};
use crate::backend::{
    matmul_bwd_or_kept, AmaxSink, AttnInputs, AttnShape, BResult, Backend, Device, DgeluOf, GeluInput, LnSaved,
    LnStats, Loc, MatShape, NormLocs, Rows, SeqShape, UnitGrads, Weights,
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

/// The per-row statistics of one LayerNorm, kept from its forward for its backward.
struct NormStats<B: Device> {
    mean: B::F32,
    rstd: B::F32,
}

impl<B: Device> NormStats<B> {
    fn out(&mut self) -> LnStats<'_, B> {
        LnStats { mean: &mut self.mean, rstd: &mut self.rstd }
    }
    /// The norm at `at` writing `out` (where allocated) and these statistics, before a linear
    /// layer (`BlockCtx::norm_then_linear`).
    fn before<'a>(&'a mut self, out: Option<&'a mut B::Buf>, at: NormLocs) -> BlockNorm<'a, B> {
        BlockNorm::LayerNorm { out, mean: &mut self.mean, rstd: &mut self.rstd, at }
    }
    fn saved<'a>(&'a self, inp: &'a B::Buf) -> LnSaved<'a, B> {
        LnSaved { inp, mean: &self.mean, rstd: &self.rstd }
    }
}

/// Activations one block saves for its backward.
struct BlockActs<B: Device> {
    /// The norms' outputs; `None` where every block of the set applies the norm in its FP8
    /// layer's cast (`Gpt2::norm_in_cast`): nothing writes or reads them there.
    ln1: Option<B::Buf>,
    ln1_stats: NormStats<B>,
    qkv: B::Buf,
    atty: B::Buf,
    att_saved: B::F32,
    resid2: B::Buf,
    ln2: Option<B::Buf>,
    ln2_stats: NormStats<B>,
    /// MLP hidden pre-activation. GELU(fch) is not saved by default: backward recomputes it
    /// (one element-wise pass) to save 4·C values per token per layer.
    fch: B::Buf,
    /// GELU(fch) as the forward made it (`checkpointing.keep_gelu`, blocks not checkpointed;
    /// in FP8, where fc2 keeps the codes of it instead, not kept here).
    gelu: Option<B::Buf>,
}

/// The error of a block that would write GELU's output where the model decided none does
/// (every fc2 takes it from the pre-activation; `Gpt2::new` and `Block::forward` disagree).
fn no_gelu_output() -> crate::backend::BackendError {
    crate::backend::BackendError::Device(
        "a GPT-2 block writes GELU's output, but no buffer was allocated for it because every fc2 takes GELU from the \
         pre-activation in its FP8 cast (a bug: Gpt2::new and Block::forward disagree)"
            .into(),
    )
}

/// Backward scratch shared by all blocks.
struct GradScratch<B: Device> {
    /// Gradient of the residual stream, updated in place block by block.
    dres: B::Buf,
    dln: B::Buf,
    dbig1: B::Buf,
    dbig2: B::Buf,
    dqkv: B::Buf,
}

/// Forward scratch shared by all blocks.
struct Scratch<B: Device> {
    tmp: B::Buf,
    /// GELU output of the block being computed; `None` where every block's fc2 takes GELU
    /// from the pre-activation in its cast (nothing writes it).
    gelu_out: Option<B::Buf>,
}

/// GPT-2's activation memory for a fixed micro-batch, and its per-unit computations.
pub struct Gpt2<B: Backend> {
    embed: EmbedUnitLocs,
    block: BlockLocs,
    shape: AttnShape,
    ckpt: ActivationCheckpointing,
    /// Residual stream entering each block, plus the final one: `n_layer + 1` buffers.
    resid: Vec<B::Buf>,
    /// Saved-activation sets; `act_slot[l]` says which one block `l` uses (checkpointed
    /// blocks share the last set, which is recomputed in backward).
    acts: Vec<BlockActs<B>>,
    act_slot: Vec<usize>,
    /// Per FP8 layer: whether its forward keeps its input's codes (`model::fp8_kept_inputs`).
    fp8_kept: Vec<bool>,
    /// Per block: its kept attention (checkpointed blocks with `keep_attention`).
    kept: Vec<Option<KeptAttention<B>>>,
    scratch: Scratch<B>,
    lnf: B::Buf,
    lnf_stats: NormStats<B>,
    /// The tied LM head and the loss, in chunks of rows.
    head: LossHead<B>,
    /// Input ids and, with `document_mask`, each row's document start.
    tokens: BatchTokens<B>,
    g: GradScratch<B>,
}

impl<B: Backend> Gpt2<B> {
    /// Allocate activations for micro-batch `opts.micro_batch` (sequences of `seq_len`),
    /// counted in `ledger`.
    pub fn new(be: &B, layout: &ModelLayout, opts: &ModelOptions, ledger: &mut MemoryLedger) -> BResult<Gpt2<B>> {
        let (b, ckpt_cfg) = (opts.micro_batch, &opts.checkpointing);
        let ckpt = ckpt_cfg.activations;
        let cfg = &layout.cfg;
        let (_, locs) = super::layout::layout(cfg);
        let (t, c, l) = (cfg.seq_len, cfg.n_embd, cfg.n_layer);
        let n = b * t;
        let sz = be.elem_bytes();
        let shape = AttnShape::mha(b, t, c, cfg.n_head);
        let mut buf = |len: usize, what: &str| -> BResult<B::Buf> {
            ledger.alloc(Category::Activations, len * sz.buf);
            be.alloc_buf(len, what)
        };
        let resid = (0..=l).map(|_| buf(n * c, "residual stream")).collect::<BResult<Vec<_>>>()?;
        let tmp = buf(n * c, "block scratch")?;
        let lnf = buf(n * c, "final layernorm")?;
        let g = GradScratch {
            dres: buf(n * c, "residual gradient")?,
            dln: buf(n * c, "gradient scratch")?,
            dbig1: buf(n * 4 * c, "gradient scratch")?,
            dbig2: buf(n * 4 * c, "gradient scratch")?,
            dqkv: buf(n * 3 * c, "qkv gradient")?,
        };
        let mut f32buf = |len: usize, what: &str| -> BResult<B::F32> {
            ledger.alloc(Category::Activations, len * sz.f32);
            be.alloc_f32(len, what)
        };
        let lnf_stats = NormStats { mean: f32buf(n, "layernorm stats")?, rstd: f32buf(n, "layernorm stats")? };
        let slots = ActSlots::new(ckpt, l);
        let saved_len = be.attention_saved_len(shape);
        // qkv, proj, fc, fc2 (the tied head stays bf16: LossHead).
        let linears = locs.block.linears(cfg).map(|(_, c, oc)| (c, oc));
        let fp8_kept = fp8_kept_inputs(opts, n, &linears, l);
        let fc2_codes = mlp_out_keeps_codes(&fp8_kept, linears.len());
        // Where each block's qkv and fc apply their norm in their cast (`model::norm_in_cast`;
        // fc only where fc2 takes GELU from the pre-activation), that norm's output is never
        // written.
        let norm_cast =
            |layer: usize, k: usize| keeps_codes(&fp8_kept, layer, k) && (k == 0 || keeps_codes(&fp8_kept, layer, 3));
        let set_needs = |set: usize, k: usize| (0..l).any(|layer| slots.slot[layer] == set && !norm_cast(layer, k));
        // fc2 takes GELU from the pre-activation (`Block::forward`'s `of_pre`) where it keeps
        // its input's codes and fc runs in FP8; elsewhere GELU's output is written, into the
        // block's kept copy or this scratch.
        let of_pre = |layer: usize| keeps_codes(&fp8_kept, layer, 3) && !opts.fp8_bf16_layers[2];
        let gelu_out = if (0..l).all(of_pre) {
            None
        } else {
            ledger.alloc(Category::Activations, n * 4 * c * sz.buf);
            Some(be.alloc_buf(n * 4 * c, "gelu output")?)
        };
        let scratch = Scratch { tmp, gelu_out };
        let mut acts = Vec::with_capacity(slots.sets);
        for set in 0..slots.sets {
            let mut bb = |len: usize, what: &str| -> BResult<B::Buf> {
                ledger.alloc(Category::Activations, len * sz.buf);
                be.alloc_buf(len, what)
            };
            let ln1 = if set_needs(set, 0) { Some(bb(n * c, "ln1")?) } else { None };
            let qkv = bb(n * 3 * c, "qkv")?;
            let atty = bb(n * c, "attention output")?;
            let resid2 = bb(n * c, "residual")?;
            let ln2 = if set_needs(set, 2) { Some(bb(n * c, "ln2")?) } else { None };
            let fch = bb(n * 4 * c, "mlp hidden")?;
            let keep_gelu = ckpt_cfg.keep_gelu.keeps() && !slots.is_shared(set) && !fc2_codes;
            let gelu = if keep_gelu { Some(bb(n * 4 * c, "kept gelu output")?) } else { None };
            let mut ff = |len: usize, what: &str| -> BResult<B::F32> {
                ledger.alloc(Category::Activations, len * sz.f32);
                be.alloc_f32(len, what)
            };
            acts.push(BlockActs {
                ln1,
                ln1_stats: NormStats { mean: ff(n, "ln1 mean")?, rstd: ff(n, "ln1 rstd")? },
                qkv,
                atty,
                att_saved: ff(saved_len, "attention softmax state")?,
                resid2,
                ln2,
                ln2_stats: NormStats { mean: ff(n, "ln2 mean")?, rstd: ff(n, "ln2 rstd")? },
                fch,
                gelu,
            });
        }
        let kept = KeptAttention::for_blocks(be, ckpt_cfg, l, n * c, saved_len, ledger)?;
        let head = LossHead::new(be, n, c, cfg.vocab_size, opts.loss_chunk_rows, ledger)?;
        let tokens = BatchTokens::new(be, b, t, opts.document_mask, ledger)?;
        prepare_precision(be, opts, n, &linears, l, &fp8_kept, ledger)?;
        Ok(Gpt2 {
            embed: locs.embed,
            block: locs.block.with_precision(opts.precision, opts.fp8_bf16_layers),
            shape,
            ckpt,
            resid,
            acts,
            act_slot: slots.slot,
            fp8_kept,
            kept,
            scratch,
            lnf,
            lnf_stats,
            head,
            tokens,
            g,
        })
    }

    fn rows(&self) -> Rows {
        Rows { n: self.shape.b * self.shape.t, c: self.shape.c }
    }

    /// Where the op writing block `layer`'s output gradient (the residual gradient: the norm
    /// backward above it, the block's own fc2 reads it first) leaves its amax; `None` below
    /// block 0.
    fn fc2_grad_sink(&self, layer: Option<usize>) -> Option<AmaxSink> {
        let (n, c) = (self.shape.b * self.shape.t, self.shape.c);
        layer.and_then(|l| self.locs(l).fc2.grad_sink(MatShape { n, c: 4 * c, oc: c }))
    }

    /// Block `layer`'s locations with its FP8 layers' state.
    fn locs(&self, layer: usize) -> BlockLocs {
        self.block.for_layer(layer, &self.fp8_kept)
    }
}

impl<B: Backend> DecoderModel<B> for Gpt2<B> {
    fn load_batch(&mut self, be: &B, batch: &MicroBatch<'_>) -> BResult<()> {
        self.tokens.upload(be, batch)?;
        self.head.load_targets(be, batch.targets)
    }

    fn embed_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()> {
        let s = SeqShape { b: self.shape.b, t: self.shape.t, c: self.shape.c };
        be.encoder_fwd(&mut self.resid[0], self.tokens.embed(), Weights::new(p, self.embed.tokens), s)
    }

    fn block_fwd(&mut self, be: &B, layer: usize, p: &B::Buf) -> BResult<()> {
        clear_block_sinks(be, layer)?;
        let k = &self.locs(layer);
        let (x, rest) = self.resid.split_at_mut(layer + 1);
        let acts = &mut self.acts[self.act_slot[layer]];
        let c = BlockCtx { be, p, docs: self.tokens.docs.as_ref(), dres_sink: None, family: "GPT-2" };
        let blk = Block { c, k, s: self.shape };
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        let r = blk.forward(&x[layer], Pass::Full(&mut rest[0]), acts, &mut self.scratch);
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        r
    }

    fn head_fwd(&mut self, be: &B, p: &B::Buf) -> BResult<()> {
        let (r, l, e) = (self.rows(), self.resid.len() - 1, self.embed);
        be.layernorm_fwd(&mut self.lnf, self.lnf_stats.out(), &self.resid[l], Weights::new(p, e.ln_f), r, None)?;
        self.head.forward(be, &self.lnf, Weights::new(p, e.head))
    }

    fn head_fwd_bwd(&mut self, be: &B, p: &B::Buf, dloss_scale: f32, mut gr: UnitGrads<'_, B>) -> BResult<()> {
        let (r, l, e) = (self.rows(), self.resid.len() - 1, self.embed);
        be.layernorm_fwd(&mut self.lnf, self.lnf_stats.out(), &self.resid[l], Weights::new(p, e.ln_f), r, None)?;
        // The head is wte: written here first, the embedding's backward adds to it.
        let w = Weights::new(p, e.head);
        self.head.forward_backward(be, &self.lnf, w, dloss_scale, gr.first(e.head), &mut self.g.dln)?;
        be.zero_buf(&mut self.g.dres, Loc::all(r.n * r.c))?;
        let saved = self.lnf_stats.saved(&self.resid[l]);
        // The last block's fc2 reads this gradient first.
        let sink = self.fc2_grad_sink(l.checked_sub(1));
        be.layernorm_bwd(&mut self.g.dres, gr.first(e.ln_f), &self.g.dln, saved, Weights::new(p, e.ln_f), r, sink)
    }

    fn block_bwd(&mut self, be: &B, layer: usize, p: &B::Buf, gr: UnitGrads<'_, B>) -> BResult<()> {
        let slot = self.act_slot[layer];
        let (k, dres_sink) = (&self.locs(layer), self.fc2_grad_sink(layer.checked_sub(1)));
        let c = BlockCtx { be, p, docs: self.tokens.docs.as_ref(), dres_sink, family: "GPT-2" };
        let blk = Block { c, k, s: self.shape };
        let acts = &mut self.acts[slot];
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        let mut r = Ok(());
        if self.ckpt.is_checkpointed(layer) {
            let pass = Pass::Recompute { attention: self.kept[layer].is_none() };
            r = blk.forward(&self.resid[layer], pass, acts, &mut self.scratch);
        }
        if r.is_ok() {
            r = blk.backward(gr, &self.resid[layer], acts, &mut self.g);
        }
        KeptAttention::swap(self.kept[layer].as_mut(), &mut acts.atty, &mut acts.att_saved);
        r
    }

    fn embed_bwd(&mut self, be: &B, mut gr: UnitGrads<'_, B>) -> BResult<()> {
        let s = SeqShape { b: self.shape.b, t: self.shape.t, c: self.shape.c };
        // head_bwd wrote wte (the tied head) already; wpe is this op's alone.
        if let (true, Some(wpe)) = (gr.fresh, self.embed.tokens.wpe) {
            be.zero_grad(&mut *gr.buf, wpe)?;
        }
        be.encoder_bwd(gr.again(self.embed.tokens), &self.g.dres, self.tokens.embed(), s)
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
/// documents start, where its input gradient's amax goes), where its tensors are, and the
/// shapes.
struct Block<'a, B: Backend> {
    c: BlockCtx<'a, B>,
    k: &'a BlockLocs,
    s: AttnShape,
}

impl<B: Backend> Block<'_, B> {
    /// Forward: `out = x + attn(ln1(x)) + mlp(ln2(..))`, or what `pass` says of it.
    fn forward(&self, x: &B::Buf, pass: Pass<'_, B>, a: &mut BlockActs<B>, sc: &mut Scratch<B>) -> BResult<()> {
        let (be, k, s) = (self.c.be, self.k, self.s);
        let (n, c) = (s.b * s.t, s.c);
        let r = Rows { n, c };
        // The norms leave their outputs' amaxes for the FP8 GEMMs that read them next.
        let qkv = MatShape { n, c, oc: 3 * c };
        self.c.norm_then_linear(a.ln1_stats.before(a.ln1.as_mut(), k.ln1), x, &mut a.qkv, k.qkv, qkv)?;
        // Attention leaves its output's amax for proj (where it runs in this pass: a kept
        // output is not rewritten, and proj then takes its own amax of it).
        let proj = MatShape { n, c, oc: c };
        let sink = if pass.runs_attention() { k.proj.input_sink(proj) } else { None };
        if pass.runs_attention() {
            be.attention_fwd(&mut a.atty, &mut a.att_saved, AttnInputs { qkv: &a.qkv, docs: self.c.docs }, s, sink)?;
        }
        let proj_at = k.proj.input_amax_from(sink);
        be.matmul_residual_fwd(&mut a.resid2, x, &a.atty, self.c.w(proj_at), proj, &mut sc.tmp)?;
        let fc = MatShape { n, c, oc: 4 * c };
        // The GELU output's amax for fc2, where fc2 runs in this pass.
        let fc2 = MatShape { n, c: 4 * c, oc: c };
        let gelu_sink = if matches!(pass, Pass::Full(_)) { k.fc2.input_sink(fc2) } else { None };
        // An FP8 fc2 that keeps its input's codes quantizes GELU's output as its cast reads
        // the pre-activation: GELU's output is never written, only its amax found (the
        // composed FP8 fc forward is this GEMM, then GELU).
        let of_pre = gelu_sink.filter(|_| k.fc2.keeps_input(fc2) && k.fc.fp8(fc));
        let pass = match (of_pre, pass) {
            (Some(_), Pass::Full(out)) => {
                let ln2 = a.ln2_stats.before(a.ln2.as_mut(), k.ln2);
                self.c.norm_then_linear(ln2, &a.resid2, &mut a.fch, k.fc, fc)?;
                // fc2's cast predicts its scale and finds GELU's amax itself: no pass before it.
                let fc2_at = k.fc2.input_amax_from(None);
                return be.matmul_residual_fwd_of_gelu(out, &a.resid2, &a.fch, self.c.w(fc2_at), fc2, &mut sc.tmp);
            }
            (_, pass) => pass,
        };
        let sink = k.fc.input_sink(fc);
        let ln2 = a.ln2.as_mut().ok_or_else(|| no_norm_output("GPT-2"))?;
        be.layernorm_fwd(ln2, a.ln2_stats.out(), &a.resid2, self.c.w(k.ln2), r, sink)?;
        let fc_at = k.fc.input_amax_from(sink);
        let gelu = match a.gelu.as_mut() {
            Some(kept) => kept,
            None => sc.gelu_out.as_mut().ok_or_else(no_gelu_output)?,
        };
        be.matmul_gelu_fwd(&mut a.fch, gelu, ln2, self.c.w(fc_at), fc, gelu_sink)?;
        let Pass::Full(out) = pass else { return Ok(()) };
        let gelu = match a.gelu.as_ref() {
            Some(kept) => kept,
            None => sc.gelu_out.as_ref().ok_or_else(no_gelu_output)?,
        };
        be.matmul_residual_fwd(out, &a.resid2, gelu, self.c.w(k.fc2.input_amax_from(gelu_sink)), fc2, &mut sc.tmp)?;
        Ok(())
    }

    /// Backward: on entry `g.dres` holds dL/d(out); on exit dL/d(x).
    /// Every tensor of the block is reached by exactly one op, which writes it when `gr` is
    /// fresh.
    fn backward(
        &self,
        mut gr: UnitGrads<'_, B>,
        x: &B::Buf,
        a: &mut BlockActs<B>,
        g: &mut GradScratch<B>,
    ) -> BResult<()> {
        let (be, k, s) = (self.c.be, self.k, self.s);
        let (n, c) = (s.b * s.t, s.c);
        let r = Rows { n, c };
        // MLP: GELU(fch), kept (in FP8 as fc2's codes of it), or else recomputed into dbig2
        // (always with the element-wise kernel, never from a recompute's GEMM epilogue, so
        // that checkpointing does not change the bits); then backprop through fc2 and GELU.
        // A recomputed GELU output may differ in its last bits from the forward's (the GEMM
        // epilogue's), so an FP8 fc2 takes its own scale of it, which the recompute leaves.
        let fc2 = MatShape { n, c: 4 * c, oc: c };
        let (act, fc2_at) = match a.gelu.as_ref() {
            Some(kept) => (Some(kept), k.fc2),
            None if k.fc2.keeps_input(fc2) => (None, k.fc2),
            None => {
                let sink = k.fc2.input_sink(fc2);
                be.gelu_fwd(&mut g.dbig2, &a.fch, n * 4 * c, sink)?;
                (Some(&g.dbig2), k.fc2.input_recomputed().input_amax_from(sink))
            }
        };
        // The GELU backward leaves dpre's amax for fc's FP8 backward.
        let fc = MatShape { n, c, oc: 4 * c };
        let sink = k.fc.grad_sink(fc);
        // dres's amax: left by the norm backward above (the head's, or the next block's ln1).
        let fc2_at = fc2_at.grad_amax_from(k.fc2.grad_sink(fc2));
        // Where ln2's output was never written (applied in fc's cast), fc's codes serve.
        let fc_inp = match norm_in_cast(k.fc, fc) {
            true => None,
            false => Some(a.ln2.as_ref().ok_or_else(|| no_norm_output("GPT-2"))?),
        };
        if sink.is_some() {
            // GELU' belongs to fc's backward, whose dY cast applies it (with a predicted
            // scale): fc2's backward writes the gradient of GELU's output, and dpre is never
            // written (`MatmulOps::matmul_bwd_of_dgelu`).
            matmul_bwd_or_kept(be, &mut g.dbig1, gr.first(fc2_at), &g.dres, act, self.c.w(fc2_at), fc2)?;
            // dpre = GELU'(pre)·(dres·W2): its scale moves with dres's, whose amax fc2's
            // output-gradient slot holds (left by the norm backward above).
            let x = DgeluOf { pre: &a.fch, inp: fc_inp, scale_ref: k.fc2.grad_sink(fc2) };
            be.matmul_bwd_of_dgelu(&mut g.dln, gr.first(k.fc), &mut g.dbig1, x, self.c.w(k.fc), fc)?;
        } else {
            let gelu = GeluInput { act, pre: &a.fch, dpre_amax: sink };
            be.matmul_bwd_dgelu(&mut g.dbig1, gr.first(fc2_at), &g.dres, gelu, self.c.w(fc2_at), fc2)?;
            let fc_at = k.fc.grad_amax_from(sink);
            matmul_bwd_or_kept(be, &mut g.dln, gr.first(k.fc), &g.dbig1, fc_inp, self.c.w(fc_at), fc)?;
        }
        // dres += through ln2 (the residual branch already carries dres itself), leaving its
        // amax for proj's FP8 backward.
        let proj = MatShape { n, c, oc: c };
        let sink = k.proj.grad_sink(proj);
        let saved = a.ln2_stats.saved(&a.resid2);
        be.layernorm_bwd(&mut g.dres, gr.first(k.ln2), &g.dln, saved, self.c.w(k.ln2), r, sink)?;
        // attention
        let proj_at = k.proj.grad_amax_from(sink);
        be.matmul_bwd(&mut g.dln, gr.first(proj_at), &g.dres, &a.atty, self.c.w(proj_at), proj)?;
        let att_in = AttnInputs { qkv: &a.qkv, docs: self.c.docs };
        // Attention's backward leaves dqkv's amax for qkv's FP8 backward.
        let qkv = MatShape { n, c, oc: 3 * c };
        let sink = k.qkv.grad_sink(qkv);
        be.attention_bwd(&mut g.dqkv, &g.dln, att_in, &a.atty, &a.att_saved, s, sink)?;
        let qkv_at = k.qkv.grad_amax_from(sink);
        if norm_in_cast(k.qkv, qkv) {
            be.matmul_bwd_kept(&mut g.dln, gr.first(qkv_at), &g.dqkv, self.c.w(qkv_at), qkv)?;
        } else {
            let ln1 = a.ln1.as_ref().ok_or_else(|| no_norm_output("GPT-2"))?;
            be.matmul_bwd(&mut g.dln, gr.first(qkv_at), &g.dqkv, ln1, self.c.w(qkv_at), qkv)?;
        }
        let saved = a.ln1_stats.saved(x);
        be.layernorm_bwd(&mut g.dres, gr.first(k.ln1), &g.dln, saved, self.c.w(k.ln1), r, self.c.dres_sink)
    }
}
