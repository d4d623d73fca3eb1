//! Random initialisation, shared by every family: each element is computed from (seed,
//! tensor name, element index), so it is identical on every rank, world size and ZeRO
//! stage, and a ZeRO-3 rank makes only its shard. A family says what each tensor gets
//! ([`InitRule`]); the scales come from `init.scheme` ([`stds`]).

use crate::config::InitScheme;
use crate::model::{ModelLayout, UnitLayout};
use crate::rng;
use std::ops::Range;

/// What one tensor is initialised to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InitRule {
    Zeros,
    Ones,
    /// Normal with this standard deviation.
    Normal(f64),
}

/// Initial values of one unit's tensors (unpadded length `unit.numel`).
pub fn init_unit(layout: &ModelLayout, unit: &UnitLayout, seed: u64, scheme: InitScheme) -> Vec<f32> {
    init_unit_range(layout, unit, seed, scheme, 0..unit.numel)
}

/// The standard deviations of (matrices, residual projections) under `scheme`.
pub fn stds(layout: &ModelLayout, scheme: InitScheme) -> (f64, f64) {
    let (l, c) = (layout.cfg.n_layer as f64, layout.cfg.n_embd as f64);
    match scheme {
        // Residual projections are scaled by 1/sqrt(2·n_layer) (GPT-2 paper).
        InitScheme::Gpt2 => (0.02, 0.02 / (2.0 * l).sqrt()),
        InitScheme::Scaled => ((2.0 / (5.0 * c)).sqrt(), 2.0 / (l * c.sqrt())),
    }
}

/// Elements `range` of [`init_unit`]'s result, computed without the rest: a ZeRO-3 rank
/// makes only its shard. Each element is a pure function of (seed, tensor, index), so the
/// values do not depend on the range or on how many threads fill it.
pub fn init_unit_range(
    layout: &ModelLayout,
    unit: &UnitLayout,
    seed: u64,
    scheme: InitScheme,
    range: Range<usize>,
) -> Vec<f32> {
    let mut out = vec![0.0f32; range.len()];
    let (std_all, proj_std) = stds(layout, scheme);
    let family = layout.cfg.family;
    for t in &unit.tensors {
        // The part of tensor t inside `range`, in unit coordinates.
        let (lo, hi) = (t.loc.off.max(range.start), t.loc.end().min(range.end));
        if lo >= hi {
            continue;
        }
        let dst = &mut out[lo - range.start..hi - range.start];
        match family.init_rule(t, std_all, proj_std) {
            InitRule::Zeros => dst.fill(0.0),
            InitRule::Ones => dst.fill(1.0),
            InitRule::Normal(std) => {
                let stream = rng::stream_id(&t.name);
                let first = (lo - t.loc.off) as u64;
                fill_parallel(dst, |i| (rng::normal(seed, stream, first + i as u64) * std) as f32);
            }
        }
    }
    out
}

/// `dst[i] = f(i)` on this rank's share of the cores (GPT-2 1.5B is 1.6 billion normal
/// draws: about a minute on one core).
fn fill_parallel(dst: &mut [f32], f: impl Fn(usize) -> f32 + Sync) {
    const MIN_PER_THREAD: usize = 1 << 16;
    let threads = init_threads().min(dst.len().div_ceil(MIN_PER_THREAD)).max(1);
    let chunk = dst.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (k, part) in dst.chunks_mut(chunk.max(1)).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, x) in part.iter_mut().enumerate() {
                    *x = f(k * chunk + j);
                }
            });
        }
    });
}

/// Threads for initialisation: the rank's share of the node's cores, which the launcher
/// passes to every rank as `MATMUL_NUM_THREADS`; all cores when run without it.
fn init_threads() -> usize {
    std::env::var("MATMUL_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn any_range_equals_the_slice_of_the_whole_unit() {
        let cfg = ModelConfig::gpt2(2, 2, 16, 50, 8);
        let layout = ModelLayout::new(&cfg);
        for unit in &layout.units {
            let full = init_unit(&layout, unit, 9, InitScheme::Gpt2);
            assert_eq!(full.len(), unit.numel);
            for (lo, hi) in [(0, unit.numel), (3, unit.numel / 2), (unit.numel / 3, unit.numel), (5, 5)] {
                let part = init_unit_range(&layout, unit, 9, InitScheme::Gpt2, lo..hi);
                assert_eq!(part, full[lo..hi].to_vec(), "unit {} range {lo}..{hi}", unit.name);
            }
        }
    }
}

#[cfg(test)]
mod scheme_tests {
    use super::*;
    use crate::config::ModelConfig;

    /// Each scheme draws every matrix with its stated standard deviation.
    #[test]
    fn schemes_draw_the_stated_scales() {
        let cfg = ModelConfig::gpt2(4, 4, 256, 64, 8);
        let layout = ModelLayout::new(&cfg);
        for scheme in [InitScheme::Gpt2, InitScheme::Scaled] {
            let (all, proj) = stds(&layout, scheme);
            let block = &layout.units[1];
            let vals = init_unit(&layout, block, 3, scheme);
            for t in &block.tensors {
                let x = &vals[t.loc.off..t.loc.end()];
                let sd = (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
                let want = match crate::model::gpt2::layout::init_rule(t, all, proj) {
                    InitRule::Zeros => 0.0,
                    InitRule::Ones => 1.0,
                    InitRule::Normal(s) => s,
                };
                assert!((sd - want).abs() <= 0.03 * want.max(1e-9), "{scheme:?} {}: {sd} vs {want}", t.name);
            }
        }
        let (all, proj) = stds(&layout, InitScheme::Scaled);
        assert!((all - (2.0f64 / (5.0 * 256.0)).sqrt()).abs() < 1e-12 && (proj - 2.0 / (4.0 * 16.0)).abs() < 1e-12);
    }
}
