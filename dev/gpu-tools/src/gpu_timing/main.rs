//! `gpu-timing`: the CUDA backend's per-op timing table (the median of event-timed
//! repeats) at a model's shapes, and the step time it adds up to. GPT-2 124M by default;
//! `GPU_CHECK_SHAPE="B,T,C,NH,V"` and `GPU_CHECK_LAYERS=L` time another model (e.g. 1.5B:
//! `8,1024,1600,25,50304` with 48 layers).
//!
//! `gpu-timing attention [T [B NH [NKV [DOC]]]]`: causal attention forward and backward at
//! every tensor-core head size (64, 80, 96, 128), B×NH query heads (default 4×16) of length T
//! (default 1024) sharing NKV key/value heads (grouped-query; default NKV = NH), in TFLOP/s,
//! the default kernels beside the mma.sync ones — the same shapes
//! `dev/sdpa_timing.py T B NH [NKV]` times with PyTorch's SDPA. Llama 3.2 1B:
//! `attention 2048 8 32 8` (its head size is 64), Llama 3.1 8B: `attention 4096 1 32 8` (128).
//! DOC: each call also within documents of DOC tokens (`data.document_mask`), with its
//! speed-up over the plain call (e.g. `attention 2048 8 32 8 512`).
//!
//! `gpu-timing gemm-algos [COUNT]`: the table, then every GEMM it ran timed again with each
//! of cuBLASLt's first COUNT (default 8) heuristic algorithms: is the heuristic's first
//! choice, the one the trainer uses, the fastest at these shapes?
//!
//! `gpu-timing layernorm`: the LayerNorm forward and backward alone at the three models'
//! row shapes, for before/after comparisons of those kernels.
//!
//! `gpu-timing llama [B [T]]`: the Llama ops — RMSNorm, SwiGLU, RoPE, forward and backward —
//! at Llama-3.2-1B's and Llama-3-8B's shapes, B×T rows (default 8×2048), in GB/s.
//!
//! `gpu-timing fp8 [B [T]]`: every linear layer of GPT-2 1.5B and Llama-3-8B, forward and
//! backward (both GEMMs, dW accumulated), in bf16 beside FP8 (`train.precision = "fp8"`:
//! the amax passes and casts included) twice: every operand cast at each use (ZeRO-3, or
//! `train.fp8_weight_cache = false`), and the training path of stages 0-2 (the weight cached,
//! the input's scale kept from forward to backward); then each one's casts alone and the
//! weight cache's fill; B×T rows (default 8×1024), and the layers' sums: how much faster
//! the blocks' GEMMs get. Then each layer as the model calls it, with the residual, GELU
//! and GELU' epilogues it fuses, in bf16 and FP8 (training path), naming each fused GEMM
//! cuBLASLt has no FP8 algorithm for (it then runs as the GEMM and a separate kernel). And
//! each layer's backward under the FP8 backward's other recipes (e4m3 dY, dW in bf16, both).
//!
//! `gpu-timing fp8-algos [COUNT [B [T]]]`: the `fp8` table (without the other recipes), each
//! layer's GEMMs, bf16 and FP8, then timed again with each of cuBLASLt's first COUNT (default
//! 32) heuristic algorithms: does timed tuning's eight miss a faster FP8 kernel?
//!
//! `gpu-timing fp8-search [CAP [B [T]]]`: the same layers, each FP8 GEMM then timed over
//! cuBLASLt's whole algorithm space (every algorithm id's tiles, stages, cluster shapes,
//! custom options and swizzles that `cublasLtMatmulAlgoCheck` accepts, at most CAP, default
//! 4000, timed briefly, the fastest five again): does a configuration the heuristic never
//! offers beat timed tuning's pick?

//!
//! Here: the subcommands. `timer.rs`: the event timer, its GEMM sweeps and the buffers the
//! tables time on; `table.rs`: the default per-op table and its step estimate;
//! `kernels.rs`: the attention, LayerNorm and Llama tables; `fp8.rs`: the FP8 tables.

mod fp8;
mod kernels;
mod table;
mod timer;

use std::process::ExitCode;
use std::time::Instant;

use fp8::fp8_timing;
use kernels::{attention_timing, layernorm_timing, llama_timing};
use table::timing;
use trainer::backend::cuda::CudaBackend;
use trainer::backend::Device;

fn main() -> ExitCode {
    let t0 = Instant::now();
    let be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            println!("CUDA backend unavailable: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "gpu-timing on {} ({} SMs); backend ready in {:.2} s",
        be.name(),
        be.sm_count(),
        t0.elapsed().as_secs_f64()
    );
    let args: Vec<String> = std::env::args().collect();
    let run = match args.get(1).map(String::as_str) {
        Some("attention") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            let nh = arg(4, 16);
            let doc = args.get(6).and_then(|v| v.parse().ok());
            attention_timing(&be, arg(2, 1024), arg(3, 4), nh, arg(5, nh), doc)
        }
        Some("layernorm") => layernorm_timing(&be),
        Some("llama") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            llama_timing(&be, arg(2, 8), arg(3, 2048))
        }
        Some("fp8") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(2, 8), arg(3, 1024), None, None)
        }
        Some("fp8-algos") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(3, 8), arg(4, 1024), Some(arg(2, 32)), None)
        }
        Some("fp8-search") => {
            let arg = |i: usize, default: usize| args.get(i).and_then(|v| v.parse().ok()).unwrap_or(default);
            fp8_timing(&be, arg(3, 8), arg(4, 1024), None, Some(arg(2, 4000)))
        }
        Some("gemm-algos") => timing(&be, Some(args.get(2).and_then(|v| v.parse().ok()).unwrap_or(8))),
        _ => timing(&be, None),
    };
    match run {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("timing failed: {e}");
            ExitCode::FAILURE
        }
    }
}
