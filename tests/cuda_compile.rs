//! Every CUDA kernel file compiles with NVRTC for Hopper (sm_90a, what an H100/H200 gets,
//! and plain sm_90) and Ampere (sm_80),
//! without a GPU: only libnvrtc is needed. Ignored by default (most machines have no
//! libnvrtc); CI installs NVRTC from PyPI and runs it with `--include-ignored`, so a
//! kernel that does not compile fails CI instead of the first GPU run.

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs libnvrtc on the loader path (.ci/run installs it: see there)"]
fn every_kernel_file_compiles_with_nvrtc() {
    let mut failed = Vec::new();
    for arch in ["sm_90a", "sm_90", "sm_80"] {
        let results = trainer::backend::cuda::compile_all(arch).expect("libnvrtc must be loadable for this test");
        assert!(results.len() >= 9, "expected every kernel file, got {}", results.len());
        for (name, r) in results {
            match r {
                Ok(bytes) => {
                    assert!(bytes > 0, "{name}.cu for {arch}: empty CUBIN");
                    eprintln!("{arch} {name}.cu: {bytes} bytes of CUBIN");
                }
                Err(log) => failed.push(format!("{arch} {name}.cu:\n{log}")),
            }
        }
    }
    assert!(failed.is_empty(), "kernels failed to compile:\n{}", failed.join("\n"));
}
