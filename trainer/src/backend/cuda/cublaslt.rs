//! cuBLASLt for the linear layers' GEMMs (used by `matmul.rs`): bf16 operands, fp32
//! accumulation. The forward writes bf16 with the bias fused into the epilogue; the
//! weight gradient accumulates straight into the fp32 gradient buffer (C = D in fp32,
//! beta = 1), which is why this uses the raw cuBLASLt API (the safe wrapper in cudarc
//! wants A, B and C of one type). The MLP's GELU rides in the epilogue: forward
//! `GELU_AUX_BIAS` writes GELU(x·Wᵀ + b) and keeps the pre-activation as the aux matrix;
//! backward `DGELU` multiplies dout·W by GELU'(pre) read from aux.
//!
//! Descriptors, layouts and the heuristic's algorithm are made once per shape and
//! pointer alignment and cached (the heuristic query costs more than a small GEMM).
//!
//! Timed tuning (`GemmTuning::Timed`) times a shape's candidates at its first call and
//! records the fastest as a pick; the call itself, and every later one, runs the heuristic's
//! algorithm until the trainer hands back a table of choices ([`Lt::use_choices`]: rank 0's
//! picks, or a stored run's, see `backend/gemm_tuning.rs`), whose algorithms then replace
//! the heuristic's for their shapes. Picking and using are apart so that every rank runs the
//! same algorithms, and a rerun given the table runs exactly what the first run did.
//! Searched tuning (`GemmTuning::Searched`) also times the configurations cuBLASLt accepts
//! near the heuristic's candidates (`Lt::configurations`: the heuristic offers few FP8 ones),
//! within a time bound per shape, and checks a found one's output before picking it.
//!
//! FP8 GEMMs (`Gemm::fp8`, `train.precision = "fp8"`, see `fp8.rs`) take e4m3/e5m2 A and B
//! in the "TN" layout Hopper requires, with their inverse scales as device pointers
//! (`A_SCALE_POINTER`, `B_SCALE_POINTER`: cuBLASLt multiplies the fp32 sum by both), bf16 or
//! fp32 C/D and the same epilogues where cuBLASLt has them ([`Lt::try_gemm`] finds out).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::CudaSlice;

use cudarc::driver::{result as dr, sys as dsys};

use crate::backend::gemm_tuning::{
    GemmEnvironment, GemmEpilogue, GemmShape, GemmTuningTable, GemmType, OnMismatch, StoredGemm,
};
use crate::backend::{BResult, BackendError, Fp8Format, GemmTuning, TunedGemm};

/// `GemmTuning::Timed`: how many of the heuristic's candidates to time. The eight cover
/// the fastest at every GPT-2 shape `gpu-timing gemm-algos` measured on an H200.
const TUNE_CANDIDATES: usize = 8;
/// ... and how much faster than the heuristic's first another must be to be picked, so
/// that a tie within the timing noise keeps the heuristic's choice.
const TUNE_MARGIN: f64 = 0.01;
/// `GemmTuning::Searched`: the GPU time a shape's brief runs over the configurations found
/// near the candidates may take (a warm-up and two timed runs each; a GEMM too long for all
/// of them gets a sample spread evenly over them), at least `SEARCH_MIN` runs...
const SEARCH_BUDGET_MS: f64 = 1500.0;
const SEARCH_MIN: usize = 64;
/// ... within this many wall seconds a shape (checks and runs; the host's calls dominate at
/// small shapes) ...
const SEARCH_SECONDS: f64 = 3.0;
/// ... how many of the fastest are then timed as the candidates are ...
const SEARCH_FINALISTS: usize = 5;
/// ... at most how many configurations a shape checks (`cublasLtMatmulAlgoCheck`, a host
/// call each) ...
const SEARCH_MAX_BUILT: usize = 50_000;
/// ... and how close (to the largest output's magnitude) a found one's output must be to
/// the heuristic's to be picked: different tilings sum in other orders (and FP8's fast
/// accumulation promotes at other points), a wrong kernel is off by the output itself.
const SEARCH_AGREEMENT: f64 = 1.0 / 64.0;

fn lt_err(what: &str, e: lt::CublasError) -> BackendError {
    BackendError::Device(format!("cuBLASLt {what}: {:?}", e.0))
}

/// Output precision of a GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum OutType {
    Bf16,
    F32,
}

/// What the epilogue does beyond the optional bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Act {
    None,
    /// D = GELU(AB + bias); aux (bf16, shaped like D) = AB + bias.
    Gelu,
    /// D = AB ⊙ GELU'(aux).
    DGelu,
}

