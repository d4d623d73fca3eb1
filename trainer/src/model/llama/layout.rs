//! Llama's parameter layout. Unit 0 holds the token embedding (and, when the head is tied
//! to it, the final norm: the head lives there too); unit `1 + l` is block `l`; an untied
//! head is unit `n_layer + 1`, holding the final norm and `lm_head`. Tensor names are
//! Hugging Face's `LlamaForCausalLM` names, and shapes are theirs (`[out, in]`), so a
//! checkpoint maps tensor for tensor.
//!
//! The query, key and value projections sit next to each other in the block's unit, so
//! together they are one `[(nh + 2·nkv)·hs, C]` matrix: one GEMM makes a token's whole
//! `qkv` row. Likewise `gate_proj` and `up_proj` form one `[2F, C]` matrix.

use crate::backend::{EmbedLocs, LinearLocs, Loc, Precision};
use crate::config::ModelConfig;
use crate::model::init::InitRule;
use crate::model::{Bf16Layers, ModelLayout, TensorSpec, UnitLayout};

/// Where the embedding, final norm and LM head are.
#[derive(Debug, Clone, Copy)]
pub struct EmbedUnitLocs {
    pub tokens: EmbedLocs,
    /// The final RMSNorm's weight (in the head's unit).
    pub norm: Loc,
    /// The LM head (`embed_tokens` itself when tied), in `head_unit`.
    pub head: LinearLocs,
}

/// Locations of one block's tensors inside its unit (the same for every block).
#[derive(Debug, Clone, Copy)]
pub struct BlockLocs {
    pub ln1: Loc,
    /// q_proj, k_proj, v_proj as one matrix.
    pub qkv: LinearLocs,
    pub o: LinearLocs,
    pub ln2: Loc,
    /// gate_proj, up_proj as one matrix.
    pub gate_up: LinearLocs,
    pub down: LinearLocs,
}

impl BlockLocs {
    /// The block with its four linear layers in precision `p` (`train.precision`), but
    /// those `bf16` keeps in bf16 (`train.fp8_bf16_layers`, in FP8 layer order).
    pub fn with_precision(self, p: Precision, bf16: Bf16Layers) -> BlockLocs {
        let p = bf16.map(|kept| if kept { Precision::Bf16 } else { p });
        let (qkv, o) = (self.qkv.with_precision(p[0]), self.o.with_precision(p[1]));
        BlockLocs { qkv, o, gate_up: self.gate_up.with_precision(p[2]), down: self.down.with_precision(p[3]), ..self }
    }

    /// The block's linear layers in FP8 layer order (qkv, o, gate_up, down; see
    /// [`BlockLocs::for_layer`]): each weight with its `(inputs, outputs)` (o's input: the
    /// query heads' width).
    pub fn linears(&self, cfg: &ModelConfig) -> [(Loc, usize, usize); 4] {
        let (c, hs, f) = (cfg.n_embd, cfg.head_size(), cfg.intermediate_size.unwrap_or(0));
        let (q, kv) = (cfg.n_head * hs, cfg.kv_heads() * hs);
        [(self.qkv.w, c, q + 2 * kv), (self.o.w, q, c), (self.gate_up.w, c, 2 * f), (self.down.w, f, c)]
    }

    /// Block `layer`'s locations with its FP8 layers' state (`model::prepare_precision`
    /// numbers them: qkv, o, gate_up, down); `kept`, per FP8 layer of the model, whether its forward keeps
    /// its input's codes for its backward (`model::fp8_kept_inputs`; missing: no).
    pub fn for_layer(self, layer: usize, kept: &[bool]) -> BlockLocs {
        let i = 4 * layer;
        let at = |l: LinearLocs, k: usize| {
            l.with_fp8_index(i + k).with_kept_input(kept.get(i + k).copied().unwrap_or(false))
        };
        BlockLocs {
            qkv: at(self.qkv, 0),
            o: at(self.o, 1),
            gate_up: at(self.gate_up, 2),
            down: at(self.down, 3),
            ..self
        }
    }
}

/// Where every Llama tensor lives.
#[derive(Debug, Clone, Copy)]
pub struct LlamaLocs {
    pub embed: EmbedUnitLocs,
    pub block: BlockLocs,
}

/// Llama's initialisation: RMSNorm weights 1; the residual projections (`o_proj`,
/// `down_proj`) the scheme's smaller scale; every other matrix the larger
/// (transformers draws every matrix with std 0.02: `init.scheme = "gpt2"` scales the
/// residual projections down by √(2L) as well).
pub fn init_rule(t: &TensorSpec, std_all: f64, proj_std: f64) -> InitRule {
    let name = t.name.as_str();
    if name.ends_with("norm.weight") {
        InitRule::Ones
    } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        InitRule::Normal(proj_std)
    } else {
        InitRule::Normal(std_all)
    }
}

