//! The CPU backend: plain-Rust f32 reference implementation of every operation.
//!
//! This is the reference the CUDA kernels are checked against (as llm.c keeps
//! `train_gpt2.c` beside `train_gpt2.cu`), and the backend CPU ranks train with.
//! Every role (`Buf`, `Grad`, `F32`) is a `Vec<f32>`. One file per op group, each with
//! the reference functions and the group's trait implementation; this file holds the
//! backend type and the helpers they share.

mod activation;
mod adamw;
mod attention;
mod comm;
mod cross_entropy;
mod encoder;
mod fp8_gather;
mod graph;
mod layernorm;
mod matmul;
mod memory;
mod reduce;
mod transfer;

pub use activation::{gelu_backward, gelu_forward, swiglu_backward, swiglu_forward};
pub use adamw::adamw_segment;
pub use attention::{attention_backward, attention_forward, rope_rotate};
pub use comm::HostComm;
pub use cross_entropy::cross_entropy_forward_backward;
pub use encoder::{encoder_backward, encoder_forward};
pub use layernorm::{layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward, LN_EPS};
pub use matmul::{matmul_backward, matmul_forward};

use super::{BResult, BackendError, Device, ElemBytes, Loc};

/// The f32 CPU backend. Its only state is the FP8 layers' (`train.precision = "fp8"`: each
/// layer's input scale and cached weight, `matmul.rs`); matrixmultiply reads its thread
/// count from `MATMUL_NUM_THREADS` (the launcher divides the cores between ranks).
#[derive(Debug, Default, Clone)]
pub struct CpuBackend {
    fp8: std::cell::RefCell<matmul::Fp8State>,
}

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }
}

impl Device for CpuBackend {
    type Buf = Vec<f32>;
    type Grad = Vec<f32>;
    type F32 = Vec<f32>;
    type Tokens = Vec<u32>;

    fn name(&self) -> String {
        "cpu".into()
    }
    fn elem_bytes(&self) -> ElemBytes {
        ElemBytes { buf: 4, grad: 4, f32: 4 }
    }
    fn synchronize(&self) -> BResult<()> {
        Ok(())
    }
}

/// A zeroed host vector, or an out-of-memory error naming `what`.
fn alloc(n: usize, what: &str) -> BResult<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| BackendError::OutOfMemory {
        device: "host".into(),
        bytes: n * 4,
        what: what.to_string(),
    })?;
    v.resize(n, 0.0);
    Ok(v)
}

/// The slice of `buf` at `at`.
fn at(buf: &[f32], at: Loc) -> &[f32] {
    &buf[at.off..at.end()]
}

/// Two disjoint mutable views into one buffer (e.g. a weight's and a bias's gradient).
fn two_mut(buf: &mut [f32], a: Loc, b: Loc) -> (&mut [f32], &mut [f32]) {
    assert!(a.end() <= b.off || b.end() <= a.off, "overlapping tensors {a:?} {b:?}");
    if a.off < b.off {
        let (lo, hi) = buf.split_at_mut(b.off);
        (&mut lo[a.off..a.end()], &mut hi[..b.len])
    } else {
        let (lo, hi) = buf.split_at_mut(a.off);
        (&mut hi[..a.len], &mut lo[b.off..b.end()])
    }
}
