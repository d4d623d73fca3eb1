//! AdamW on the host, for optimizer offload: the same update as the backends' (the same
//! expressions in the same order, so the fp32 results are the CPU reference's bit for bit),
//! vectorised and spread over the rank's share of the cores. Element-wise, so the result
//! does not depend on the number of threads.
//!
//! The update is memory-bound (it reads g, m, v, w and writes m, v, w and a rounded copy:
//! 30 bytes per parameter), so the point is to keep every core's memory stream busy:
//! - the element loop is written so LLVM vectorises it, and compiled three times (AVX-512,
//!   AVX2+FMA, baseline) with the widest the CPU has picked at run time;
//! - each segment is cut into chunks of `CHUNK` elements handed to a rayon pool of the
//!   rank's threads, each thread pinned to one core of the rank's share (several ranks on
//!   one host split the cores instead of fighting over them).
//!
//! The rounded compute-precision copy goes out as bf16 (GPU parameters) or f32 (the CPU
//! backend's), as [`HostValues`] says.

pub use crate::backend::HostValues;
use crate::backend::{AdamWSegment, AdamWStep};
use rayon::prelude::*;
use std::time::Instant;

/// Elements per work item: large enough to amortise scheduling, small enough that 16
/// threads share a 50M-element unit evenly.
const CHUNK: usize = 1 << 16;

/// fp32 → bf16 bits, round to nearest even (NaN stays NaN): `half::bf16::from_f32`'s
/// result, in a form that vectorises.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The per-step constants of one segment.
#[derive(Clone, Copy)]
struct Consts {
    b1: f32,
    b2: f32,
    one_m_b1: f32,
    one_m_b2: f32,
    bc1: f32,
    bc2: f32,
    lr: f32,
    eps: f32,
    wd: f32,
    scale: f32,
}

/// The element loop: exactly cpu::adamw_segment's arithmetic.
#[inline(always)]
fn update(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], mut out: Option<&mut [u16]>, k: Consts) {
    let n = w.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
    for i in 0..n {
        let gi = g[i] * k.scale;
        let mi = k.b1 * m[i] + k.one_m_b1 * gi;
        let vi = k.b2 * v[i] + k.one_m_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let mhat = mi / k.bc1;
        let vhat = vi / k.bc2;
        let wi = w[i] - k.lr * (mhat / (vhat.sqrt() + k.eps) + k.wd * w[i]);
        w[i] = wi;
        if let Some(o) = out.as_deref_mut() {
            o[i] = bf16_bits(wi);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn update_avx512(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>, k: Consts) {
    update(w, m, v, g, out, k)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_avx2(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>, k: Consts) {
    update(w, m, v, g, out, k)
}

/// The widest vector unit this CPU has, picked once.
fn update_fast(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], out: Option<&mut [u16]>, k: Consts) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { update_avx512(w, m, v, g, out, k) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { update_avx2(w, m, v, g, out, k) };
        }
    }
    update(w, m, v, g, out, k)
}

/// Threads for the host optimizer, each pinned to one core of this rank's share.
pub struct HostAdamW {
    pool: rayon::ThreadPool,
    threads: usize,
    /// Time spent and elements updated since the last [`HostAdamW::take_stats`].
    busy: f64,
    elements: u64,
}

/// What the host optimizer did over some steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HostAdamWStats {
    pub seconds: f64,
    pub params: u64,
    pub threads: usize,
}

impl HostAdamWStats {
    /// Count `other`'s time and parameters too (the thread count stays).
    pub fn add(&mut self, other: HostAdamWStats) {
        self.seconds += other.seconds;
        self.params += other.params;
    }

    /// Parameters updated per second per thread.
    pub fn params_per_s_per_core(&self) -> f64 {
        if self.seconds > 0.0 && self.threads > 0 {
            self.params as f64 / self.seconds / self.threads as f64
        } else {
            0.0
        }
    }
}

/// One unit's optimizer state on the host, the three arrays indexed alike: fp32 master
/// weights and AdamW's moments.
pub struct HostState<'a> {
    pub master: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

