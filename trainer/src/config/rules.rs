//! The checks that tie one section's keys to another's: each names both keys. The
//! sections' own checks are beside their structs (`config/<section>.rs`);
//! [`Config::validate`] runs those first, then these.

use super::{bad, Config, ConfigError, Fp8WeightCache};

impl Config {
    /// The rules across sections, in the order they are checked.
    pub(super) fn validate_across(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        let t = &self.train;
        if let Fp8WeightCache::Blocks(k) = t.fp8_weight_cache {
            if k > m.n_layer {
                return Err(bad(
                    "train.fp8_weight_cache",
                    k,
                    format!("caches the first N blocks, and the model has {} (model.n_layer)", m.n_layer),
                ));
            }
        }
        let names = m.family.linear_names();
        for (i, name) in t.fp8_bf16_layers.iter().enumerate() {
            if !names.contains(&name.as_str()) {
                let why = format!("the {} family's block linear layers are {names:?}", m.family.name());
                return Err(bad("train.fp8_bf16_layers", format!("{name:?}"), why));
            }
            if t.fp8_bf16_layers[..i].contains(name) {
                return Err(bad("train.fp8_bf16_layers", format!("{name:?}"), "is listed twice"));
            }
        }
        self.check_scale()?;
        if self.checkpointing.keep_gelu.keeps() && self.every_block_checkpointed() {
            return Err(bad(
                "checkpointing.keep_gelu",
                true,
                "applies to blocks that are not checkpointed, and every block is (their recompute gives \
                 the GELU output to the backward anyway); checkpoint fewer blocks or drop keep_gelu",
            ));
        }
        if self.offload.params && self.zero.stage != 3 {
            return Err(bad(
                "offload.params",
                true,
                format!(
                    "needs zero.stage = 3 (stage {} keeps the full parameters on the device); set zero.stage = 3",
                    self.zero.stage
                ),
            ));
        }
        Ok(())
    }

    /// Whether every block recomputes its forward (so none has a GELU output to keep).
    pub fn every_block_checkpointed(&self) -> bool {
        let ckpt = self.checkpointing.activations;
        (0..self.model.n_layer).all(|l| ckpt.is_checkpointed(l))
    }

    /// Shapes beyond any machine are refused before anything multiplies them: every size
    /// then stays far from overflowing 64 bits, and planning, which walks every block, stays
    /// quick (`launcher memory` on a 100000-layer model took 20 s and 430 MB to answer).
    fn check_scale(&self) -> Result<(), ConfigError> {
        let (m, t) = (&self.model, &self.train);
        let huge = |key: &'static str, value: String, message: String| ConfigError::Invalid { key, value, message };
        if m.n_layer > MAX_LAYERS {
            return Err(huge(
                "model.n_layer",
                m.n_layer.to_string(),
                format!(
                    "is beyond {MAX_LAYERS} blocks (the deepest models trained have a few hundred; planning and \
                     training walk every block): use fewer, wider blocks"
                ),
            ));
        }
        // In f64: the estimates themselves must not overflow, whatever the config says.
        let [l, c, v, s, h, b] =
            [m.n_layer, m.n_embd, m.vocab_size, m.seq_len, m.n_head, t.micro_batch].map(|x| x as f64);
        // A decoder block holds about 12·C² parameters (attention 4·C², MLP 8·C²).
        let params = l * (12.0 * c * c + 13.0 * c) + (v + s) * c;
        if params > MAX_PARAMS {
            return Err(huge(
                "model.n_embd",
                m.n_embd.to_string(),
                format!(
                    "with model.n_layer = {} and model.vocab_size = {} the model has about {params:.3e} parameters, \
                     beyond {MAX_PARAMS:.0e} (1.6 PB of weights, gradients and optimizer state at 16 bytes per \
                     parameter: more than 4096 of the largest GPUs hold); make the model smaller",
                    m.n_layer, m.vocab_size
                ),
            ));
        }
        if b * s > MAX_TOKENS {
            return Err(huge(
                "train.micro_batch",
                t.micro_batch.to_string(),
                format!(
                    "times model.seq_len = {} is {:.3e} tokens per rank and micro-step, beyond {MAX_TOKENS:.3e}: \
                     lower train.micro_batch and raise train.grad_accum for the same global batch",
                    m.seq_len,
                    b * s
                ),
            ));
        }
        // Saved activations per micro-step, as the CPU backend keeps them (its attention keeps
        // B·heads·T·T): about 16·C + 2·heads·T values per token and block, and the logits.
        let activations = b * s * (l * (16.0 * c + 2.0 * h * s) + 2.0 * v);
        if activations > MAX_ACTIVATIONS {
            return Err(huge(
                "model.seq_len",
                m.seq_len.to_string(),
                format!(
                    "with train.micro_batch = {} and this model, one micro-step would keep about {activations:.3e} \
                     activation values, beyond {MAX_ACTIVATIONS:.3e}: lower train.micro_batch or model.seq_len",
                    t.micro_batch
                ),
            ));
        }
        Ok(())
    }
}

/// The most transformer blocks a model may have.
pub const MAX_LAYERS: usize = 10_000;
/// The most parameters a model may have (about: see `check_scale`).
const MAX_PARAMS: f64 = 1e14;
/// The most tokens one rank's micro-step may hold (2^30).
const MAX_TOKENS: f64 = 1_073_741_824.0;
/// The most activation values one micro-step may keep (2^52: 16 PiB in f32).
const MAX_ACTIVATIONS: f64 = 4_503_599_627_370_496.0;
