//! GPT-2's parameter layout: unit 0 holds `wte`, `wpe` and the final LayerNorm `ln_f`
//! (the LM head is tied to `wte`, so it lives there too); unit `1 + l` is block `l`.
//! Tensor names follow Hugging Face's GPT-2 (`h.{l}.attn.c_attn.weight`, …); linear
//! weights are stored `[out, in]` (`hf.rs` transposes to Hugging Face's `Conv1D`).

use crate::backend::{EmbedLocs, LinearLocs, Loc, NormLocs, Precision};
use crate::config::ModelConfig;
use crate::model::init::InitRule;
use crate::model::{Bf16Layers, ModelLayout, TensorSpec, UnitLayout};

/// Locations of unit 0's tensors.
#[derive(Debug, Clone, Copy)]
pub struct EmbedUnitLocs {
    pub tokens: EmbedLocs,
    pub ln_f: NormLocs,
    /// The LM head: `wte` read as a `[V, C]` linear layer without a bias.
    pub head: LinearLocs,
}

/// Locations of one block's tensors inside its unit (the same for every block).
#[derive(Debug, Clone, Copy)]
pub struct BlockLocs {
    pub ln1: NormLocs,
    pub qkv: LinearLocs,
    pub proj: LinearLocs,
    pub ln2: NormLocs,
    pub fc: LinearLocs,
    pub fc2: LinearLocs,
}

impl BlockLocs {
    /// The block with its four linear layers in precision `p` (`train.precision`), but
    /// those `bf16` keeps in bf16 (`train.fp8_bf16_layers`, in FP8 layer order).
    pub fn with_precision(self, p: Precision, bf16: Bf16Layers) -> BlockLocs {
        let p = bf16.map(|kept| if kept { Precision::Bf16 } else { p });
        let (qkv, proj) = (self.qkv.with_precision(p[0]), self.proj.with_precision(p[1]));
        BlockLocs { qkv, proj, fc: self.fc.with_precision(p[2]), fc2: self.fc2.with_precision(p[3]), ..self }
    }

    /// The block's linear layers in FP8 layer order (qkv, proj, fc, fc2; see
    /// [`BlockLocs::for_layer`]): each weight with its `(inputs, outputs)`.
    pub fn linears(&self, cfg: &ModelConfig) -> [(Loc, usize, usize); 4] {
        let c = cfg.n_embd;
        [(self.qkv.w, c, 3 * c), (self.proj.w, c, c), (self.fc.w, c, 4 * c), (self.fc2.w, 4 * c, c)]
    }

    /// Block `layer`'s locations with its FP8 layers' state (`model::prepare_precision`
    /// numbers them: qkv, proj, fc, fc2); `kept`, per FP8 layer of the model, whether its forward keeps
    /// its input's codes for its backward (`model::fp8_kept_inputs`; missing: no).
    pub fn for_layer(self, layer: usize, kept: &[bool]) -> BlockLocs {
        let i = 4 * layer;
        let at = |l: LinearLocs, k: usize| {
            l.with_fp8_index(i + k).with_kept_input(kept.get(i + k).copied().unwrap_or(false))
        };
        BlockLocs { qkv: at(self.qkv, 0), proj: at(self.proj, 1), fc: at(self.fc, 2), fc2: at(self.fc2, 3), ..self }
    }
}

/// Where every GPT-2 tensor lives.
#[derive(Debug, Clone, Copy)]
pub struct Gpt2Locs {
    pub embed: EmbedUnitLocs,
    pub block: BlockLocs,
}

/// GPT-2's rule: biases 0, LayerNorm weights 1, residual projections (`c_proj`) the
/// smaller scale, every other matrix the larger.
pub fn init_rule(t: &TensorSpec, std_all: f64, proj_std: f64) -> InitRule {
    let name = t.name.as_str();
    if name.ends_with(".bias") {
        InitRule::Zeros
    } else if name.contains("ln_") {
        InitRule::Ones
    } else if name.ends_with("c_proj.weight") {
        InitRule::Normal(proj_std)
    } else {
        InitRule::Normal(std_all)
    }
}

/// The layout of a GPT-2 of `cfg`'s shape, and where its tensors are.
pub fn layout(cfg: &ModelConfig) -> (ModelLayout, Gpt2Locs) {
    let (v, t, c) = (cfg.vocab_size, cfg.seq_len, cfg.n_embd);
    let mut e = UnitLayout::new("embed");
    let (wte, wpe) = (e.push("wte.weight".into(), &[v, c]), e.push("wpe.weight".into(), &[t, c]));
    let ln_f = NormLocs { w: e.push("ln_f.weight".into(), &[c]), b: e.push("ln_f.bias".into(), &[c]) };
    let embed = EmbedUnitLocs { tokens: EmbedLocs { wte, wpe: Some(wpe) }, ln_f, head: LinearLocs::new(wte, None) };
    let mut units = vec![e];
    let mut block = None;
    for l in 0..cfg.n_layer {
        let mut u = UnitLayout::new(format!("h.{l}"));
        let mut push = |s: &str, shape: &[usize]| u.push(format!("h.{l}.{s}"), shape);
        let ln1 = NormLocs { w: push("ln_1.weight", &[c]), b: push("ln_1.bias", &[c]) };
        let qkv = LinearLocs::new(push("attn.c_attn.weight", &[3 * c, c]), Some(push("attn.c_attn.bias", &[3 * c])));
        let proj = LinearLocs::new(push("attn.c_proj.weight", &[c, c]), Some(push("attn.c_proj.bias", &[c])));
        let ln2 = NormLocs { w: push("ln_2.weight", &[c]), b: push("ln_2.bias", &[c]) };
        let fc = LinearLocs::new(push("mlp.c_fc.weight", &[4 * c, c]), Some(push("mlp.c_fc.bias", &[4 * c])));
        let fc2 = LinearLocs::new(push("mlp.c_proj.weight", &[c, 4 * c]), Some(push("mlp.c_proj.bias", &[c])));
        block = Some(BlockLocs { ln1, qkv, proj, ln2, fc, fc2 });
        units.push(u);
    }
    // n_layer >= 1 is validated by Config; a zero-layer model still gets valid locs.
    let empty = Loc::new(0, 0);
    let block = block.unwrap_or(BlockLocs {
        ln1: NormLocs { w: empty, b: empty },
        qkv: LinearLocs::new(empty, None),
        proj: LinearLocs::new(empty, None),
        ln2: NormLocs { w: empty, b: empty },
        fc: LinearLocs::new(empty, None),
        fc2: LinearLocs::new(empty, None),
    });
    (ModelLayout { cfg: cfg.clone(), units, head_unit: ModelLayout::EMBED_UNIT }, Gpt2Locs { embed, block })
}

/// Forward+backward FLOPs per token: 6 per parameter of the matmuls (everything but
/// `wpe`) plus the attention scores and their use, 12·L·T·C.
pub fn flops_per_token(layout: &ModelLayout) -> f64 {
    let c = &layout.cfg;
    let n = (layout.num_params() - c.seq_len * c.n_embd) as f64;
    6.0 * n + 12.0 * (c.n_layer * c.seq_len * c.n_embd) as f64
}
