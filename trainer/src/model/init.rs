//! GPT-2 initialisation, computed per tensor from (seed, tensor name, element index)
//! so it is identical on every rank, world size and ZeRO stage.

use super::layout::{ModelLayout, UnitLayout};
use crate::rng;

/// Initial values of one unit's tensors (unpadded length `unit.numel`).
pub fn init_unit(layout: &ModelLayout, unit: &UnitLayout, seed: u64) -> Vec<f32> {
    let mut out = vec![0.0f32; unit.numel];
    // Residual projections are scaled by 1/sqrt(2·n_layer) (GPT-2 paper).
    let proj_std = 0.02 / (2.0 * layout.cfg.n_layer as f64).sqrt();
    for t in &unit.tensors {
        let dst = &mut out[t.loc.off..t.loc.end()];
        let name = t.name.as_str();
        if name.ends_with(".bias") {
            dst.fill(0.0);
        } else if name.contains("ln_") {
            dst.fill(1.0);
        } else {
            let std = if name.ends_with("c_proj.weight") { proj_std } else { 0.02 };
            let stream = rng::stream_id(name);
            for (i, x) in dst.iter_mut().enumerate() {
                *x = (rng::normal(seed, stream, i as u64) * std) as f32;
            }
        }
    }
    out
}