/// The FP8 operands of a GEMM: their formats, the device pointers of their inverse scales
/// (one f32 each), and whether the tensor cores may skip the periodic promotion of partial
/// sums to fp32 (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`: faster, less exact; the forward uses
/// it, the backward's GEMMs do not, as Transformer Engine and torchao do).
#[derive(Debug, Clone, Copy)]
pub(super) struct Fp8Gemm {
    pub a: Fp8Format,
    pub b: Fp8Format,
    pub a_scale: u64,
    pub b_scale: u64,
    pub fast_accum: bool,
}

/// One GEMM `D = alpha·op(A)·op(B) + beta·C`, column-major, A and B bf16 (or FP8, `fp8`);
/// C is D unless `c` names another matrix of D's type and layout (a residual added in the
/// epilogue).
#[derive(Debug, Clone, Copy)]
pub(super) struct Gemm {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub d: u64,
    pub ldd: usize,
    pub out: OutType,
    pub beta: f32,
    /// C when it is not D (same type, shape and leading dimension).
    pub c: Option<u64>,
    /// Bias of length m (bf16) added to every column: the fused epilogue.
    pub bias: Option<u64>,
    /// GELU in the epilogue, with its aux matrix (same shape and leading dimension as D).
    pub act: Act,
    pub aux: Option<u64>,
    /// FP8 A and B (TN only: `transa` and not `transb`).
    pub fp8: Option<Fp8Gemm>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    transa: bool,
    transb: bool,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldd: usize,
    out: OutType,
    bias: bool,
    act: Act,
    /// FP8 A and B formats and fast accumulation.
    fp8: Option<(Fp8Format, Fp8Format, bool)>,
    align: [u32; 6],
}

impl Key {
    /// Bytes D spans (n columns of ldd elements, the last m long).
    fn d_bytes(&self) -> usize {
        let elem = match self.out {
            OutType::Bf16 => 2,
            OutType::F32 => 4,
        };
        (self.ldd * (self.n - 1) + self.m) * elem
    }

    /// cuBLASLt's element types of A, B and D (C is D) for this GEMM: what its layouts are
    /// made with, and what its algorithm space is enumerated for (`Lt::configurations`).
    fn data_types(&self) -> (sys::cudaDataType, sys::cudaDataType, sys::cudaDataType) {
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let fp8_type = |f: Fp8Format| match f {
            Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
            Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
        };
        let (a, b) = match self.fp8 {
            Some((a, b, _)) => (fp8_type(a), fp8_type(b)),
            None => (bf16, bf16),
        };
        let d = match self.out {
            OutType::Bf16 => bf16,
            OutType::F32 => sys::cudaDataType::CUDA_R_32F,
        };
        (a, b, d)
    }
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The GEMM this plan last ran (its pointers): what `Lt::sweep` times again.
    last: Option<Gemm>,
    /// Whether `algo` was settled by its first run (timed tuning happens there, not when
    /// `Lt::supports` makes the plan: that has no buffers to time on), or by a stored choice.
    settled: bool,
}

