//! The configuration space searched tuning and `gpu-timing gemm-search` walk: every
//! configuration cuBLASLt accepts for a GEMM's algorithms (tiles, stages, cluster shapes,
//! ...), the order a bounded sample of it is taken in, and a configuration in words.

use super::*;

/// The thread-block cluster shapes `Lt::search` tries (cuBLASLt lists 51, most of them
/// longer than the 8 blocks a Hopper cluster may portably hold, or odd): its own choice, and
/// clusters of 1, 2 and 4 blocks along either dimension.
pub(super) const CLUSTERS: [sys::cublasLtClusterShape_t; 7] = {
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

/// shape and so on; their meaning is in cublasLt.h's enums).
/// 0..n in an order whose every prefix is spread over the whole range: steps of the
/// largest stride near n/φ (the golden ratio) coprime with n.
pub(super) fn spread_order(n: usize) -> impl Iterator<Item = usize> {
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
pub(super) fn config_attr(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
    size: usize,
) -> i64 {
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

/// An algorithm's configuration as cuBLASLt reports it (ids of its tile, stages, cluster
pub(super) fn algo_config(algo: &sys::cublasLtMatmulAlgo_t, workspace: usize, waves: f32) -> String {
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

/// Whether a cuBLASLt call succeeded.
fn ok(st: sys::cublasStatus_t) -> bool {
    st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
}

/// An algorithm's list capability (ids of i32), or `[0]` (undefined: the algorithm's
/// own choice) where it has none.
fn cap_list(algo: &sys::cublasLtMatmulAlgo_t, cap: sys::cublasLtMatmulAlgoCapAttributes_t) -> Vec<i32> {
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
}

/// An algorithm's scalar capability (an i32), or 0 where it has none.
fn cap_scalar(algo: &sys::cublasLtMatmulAlgo_t, cap: sys::cublasLtMatmulAlgoCapAttributes_t) -> i32 {
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
}

impl Lt {
    /// Every configuration of every algorithm id cuBLASLt has for `key`'s types (fp32
    /// compute and scales): each tile, stage count, custom option and CTA swizzle the
    /// algorithm reports it supports, with each of [`CLUSTERS`], without split-K, kept where
    /// `cublasLtMatmulAlgoCheck` accepts it for `plan` within the workspace, up to
    /// `max_built` built or until `deadline`. With `near` (the heuristic's candidates), only
    /// their algorithm ids (in the heuristic's order) and stage counts: the space timed
    /// tuning searches (`GemmTuning::Searched`), thousands of checks rather than hundreds of
    /// thousands. Returns how many were built and the accepted ones.
    pub(super) fn configurations(
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
                (cap_list(&algo, Cap::CUBLASLT_ALGO_CAP_TILE_IDS), cap_list(&algo, Cap::CUBLASLT_ALGO_CAP_STAGES_IDS));
            if let Some(keep) = &near_stages {
                stages.retain(|s| keep.contains(s));
                if stages.is_empty() {
                    stages.clone_from(keep); // the algorithm lists none of them: the candidates' own
                }
            }
            let custom_max = cap_scalar(&algo, Cap::CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX).max(0);
            let swizzle_max = cap_scalar(&algo, Cap::CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT).clamp(0, 1);
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
