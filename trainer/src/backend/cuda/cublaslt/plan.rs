//! A plan: the matmul descriptor and matrix layouts of a key, with its algorithm (a stored
//! choice or the heuristic's first), and the heuristic's candidates.

use super::*;

impl Lt {
    /// The descriptors and the algorithm for `key`: the stored one ([`Lt::use_choices`]) or
    /// the heuristic's (`g` is a GEMM of that key: an FP8 GEMM's scale pointers are set
    /// before the heuristic is asked, since whether the operands are scaled decides which
    /// kernels qualify; each call sets its own).
    pub(super) fn plan(&self, key: &Key, g: &Gemm) -> BResult<Plan> {
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
    pub(super) fn descriptors(&self, key: &Key, scales: Option<(u64, u64)>) -> BResult<Plan> {
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
    pub(super) fn heuristics(
        &self,
        plan: &Plan,
        key: &Key,
        count: usize,
    ) -> BResult<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
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
