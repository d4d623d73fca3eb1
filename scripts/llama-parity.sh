#!/usr/bin/env bash
# Llama checkpoints in and out against Hugging Face transformers, on a GPU machine:
#
#   scripts/llama-parity.sh        # expects .carry/launcher, .carry/llama_parity.py, .carry/text/shards
#
# 1. transformers makes a random LlamaForCausalLM (GQA, Llama 3.1 RoPE scaling, untied head,
#    norms not 1) and save_pretrained's it; shardtrain imports the folder with the config's
#    [model] left out, and `launcher eval` (CPU f32 and GPU bf16) must give transformers' loss
#    on the same validation windows (CPU: rel <= 1e-4; GPU: rel <= 2e-3).
# 2. shardtrain trains it STEPS steps on real text (ZeRO-3, the import read by range), saves,
#    exports a folder; transformers loads it and must give the loss `launcher eval` gives the
#    checkpoint (rel <= 2e-3). The training loss must fall.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-parity-out}
BIN=${BIN:-.carry}
DATA=${DATA:-.carry/text/shards}
STEPS=${STEPS:-300}
T=512
W=${W:-16}
D="$OUT/parity"
mkdir -p "$D"
py() { python3 "$BIN/llama_parity.py" "$@"; }
L="$BIN/launcher"

py make "$D/hf-init" || exit 1
cat > "$D/cfg.toml" <<TOML
# The model comes from train.init_from's config.json; only the context to train is given.
[model]
seq_len = $T

[train]
init_from = "$D/hf-init"
micro_batch = 8
steps = $STEPS
lr = 3e-4
min_lr = 3e-5
warmup_steps = 20
eval_every = 100
eval_batches = 8

[zero]
stage = 3

[checkpoint]
every = $STEPS

[data]
path = "$DATA"

[output]
dir = "$D/run"
TOML
ev() { "$L" eval "$D/cfg.toml" --windows "$W" --json "$@" | tail -1; }
cpu=$(ev --device cpu) || echo "eval on CPU failed"
gpu=$(ev --device gpu) || echo "eval on GPU failed"
hf=$(py loss "$D/hf-init" "$DATA" --seq $T --windows "$W") || echo "transformers failed"
"$L" --gpus 1 "$D/cfg.toml" > "$D/train.log" 2>&1 || { echo "training failed"; tail -20 "$D/train.log"; }
ck="$D/run/checkpoints/step_$(printf %08d "$STEPS")"
after=$(ev --device gpu --checkpoint "$ck") || echo "eval of the checkpoint failed"
"$L" export "$ck" "$D/hf-after" > "$D/export.log" 2>&1 || { echo "export failed"; cat "$D/export.log"; }
hf_after=$(py loss "$D/hf-after" "$DATA" --seq $T --windows "$W") || echo "transformers (after) failed"
python3 - "$cpu" "$gpu" "$hf" "$after" "$hf_after" "$D/run/metrics.jsonl" <<'PY'
import json, sys
cpu, gpu, hf, after, hf_after = (json.loads(s) if s else {} for s in sys.argv[1:6])
recs = [json.loads(l) for l in open(sys.argv[6])]
rel = lambda a, b: abs(a - b) / abs(b)
ok = True
def row(what, ours, theirs, tol):
    global ok
    r = rel(ours, theirs)
    ok &= r <= tol
    print(f"| {what} | {ours:.6f} | {theirs:.6f} | {r:.2e} | {'ok' if r <= tol else 'FAIL'} (<= {tol:g}) |")
print("| check | shardtrain | transformers | rel. difference | |")
print("|---|---|---|---|---|")
row("imported, eval on CPU (f32) vs transformers fp32", cpu["loss"], hf["fp32"], 1e-4)
row("imported, eval on GPU (bf16) vs transformers fp32", gpu["loss"], hf["fp32"], 2e-3)
row(f"after {recs[-1]['step']} steps: eval of the checkpoint (GPU) vs the exported folder in transformers fp32", after["loss"], hf_after["fp32"], 2e-3)
first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-10:]) / min(10, len(recs))
vals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
print(f"training loss {first:.3f} -> {last:.3f} (mean of the last 10 steps); validation {vals}")
ok &= last < first - 1.0
print("LLAMA PARITY PASSED" if ok else "LLAMA PARITY FAILED")
sys.exit(0 if ok else 1)
PY