/// What timed tuning picked for one shape (used once the trainer hands it back).
struct Pick {
    key: Key,
    algo: sys::cublasLtMatmulAlgo_t,
    config: String,
    report: TunedGemm,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once; errors at
        // teardown have nowhere to go.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle, its workspace and the per-shape plans.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    ws_ptr: u64,
    plans: RefCell<HashMap<Key, Plan>>,
    /// The fused GEMMs (an epilogue beyond the bias) cuBLASLt has no algorithm for, or whose
    /// algorithm it offered and then refused to run ([`Lt::try_gemm`]): their callers run
    /// the GEMM and a separate kernel instead. Described, for [`Lt::unfused`]; what
    /// [`Lt::supports`] answers without asking the heuristic again (not offered again).
    unfused: RefCell<HashMap<Key, String>>,
    tuning: Cell<GemmTuning>,
    /// What timed tuning picked, per shape, in the order the shapes were first run.
    picks: RefCell<Vec<Pick>>,
    /// The algorithms in use instead of the heuristic's ([`Lt::use_choices`]), checked.
    stored: RefCell<HashMap<Key, sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time; `Lt` is
// not `Sync` (its plan cache is a RefCell), so calls cannot overlap. This makes the
// backend movable to the thread that runs its rank.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.borrow_mut().clear();
        // SAFETY: the handle is live and destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// Why a GEMM did not run: cuBLASLt refused it (`CUBLAS_STATUS_NOT_SUPPORTED`: a fused
/// variant's caller may fall back), or anything else.
enum GemmFailure {
    NotSupported(BackendError),
    Other(BackendError),
}

/// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume.
fn alignment(p: u64) -> u32 {
    let mut a = 256u32;
    while a > 1 && !p.is_multiple_of(a as u64) {
        a /= 2;
    }
    a
}

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

/// The thread-block cluster shapes `Lt::search` tries (cuBLASLt lists 51, most of them
/// longer than the 8 blocks a Hopper cluster may portably hold, or odd): its own choice, and
/// clusters of 1, 2 and 4 blocks along either dimension.
const CLUSTERS: [sys::cublasLtClusterShape_t; 7] = {
    use sys::cublasLtClusterShape_t as S;
    [
        S::CUBLASLT_CLUSTER_SHAPE_AUTO,
        S::CUBLASLT_CLUSTER_SHAPE_1x1x1,
        S::CUBLASLT_CLUSTER_SHAPE_2x1x1,
        S::CUBLASLT_CLUSTER_SHAPE_4x1x1,
        S::CUBLASLT_CLUSTER_SHAPE_1x2x1,
        S::CUBLASLT_CLUSTER_SHAPE_2x2x1,
        S::CUBLASLT_CLUSTER_SHAPE_1x4x1,
    ]
};

/// At most this many configurations a GEMM `Lt::search` checks (each a host call to
/// `cublasLtMatmulAlgoCheck`), in algorithm id order: a bound on the search's time.
const MAX_BUILT: usize = 200_000;

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

/// A GEMM in words: its shape, transposes, output type, epilogue and beta.
fn describe(key: &Key, g: &Gemm) -> String {
    let fp8 = match key.fp8 {
        Some((a, b, fast)) => format!(" fp8={a:?}x{b:?}{}", if fast { " fast-accum" } else { "" }),
        None => String::new(),
    };
    format!(
        "m={} n={} k={} {}{} out={:?} bias={} act={:?} beta={}{fp8}",
        key.m,
        key.n,
        key.k,
        if key.transa { 'T' } else { 'N' },
        if key.transb { 'T' } else { 'N' },
        key.out,
        key.bias,
        key.act,
        g.beta
    )
}

/// An algorithm's configuration as cuBLASLt reports it (ids of its tile, stages, cluster
/// shape and so on; their meaning is in cublasLt.h's enums).
/// 0..n in an order whose every prefix is spread over the whole range: steps of the
/// largest stride near n/φ (the golden ratio) coprime with n.
fn spread_order(n: usize) -> impl Iterator<Item = usize> {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    let mut stride = ((n as f64 / 1.618_034).round() as usize).max(1);
    while n > 1 && gcd(stride, n) != 1 {
        stride -= 1;
    }
    (0..n).map(move |k| (k * stride) % n.max(1))
}

/// One configuration attribute of an initialised algorithm (`size` bytes: 2 or 4), or -1.
fn config_attr(algo: &sys::cublasLtMatmulAlgo_t, attr: sys::cublasLtMatmulAlgoConfigAttributes_t, size: usize) -> i64 {
    let mut v = 0u64;
    let mut written = 0usize;
    // SAFETY: `algo` is an initialised algorithm; `v` has room for `size` <= 8 bytes.
    let st = unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u64 as *mut c_void, size, &mut written)
    };
    if st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        match size {
            2 => v as u16 as i64,
            _ => v as u32 as i32 as i64,
        }
    } else {
        -1
    }
}

fn algo_config(algo: &sys::cublasLtMatmulAlgo_t, workspace: usize, waves: f32) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr: A, size: usize| config_attr(algo, attr, size);
    format!(
        "id {} tile {} stages {} splitk {} red {} swizzle {} custom {} inner {} cluster {} ws {} KiB waves {:.2}",
        get(A::CUBLASLT_ALGO_CONFIG_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, 4),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 4),
        get(A::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 4),
        get(A::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, 2),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 2),
        workspace >> 10,
        waves
    )
}

/// A plan key as the stored table records it.
fn shape_of(key: &Key) -> GemmShape {
    let fp8 = |f: Fp8Format| match f {
        Fp8Format::E4M3 => GemmType::E4m3,
        Fp8Format::E5M2 => GemmType::E5m2,
    };
    let (a_type, b_type, fast_accum) = match key.fp8 {
        Some((a, b, fast)) => (fp8(a), fp8(b), fast),
        None => (GemmType::Bf16, GemmType::Bf16, false),
    };
    GemmShape {
        transa: key.transa,
        transb: key.transb,
        m: key.m,
        n: key.n,
        k: key.k,
        lda: key.lda,
        ldb: key.ldb,
        ldd: key.ldd,
        a_type,
        b_type,
        d_type: match key.out {
            OutType::Bf16 => GemmType::Bf16,
            OutType::F32 => GemmType::F32,
        },
        bias: key.bias,
        epilogue: match key.act {
            Act::None => GemmEpilogue::None,
            Act::Gelu => GemmEpilogue::Gelu,
            Act::DGelu => GemmEpilogue::Dgelu,
        },
        fast_accum,
        align: key.align,
    }
}

