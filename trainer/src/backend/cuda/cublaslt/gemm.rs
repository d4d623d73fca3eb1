//! The GEMM call: whether cuBLASLt runs a GEMM (its plan made and cached), and enqueueing
//! it with the plan's algorithm, telling a refusal of a fused epilogue from a failure.

use super::key::describe;
use super::*;

impl Lt {
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

    pub(super) fn gemm_status(&self, g: &Gemm, stream: sys::cudaStream_t) -> Result<(), GemmFailure> {
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
    pub(super) fn run(
        &self,
        plan: &Plan,
        g: &Gemm,
        algo: &sys::cublasLtMatmulAlgo_t,
        stream: sys::cudaStream_t,
    ) -> BResult<()> {
        self.run_status(plan, g, algo, stream).map_err(|e| match e {
            GemmFailure::NotSupported(e) | GemmFailure::Other(e) => e,
        })
    }

    /// [`Lt::run`], telling a refusal (`CUBLAS_STATUS_NOT_SUPPORTED`) from other failures.
    pub(super) fn run_status(
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
}
