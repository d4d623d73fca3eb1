//! The config's parsing, overrides and validation, each refusal naming its key.

use super::*;
use crate::backend::{Fp8GradFormat, Fp8WeightGrad, GemmTuning, Precision};
use std::path::{Path, PathBuf};

const BASE: &str = "[model]\nn_layer = 2\nn_head = 2\nn_embd = 8\nvocab_size = 11\nseq_len = 4\n";

fn load_str(text: &str, overrides: &[&str]) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("c.toml");
    std::fs::write(&p, text).expect("write");
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Config::load(&p, &o)
}

#[test]
fn minimal_config_gets_defaults() {
    let c = load_str(BASE, &[]).expect("valid");
    assert_eq!(c.zero.stage, 0);
    assert_eq!(c.checkpointing.activations, ActivationCheckpointing::None);
    assert_eq!(c.data.path, None);
}

#[test]
fn unknown_key_is_named() {
    let e = load_str(&format!("{BASE}[train]\nlearning_rate = 1.0\n"), &[]).unwrap_err().to_string();
    assert!(e.contains("learning_rate"), "{e}");
    let e = load_str(&format!("{BASE}[trian]\nlr = 1.0\n"), &[]).unwrap_err().to_string();
    assert!(e.contains("trian"), "{e}");
}

#[test]
fn wrong_type_is_named() {
    let e = load_str(&format!("{BASE}[train]\nsteps = \"ten\"\n"), &[]).unwrap_err().to_string();
    assert!(e.contains("steps") || e.contains("ten"), "{e}");
}

#[test]
fn impossible_values_name_key_and_fix() {
    let e = load_str(BASE, &["zero.stage=7"]).unwrap_err().to_string();
    assert!(e.contains("zero.stage") && e.contains("0 (data parallel)"), "{e}");
    let e = load_str(&BASE.replace("n_embd = 8", "n_embd = 9"), &[]).unwrap_err().to_string();
    assert!(e.contains("model.n_embd") && e.contains("multiple of model.n_head"), "{e}");
    let e = load_str(BASE, &["train.steps=0"]).unwrap_err().to_string();
    assert!(e.contains("train.steps") && e.contains("at least 1"), "{e}");
    let e = load_str(BASE, &["watchdog.timeout_s=-1"]).unwrap_err().to_string();
    assert!(e.contains("watchdog.timeout_s"), "{e}");
    assert_eq!(load_str(BASE, &[]).expect("valid").watchdog.timeout_s, 120.0);
    assert_eq!(load_str(BASE, &[]).expect("valid").watchdog.flight_records, 64);
    let e = load_str(BASE, &["checkpoint.async=true"]).unwrap_err().to_string();
    assert!(e.contains("checkpoint.async") && e.contains("checkpoint.every"), "{e}");
    let c = load_str(BASE, &["checkpoint.async=true", "checkpoint.every=5"]).expect("valid");
    assert!(c.checkpoint.async_save);
    let e = load_str(BASE, &["watchdog.flight_records=100000"]).unwrap_err().to_string();
    assert!(e.contains("watchdog.flight_records") && e.contains("16384"), "{e}");
    let e = load_str(BASE, &["train.micro_batch=0"]).unwrap_err().to_string();
    assert!(e.contains("train.micro_batch"), "{e}");
    let e = load_str(BASE, &["train.beta2=1.5"]).unwrap_err().to_string();
    assert!(e.contains("train.beta2"), "{e}");
    let e = load_str(BASE, &["train.min_lr=1.0", "train.lr=0.1"]).unwrap_err().to_string();
    assert!(e.contains("train.min_lr"), "{e}");
    let e = load_str(BASE, &["checkpointing.activations=0"]).unwrap_err().to_string();
    assert!(e.contains("positive integer"), "{e}");
    let e = load_str(BASE, &["checkpointing.activations=sometimes"]).unwrap_err().to_string();
    assert!(e.contains("every_layer"), "{e}");
}

#[test]
fn model_family_defaults_to_gpt2_and_unknown_ones_are_named() {
    assert_eq!(load_str(BASE, &[]).expect("valid").model.family, ModelFamily::Gpt2);
    let c = load_str(BASE, &["model.family=\"gpt2\""]).expect("valid");
    assert_eq!(c.model.family, ModelFamily::Gpt2);
    let e = load_str(BASE, &["model.family=\"gpt3\""]).unwrap_err().to_string();
    assert!(e.contains("unknown model.family \"gpt3\"") && e.contains("\"gpt2\", \"llama\""), "{e}");
}

