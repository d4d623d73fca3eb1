//! Compiling and loading the CUDA kernels: NVRTC turns each `.cu` file of this
//! directory (with `common.cuh` prepended, and the `#define`s its op module hands in)
//! into a CUBIN for the device's own
//! architecture, once, and the CUBIN is cached on disk keyed by a hash of the source,
//! the architecture, the options and the NVRTC version, so later start-ups skip NVRTC.
//!
//! CUBIN rather than PTX: a driver older than the NVRTC that wrote the PTX rejects it,
//! while a CUBIN for the exact architecture loads on any driver that knows the GPU.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};

use crate::backend::{BResult, BackendError};

const COMMON: &str = include_str!("common.cuh");

/// One kernel source file: registered by the op module beside it (`layernorm.rs` holds
/// `layernorm.cu`'s), so a kernel's launch code, its constants and its registration are
/// in one place.
pub(super) struct KernelFile {
    pub name: &'static str,
    pub src: &'static str,
    /// The `extern "C"` functions the file defines.
    pub functions: &'static [&'static str],
    /// Which of them take more than the default 48 KiB of dynamic shared memory.
    pub big_smem: fn(&str) -> bool,
    /// `#define`s handed to NVRTC (`-DNAME=VALUE`): constants the launch code and the
    /// kernel must agree on are defined once, in Rust, and passed in.
    pub defines: fn() -> Vec<(&'static str, String)>,
}

/// No function needs more than 48 KiB of dynamic shared memory.
pub(super) fn no_big_smem(_: &str) -> bool {
    false
}

/// No `#define`s from Rust.
pub(super) fn no_defines() -> Vec<(&'static str, String)> {
    Vec::new()
}

/// Every kernel file of the backend.
const FILES: &[&KernelFile] = &[
    &super::memory::KERNELS,
    &super::encoder::KERNELS,
    &super::layernorm::KERNELS,
    &super::matmul::KERNELS,
    &super::fp8::KERNELS,
    &super::attention::KERNELS,
    &super::attention::SIMT_KERNELS,
    &super::attention::MMA_KERNELS,
    &super::attention::WGMMA_KERNELS,
    &super::rope::KERNELS,
    &super::activation::KERNELS,
    &super::cross_entropy::KERNELS,
    &super::reduce::KERNELS,
    &super::adamw::KERNELS,
];

/// Every loaded kernel by name, and what went wrong with the ones that did not load.
pub(super) struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
    failed: HashMap<&'static str, String>,
    /// Largest dynamic shared memory a block may ask for (the device's opt-in limit).
    pub max_smem: usize,
    /// Built for sm_90a: the kernels that use wgmma are real (elsewhere they trap).
    pub wgmma: bool,
}

impl Kernels {
    /// The kernel `name`; an error carrying the compiler's log if its file failed.
    pub fn get(&self, name: &str) -> BResult<&CudaFunction> {
        if let Some(f) = self.functions.get(name) {
            return Ok(f);
        }
        match self.failed.get(name) {
            Some(why) => Err(BackendError::Device(format!("CUDA kernel `{name}` is unavailable: {why}"))),
            None => Err(BackendError::Device(format!("no CUDA kernel named `{name}` (a bug in the CUDA backend)"))),
        }
    }

    /// One line per source file that failed to compile or load (empty when all loaded).
    pub fn failures(&self) -> Vec<String> {
        let mut seen: Vec<String> = self.failed.values().cloned().collect();
        seen.sort();
        seen.dedup();
        seen
    }
}

/// Compile (or fetch from the cache) and load every kernel for `ctx`'s device.
pub(super) fn load_all(ctx: &Arc<CudaContext>) -> BResult<Kernels> {
    let (major, minor) =
        ctx.compute_capability().map_err(|e| BackendError::Device(format!("reading the compute capability: {e}")))?;
    // Hopper (compute capability 9.0) builds for sm_90a, which adds wgmma (the attention
    // forward's warpgroup MMAs); a CUBIN for sm_90a runs on exactly that architecture.
    let arch = if (major, minor) == (9, 0) { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
    let wgmma = arch == "sm_90a";
    let nvrtc = nvrtc_version();
    let max_smem =
        ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| BackendError::Device(format!("reading the shared-memory limit: {e}")))? as usize;
    let mut k = Kernels { functions: HashMap::new(), failed: HashMap::new(), max_smem, wgmma };
    for s in FILES {
        match load_source(ctx, s, &arch, &nvrtc) {
            Ok(funcs) => {
                for (name, f) in funcs {
                    if (s.big_smem)(name) {
                        // Leave room for the kernel's static shared memory.
                        let static_smem = f.shared_size_bytes().unwrap_or(0).max(0) as usize;
                        let allow = max_smem.saturating_sub(static_smem) as i32;
                        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, allow)
                            .map_err(|e| {
                            BackendError::Device(format!("raising the shared-memory limit of `{name}`: {e}"))
                        })?;
                    }
                    k.functions.insert(name, f);
                }
            }
            Err(why) => {
                for f in s.functions {
                    k.failed.insert(f, format!("{}.cu: {why}", s.name));
                }
            }
        }
    }
    Ok(k)
}

