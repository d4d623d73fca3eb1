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

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::CudaSlice;

use crate::backend::{BResult, BackendError};

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

/// One GEMM `D = alpha·op(A)·op(B) + beta·C`, column-major, A and B bf16; C is D unless
/// `c` names another matrix of D's type and layout (a residual added in the epilogue).
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
    align: [u32; 6],
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
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

/// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume.
fn alignment(p: u64) -> u32 {
    let mut a = 256u32;
    while a > 1 && !p.is_multiple_of(a as u64) {
        a /= 2;
    }
    a
}

impl Lt {
    /// `workspace` is the scratch cuBLASLt may use (32 MiB is NVIDIA's advice for Hopper).
    pub fn new(workspace: CudaSlice<u8>, ws_ptr: u64) -> BResult<Lt> {
        let handle = lt::create_handle().map_err(|e| lt_err("create handle", e))?;
        Ok(Lt { handle, workspace, ws_ptr, plans: RefCell::new(HashMap::new()) })
    }

    /// Whether cuBLASLt has an algorithm for `g`'s shape and epilogue (the plan is cached).
    pub fn supports(&self, g: &Gemm) -> bool {
        let key = Self::key(g);
        let mut plans = self.plans.borrow_mut();
        if plans.contains_key(&key) {
            return true;
        }
        match self.plan(&key) {
            Ok(p) => {
                plans.insert(key, p);
                true
            }
            Err(_) => false,
        }
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

    /// Enqueue `g` on `stream`.
    pub fn gemm(&self, g: &Gemm, stream: sys::cudaStream_t) -> BResult<()> {
        if (g.act == Act::None) != g.aux.is_none() {
            return Err(BackendError::Device("GEMM: a GELU epilogue needs an aux matrix, and only it".into()));
        }
        let key = Self::key(g);
        let mut plans = self.plans.borrow_mut();
        let plan = match plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(self.plan(&key)?),
        };
        let alpha = 1.0f32;
        let beta = g.beta;
        // SAFETY: the plan's descriptors are live; the pointers address device buffers
        // the caller bounds-checked for these shapes; alpha/beta are host f32 as the
        // descriptor's scale type says.
        unsafe {
            if let Some(bias) = g.bias {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &bias as *const u64 as *const c_void,
                    size_of::<u64>(),
                )
                .map_err(|e| lt_err("set bias pointer", e))?;
            }
            if let Some(aux) = g.aux {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    &aux as *const u64 as *const c_void,
                    size_of::<u64>(),
                )
                .map_err(|e| lt_err("set aux pointer", e))?;
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
                &plan.algo,
                self.ws_ptr as *mut c_void,
                self.workspace.len(),
                stream,
            )
            .map_err(|e| {
                lt_err(
                    &format!(
                        "matmul m={} n={} k={} transa={} transb={} out={:?}",
                        g.m, g.n, g.k, g.transa, g.transb, g.out
                    ),
                    e,
                )
            })
        }
    }

    fn plan(&self, key: &Key) -> BResult<Plan> {
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        let dtype = match key.out {
            OutType::Bf16 => bf16,
            OutType::F32 => sys::cudaDataType::CUDA_R_32F,
        };
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
        };
        plan.a =
            lt::create_matrix_layout(bf16, ar as u64, ac as u64, key.lda as i64).map_err(|e| lt_err("layout A", e))?;
        plan.b =
            lt::create_matrix_layout(bf16, br as u64, bc as u64, key.ldb as i64).map_err(|e| lt_err("layout B", e))?;
        plan.d = lt::create_matrix_layout(dtype, key.m as u64, key.n as u64, key.ldd as i64)
            .map_err(|e| lt_err("layout D", e))?;
        // cublasOperation_t as an int: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| -> i32 { i32::from(t) };
        let pref = lt::create_matmul_pref().map_err(|e| lt_err("create preference", e))?;
        // SAFETY: descriptors created above; every attribute value is the documented type.
        let res = unsafe {
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
            if r.is_ok() && key.bias {
                let bt = bf16;
                r = set_desc(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                    &bt as *const _ as *const c_void,
                    size_of::<sys::cudaDataType>(),
                );
            }
            let ws = self.workspace.len() as u64;
            let set_pref = |attr, p: *const c_void, n: usize| lt::set_matmul_pref_attribute(pref, attr, p, n);
            if r.is_ok() {
                r = set_pref(
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws as *const u64 as *const c_void,
                    size_of::<u64>(),
                );
            }
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
            let r = r.map_err(|e| lt_err("set attributes", e)).and_then(|_| {
                lt::get_matmul_algo_heuristic(self.handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref).map_err(
                    |e| {
                        lt_err(
                            &format!(
                                "no algorithm for m={} n={} k={} transa={} transb={} out={:?} bias={} act={:?} alignments={:?}",
                                key.m, key.n, key.k, key.transa, key.transb, key.out, key.bias, key.act, key.align
                            ),
                            e,
                        )
                    },
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            r
        };
        plan.algo = res?.algo;
        Ok(plan)
    }
}