#[test]
fn gemm_tuning_takes_its_three_values_and_names_a_wrong_one() {
    assert_eq!(load_str(BASE, &[]).expect("valid").train.gemm_tuning, GemmTuning::Timed);
    let c = load_str(BASE, &["train.gemm_tuning=\"heuristic\""]).expect("valid");
    assert_eq!(c.train.gemm_tuning, GemmTuning::Heuristic);
    let c = load_str(BASE, &["train.gemm_tuning=\"searched\""]).expect("valid");
    assert_eq!(c.train.gemm_tuning, GemmTuning::Searched);
    let c = load_str(BASE, &["train.gemm_tuning=\"searched\"", "train.gemm_tuning_from=\"runs/a\""]).expect("valid");
    assert_eq!(c.train.gemm_tuning_from, Some(PathBuf::from("runs/a")));
    let e = load_str(BASE, &["train.gemm_tuning=\"fast\""]).unwrap_err().to_string();
    assert!(
        e.contains("gemm_tuning") && e.contains("heuristic") && e.contains("timed") && e.contains("searched"),
        "{e}"
    );
    // Stored choices are timed ones: asking for them with the heuristic is a contradiction.
    let c = load_str(BASE, &["train.gemm_tuning_from=\"runs/a\""]).expect("valid");
    assert_eq!(c.train.gemm_tuning_from, Some(PathBuf::from("runs/a")));
    let e = load_str(BASE, &["train.gemm_tuning_from=\"runs/a\"", "train.gemm_tuning=\"heuristic\""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.gemm_tuning_from") && e.contains("\"timed\""), "{e}");
}

#[test]
fn keep_gelu_takes_true_false_or_auto() {
    assert_eq!(load_str(BASE, &[]).expect("valid").checkpointing.keep_gelu, KeepGelu::Auto);
    for (v, want) in [("true", KeepGelu::Keep), ("false", KeepGelu::Recompute), ("\"auto\"", KeepGelu::Auto)] {
        let c = load_str(BASE, &[&format!("checkpointing.keep_gelu={v}")]).expect("valid");
        assert_eq!(c.checkpointing.keep_gelu, want, "{v}");
        // The resolved config the ranks read says the same.
        let text = toml::to_string(&c).expect("toml");
        assert!(text.contains(&format!("keep_gelu = {v}")), "{text}");
        assert_eq!(Config::from_toml_str(&text, "resolved").expect("back").checkpointing.keep_gelu, want);
    }
    assert!(!KeepGelu::Auto.keeps() && KeepGelu::Keep.keeps() && !KeepGelu::Recompute.keeps());
    let e = load_str(BASE, &["checkpointing.keep_gelu=\"yes\""]).unwrap_err().to_string();
    assert!(e.contains("\"yes\"") && e.contains("\"auto\""), "{e}");
    // Auto with every block checkpointed is fine (it recomputes); true is refused.
    load_str(BASE, &["checkpointing.activations=\"every_layer\""]).expect("auto stays valid");
}

#[test]
fn precision_takes_bf16_or_fp8_and_names_a_wrong_one() {
    assert_eq!(load_str(BASE, &[]).expect("valid").train.precision, Precision::Bf16);
    let c = load_str(BASE, &["train.precision=\"fp8\""]).expect("valid");
    assert_eq!(c.train.precision, Precision::Fp8);
    let e = load_str(BASE, &["train.precision=\"fp4\""]).unwrap_err().to_string();
    assert!(e.contains("precision") && e.contains("bf16") && e.contains("fp8"), "{e}");
}

#[test]
fn the_fp8_recipe_is_summarised_for_the_launch_log() {
    assert_eq!(load_str(BASE, &[]).expect("valid").train.fp8_recipe_summary(), None);
    let c = load_str(BASE, &["train.precision=\"fp8\""]).expect("valid");
    let line = c.train.fp8_recipe_summary().expect("fp8");
    assert!(line.contains("e5m2 output gradients") && line.contains("weight gradient in FP8"), "{line}");
    let c = load_str(
        BASE,
        &["train.precision=\"fp8\"", "train.fp8_grad_format=\"e4m3\"", "train.fp8_weight_grad=\"bf16\""],
    )
    .expect("valid");
    let line = c.train.fp8_recipe_summary().expect("fp8");
    assert!(line.contains("e4m3 output gradients") && line.contains("weight gradient from the unquantized"), "{line}");
}

