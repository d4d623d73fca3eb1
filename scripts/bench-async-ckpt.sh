#!/usr/bin/env bash
# The step-time stall of an asynchronous checkpoint (checkpoint.async = true) against a
# synchronous one, on one GPU (issue 27, item 4). Run on the GPU machine:
#
#   scripts/bench-async-ckpt.sh        # expects .carry/launcher (scripts/build-gpu.sh)
#
# 0. Correctness on the GPU: a small model saved synchronously and asynchronously at steps 3
#    and 6 must give byte-identical shard files (the copy is queued on the copy stream: if it
#    were not ordered after the step's update, or the next update not after it, they differ).
# 1. GPT-2 1.5B (configs/gpt2-1.5b.toml, 18.6 GB of checkpoint): saves at step 4 (mid-run:
#    training goes on while it is written) and at step 8 (the end), keep = 1.
# 2. A 2.65B GPT (32 layers, d 2560, 20 heads; 31.8 GB of checkpoint), one save at its last
#    step: the largest that fits. The 6.65B config's checkpoint (fp32 master + m + v = 80 GB)
#    does not fit the 64 GiB disk, and two 2.65B checkpoints (a mid-run one and the final one,
#    both on disk until the second is complete) would not either.
#
# Each row: the stall (metrics.jsonl's checkpoint_stall_s: how long the step boundary was
# blocked), of it the wait for the previous save, the median step time of steps without a save,
# the step right after a mid-run save, the end-of-training wait for a background save (rank
# log), and the run's wall time. Checkpoints go to local disk under /tmp and are deleted after
# each run; a model is skipped when the disk lacks room for it. About 5-6 minutes on an H100.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench-async-out}
BIN=${BIN:-.carry}
TMP=${TMP_CKPT:-/tmp/shardtrain-async-bench}
mkdir -p "$OUT"
rm -rf "$TMP"
mkdir -p "$TMP"
fail=0

free_gb() { df -B1G --output=avail "$TMP" | tail -1 | tr -d ' '; }
run() { # name config extra...: one run on one GPU, its checkpoint dir on local disk, deleted after
    local name=$1 cfg=$2; shift 2
    local t0=$SECONDS
    "$BIN/launcher" --gpus 1 "$cfg" --set zero.stage=1 --set train.eval_every=0 --set train.warmup_steps=2 \
        --set checkpoint.keep=1 --set "output.dir=\"$TMP/$name\"" --set "checkpoint.dir=\"$TMP/$name-ck\"" \
        "$@" > "$OUT/$name.log" 2>&1 || { echo "FAIL: $name (see $OUT/$name.log)"; tail -5 "$OUT/$name.log"; fail=1; }
    echo "$((SECONDS - t0))" > "$OUT/$name.wall"
    cp "$TMP/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
    cp "$TMP/$name/logs/rank0.log" "$OUT/$name.rank0.log" 2>/dev/null
}
clean() { rm -rf "$TMP/$1" "$TMP/$1-ck"; }

# 0. Byte-identical files from both paths on the GPU.
SMALL=(--set model.n_layer=4 --set model.n_head=4 --set model.n_embd=256 --set model.seq_len=256
       --set train.micro_batch=4 --set train.steps=6 --set checkpoint.every=3 --set checkpoint.keep=2)
run check-sync configs/gpt2-124m.toml "${SMALL[@]}"
run check-async configs/gpt2-124m.toml "${SMALL[@]}" --set checkpoint.async=true
for step in 00000003 00000006; do
    f="step_$step/rank00000.safetensors"
    if cmp -s "$TMP/check-sync-ck/$f" "$TMP/check-async-ck/$f"; then
        echo "ok: $f byte-identical (synchronous vs asynchronous save)"
    else
        echo "FAIL: $f differs between the synchronous and the asynchronous save"
        fail=1
    fi
done
clean check-sync
clean check-async

# 1 and 2: the stall at scale.
ROWS=()
bench() { # label ckpt_gb saves config extra...
    local label=$1 gb=$2 saves=$3 cfg=$4; shift 4
    local need=$((gb * saves + gb / 4 + 2)) have
    have=$(free_gb)
    if ((have < need)); then
        echo "skipped $label: $have GiB free under $TMP, it needs about $need"
        fail=1
        return
    fi
    for mode in sync async; do
        local name="$label-$mode"
        run "$name" "$cfg" "$@" --set checkpoint.async=$([[ $mode == async ]] && echo true || echo false)
        clean "$name"
        ROWS+=("$name")
    done
}
bench 1.5b 19 2 configs/gpt2-1.5b.toml --set train.micro_batch=8 --set train.steps=8 --set checkpoint.every=4
bench 2.65b 32 1 configs/gpt-7b.toml --set model.n_layer=32 --set model.n_embd=2560 --set model.n_head=20 \
    --set train.micro_batch=4 --set train.grad_accum=1 --set train.steps=6 --set checkpoint.every=6
rm -rf "$TMP"

python3 - "$OUT" "${ROWS[@]}" <<'EOF'
import json, os, re, statistics, sys
out, rows = sys.argv[1], sys.argv[2:]
print("| run | GB saved | save at step | stall s | of it waiting s | median step s | step after save s | end wait s | wall s |")
print("|---|---|---|---|---|---|---|---|---|")
def read(path):
    return open(path).read() if os.path.exists(path) else ""
for name in rows:
    text = read(f"{out}/{name}.metrics.jsonl")
    if not text:
        print(f"| {name} | no metrics: see {name}.log | | | | | | | |")
        continue
    lines = [json.loads(l) for l in text.splitlines()]
    waits = [float(x) for x in re.findall(r"waited ([0-9.]+) s for the background save", read(f"{out}/{name}.rank0.log"))]
    wall = read(f"{out}/{name}.wall").strip()
    # The first step warms up (allocations, GEMM choices): left out of the median.
    plain = [l["step_time_s"] for l in lines[1:] if "checkpoint_stall_s" not in l]
    med = f"{statistics.median(plain):.3f}" if plain else "-"
    steps = {l["step"]: l for l in lines}
    for l in lines:
        if "checkpoint_stall_s" not in l:
            continue
        after = steps.get(l["step"] + 1)
        after = f"{after['step_time_s']:.3f}" if after else "(last step)"
        print(f"| {name} | {l['checkpoint_bytes'] / 1e9:.1f} | {l['step']} | {l['checkpoint_stall_s']:.3f} | "
              f"{l['checkpoint_waited_s']:.3f} | {med} | {after} | {sum(waits):.2f} | {wall} |")
EOF
exit $fail