/// The plan key of a stored shape; `None` for a combination this backend never runs.
fn key_of(s: &GemmShape) -> Option<Key> {
    let fp8 = |t: GemmType| match t {
        GemmType::E4m3 => Some(Fp8Format::E4M3),
        GemmType::E5m2 => Some(Fp8Format::E5M2),
        _ => None,
    };
    let fp8 = match (s.a_type, s.b_type) {
        (GemmType::Bf16, GemmType::Bf16) if !s.fast_accum => None,
        (a, b) => Some((fp8(a)?, fp8(b)?, s.fast_accum)),
    };
    Some(Key {
        transa: s.transa,
        transb: s.transb,
        m: s.m,
        n: s.n,
        k: s.k,
        lda: s.lda,
        ldb: s.ldb,
        ldd: s.ldd,
        out: match s.d_type {
            GemmType::Bf16 => OutType::Bf16,
            GemmType::F32 => OutType::F32,
            _ => return None,
        },
        bias: s.bias,
        act: match s.epilogue {
            GemmEpilogue::None => Act::None,
            GemmEpilogue::Gelu => Act::Gelu,
            GemmEpilogue::Dgelu => Act::DGelu,
        },
        fp8,
        align: s.align,
    })
}

impl Lt {
    /// `workspace` is the scratch cuBLASLt may use (32 MiB is NVIDIA's advice for Hopper).
    pub fn new(workspace: CudaSlice<u8>, ws_ptr: u64) -> BResult<Lt> {
        let handle = lt::create_handle().map_err(|e| lt_err("create handle", e))?;
        Ok(Lt {
            handle,
            workspace,
            ws_ptr,
            plans: RefCell::new(HashMap::new()),
            unfused: RefCell::new(HashMap::new()),
            tuning: Cell::new(GemmTuning::Heuristic),
            picks: RefCell::new(Vec::new()),
            stored: RefCell::new(HashMap::new()),
        })
    }

