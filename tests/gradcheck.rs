//! Finite-difference gradient check of the CPU reference: every parameter tensor of a tiny
//! GPT-2 and of tiny Llamas (tied and untied head, grouped-query attention, RoPE with
//! Llama 3.1 scaling, the LM head in several chunks), analytic gradient (backward) against
//! central differences of the loss.

use collectives::tcp::TcpComm;
use trainer::backend::cpu::{CpuBackend, HostComm};
use trainer::backend::RopeScaling;
use trainer::config::ModelConfig;
use trainer::model::{step_micro_loss, MicroBatch, ModelFamily, ModelLayout, ModelOptions};
use trainer::zero::{Engine, EngineOptions};

#[test]
fn every_gpt2_parameter_tensor_matches_finite_differences() {
    check(ModelConfig::gpt2(2, 2, 8, 11, 5), 0);
}

fn llama(tied: bool) -> ModelConfig {
    ModelConfig {
        family: ModelFamily::Llama,
        n_kv_head: Some(2),
        intermediate_size: Some(12),
        rope_theta: Some(500.0),
        rope_scaling: Some(RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        }),
        rms_norm_eps: Some(1e-5),
        tie_embeddings: Some(tied),
        // Head size 4, so RoPE rotates two pairs of dimensions per head.
        ..ModelConfig::gpt2(2, 4, 16, 11, 5)
    }
}

#[test]
fn every_llama_parameter_tensor_matches_finite_differences() {
    check(llama(false), 0);
    check(llama(true), 0);
    // The LM head and loss in chunks of 3 rows (10 rows: chunks of 3, 3, 3, 1).
    check(llama(false), 3);
}

fn check(cfg: ModelConfig, loss_chunk_rows: usize) {
    let be = CpuBackend::new();
    let mut comm = HostComm(TcpComm::local_group(1).expect("group").remove(0));
    let layout = ModelLayout::new(&cfg);
    let l2 = layout.clone();
    let mut init = |u, r| Ok(cfg.family.init_range(&l2, u, 7, Default::default(), r));
    let mut eng = Engine::new(&be, layout.clone(), EngineOptions::stage(0), 0, 1, Some(&mut init)).expect("engine");
    let b = 2;
    let opts = ModelOptions { loss_chunk_rows, ..ModelOptions::batch(b) };
    let mut model = cfg.family.build(&be, &layout, &opts, &mut eng.ledger).expect("model");
    let n = b * cfg.seq_len;
    let inputs: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 5 + 1) % 11).collect();
    let batch = MicroBatch::plain(&inputs, &targets);

    eng.begin_step(&be).expect("begin");
    step_micro_loss(model.as_mut(), &be, &mut eng, &mut comm, &batch, Some(1.0 / n as f32)).expect("fwd/bwd");
    let grads: Vec<Vec<f32>> = (0..eng.num_units()).map(|u| eng.local_grads_host(&be, u).expect("grads")).collect();
    let params: Vec<Vec<f32>> =
        (0..eng.num_units()).map(|u| eng.full_params_host(&be, &mut comm, u).expect("params")).collect();

    // Small against the 0.02 weight scale (truncation error), large against f32 loss rounding.
    let h = 1e-3f32;
    let mut checked = 0;
    for (u, unit) in layout.units.iter().enumerate() {
        for t in &unit.tensors {
            // A few spread-out elements plus the one with the largest gradient.
            let g = &grads[u][t.loc.off..t.loc.end()];
            let argmax = (0..g.len()).max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs())).expect("non-empty");
            let mut idx: Vec<usize> = (0..4).map(|k| k * g.len() / 4).collect();
            idx.push(argmax);
            for i in idx {
                let at = t.loc.off + i;
                let orig = params[u][at];
                eng.set_param(&be, u, at, orig + h).expect("set");
                let lp = step_micro_loss(model.as_mut(), &be, &mut eng, &mut comm, &batch, None).expect("fwd");
                eng.set_param(&be, u, at, orig - h).expect("set");
                let lm = step_micro_loss(model.as_mut(), &be, &mut eng, &mut comm, &batch, None).expect("fwd");
                eng.set_param(&be, u, at, orig).expect("set");
                let numeric = ((lp - lm) / (2.0 * h as f64)) as f32;
                let analytic = grads[u][at];
                let err = (numeric - analytic).abs();
                let tol = 1e-2 * numeric.abs().max(analytic.abs()) + 1e-4;
                assert!(err <= tol, "{}[{i}]: analytic {analytic:e} vs numeric {numeric:e}", t.name);
                checked += 1;
            }
            // The tensor's gradient must not be identically zero (it would hide a missing backward).
            assert!(g.iter().any(|&x| x != 0.0), "{} has an all-zero gradient", t.name);
        }
    }
    assert!(checked >= 5 * 14);
}
