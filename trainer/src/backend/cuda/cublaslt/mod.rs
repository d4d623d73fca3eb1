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
//!
//! Here: the GEMM's description ([`Gemm`]), the plan key and the handle ([`Lt`]). Beside
//! it: `gemm.rs` (the call), `key.rs` (keys in words and as the stored table records
//! them), `plan.rs` (descriptors, layouts, the heuristic), `tuning.rs` (timed and
//! searched tuning, the stored choices), `space.rs` (the configuration space searched
//! tuning walks), `tools.rs` (the sweep and search behind `gpu-timing`).

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

mod gemm;
mod key;
mod plan;
mod space;
mod tools;
mod tuning;

pub use tools::{GemmSearch, GemmSweep};

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
}