impl HostAdamW {
    /// `threads` workers (0: the rank's share of the cores, `MATMUL_NUM_THREADS` as the
    /// launcher sets it, else all, less `reserve` of them), pinned to the first cores of the
    /// rank's share when `pin`. The delayed update reserves one core: its threads run while
    /// the rank's own thread drives the device, which must not wait for a core.
    pub fn new(threads: usize, rank: usize, pin: bool, reserve: usize) -> Result<HostAdamW, String> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let share = std::env::var("MATMUL_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(cores)
            .clamp(1, cores);
        let threads = if threads == 0 { share.saturating_sub(reserve) } else { threads }.clamp(1, cores);
        // Ranks of a node are numbered consecutively, so rank % (ranks per node) is this
        // rank's place on the node and its share starts there.
        let first = (rank % (cores / share.max(threads)).max(1)) * share.max(threads);
        let ids = core_affinity::get_core_ids().unwrap_or_default();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("host-adamw-{i}"))
            .start_handler(move |i| {
                if pin {
                    if let Some(id) = ids.get(first + i) {
                        core_affinity::set_for_current(*id);
                    }
                }
            })
            .build()
            .map_err(|e| format!("starting {threads} host optimizer threads: {e}"))?;
        Ok(HostAdamW { pool, threads, busy: 0.0, elements: 0 })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// AdamW over `segs` of one unit's state: `state` and `grads` are indexed by
    /// `moff`/`goff`, the rounded copy (if any) by `poff`.
    pub fn step(
        &mut self,
        state: HostState<'_>,
        grads: &[f32],
        mut out: Option<HostValues<'_>>,
        segs: &[AdamWSegment],
        h: AdamWStep,
    ) {
        let HostState { master, m, v } = state;
        let t0 = Instant::now();
        let (bc1, bc2) = h.bias_corrections();
        let base = Consts {
            b1: h.beta1,
            b2: h.beta2,
            one_m_b1: 1.0 - h.beta1,
            one_m_b2: 1.0 - h.beta2,
            bc1,
            bc2,
            lr: h.lr,
            eps: h.eps,
            wd: 0.0,
            scale: h.grad_scale,
        };
        for s in segs {
            let k = Consts { wd: if s.decay { h.weight_decay } else { 0.0 }, ..base };
            let w = &mut master[s.moff..s.moff + s.len];
            let mm = &mut m[s.moff..s.moff + s.len];
            let vv = &mut v[s.moff..s.moff + s.len];
            let g = &grads[s.goff..s.goff + s.len];
            match out.as_mut() {
                Some(HostValues::Bf16(o)) => {
                    let o = &mut o[s.poff..s.poff + s.len];
                    self.pool.install(|| {
                        (w.par_chunks_mut(CHUNK), mm.par_chunks_mut(CHUNK), vv.par_chunks_mut(CHUNK))
                            .into_par_iter()
                            .zip(g.par_chunks(CHUNK).zip(o.par_chunks_mut(CHUNK)))
                            .for_each(|((w, m, v), (g, o))| update_fast(w, m, v, g, Some(o), k));
                    });
                }
                other => {
                    self.pool.install(|| {
                        (w.par_chunks_mut(CHUNK), mm.par_chunks_mut(CHUNK), vv.par_chunks_mut(CHUNK))
                            .into_par_iter()
                            .zip(g.par_chunks(CHUNK))
                            .for_each(|((w, m, v), g)| update_fast(w, m, v, g, None, k));
                    });
                    if let Some(HostValues::F32(o)) = other {
                        o[s.poff..s.poff + s.len].copy_from_slice(&master[s.moff..s.moff + s.len]);
                    }
                }
            }
            self.elements += s.len as u64;
        }
        self.busy += t0.elapsed().as_secs_f64();
    }