    /// `cublasLtGetVersion()`: a stored algorithm is reusable with this version only.
    pub fn version(&self) -> u64 {
        // SAFETY: a plain query of the loaded library.
        unsafe { sys::cublasLtGetVersion() as u64 }
    }

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
    fn check_algo(&self, key: &Key, algo: &sys::cublasLtMatmulAlgo_t) -> BResult<bool> {
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

    /// Whether cuBLASLt has an algorithm for `g`'s shape and epilogue (the plan is cached).
    pub fn supports(&self, g: &Gemm) -> bool {
        let key = Self::key(g);
        if self.unfused.borrow().contains_key(&key) {
            return false;
        }
        let mut plans = self.plans.borrow_mut();
        if plans.contains_key(&key) {
            return true;
        }
        match self.plan(&key, g) {
            Ok(p) => {
                plans.insert(key, p);
                true
            }
            Err(_) => {
                self.unfused.borrow_mut().insert(key, format!("{}: no algorithm", describe(&key, g)));
                false
            }
        }
    }

    /// The fused GEMMs that ran as a GEMM and a separate kernel so far (cuBLASLt had no
    /// algorithm for the epilogue, or refused the one offered), described, sorted.
    pub fn unfused(&self) -> Vec<String> {
        let mut v: Vec<String> = self.unfused.borrow().values().cloned().collect();
        v.sort();
        v
    }

    fn key(g: &Gemm) -> Key {
        Key {
            transa: g.transa,
            transb: g.transb,
            m: g.m,
            n: g.n,
            k: g.k,
            lda: g.lda,
            ldb: g.ldb,
            ldd: g.ldd,
            out: g.out,
            bias: g.bias.is_some(),
            act: g.act,
            fp8: g.fp8.map(|f| (f.a, f.b, f.fast_accum)),
            align: [
                alignment(g.a),
                alignment(g.b),
                alignment(g.d),
                g.bias.map_or(256, alignment),
                g.aux.map_or(256, alignment),
                g.c.map_or(256, alignment),
            ],
        }
    }

    /// [`Lt::gemm`] for a fused variant that has a fallback: `Ok(false)`, with nothing
    /// enqueued, where cuBLASLt has no algorithm for it or refuses the one its heuristic
    /// offered (`CUBLAS_STATUS_NOT_SUPPORTED`, which it reports when the call is made);
    /// such a GEMM is not tried again ([`Lt::supports`] says no).
    pub fn try_gemm(&self, g: &Gemm, stream: sys::cudaStream_t) -> BResult<bool> {
        if !self.supports(g) {
            return Ok(false);
        }
        match self.gemm_status(g, stream) {
            Ok(()) => Ok(true),
            Err(GemmFailure::NotSupported(_)) => {
                let key = Self::key(g);
                self.plans.borrow_mut().remove(&key);
                let why = format!("{}: offered, then refused at the call", describe(&key, g));
                self.unfused.borrow_mut().insert(key, why);
                Ok(false)
            }
            Err(GemmFailure::Other(e)) => Err(e),
        }
    }

    /// Enqueue `g` on `stream`.
    pub fn gemm(&self, g: &Gemm, stream: sys::cudaStream_t) -> BResult<()> {
        self.gemm_status(g, stream).map_err(|e| match e {
            GemmFailure::NotSupported(e) | GemmFailure::Other(e) => e,
        })
    }

    fn gemm_status(&self, g: &Gemm, stream: sys::cudaStream_t) -> Result<(), GemmFailure> {
        let other = GemmFailure::Other;
        if (g.act == Act::None) != g.aux.is_none() {
            return Err(other(BackendError::Device("GEMM: a GELU epilogue needs an aux matrix, and only it".into())));
        }
        if g.fp8.is_some() && (!g.transa || g.transb) {
            return Err(other(BackendError::Device("GEMM: FP8 operands take the TN layout only (a bug)".into())));
        }
        let key = Self::key(g);
        let mut plans = self.plans.borrow_mut();
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(&key, g).map_err(other)?),
        };
        if !plan.settled {
            if self.tuning.get().times() {
                self.tune(plan, &key, g, stream).map_err(other)?;
            }
            plan.settled = true;
        }
        plan.last = Some(*g);
        self.run_status(plan, g, &plan.algo, stream)
    }

    /// Enqueue `g` with `algo` (one of `plan`'s algorithms).
    fn run(&self, plan: &Plan, g: &Gemm, algo: &sys::cublasLtMatmulAlgo_t, stream: sys::cudaStream_t) -> BResult<()> {
        self.run_status(plan, g, algo, stream).map_err(|e| match e {
            GemmFailure::NotSupported(e) | GemmFailure::Other(e) => e,
        })
    }

    /// [`Lt::run`], telling a refusal (`CUBLAS_STATUS_NOT_SUPPORTED`) from other failures.
    fn run_status(
        &self,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: sys::cudaStream_t,
    ) -> Result<(), GemmFailure> {
        let alpha = 1.0f32;
        let beta = g.beta;
        // SAFETY: the plan's descriptors are live; the pointers address device buffers
        // the caller bounds-checked for these shapes; alpha/beta are host f32 as the
        // descriptor's scale type says.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as D;
            let set_ptr = |attr: D, p: u64, what: &str| {
                lt::set_matmul_desc_attribute(plan.desc, attr, &p as *const u64 as *const c_void, size_of::<u64>())
                    .map_err(|e| GemmFailure::Other(lt_err(what, e)))
            };
            if let Some(bias) = g.bias {
                set_ptr(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias, "set bias pointer")?;
            }
            if let Some(aux) = g.aux {
                set_ptr(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux, "set aux pointer")?;
            }
            if let Some(f) = g.fp8 {
                set_ptr(D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, f.a_scale, "set A scale pointer")?;
                set_ptr(D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, f.b_scale, "set B scale pointer")?;
            }
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.a as *const c_void,
                plan.a,
                g.b as *const c_void,
                plan.b,
                g.c.unwrap_or(g.d) as *const c_void,
                plan.d,
                g.d as *mut c_void,
                plan.d,
                algo,
                self.ws_ptr as *mut c_void,
                self.workspace.len(),
                stream,
            )
            .map_err(|e| {
                let refused = e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED;
                let e = lt_err(
                    &format!(
                        "matmul m={} n={} k={} transa={} transb={} out={:?} act={:?} fp8={:?}",
                        g.m,
                        g.n,
                        g.k,
                        g.transa,
                        g.transb,
                        g.out,
                        g.act,
                        g.fp8.map(|f| (f.a, f.b))
                    ),
                    e,
                );
                if refused {
                    GemmFailure::NotSupported(e)
                } else {
                    GemmFailure::Other(e)
                }
            })
        }
    }

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
    fn each_last_run<T>(
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

    /// Every configuration of every algorithm id cuBLASLt has for `key`'s types (fp32
    /// compute and scales): each tile, stage count, custom option and CTA swizzle the
    /// algorithm reports it supports, with each of [`CLUSTERS`], without split-K, kept where
    /// `cublasLtMatmulAlgoCheck` accepts it for `plan` within the workspace, up to
    /// `max_built` built or until `deadline`. With `near` (the heuristic's candidates), only
    /// their algorithm ids (in the heuristic's order) and stage counts: the space timed
    /// tuning searches (`GemmTuning::Searched`), thousands of checks rather than hundreds of
    /// thousands. Returns how many were built and the accepted ones.
    fn configurations(
        &self,
        plan: &Plan,
        key: &Key,
        near: Option<&[sys::cublasLtMatmulHeuristicResult_t]>,
        max_built: usize,
        deadline: Option<std::time::Instant>,
    ) -> (usize, Vec<sys::cublasLtMatmulHeuristicResult_t>) {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Cfg;
        let (at, bt, dt) = key.data_types();
        let (compute, scale) = (sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F);
        let ok = |st: sys::cublasStatus_t| st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
        // An algorithm's list capability (ids of i32), or `[0]` (undefined: the algorithm's
        // own choice) where it has none.
        let list = |algo: &sys::cublasLtMatmulAlgo_t, cap: Cap| -> Vec<i32> {
            let mut written = 0usize;
            // SAFETY: a size query (null buffer), then a buffer of the size it reported.
            unsafe {
                if !ok(sys::cublasLtMatmulAlgoCapGetAttribute(algo, cap, std::ptr::null_mut(), 0, &mut written)) {
                    return vec![0];
                }
                let mut v = vec![0i32; written / size_of::<i32>()];
                if v.is_empty()
                    || !ok(sys::cublasLtMatmulAlgoCapGetAttribute(
                        algo,
                        cap,
                        v.as_mut_ptr() as *mut c_void,
                        v.len() * size_of::<i32>(),
                        &mut written,
                    ))
                {
                    return vec![0];
                }
                v
            }
        };
        let scalar = |algo: &sys::cublasLtMatmulAlgo_t, cap: Cap| -> i32 {
            let (mut v, mut written) = (0i32, 0usize);
            // SAFETY: one i32, as the attribute is documented.
            let st = unsafe {
                sys::cublasLtMatmulAlgoCapGetAttribute(
                    algo,
                    cap,
                    &mut v as *mut i32 as *mut c_void,
                    size_of::<i32>(),
                    &mut written,
                )
            };
            if ok(st) {
                v
            } else {
                0
            }
        };
        let mut ids = vec![0i32; 256];
        let mut n = 0i32;
        // SAFETY: `ids` has room for the 256 requested.
        let st = unsafe {
            sys::cublasLtMatmulAlgoGetIds(self.handle, compute, scale, at, bt, dt, dt, 256, ids.as_mut_ptr(), &mut n)
        };
        if !ok(st) {
            return (0, Vec::new());
        }
        ids.truncate(n.max(0) as usize);
        // The candidates' stage counts and ids, when searching near them.
        let near_stages: Option<Vec<i32>> = near.map(|c| {
            let mut v: Vec<i32> =
                c.iter().map(|c| config_attr(&c.algo, Cfg::CUBLASLT_ALGO_CONFIG_STAGES_ID, 4) as i32).collect();
            v.sort_unstable();
            v.dedup();
            v
        });
        if let Some(c) = near {
            // The candidates' ids in the heuristic's order (its best first, should the
            // deadline cut the enumeration short).
            let mut order: Vec<i32> = Vec::new();
            for id in c.iter().map(|c| config_attr(&c.algo, Cfg::CUBLASLT_ALGO_CONFIG_ID, 4) as i32) {
                if ids.contains(&id) && !order.contains(&id) {
                    order.push(id);
                }
            }
            ids = order;
        }
        // One configuration attribute set on an algorithm; `p` points at a value of the
        // attribute's documented size `n`.
        let set = |a: &mut sys::cublasLtMatmulAlgo_t, attr: Cfg, p: *const c_void, n: usize| {
            // SAFETY: as said above.
            ok(unsafe { sys::cublasLtMatmulAlgoConfigSetAttribute(a, attr, p, n) })
        };
        let i32p = |v: &i32| v as *const i32 as *const c_void;
        let (mut built, mut valid) = (0usize, Vec::new());
        let ws = self.workspace.len();
        'ids: for id in ids {
            // SAFETY: zeroed storage for cuBLASLt to initialise.
            let mut algo: sys::cublasLtMatmulAlgo_t = unsafe { std::mem::zeroed() };
            // SAFETY: the handle is live; `algo` is written by the call.
            if !ok(unsafe { sys::cublasLtMatmulAlgoInit(self.handle, compute, scale, at, bt, dt, dt, id, &mut algo) }) {
                continue;
            }
            let (tiles, mut stages) =
                (list(&algo, Cap::CUBLASLT_ALGO_CAP_TILE_IDS), list(&algo, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS));
            if let Some(keep) = &near_stages {
                stages.retain(|s| keep.contains(s));
                if stages.is_empty() {
                    stages.clone_from(keep); // the algorithm lists none of them: the candidates' own
                }
            }
            let custom_max = scalar(&algo, Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX).max(0);
            let swizzle_max = scalar(&algo, Cap::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT).clamp(0, 1);
            for &tile in &tiles {
                for &stage in &stages {
                    for cluster in CLUSTERS.map(|c| c as u16) {
                        for custom in 0..=custom_max {
                            for swizzle in 0..=swizzle_max {
                                let mut a = algo;
                                let all = set(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_TILE_ID, i32p(&tile), 4)
                                    && set(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_STAGES_ID, i32p(&stage), 4)
                                    && set(
                                        &mut a,
                                        Cfg::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID,
                                        &cluster as *const u16 as *const c_void,
                                        2,
                                    )
                                    && set(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, i32p(&custom), 4)
                                    && set(&mut a, Cfg::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, i32p(&swizzle), 4);
                                if !all {
                                    continue;
                                }
                                if built == max_built
                                    || (built % 256 == 0 && deadline.is_some_and(|d| std::time::Instant::now() > d))
                                {
                                    break 'ids;
                                }
                                built += 1;
                                // SAFETY: zeroed storage the check writes.
                                let mut r: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
                                // SAFETY: the plan's descriptors are live (C is D, as every run passes them).
                                let st = unsafe {
                                    sys::cublasLtMatmulAlgoCheck(
                                        self.handle,
                                        plan.desc,
                                        plan.a,
                                        plan.b,
                                        plan.d,
                                        plan.d,
                                        &a,
                                        &mut r,
                                    )
                                };
                                if ok(st) && r.workspaceSize <= ws {
                                    r.algo = a;
                                    valid.push(r);
                                }
                            }
                        }
                    }
                }
            }
        }
        (built, valid)
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
    fn tune(&self, plan: &Plan, key: &Key, g: &Gemm, stream: sys::cudaStream_t) -> BResult<()> {
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
    fn outputs_agree(
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
    fn time_algo(
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

    /// The descriptors and the algorithm for `key`: the stored one ([`Lt::use_choices`]) or
    /// the heuristic's (`g` is a GEMM of that key: an FP8 GEMM's scale pointers are set
    /// before the heuristic is asked, since whether the operands are scaled decides which
    /// kernels qualify; each call sets its own).
    fn plan(&self, key: &Key, g: &Gemm) -> BResult<Plan> {
        let mut plan = self.descriptors(key, g.fp8.map(|f| (f.a_scale, f.b_scale)))?;
        if let Some(algo) = self.stored.borrow().get(key) {
            plan.algo = *algo;
            plan.settled = true;
            return Ok(plan);
        }
        let best = self.heuristics(&plan, key, 1)?;
        plan.algo = best[0].algo;
        Ok(plan)
    }

    /// The descriptors and layouts of `key`, with FP8 scale pointers `scales` (A, B) set;
    /// no algorithm yet.
    fn descriptors(&self, key: &Key, scales: Option<(u64, u64)>) -> BResult<Plan> {
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let (at, bt, dtype) = key.data_types();
        let (ar, ac) = if key.transa { (key.k, key.m) } else { (key.m, key.k) };
        let (br, bc) = if key.transb { (key.n, key.k) } else { (key.k, key.n) };
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(|e| lt_err("create matmul descriptor", e))?;
        // Made one by one so that each is owned (and freed) by `plan` from here on.
        let mut plan = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: unsafe { std::mem::zeroed() },
            last: None,
            settled: false,
        };
        plan.a =
            lt::create_matrix_layout(at, ar as u64, ac as u64, key.lda as i64).map_err(|e| lt_err("layout A", e))?;
        plan.b =
            lt::create_matrix_layout(bt, br as u64, bc as u64, key.ldb as i64).map_err(|e| lt_err("layout B", e))?;
        plan.d = lt::create_matrix_layout(dtype, key.m as u64, key.n as u64, key.ldd as i64)
            .map_err(|e| lt_err("layout D", e))?;
        // cublasOperation_t as an int: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| -> i32 { i32::from(t) };
        // SAFETY: descriptors created above; every attribute value is the documented type.
        let r = unsafe {
            let set_desc = |attr, p: *const c_void, n: usize| lt::set_matmul_desc_attribute(plan.desc, attr, p, n);
            let ta = op(key.transa);
            let tb = op(key.transb);
            let mut r = set_desc(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &ta as *const _ as *const c_void,
                size_of::<i32>(),
            );
            if r.is_ok() {
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    &tb as *const _ as *const c_void,
                    size_of::<i32>(),
                );
            }
            use sys::cublasLtEpilogue_t as E;
            let epi = match (key.act, key.bias) {
                (Act::None, false) => None,
                (Act::None, true) => Some(E::CUBLASLT_EPILOGUE_BIAS),
                (Act::Gelu, true) => Some(E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS),
                (Act::Gelu, false) => Some(E::CUBLASLT_EPILOGUE_GELU_AUX),
                (Act::DGelu, _) => Some(E::CUBLASLT_EPILOGUE_DGELU),
            };
            if let (true, Some(epi)) = (r.is_ok(), epi) {
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    &epi as *const _ as *const c_void,
                    size_of::<sys::cublasLtEpilogue_t>(),
                );
            }
            if r.is_ok() && key.act != Act::None {
                // aux: bf16, shaped like D (its leading dimension in elements).
                let ld = key.ldd as i64;
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    &ld as *const i64 as *const c_void,
                    size_of::<i64>(),
                );
                if r.is_ok() {
                    let at = bf16;
                    r = set_desc(
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                        &at as *const _ as *const c_void,
                        size_of::<sys::cudaDataType>(),
                    );
                }
            }
            if let (true, Some((_, _, fast))) = (r.is_ok(), key.fp8) {
                // int8_t: 1 lets the tensor cores keep partial sums in their own precision.
                let f = i8::from(fast);
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    &f as *const i8 as *const c_void,
                    size_of::<i8>(),
                );
            }
            if let (true, Some((a_scale, b_scale))) = (r.is_ok(), scales) {
                for (attr, p) in [
                    (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale),
                    (sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale),
                ] {
                    if r.is_ok() {
                        r = set_desc(attr, &p as *const u64 as *const c_void, size_of::<u64>());
                    }
                }
            }
            if r.is_ok() && key.bias {
                let bt = bf16;
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &bt as *const _ as *const c_void,
                    size_of::<sys::cudaDataType>(),
                );
            }
            r
        };
        r.map_err(|e| lt_err("set attributes", e))?;
        Ok(plan)
    }

    /// The heuristic's first `count` algorithms for `plan` (at least one, or an error that
    /// names the GEMM), best first.
    fn heuristics(&self, plan: &Plan, key: &Key, count: usize) -> BResult<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("create preference", e))?;
        // SAFETY: `pref` was created above and is destroyed once below; every attribute
        // value is the documented type; the results array has room for `count`.
        let res = unsafe {
            let ws = self.workspace.len() as u64;
            let set_pref = |attr, p: *const c_void, n: usize| lt::set_matmul_pref_attribute(pref, attr, p, n);
            let mut r = set_pref(
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                size_of::<u64>(),
            );
            let prefs = [
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ];
            let al = [key.align[0], key.align[1], key.align[2], key.align[2]];
            for (attr, a) in prefs.into_iter().zip(al) {
                if r.is_ok() {
                    r = set_pref(attr, &a as *const u32 as *const c_void, size_of::<u32>());
                }
            }
            let mut out = vec![std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); count];
            let mut found = 0i32;
            let r = r.and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.d,
                    plan.d,
                    pref,
                    count as i32,
                    out.as_mut_ptr(),
                    &mut found,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            match r {
                Ok(()) if found > 0 => {
                    out.truncate(found as usize);
                    Ok(out)
                }
                Ok(()) => Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)),
                Err(e) => Err(e),
            }
        };
        res.map_err(|e| {
            lt_err(
                &format!(
                    "no algorithm for m={} n={} k={} transa={} transb={} out={:?} bias={} act={:?} fp8={:?} alignments={:?}",
                    key.m, key.n, key.k, key.transa, key.transb, key.out, key.bias, key.act, key.fp8, key.align
                ),
                e,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::spread_order;

    #[test]
    fn spread_order_visits_each_once_and_its_prefixes_spread() {
        for n in [0usize, 1, 2, 3, 10, 64, 3744, 4096] {
            let order: Vec<usize> = spread_order(n).collect();
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n = {n}");
            if n >= 64 {
                // The first quarter touches every eighth of the range (visiting them in
                // order would not: its first quarter is the range's first quarter).
                let mut hit = [false; 8];
                for &i in &order[..n / 4] {
                    hit[i * 8 / n] = true;
                }
                assert!(hit.iter().all(|&h| h), "n = {n}: {hit:?}");
            }
        }
    }
}
