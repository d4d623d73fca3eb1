#!/usr/bin/env bash
# The large-model measurements on one GPU (issue "Large models on one GPU"), each part a
# few minutes, logs and metrics under $OUT (default large-out):
#
#   scripts/large-models.sh init      # 6.65B, first steps at the config's warmup lr: init schemes
#   scripts/large-models.sh offload   # 6.65B, batch 4 x 1024, grad_accum 4: optimizer on the GPU vs offloaded
#   scripts/large-models.sh largest   # 9.07B without offload, 10.3B with the optimizer offloaded: 10 steps
#
# Expects .carry/launcher and the real-text shards in .carry/text/shards (scripts/build-gpu.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-large-out}
BIN=${BIN:-.carry}
DATA=${DATA:-.carry/text/shards}
mkdir -p "$OUT"
run() { # name config steps extra...
    local name=$1 cfg=$2 steps=$3; shift 3
    "$BIN/launcher" --gpus 1 "$cfg" --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.every=0 \
        --set "data.path=\"$DATA\"" --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1 \
        || echo "run $name failed: $(tail -3 "$OUT/$name.log")"
}
summary() { # names...
    python3 - "$OUT" "$@" <<'PY'
import json, statistics, sys
out = sys.argv[1]
for name in sys.argv[2:]:
    try:
        recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        print(f"{name}: no metrics"); continue
    losses = " ".join(f"{r['loss']:.3f}" for r in recs)
    steady = recs[1:] or recs
    dt = statistics.median(r["step_time_s"] for r in steady)
    m = recs[-1]["memory"][0]
    dev = (m.get("device_used") or 0) / 2**30
    host = m.get("host")
    ho = m.get("host_optimizer")
    line = f"{name}: {len(recs)} steps, median step {dt:.3f} s, {recs[-1]['tokens'] / dt:.0f} tokens/s, driver {dev:.2f} GiB"
    if host:
        line += f", host {host['optimizer'] / 2**30:.2f} GiB optimizer + {host['params'] / 2**30:.2f} params + {host['staging'] / 2**30:.2f} staging"
    if ho:
        line += f", host AdamW {ho['seconds']:.3f} s for {ho['params'] / 1e9:.2f} G params on {ho['threads']} threads ({ho['params'] / ho['seconds'] / 1e9:.2f} G/s)"
    print(line)
    print(f"  losses: {losses}")
PY
}
case ${1:-} in
init)
    # The config's schedule (warmup from lr / warmup_steps) at the first steps, and the
    # same with lr 3e-4 (step-1 lr 1.5e-6) under both schemes.
    run init-config configs/gpt-7b.toml 8 --set train.micro_batch=1 --set train.grad_accum=1
    for s in gpt2 scaled; do
        run "init-$s" configs/gpt-7b.toml 4 --set train.micro_batch=1 --set train.grad_accum=1 --set "init.scheme=\"$s\"" \
            --set train.lr=3e-4 --set train.warmup_steps=100
    done
    summary init-config init-gpt2 init-scaled ;;
offload)
    A=(--set train.micro_batch=4 --set train.grad_accum=4)
    run gpu-7b-accum4 configs/gpt-7b.toml 4 "${A[@]}"
    run offload-7b-accum4 configs/gpt-7b.toml 4 "${A[@]}" --set offload.optimizer=true
    summary gpu-7b-accum4 offload-7b-accum4 ;;
largest)
    run largest-9b configs/gpt-9b.toml 10 --set train.grad_accum=1
    run largest-10b-offload configs/gpt-9b.toml 10 --set train.grad_accum=1 --set model.n_layer=50 \
        --set offload.optimizer=true
    summary largest-9b largest-10b-offload ;;
*) echo "usage: scripts/large-models.sh init|offload|largest"; exit 2 ;;
esac