#[test]
fn fp8_bf16_layers_are_named_by_family_and_refused_outside_fp8() {
    let fp8 = "train.precision=\"fp8\"";
    let c = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"proj\", \"fc2\"]"]).expect("valid");
    assert_eq!(c.train.fp8_bf16_layers, ["proj", "fc2"]);
    assert_eq!(c.model.family.bf16_layers(&c.train.fp8_bf16_layers), [false, true, false, true]);
    let line = c.train.fp8_recipe_summary().expect("fp8");
    assert!(line.contains("kept in bf16: proj, fc2"), "{line}");
    // Llama's names are not GPT-2's: the error lists the family's.
    let e = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"o\"]"]).unwrap_err().to_string();
    assert!(e.contains("train.fp8_bf16_layers") && e.contains("\"o\"") && e.contains("\"proj\""), "{e}");
    let e = load_str(BASE, &[fp8, "train.fp8_bf16_layers=[\"fc\", \"fc\"]"]).unwrap_err().to_string();
    assert!(e.contains("listed twice"), "{e}");
    // In bf16 it would change nothing: refused, with what to do; empty is fine.
    let e = load_str(BASE, &["train.fp8_bf16_layers=[\"proj\"]"]).unwrap_err().to_string();
    assert!(e.contains("train.fp8_bf16_layers") && e.contains("train.precision"), "{e}");
    load_str(BASE, &["train.fp8_bf16_layers=[]"]).expect("valid");
}

#[test]
fn fp8_backward_recipe_keys_parse_and_are_refused_outside_fp8() {
    let fp8 = "train.precision=\"fp8\"";
    let c = load_str(BASE, &[fp8]).expect("valid");
    assert_eq!((c.train.fp8_grad_format, c.train.fp8_weight_grad), (Fp8GradFormat::E5m2, Fp8WeightGrad::Fp8));
    let c = load_str(BASE, &[fp8, "train.fp8_grad_format=\"e4m3\"", "train.fp8_weight_grad=\"bf16\""]).expect("valid");
    assert_eq!((c.train.fp8_grad_format, c.train.fp8_weight_grad), (Fp8GradFormat::E4m3, Fp8WeightGrad::Bf16));
    let e = load_str(BASE, &[fp8, "train.fp8_grad_format=\"e3m4\""]).unwrap_err().to_string();
    assert!(e.contains("fp8_grad_format") && e.contains("e5m2") && e.contains("e4m3"), "{e}");
    let e = load_str(BASE, &[fp8, "train.fp8_weight_grad=\"fp32\""]).unwrap_err().to_string();
    assert!(e.contains("fp8_weight_grad") && e.contains("bf16"), "{e}");
    // In bf16 they would change nothing: refused, named, with what to do.
    let e = load_str(BASE, &["train.fp8_grad_format=\"e4m3\""]).unwrap_err().to_string();
    assert!(e.contains("train.fp8_grad_format") && e.contains("train.precision"), "{e}");
    let e = load_str(BASE, &["train.fp8_weight_grad=\"bf16\""]).unwrap_err().to_string();
    assert!(e.contains("train.fp8_weight_grad") && e.contains("train.precision"), "{e}");
    // The defaults spelled out are fine in bf16.
    load_str(BASE, &["train.fp8_grad_format=\"e5m2\"", "train.fp8_weight_grad=\"fp8\""]).expect("valid");
}

/// Every config shipped in configs/ loads and validates.
#[test]
fn shipped_configs_load() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            Config::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 8, "only {n} configs found in {}", dir.display());
}

#[test]
fn keys_that_would_do_nothing_are_errors() {
    let e = load_str(BASE, &["zero.bucket_mb=25"]).unwrap_err().to_string();
    assert!(e.contains("zero.bucket_mb") && e.contains("removed"), "{e}");
    // offload.params is a ZeRO-3 feature on top of the host optimizer.
    let e = load_str(BASE, &["offload.params=true"]).unwrap_err().to_string();
    assert!(e.contains("offload.params") && e.contains("offload.optimizer = true"), "{e}");
    let e = load_str(BASE, &["offload.params=true", "offload.optimizer=true"]).unwrap_err().to_string();
    assert!(e.contains("offload.params") && e.contains("zero.stage = 3"), "{e}");
    load_str(BASE, &["offload.params=true", "offload.optimizer=true", "zero.stage=3"]).expect("valid");
    load_str(BASE, &["offload.params=true", "offload.optimizer=true", "zero.stage=3", "train.grad_accum=2"])
        .expect("parameter offload with gradient accumulation is valid");
    load_str(BASE, &["offload.optimizer=true", "offload.cpu_threads=4"]).expect("valid");
    // The delayed update is a schedule of the host optimizer, not of the host parameters.
    let e = load_str(BASE, &["offload.delayed_update=true"]).unwrap_err().to_string();
    assert!(e.contains("offload.delayed_update") && e.contains("offload.optimizer = true"), "{e}");
    let both = ["offload.delayed_update=true", "offload.optimizer=true", "offload.params=true", "zero.stage=3"];
    let e = load_str(BASE, &both).unwrap_err().to_string();
    assert!(e.contains("offload.delayed_update") && e.contains("offload.params"), "{e}");
    load_str(BASE, &["offload.delayed_update=true", "offload.optimizer=true"]).expect("valid");
}

