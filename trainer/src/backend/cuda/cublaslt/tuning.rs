//! Timed and searched tuning (`GemmTuning::Timed`, `GemmTuning::Searched`): a shape's
//! candidates timed at its first call, the fastest recorded as a pick, and the table of
//! choices the trainer hands back ([`Lt::use_choices`]) run from then on.

use super::key::{describe, key_of, shape_of};
use super::space::{algo_config, spread_order};
use super::*;

/// `GemmTuning::Timed`: how many of the heuristic's candidates to time. The eight cover
/// the fastest at every GPT-2 shape `gpu-timing gemm-algos` measured on an H200.
pub(super) const TUNE_CANDIDATES: usize = 8;
/// ... and how much faster than the heuristic's first another must be to be picked, so
/// that a tie within the timing noise keeps the heuristic's choice.
pub(super) const TUNE_MARGIN: f64 = 0.01;
/// `GemmTuning::Searched`: the GPU time a shape's brief runs over the configurations found
/// near the candidates may take (a warm-up and two timed runs each; a GEMM too long for all
/// of them gets a sample spread evenly over them), at least `SEARCH_MIN` runs...
pub(super) const SEARCH_BUDGET_MS: f64 = 1500.0;
pub(super) const SEARCH_MIN: usize = 64;
/// ... within this many wall seconds a shape (checks and runs; the host's calls dominate at
/// small shapes) ...
pub(super) const SEARCH_SECONDS: f64 = 3.0;
/// ... how many of the fastest are then timed as the candidates are ...
pub(super) const SEARCH_FINALISTS: usize = 5;
/// ... at most how many configurations a shape checks (`cublasLtMatmulAlgoCheck`, a host
/// call each) ...
pub(super) const SEARCH_MAX_BUILT: usize = 50_000;
/// ... and how close (to the largest output's magnitude) a found one's output must be to
/// the heuristic's to be picked: different tilings sum in other orders (and FP8's fast
/// accumulation promotes at other points), a wrong kernel is off by the output itself.
pub(super) const SEARCH_AGREEMENT: f64 = 1.0 / 64.0;

impl Lt {
    /// Timed tuning's picks so far as a table of `env` (not in use until [`Lt::use_choices`]).
    pub fn choices(&self, env: GemmEnvironment) -> GemmTuningTable {
        let mut t = GemmTuningTable::new(env);
        t.gemms = self
            .picks
            .borrow()
            .iter()
            .map(|p| StoredGemm {
                shape: shape_of(&p.key),
                algo: p.algo.data,
                config: p.config.clone(),
                candidate: p.report.chosen,
                candidates: p.report.candidates,
                heuristic_ms: p.report.heuristic_ms,
                chosen_ms: p.report.chosen_ms,
            })
            .collect();
        t
    }

    /// Run the table's shapes with its algorithms from here on (plans made already switch
    /// now; others take it when made), each first checked by cuBLASLt for this device
    /// (`cublasLtMatmulAlgoCheck`, and its workspace within ours): one that fails is refused
    /// or left to the heuristic, as `on` says. The caller checked the environment. Returns
    /// how many are in use.
    pub fn use_choices(
        &self,
        table: &GemmTuningTable,
        here: &GemmEnvironment,
        origin: &str,
        on: OnMismatch,
    ) -> BResult<usize> {
        let mut used = 0;
        for entry in &table.gemms {
            let algo = sys::cublasLtMatmulAlgo_t { data: entry.algo };
            let ok = match key_of(&entry.shape) {
                Some(key) => self.check_algo(&key, &algo)?.then_some(key),
                None => None,
            };
            let Some(key) = ok else {
                GemmTuningTable::unavailable(entry, here, origin, on)
                    .map_err(|e| BackendError::Device(e.to_string()))?;
                continue;
            };
            self.stored.borrow_mut().insert(key, algo);
            if let Some(plan) = self.plans.borrow_mut().get_mut(&key) {
                plan.algo = algo;
                plan.settled = true;
            }
            used += 1;
        }
        Ok(used)
    }

    /// Whether cuBLASLt would run `algo` for `key` here, within our workspace.
    pub(super) fn check_algo(&self, key: &Key, algo: &sys::cublasLtMatmulAlgo_t) -> BResult<bool> {
        // FP8 plans need scale pointers set to be checked as scaled GEMMs: any device
        // address serves (nothing runs), the workspace's.
        let scales = key.fp8.map(|_| (self.ws_ptr, self.ws_ptr));
        let plan = self.descriptors(key, scales)?;
        // SAFETY: the plan's descriptors are live until it drops; `result` is written by
        // cuBLASLt only.
        let (status, result) = unsafe {
            let mut result = std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>();
            let st =
                sys::cublasLtMatmulAlgoCheck(self.handle, plan.desc, plan.a, plan.b, plan.d, plan.d, algo, &mut result);
            (st, result)
        };
        Ok(status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && result.workspaceSize <= self.workspace.len())
    }

