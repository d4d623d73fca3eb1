//! Parameter layout: the model's tensors grouped into *units*, each one flat buffer.
//!
//! Unit 0 holds the embeddings and the final LayerNorm (`wte`, `wpe`, `ln_f`); the LM
//! head is tied to `wte`, so it lives there too. Units 1..=L are the transformer blocks.
//! A unit is what the ZeRO engine gathers, reduces and shards as one piece (one
//! all-gather per block, never one per tensor). Tensor names follow Hugging Face GPT-2.

use crate::backend::Loc;
use crate::config::ModelConfig;

/// One tensor inside a unit's flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub loc: Loc,
    /// Matrices get weight decay; biases and LayerNorm parameters do not.
    pub decay: bool,
}

/// One flat parameter group.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitLayout {
    pub name: String,
    pub tensors: Vec<TensorSpec>,
    /// Elements used by tensors (before padding to the world size).
    pub numel: usize,
}

impl UnitLayout {
    fn push(&mut self, name: String, shape: &[usize]) -> Loc {
        let len: usize = shape.iter().product();
        let loc = Loc::new(self.numel, len);
        self.tensors.push(TensorSpec { name, shape: shape.to_vec(), loc, decay: shape.len() >= 2 });
        self.numel += len;
        loc
    }
}

/// Locations of unit 0's tensors.
#[derive(Debug, Clone, Copy)]
pub struct EmbedLocs {
    pub wte: Loc,
    pub wpe: Loc,
    pub lnf_w: Loc,
    pub lnf_b: Loc,
}

/// Locations of one block's tensors inside its unit (same for every block).
#[derive(Debug, Clone, Copy)]
pub struct BlockLocs {
    pub ln1_w: Loc,
    pub ln1_b: Loc,
    pub qkv_w: Loc,
    pub qkv_b: Loc,
    pub proj_w: Loc,
    pub proj_b: Loc,
    pub ln2_w: Loc,
    pub ln2_b: Loc,
    pub fc_w: Loc,
    pub fc_b: Loc,
    pub fc2_w: Loc,
    pub fc2_b: Loc,
}

/// The whole model's layout.
#[derive(Debug, Clone)]
pub struct ModelLayout {
    pub cfg: ModelConfig,
    pub units: Vec<UnitLayout>,
    pub embed: EmbedLocs,
    pub block: BlockLocs,
}

impl ModelLayout {
    pub fn new(cfg: &ModelConfig) -> ModelLayout {
        let (v, t, c) = (cfg.vocab_size, cfg.seq_len, cfg.n_embd);
        let mut e = UnitLayout { name: "embed".into(), tensors: vec![], numel: 0 };
        let embed = EmbedLocs {
            wte: e.push("wte.weight".into(), &[v, c]),
            wpe: e.push("wpe.weight".into(), &[t, c]),
            lnf_w: e.push("ln_f.weight".into(), &[c]),
            lnf_b: e.push("ln_f.bias".into(), &[c]),
        };
        let mut units = vec![e];
        let mut block = None;
        for l in 0..cfg.n_layer {
            let mut u = UnitLayout { name: format!("h.{l}"), tensors: vec![], numel: 0 };
            let p = |s: &str| format!("h.{l}.{s}");
            let locs = BlockLocs {
                ln1_w: u.push(p("ln_1.weight"), &[c]),
                ln1_b: u.push(p("ln_1.bias"), &[c]),
                qkv_w: u.push(p("attn.c_attn.weight"), &[3 * c, c]),
                qkv_b: u.push(p("attn.c_attn.bias"), &[3 * c]),
                proj_w: u.push(p("attn.c_proj.weight"), &[c, c]),
                proj_b: u.push(p("attn.c_proj.bias"), &[c]),
                ln2_w: u.push(p("ln_2.weight"), &[c]),
                ln2_b: u.push(p("ln_2.bias"), &[c]),
                fc_w: u.push(p("mlp.c_fc.weight"), &[4 * c, c]),
                fc_b: u.push(p("mlp.c_fc.bias"), &[4 * c]),
                fc2_w: u.push(p("mlp.c_proj.weight"), &[c, 4 * c]),
                fc2_b: u.push(p("mlp.c_proj.bias"), &[c]),
            };
            block = Some(locs);
            units.push(u);
        }
        // n_layer >= 1 is validated by Config; a zero-layer model still gets valid locs.
        let block = block.unwrap_or(BlockLocs {
            ln1_w: Loc::new(0, 0),
            ln1_b: Loc::new(0, 0),
            qkv_w: Loc::new(0, 0),
            qkv_b: Loc::new(0, 0),
            proj_w: Loc::new(0, 0),
            proj_b: Loc::new(0, 0),
            ln2_w: Loc::new(0, 0),
            ln2_b: Loc::new(0, 0),
            fc_w: Loc::new(0, 0),
            fc_b: Loc::new(0, 0),
            fc2_w: Loc::new(0, 0),
            fc2_b: Loc::new(0, 0),
        });
        ModelLayout { cfg: cfg.clone(), units, embed, block }
    }

    /// Total parameters (tied head counted once).
    pub fn num_params(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Unit index of block `l`.
    pub fn block_unit(l: usize) -> usize {
        l + 1
    }

    /// Model FLOPs per token for forward+backward (6N for matmuls excluding wpe, plus attention),
    /// the convention used for MFU by PyTorch/llm.c references.
    pub fn flops_per_token(&self) -> f64 {
        let c = &self.cfg;
        let n = (self.num_params() - c.seq_len * c.n_embd) as f64;
        6.0 * n + 12.0 * (c.n_layer * c.seq_len * c.n_embd) as f64
    }
}