/// A kernel file's name and its CUBIN size, or NVRTC's log.
pub type CompileResult = (&'static str, Result<usize, String>);

/// Compile every kernel file for `arch` (e.g. `"sm_90"`) with NVRTC alone, no GPU or
/// driver needed: each file's name with its CUBIN size, or the compiler's log. `Err` when
/// libnvrtc cannot be loaded. For checking kernels on a machine without a GPU.
pub fn compile_all(arch: &str) -> Result<Vec<CompileResult>, String> {
    // SAFETY: only asks the dynamic loader whether the library opens.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(format!("libnvrtc is not loadable (tried {:?})", cudarc::get_lib_name_candidates("nvrtc")));
    }
    Ok(FILES
        .iter()
        .map(|s| {
            let full = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", s.name, s.src);
            (s.name, compile(&full, s.name, &options(arch, s)).map(|bin| bin.len()))
        })
        .collect())
}

fn nvrtc_version() -> String {
    let (mut a, mut b) = (0, 0);
    // SAFETY: writes two ints.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) };
    if r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        format!("{a}.{b}")
    } else {
        "unknown".into()
    }
}

fn options(arch: &str, s: &KernelFile) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-lineinfo".to_string()];
    for (name, value) in (s.defines)() {
        o.push(format!("-D{name}={value}"));
    }
    // The kernels include no CUDA header today; the path is there for ones that will.
    for dir in cuda_include_dirs() {
        o.push(format!("--include-path={dir}"));
    }
    o
}

fn cuda_include_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            dirs.push(format!("{d}/include"));
        }
    }
    dirs.push("/usr/local/cuda/include".into());
    dirs.into_iter().filter(|d| std::path::Path::new(d).is_dir()).collect()
}

fn load_source(
    ctx: &Arc<CudaContext>,
    s: &KernelFile,
    arch: &str,
    nvrtc: &str,
) -> Result<Vec<(&'static str, CudaFunction)>, String> {
    let full = format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", s.name, s.src);
    let opts = options(arch, s);
    let key = fnv1a(&[full.as_bytes(), arch.as_bytes(), opts.join(" ").as_bytes(), nvrtc.as_bytes()]);
    let cache = cache_dir().map(|d| d.join(format!("{}-{arch}-{key:016x}.cubin", s.name)));
    let cached = cache.as_ref().and_then(|p| std::fs::read(p).ok());
    let module = match cached.and_then(|bin| ctx.load_module(Ptx::from_binary(bin)).ok()) {
        Some(m) => m,
        None => {
            let bin = compile(&full, s.name, &opts)?;
            if let Some(p) = &cache {
                store(p, &bin);
            }
            ctx.load_module(Ptx::from_binary(bin)).map_err(|e| format!("loading the compiled module: {e}"))?
        }
    };
    s.functions
        .iter()
        .map(|&f| module.load_function(f).map(|func| (f, func)).map_err(|e| format!("function `{f}`: {e}")))
        .collect()
}

/// NVRTC to CUBIN; on failure the error is the compiler's log.
fn compile(src: &str, name: &str, opts: &[String]) -> Result<Vec<u8>, String> {
    let csrc = CString::new(src).map_err(|_| "kernel source contains a NUL byte".to_string())?;
    let cname = CString::new(format!("{name}.cu")).map_err(|_| "bad kernel name".to_string())?;
    let prog = nvrtc_result::create_program(&csrc, Some(&cname)).map_err(|e| format!("nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program until destroyed at the end of this block; the
    // buffers handed to NVRTC are sized by NVRTC's own size queries.
    unsafe {
        let out = match nvrtc_result::compile_program(prog, opts) {
            Ok(()) => {
                let mut n = 0usize;
                let r = nvrtc_sys::nvrtcGetCUBINSize(prog, &mut n);
                if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
                    Err(format!("nvrtcGetCUBINSize failed ({r:?})"))
                } else {
                    let mut buf = vec![0u8; n];
                    let r = nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _);
                    if r == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(buf)
                    } else {
                        Err(format!("nvrtcGetCUBIN failed ({r:?})"))
                    }
                }
            }
            Err(e) => {
                let log = nvrtc_result::get_program_log(prog)
                    .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(format!("NVRTC compile failed ({e:?}) with options {opts:?}:\n{log}"))
            }
        };
        let _ = nvrtc_result::destroy_program(prog);
        out
    }
}

/// `$SHARDTRAIN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/shardtrain/kernels`, else
/// `~/.cache/shardtrain/kernels`; none if no such directory can be made.
fn cache_dir() -> Option<PathBuf> {
    let dir = if let Ok(d) = std::env::var("SHARDTRAIN_KERNEL_CACHE") {
        PathBuf::from(d)
    } else if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        PathBuf::from(d).join("shardtrain").join("kernels")
    } else {
        PathBuf::from(std::env::var("HOME").ok()?).join(".cache").join("shardtrain").join("kernels")
    };
    std::fs::create_dir_all(&dir).ok()?;
    Some(dir)
}

/// Write through a temporary file and rename, so a concurrent reader (another rank
/// starting at the same time) never sees half a file. Failure only costs a recompile.
fn store(path: &std::path::Path, bin: &[u8]) {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bin).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// FNV-1a, 64 bit: a stable hash (std's hasher may change between Rust releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // Separate the parts so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