    /// How shapes first run from here on pick their algorithm.
    pub fn set_tuning(&self, t: GemmTuning) {
        self.tuning.set(t);
    }

    /// What timed tuning picked so far.
    pub fn tuned(&self) -> Vec<TunedGemm> {
        self.picks.borrow().iter().map(|p| p.report.clone()).collect()
    }

    /// Timed tuning (`GemmTuning::Timed`): time the heuristic's first candidates on `g`
    /// itself and record the fastest as this shape's pick (the heuristic's first unless
    /// another is `TUNE_MARGIN` faster); `plan` keeps running the heuristic's until the
    /// trainer hands the picks back ([`Lt::use_choices`]). `GemmTuning::Searched` adds the
    /// configurations [`Lt::configurations`] finds near the candidates: each timed once
    /// briefly (a sample spread evenly where more than `SEARCH_BUDGET_MS` of runs), the
    /// fastest `SEARCH_FINALISTS` timed again as the candidates are; one of those is picked
    /// only if its output agrees with the heuristic's ([`Lt::outputs_agree`]).
    ///
    /// A GEMM that reads D (beta ≠ 0 with C = D: a gradient accumulating) has D copied to
    /// the host first and put back after, so the call that follows computes from the same D
    /// as an untuned one; any other output is rewritten by that call. No device memory is
    /// allocated. A stream being captured into a CUDA graph cannot be timed: a shape first
    /// seen there keeps the heuristic's choice.
    pub(super) fn tune(&self, plan: &Plan, key: &Key, g: &Gemm, stream: sys::cudaStream_t) -> BResult<()> {
        let cs = stream as dsys::CUstream;
        let err =
            |what: &str, e: cudarc::driver::DriverError| BackendError::Device(format!("GEMM tuning: {what}: {e}"));
        // SAFETY: the stream is this backend's, live.
        let status = unsafe { dr::stream::is_capturing(cs) }.map_err(|e| err("capture status", e))?;
        if status != dsys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        let searching = self.tuning.get() == GemmTuning::Searched;
        let started = std::time::Instant::now();
        let mut cands = self.heuristics(plan, key, TUNE_CANDIDATES)?;
        if cands.len() < 2 && !searching {
            return Ok(());
        }
        let saved = if g.beta != 0.0 && g.c.is_none_or(|c| c == g.d) {
            let mut host = vec![0u8; key.d_bytes()];
            // SAFETY: D spans these bytes (its layout: n columns of ldd, the last m long);
            // the stream is synchronised before `host` is read or dropped.
            unsafe {
                dr::memcpy_dtoh_async(&mut host, g.d, cs).map_err(|e| err("saving D", e))?;
                dr::stream::synchronize(cs).map_err(|e| err("saving D", e))?;
            }
            Some(host)
        } else {
            None
        };
        let restore = |saved: Option<&[u8]>| -> BResult<()> {
            if let Some(host) = saved {
                // SAFETY: as above; the copy completes before `host` can be dropped.
                unsafe {
                    dr::memcpy_htod_async(g.d, host, cs).map_err(|e| err("restoring D", e))?;
                    dr::stream::synchronize(cs).map_err(|e| err("restoring D", e))?;
                }
            }
            Ok(())
        };
        // A candidate cuBLASLt offers but then refuses to run is skipped.
        let time = |algo: &sys::cublasLtMatmulAlgo_t, reps: Option<usize>, rounds: usize| {
            self.time_algo(plan, g, algo, stream, reps, rounds).unwrap_or(f64::INFINITY)
        };
        let mut times: Vec<f64> = cands.iter().map(|c| time(&c.algo, None, 3)).collect();
        if !times[0].is_finite() {
            // The heuristic's own choice did not run: the call that follows says why.
            return restore(saved.as_deref());
        }
        let offered = cands.len();
        let mut searched = 0;
        if searching {
            let deadline = started + std::time::Duration::from_secs_f64(SEARCH_SECONDS);
            let (_, found) = self.configurations(plan, key, Some(&cands), SEARCH_MAX_BUILT, Some(deadline));
            let found: Vec<_> =
                found.into_iter().filter(|f| !cands.iter().any(|c| c.algo.data == f.algo.data)).collect();
            // A warm-up and two timed runs each, within the GPU time budget and the deadline,
            // visited in an order any prefix of which is spread over all of them.
            let n = ((SEARCH_BUDGET_MS / (3.0 * times[0])) as usize).clamp(SEARCH_MIN, found.len().max(SEARCH_MIN));
            let mut quick: Vec<(f64, usize)> = Vec::new();
            for i in spread_order(found.len()).take(n) {
                if std::time::Instant::now() > deadline {
                    break;
                }
                quick.push((time(&found[i].algo, Some(2), 1), i));
            }
            searched = quick.len();
            quick.sort_by(|a, b| a.0.total_cmp(&b.0));
            for &(_, i) in quick.iter().take(SEARCH_FINALISTS).filter(|q| q.0.is_finite()) {
                times.push(time(&found[i].algo, None, 3));
                cands.push(found[i]);
            }
        }
        // The fastest of `times[..upto]`, or the heuristic's first within the margin.
        let pick = |upto: usize| {
            let (fastest, t) =
                times[..upto].iter().enumerate().fold((0, times[0]), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
            if t < times[0] * (1.0 - TUNE_MARGIN) {
                fastest
            } else {
                0
            }
        };
        let mut chosen = pick(times.len());
        let mut disagreed = false;
        // A found one: its output checked first (each run from the saved D).
        if chosen >= offered
            && !self.outputs_agree(plan, key, g, (&cands[0].algo, &cands[chosen].algo), saved.as_deref(), stream)?
        {
            disagreed = true;
            chosen = pick(offered);
        }
        restore(saved.as_deref())?;
        let c = &cands[chosen];
        self.picks.borrow_mut().push(Pick {
            key: *key,
            algo: c.algo,
            config: algo_config(&c.algo, c.workspaceSize, c.wavesCount),
            report: TunedGemm {
                gemm: describe(key, g),
                candidates: offered,
                searched,
                disagreed,
                chosen,
                heuristic_ms: times[0],
                chosen_ms: times[chosen],
                seconds: started.elapsed().as_secs_f64(),
            },
        });
        Ok(())
    }

    /// Whether `g` run with `algos.1` writes what it writes with `algos.0` (the heuristic's
    /// first), to within `SEARCH_AGREEMENT` of the largest output: a searched configuration
    /// cuBLASLt accepted is still checked before it is picked. Each run starts from
    /// `saved` D where D is read (accumulating); NaN where the other has none disagrees.
    pub(super) fn outputs_agree(
        &self,
        plan: &Plan,
        key: &Key,
        g: &Gemm,
        algos: (&sys::cublasLtMatmulAlgo_t, &sys::cublasLtMatmulAlgo_t),
        saved: Option<&[u8]>,
        stream: sys::cudaStream_t,
    ) -> BResult<bool> {
        let cs = stream as dsys::CUstream;
        let err = |e: cudarc::driver::DriverError| BackendError::Device(format!("GEMM tuning: checking D: {e}"));
        let output = |algo: &sys::cublasLtMatmulAlgo_t| -> BResult<Vec<f32>> {
            let mut host = vec![0u8; key.d_bytes()];
            // SAFETY: D spans these bytes; each copy completes before the next use of `host`
            // (the stream is synchronised).
            unsafe {
                if let Some(d) = saved {
                    dr::memcpy_htod_async(g.d, d, cs).map_err(err)?;
                }
                self.run(plan, g, algo, stream)?;
                dr::memcpy_dtoh_async(&mut host, g.d, cs).map_err(err)?;
                dr::stream::synchronize(cs).map_err(err)?;
            }
            Ok(match key.out {
                OutType::Bf16 => {
                    host.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
                }
                OutType::F32 => host.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            })
        };
        let (want, got) = (output(algos.0)?, output(algos.1)?);
        let largest = want.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
        let tol = SEARCH_AGREEMENT * largest as f64;
        Ok(want.iter().zip(&got).all(|(&w, &o)| {
            if w.is_finite() && o.is_finite() {
                ((w - o).abs() as f64) <= tol
            } else {
                w.is_nan() == o.is_nan() && (w.is_nan() || w == o)
            }
        }))
    }

    /// Mean ms of one run of `g` with `algo`: after one warm-up, the least over `rounds`
    /// of the mean of `reps` back-to-back runs (`None`: as many as take about half a
    /// millisecond, 1 to 50).
    pub(super) fn time_algo(
        &self,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: sys::cudaStream_t,
        reps: Option<usize>,
        rounds: usize,
    ) -> BResult<f64> {
        let cs = stream as dsys::CUstream;
        let err = |e: cudarc::driver::DriverError| BackendError::Device(format!("GEMM timing event: {e}"));
        let start = dr::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err)?;
        let end = dr::event::create(dsys::CUevent_flags::CU_EVENT_DEFAULT).map_err(err)?;
        // SAFETY: both events live until destroyed at the end; the stream is this
        // backend's; elapsed times are read after `end` completed.
        let timed = |n: usize| -> BResult<f64> {
            unsafe {
                dr::event::record(start, cs).map_err(err)?;
                for _ in 0..n {
                    self.run(plan, g, algo, stream)?;
                }
                dr::event::record(end, cs).map_err(err)?;
                dr::event::synchronize(end).map_err(err)?;
                Ok(dr::event::elapsed(start, end).map_err(err)? as f64 / n as f64)
            }
        };
        let r = timed(1).and_then(|first| {
            let n = reps.unwrap_or_else(|| ((0.5 / first.max(1e-4)).ceil() as usize).clamp(1, 50));
            (0..rounds.max(1)).try_fold(f64::INFINITY, |best, _| Ok(best.min(timed(n)?)))
        });
        // SAFETY: created above, no longer recorded.
        unsafe {
            let _ = dr::event::destroy(start);
            let _ = dr::event::destroy(end);
        }
        r
    }
}
