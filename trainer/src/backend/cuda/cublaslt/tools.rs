//! The timing tools' entry points (`gpu-timing gemm-algos`, `gemm-search`): the GEMMs run
//! since the last call, run again over the heuristic's candidates or the searched space.

use super::key::describe;
use super::space::algo_config;
use super::tuning::TUNE_CANDIDATES;
use super::*;

/// One GEMM and the heuristic's candidates for it, timed (`Lt::sweep`).
#[derive(Debug, Clone)]
pub struct GemmSweep {
    /// Its shape, transposes, output type and epilogue.
    pub gemm: String,
    /// 2·m·n·k.
    pub flop: f64,
    /// Per candidate, in the heuristic's order: its configuration and mean ms.
    pub candidates: Vec<(String, f64)>,
}

/// At most this many configurations a GEMM `Lt::search` checks (each a host call to
/// `cublasLtMatmulAlgoCheck`), in algorithm id order: a bound on the search's time.
pub(super) const MAX_BUILT: usize = 200_000;

/// One GEMM timed over cuBLASLt's algorithm space (`Lt::search`): the heuristic's
/// candidates as timed tuning sees them, then every configuration of every algorithm id
/// cuBLASLt accepts for the GEMM.
#[derive(Debug, Clone)]
pub struct GemmSearch {
    /// Its shape, transposes, output type and epilogue.
    pub gemm: String,
    /// 2·m·n·k.
    pub flop: f64,
    /// The heuristic's first algorithm (what runs without tuning) and the fastest of its
    /// first `TUNE_CANDIDATES` (what timed tuning picks from), in ms.
    pub heuristic_first_ms: f64,
    pub heuristic_best_ms: f64,
    /// Configurations built, those `cublasLtMatmulAlgoCheck` accepted within the workspace,
    /// and of those the ones timed (at most the search's cap).
    pub configs_built: usize,
    pub configs_valid: usize,
    pub configs_timed: usize,
    /// The fastest configurations found, each timed again as timed tuning times: its
    /// configuration and ms, fastest first.
    pub best: Vec<(String, f64)>,
}

impl Lt {
    /// Every GEMM run since the last sweep, run again with each of the heuristic's first
    /// `count` algorithms (one warm-up, then the mean of `reps` back-to-back runs): what
    /// `gpu-timing gemm-algos` prints, to see whether the heuristic's first choice is the
    /// fastest. Each GEMM reruns on the pointers it last ran on, which must still be live,
    /// and its output (and a gradient it accumulates into) is overwritten: for timing
    /// tools only.
    pub fn sweep(&self, stream: sys::cudaStream_t, count: usize, reps: usize) -> BResult<Vec<GemmSweep>> {
        self.each_last_run(
            |_| true,
            |key, plan, g| {
                let mut row = GemmSweep {
                    gemm: describe(key, g),
                    flop: 2.0 * (key.m * key.n * key.k) as f64,
                    candidates: Vec::new(),
                };
                for cand in self.heuristics(plan, key, count)? {
                    let ms = self.time_algo(plan, g, &cand.algo, stream, Some(reps), 1)?;
                    row.candidates.push((algo_config(&cand.algo, cand.workspaceSize, cand.wavesCount), ms));
                }
                Ok(row)
            },
        )
    }

    /// `each` over every plan whose key `keep` accepts and that ran since the last call, in
    /// a fixed order, with the GEMM it last ran (taken: a later call sees only newer runs).
    /// What the timing tools ([`Lt::sweep`], [`Lt::search`]) rerun.
    pub(super) fn each_last_run<T>(
        &self,
        keep: impl Fn(&Key) -> bool,
        mut each: impl FnMut(&Key, &Plan, &Gemm) -> BResult<T>,
    ) -> BResult<Vec<T>> {
        let mut plans = self.plans.borrow_mut();
        let mut keys: Vec<Key> = plans.iter().filter(|(k, p)| p.last.is_some() && keep(k)).map(|(k, _)| *k).collect();
        keys.sort_by_key(|k| format!("{k:?}"));
        let mut out = Vec::new();
        for key in &keys {
            let Some(plan) = plans.get_mut(key) else { continue };
            let Some(g) = plan.last.take() else { continue };
            out.push(each(key, plan, &g)?);
        }
        Ok(out)
    }

    /// Every FP8 GEMM run since the last call (its buffers still live, as for
    /// [`Lt::sweep`]; the others stay unswept), timed over cuBLASLt's algorithm space: the
    /// heuristic's first `TUNE_CANDIDATES`, then every configuration [`Lt::configurations`]
    /// builds, each timed once briefly (at most `cap` of them, spread evenly), the fastest
    /// five again as timed tuning times. A measurement, for `gpu-timing fp8-search`: whether
    /// a configuration the heuristic does not offer beats what timed tuning picks. Outputs
    /// are overwritten: for timing tools only.
    pub fn search(&self, stream: sys::cudaStream_t, cap: usize) -> BResult<Vec<GemmSearch>> {
        self.each_last_run(
            |k| k.fp8.is_some(),
            |key, plan, g| {
                let time = |algo: &sys::cublasLtMatmulAlgo_t, reps: Option<usize>, rounds: usize| {
                    self.time_algo(plan, g, algo, stream, reps, rounds).unwrap_or(f64::INFINITY)
                };
                let heur: Vec<f64> =
                    self.heuristics(plan, key, TUNE_CANDIDATES)?.iter().map(|c| time(&c.algo, None, 3)).collect();
                let (built, valid) = self.configurations(plan, key, None, MAX_BUILT, None);
                // At most `cap`, spread evenly over the accepted ones (they come algorithm id by id).
                let stride = valid.len().div_ceil(cap.max(1)).max(1);
                let mut quick: Vec<(f64, usize)> =
                    (0..valid.len()).step_by(stride).map(|i| (time(&valid[i].algo, Some(3), 1), i)).collect();
                quick.sort_by(|a, b| a.0.total_cmp(&b.0));
                let mut best: Vec<(String, f64)> = quick
                    .iter()
                    .take(5)
                    .filter(|q| q.0.is_finite())
                    .map(|&(_, i)| {
                        let c = &valid[i];
                        (algo_config(&c.algo, c.workspaceSize, c.wavesCount), time(&c.algo, None, 3))
                    })
                    .collect();
                best.sort_by(|a, b| a.1.total_cmp(&b.1));
                Ok(GemmSearch {
                    gemm: describe(key, g),
                    flop: 2.0 * (key.m * key.n * key.k) as f64,
                    heuristic_first_ms: heur.first().copied().unwrap_or(f64::INFINITY),
                    heuristic_best_ms: heur.iter().copied().fold(f64::INFINITY, f64::min),
                    configs_built: built,
                    configs_valid: valid.len(),
                    configs_timed: quick.len(),
                    best,
                })
            },
        )
    }
}