/// The layout of a Llama of `cfg`'s shape, and where its tensors are.
pub fn layout(cfg: &ModelConfig) -> (ModelLayout, LlamaLocs) {
    let (v, c, l) = (cfg.vocab_size, cfg.n_embd, cfg.n_layer);
    let hs = cfg.head_size();
    let (q, kv, f) = (cfg.n_head * hs, cfg.kv_heads() * hs, cfg.intermediate_size.unwrap_or(0));
    let mut e = UnitLayout::new("embed");
    let wte = e.push("model.embed_tokens.weight".into(), &[v, c]);
    let tokens = EmbedLocs { wte, wpe: None };
    let mut units = vec![e];
    let mut block = None;
    for i in 0..l {
        let mut u = UnitLayout::new(format!("model.layers.{i}"));
        let mut push = |s: &str, shape: &[usize]| u.push(format!("model.layers.{i}.{s}"), shape);
        let ln1 = push("input_layernorm.weight", &[c]);
        let (wq, wk, wv) = (
            push("self_attn.q_proj.weight", &[q, c]),
            push("self_attn.k_proj.weight", &[kv, c]),
            push("self_attn.v_proj.weight", &[kv, c]),
        );
        let o = LinearLocs::new(push("self_attn.o_proj.weight", &[c, q]), None);
        let ln2 = push("post_attention_layernorm.weight", &[c]);
        let (wg, wu) = (push("mlp.gate_proj.weight", &[f, c]), push("mlp.up_proj.weight", &[f, c]));
        let down = LinearLocs::new(push("mlp.down_proj.weight", &[c, f]), None);
        debug_assert!(wk.off == wq.end() && wv.off == wk.end() && wu.off == wg.end());
        let qkv = LinearLocs::new(Loc::new(wq.off, wq.len + wk.len + wv.len), None);
        let gate_up = LinearLocs::new(Loc::new(wg.off, wg.len + wu.len), None);
        block = Some(BlockLocs { ln1, qkv, o, ln2, gate_up, down });
        units.push(u);
    }
    let (norm, head, head_unit) = if cfg.tied() {
        (units[0].push("model.norm.weight".into(), &[c]), LinearLocs::new(wte, None), ModelLayout::EMBED_UNIT)
    } else {
        let mut h = UnitLayout::new("head");
        let norm = h.push("model.norm.weight".into(), &[c]);
        let w = h.push("lm_head.weight".into(), &[v, c]);
        units.push(h);
        (norm, LinearLocs::new(w, None), l + 1)
    };
    // n_layer >= 1 is validated by Config; a zero-layer model still gets valid locs.
    let empty = LinearLocs::new(Loc::new(0, 0), None);
    let block = block.unwrap_or(BlockLocs {
        ln1: Loc::new(0, 0),
        qkv: empty,
        o: empty,
        ln2: Loc::new(0, 0),
        gate_up: empty,
        down: empty,
    });
    let embed = EmbedUnitLocs { tokens, norm, head };
    (ModelLayout { cfg: cfg.clone(), units, head_unit }, LlamaLocs { embed, block })
}

/// Forward+backward FLOPs per token, as `llama_ref.py` counts them for MFU: 6 per parameter
/// of the matmuls (the embedding lookup is not one, unless it is also the tied head) plus
/// the attention scores and their use, 12·L·T·C.
pub fn flops_per_token(layout: &ModelLayout) -> f64 {
    let c = &layout.cfg;
    let emb = if c.tied() { 0 } else { c.vocab_size * c.n_embd };
    let n = (layout.num_params() - emb) as f64;
    6.0 * n + 12.0 * (c.n_layer * c.seq_len * c.n_embd) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelFamily;

    fn cfg(tied: bool) -> ModelConfig {
        ModelConfig {
            family: ModelFamily::Llama,
            n_kv_head: Some(2),
            intermediate_size: Some(40),
            tie_embeddings: Some(tied),
            ..ModelConfig::gpt2(2, 4, 16, 50, 8)
        }
    }

    #[test]
    fn tensors_are_hugging_face_names_and_shapes() {
        let (l, locs) = layout(&cfg(false));
        assert_eq!(l.units.len(), 4);
        assert_eq!(l.head_unit, 3);
        let names: Vec<&str> = l.units[1].tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight",
                "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.post_attention_layernorm.weight",
                "model.layers.0.mlp.gate_proj.weight",
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight",
            ]
        );
        // q: 4 heads of 4, k and v: 2 heads of 4 -> the fused projection is [16 + 8 + 8, 16].
        assert_eq!(locs.block.qkv.w.len, 32 * 16);
        assert_eq!(locs.block.gate_up.w.len, 80 * 16);
        let head: Vec<&str> = l.units[3].tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(head, ["model.norm.weight", "lm_head.weight"]);
        // Parameters: embedding 800, blocks 2 x (16 + 256 + 128 + 128 + 256 + 16 + 640 + 640 + 640), head 16 + 800.
        assert_eq!(l.num_params(), 800 + 2 * 2720 + 816);
    }

    #[test]
    fn a_tied_head_lives_in_the_embedding_unit() {
        let (l, locs) = layout(&cfg(true));
        assert_eq!((l.units.len(), l.head_unit), (3, 0));
        assert_eq!(locs.embed.head.w, locs.embed.tokens.wte);
        assert_eq!(l.units[0].tensors[1].name, "model.norm.weight");
    }

    #[test]
    fn norms_start_at_one_and_residual_projections_smaller() {
        let (l, _) = layout(&cfg(false));
        let rule = |name: &str| {
            let t = l.units.iter().flat_map(|u| &u.tensors).find(|t| t.name == name).expect("tensor");
            init_rule(t, 0.02, 0.005)
        };
        assert_eq!(rule("model.norm.weight"), InitRule::Ones);
        assert_eq!(rule("model.layers.1.input_layernorm.weight"), InitRule::Ones);
        assert_eq!(rule("model.layers.1.mlp.down_proj.weight"), InitRule::Normal(0.005));
        assert_eq!(rule("model.layers.0.self_attn.o_proj.weight"), InitRule::Normal(0.005));
        assert_eq!(rule("model.layers.0.self_attn.k_proj.weight"), InitRule::Normal(0.02));
        assert_eq!(rule("lm_head.weight"), InitRule::Normal(0.02));
        assert_eq!(rule("model.embed_tokens.weight"), InitRule::Normal(0.02));
    }
}