#[test]
fn overrides_apply_and_bad_ones_are_explained() {
    let c = load_str(BASE, &["zero.stage=3", "train.lr=1e-4", "checkpointing.activations=every_layer", "data.path=/x"])
        .expect("valid");
    assert_eq!(c.zero.stage, 3);
    assert_eq!(c.train.lr, 1e-4);
    assert_eq!(c.checkpointing.activations, ActivationCheckpointing::EveryLayer);
    assert_eq!(c.data.path, Some(PathBuf::from("/x")));
    let e = load_str(BASE, &["checkpointing.keep_attention=true"]).unwrap_err().to_string();
    assert!(e.contains("checkpointing.keep_attention") && e.contains("checkpointing.activations"), "{e}");
    load_str(BASE, &["checkpointing.keep_attention=true", "checkpointing.activations=2"]).expect("valid");
    let e = load_str(BASE, &["checkpointing.keep_gelu=true", "checkpointing.activations=\"every_layer\""])
        .unwrap_err()
        .to_string();
    assert!(e.contains("checkpointing.keep_gelu") && e.contains("every block is"), "{e}");
    load_str(BASE, &["checkpointing.keep_gelu=true", "checkpointing.activations=2"]).expect("valid");
    load_str(BASE, &["checkpointing.keep_gelu=true"]).expect("valid");
    let c = load_str(BASE, &["checkpointing.activations=2"]).expect("valid");
    assert_eq!(c.checkpointing.activations, ActivationCheckpointing::Every(2));
    let e = load_str(BASE, &["zero.stage"]).unwrap_err().to_string();
    assert!(e.contains("section.key=value"), "{e}");
    let e = load_str(BASE, &["stage=3"]).unwrap_err().to_string();
    assert!(e.contains("section.key"), "{e}");
    let e = load_str(BASE, &["zero.nonsense=3"]).unwrap_err().to_string();
    assert!(e.contains("nonsense"), "{e}");
}

#[test]
fn missing_file_and_bad_toml_are_reported() {
    let e = Config::load(Path::new("/definitely/not/here.toml"), &[]).unwrap_err().to_string();
    assert!(e.contains("/definitely/not/here.toml"), "{e}");
    let e = load_str("[model\n", &[]).unwrap_err().to_string();
    assert!(e.contains("c.toml"), "{e}");
}

#[test]
fn shapes_beyond_any_machine_are_refused_naming_the_key() {
    let cases: [(&[&str], &str); 4] = [
        (&["model.n_layer=100000"], "model.n_layer"),
        (&["model.n_embd=230000", "model.n_head=1000", "model.n_layer=2000"], "1.270e15 parameters"),
        (&["model.n_embd=18446744073709551615", "model.n_head=1"], "model.n_embd"),
        (&["train.micro_batch=4000000000"], "train.micro_batch"),
    ];
    for (set, needle) in cases {
        let e = load_str(BASE, set).unwrap_err().to_string();
        assert!(e.contains(needle), "{set:?}: {e}");
    }
    let e = load_str(BASE, &["model.seq_len=100000000", "train.micro_batch=1"]).unwrap_err().to_string();
    assert!(e.contains("model.seq_len") && e.contains("activation values"), "{e}");
    // The largest shipped config is far inside every bound.
    load_str(BASE, &["model.n_layer=59", "model.n_head=72", "model.n_embd=9216", "model.vocab_size=50304"])
        .expect("60B");
}

#[test]
fn checkpoint_policy_selects_blocks() {
    assert!(!ActivationCheckpointing::None.is_checkpointed(0));
    assert!(ActivationCheckpointing::EveryLayer.is_checkpointed(3));
    let e2 = ActivationCheckpointing::Every(2);
    assert!(e2.is_checkpointed(0) && !e2.is_checkpointed(1) && e2.is_checkpointed(2));
}
