//! Counter-based random numbers for initialisation (normal draws on top of the data
//! crate's SplitMix64, the project's one source of randomness).
//!
//! Hand-written on purpose: a value depends only on (seed, stream, index), never on
//! the order of calls, the world size, or a crate version's stream — so every rank,
//! on any ZeRO stage, initialises identical weights.

use data::rng::splitmix64;

/// Uniform in (0, 1) for (seed, stream, index).
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    let h = splitmix64(seed ^ splitmix64(stream.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ splitmix64(index)));
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Standard normal for (seed, stream, index), by Box–Muller on two uniforms.
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let u1 = uniform(seed, stream, 2 * index);
    let u2 = uniform(seed, stream, 2 * index + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A stable 64-bit hash of a tensor name, used as its random stream id.
pub fn stream_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn normal_has_unit_moments() {
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| normal(7, 3, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
        assert_eq!(normal(7, 3, 5), normal(7, 3, 5));
        assert_ne!(normal(7, 3, 5), normal(8, 3, 5));
    }
}