    /// Time and elements since the last call.
    pub fn take_stats(&mut self) -> HostAdamWStats {
        let s = HostAdamWStats { seconds: self.busy, params: self.elements, threads: self.threads };
        self.busy = 0.0;
        self.elements = 0;
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::adamw_segment;

    fn vals(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        (0..n as u64).map(|i| crate::rng::normal(seed, 1, i) as f32 * scale).collect()
    }

    /// The host update equals the CPU reference bit for bit (fp32 and the bf16 rounding),
    /// over segments with and without decay, at odd offsets and lengths that cut chunks.
    #[test]
    fn host_adamw_equals_the_cpu_reference_bit_for_bit() {
        let n = 3 * CHUNK + 1001;
        let segs = [
            AdamWSegment::plain(3, 0, 5, CHUNK + 17, true),
            AdamWSegment::plain(3 + CHUNK + 17, CHUNK + 17, 5 + CHUNK + 17, n - CHUNK - 17, false),
        ];
        let h = AdamWStep { lr: 3e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 7, grad_scale: 0.6 };
        let (w0, m0) = (vals(n, 1, 0.5), vals(n, 2, 0.01));
        let v0: Vec<f32> = vals(n, 3, 0.01).iter().map(|x| x * x).collect();
        let g = vals(n + 5, 4, 0.1);
        let (mut rw, mut rm, mut rv) = (w0.clone(), m0.clone(), v0.clone());
        for s in &segs {
            let r = s.moff..s.moff + s.len;
            let wd = if s.decay { h.weight_decay } else { 0.0 };
            adamw_segment(&mut rw[r.clone()], &mut rm[r.clone()], &mut rv[r], &g[s.goff..s.goff + s.len], h, wd);
        }
        for threads in [1, 3] {
            let mut opt = HostAdamW::new(threads, 0, false, 0).expect("pool");
            let (mut w, mut m, mut v) = (w0.clone(), m0.clone(), v0.clone());
            let mut out = vec![0u16; n + 3];
            opt.step(
                HostState { master: &mut w, m: &mut m, v: &mut v },
                &g,
                Some(HostValues::Bf16(&mut out)),
                &segs,
                h,
            );
            assert!(m.iter().zip(&rm).all(|(a, b)| a.to_bits() == b.to_bits()), "m differs");
            assert!(v.iter().zip(&rv).all(|(a, b)| a.to_bits() == b.to_bits()), "v differs");
            if let Some(i) = (0..n).find(|&i| w[i].to_bits() != rw[i].to_bits()) {
                panic!("master {i}: {} vs {} ({threads} threads)", w[i], rw[i]);
            }
            for (i, &o) in out[3..].iter().enumerate() {
                assert_eq!(o, half::bf16::from_f32(rw[i]).to_bits(), "bf16 copy of element {i}");
            }
            let st = opt.take_stats();
            assert_eq!(st.params, n as u64);
            assert_eq!(st.threads, threads.min(std::thread::available_parallelism().map_or(1, |n| n.get())));
            // f32 output: the copy is the master value.
            let (mut w2, mut m2, mut v2) = (w0.clone(), m0.clone(), v0.clone());
            let mut out32 = vec![0f32; n + 3];
            opt.step(
                HostState { master: &mut w2, m: &mut m2, v: &mut v2 },
                &g,
                Some(HostValues::F32(&mut out32)),
                &segs,
                h,
            );
            assert_eq!(&out32[3..], &w2[..]);
            assert_eq!(w2, w, "the same update twice gives the same bits");
        }
    }

    #[test]
    fn the_delayed_update_leaves_a_core_to_the_driving_thread() {
        let all = HostAdamW::new(0, 0, false, 0).expect("pool").threads();
        assert_eq!(HostAdamW::new(0, 0, false, 1).expect("pool").threads(), (all - 1).max(1));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(HostAdamW::new(3, 0, false, 1).expect("pool").threads(), 3.min(cores), "a stated count is kept");
    }

    #[test]
    fn bf16_rounding_is_nearest_even_like_half() {
        // 0x3f80_8000 and 0x3f81_8000 sit exactly halfway between two bf16 values.
        let halfway = [f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000)];
        for x in [0.0f32, -0.0, 1.0, halfway[0], halfway[1], -3.3e-5, 65504.0, f32::MAX, f32::INFINITY, 1e-40] {
            assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "{x}");
        }
        assert!(half::bf16::from_bits(bf16_bits(f32::NAN)).is_nan());
    }
}
