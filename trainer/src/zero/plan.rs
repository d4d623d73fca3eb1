//! Memory prediction before launch: run one optimizer step of the real engine and model
//! on the [meta backend](crate::backend::meta), so the per-rank report (by category, and
//! at peak) is exactly what the ledger will record in the real run.

use super::{Engine, EngineOptions, MemoryReport};
use crate::backend::fp8::{cpu_reserved, CudaFp8WeightCache};
use crate::backend::meta::{MetaBackend, MetaComm};
use crate::backend::{AttnShape, ElemBytes, Fp8Bytes, Fp8Layers};
use crate::config::Config;
use crate::model::{step_micro, MicroBatch, ModelLayout, ModelOptions};
use crate::optim::Hyper;
use crate::TrainError;

/// Element sizes, attention state and FP8 reservations of the backend being planned for.
#[derive(Debug, Clone, Copy)]
pub struct DeviceModel {
    pub sizes: ElemBytes,
    pub attention_saved: fn(AttnShape) -> usize,
    /// Bytes `MatmulOps::prepare_fp8` reserves for a model's FP8 layers.
    pub fp8: fn(&Fp8Layers) -> Fp8Bytes,
}

impl DeviceModel {
    /// The f32 CPU backend (saves the full softmax: B·NH·T·T; quantizes FP8 operands into
    /// per-call scratch, keeping an input scale per layer and, cached, the dequantized
    /// weights: [`cpu_reserved`]).
    pub fn cpu() -> DeviceModel {
        DeviceModel {
            sizes: ElemBytes { buf: 4, grad: 4, f32: 4 },
            attention_saved: |s| s.b * s.nh * s.t * s.t,
            fp8: cpu_reserved,
        }
    }

    /// The CUDA backend: bf16 compute buffers, fp32 gradients, flash attention saving
    /// one fp32 log-sum-exp per (batch, head, position), the FP8 operands' workspace and
    /// the cached FP8 weights ([`CudaFp8WeightCache::reserved`]).
    pub fn cuda() -> DeviceModel {
        DeviceModel {
            sizes: ElemBytes { buf: 2, grad: 4, f32: 4 },
            attention_saved: |s| s.b * s.nh * s.t,
            fp8: CudaFp8WeightCache::reserved,
        }
    }
}

/// Predicted memory of rank `rank` of `world` after one full training step.
pub fn predict(cfg: &Config, world: usize, rank: usize, device: DeviceModel) -> Result<MemoryReport, TrainError> {
    Ok(dry_run(cfg, world, rank, device, 1)?.0)
}

/// Run `steps` optimizer steps on the meta backend; the memory report and the number of
/// buffers allocated after each step (equal after the first: the steady state allocates nothing).
pub fn dry_run(
    cfg: &Config,
    world: usize,
    rank: usize,
    device: DeviceModel,
    steps: usize,
) -> Result<(MemoryReport, Vec<usize>), TrainError> {
    let be = MetaBackend::new(device.sizes, device.attention_saved, device.fp8);
    let mut comm = MetaComm { rank, world };
    let layout = ModelLayout::new(&cfg.model);
    // No initial values: the meta backend holds none, and making them would cost host
    // memory and time that grow with the model.
    let mut eng = Engine::new(&be, layout, EngineOptions::from_config(cfg), rank, world, None)?;
    let opts = ModelOptions::from_config(cfg);
    let mut model = cfg.model.family.build(&be, &eng.layout, &opts, &mut eng.ledger)?;
    let n = cfg.train.micro_batch * cfg.model.seq_len;
    let toks = vec![0u32; n];
    // Zeros are valid document starts too (one document per sequence): the meta backend
    // reads no values, only what is allocated and uploaded.
    let batch = MicroBatch { inputs: &toks, targets: &toks, docs: cfg.data.document_mask.then_some(&toks[..]) };
    let h = Hyper { lr: 0.0, weight_decay: 0.0, beta1: 0.9, beta2: 0.95, eps: 1e-8, grad_clip: 0.0 };
    let mut allocs = Vec::with_capacity(steps);
    // The first, a middle and the last micro-step are every kind there is (the middle ones
    // all do the same), so at most three are run: planning takes no longer with a large
    // train.grad_accum (tests/memory.rs compares five against a real run).
    let micro_steps = cfg.train.grad_accum.min(3);
    for t in 1..=steps {
        eng.begin_step(&be)?;
        for _ in 0..micro_steps {
            step_micro(model.as_mut(), &be, &mut eng, &mut comm, &batch, Some(1.0))?;
        }
        eng.step(&be, &mut comm, h, t as u64)?;
        allocs.push(be.allocations.get());
    }
    Ok((eng.memory(), allocs))
}
