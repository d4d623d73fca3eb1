#!/usr/bin/env bash
# Optimizer offload with and without the delayed update beside the on-GPU step (issue 9):
# a 5.0B GPT (configs/gpt-7b.toml at 24 layers), batch 4x1024, grad_accum 4 (16k tokens per
# step). BENCHMARKS.md run 7 ran these three with a 100 s limit each; the delayed run logged
# no step within it, so every run here prints the elapsed time, the rank's last log line and
# host/GPU memory every 10 s. Expects .carry/ from scripts/build-gpu.sh.
#   OUT=out LIMIT=200 scripts/offload-delayed.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-offload-delayed-out}
mkdir -p "$OUT"
A=(--set model.n_layer=24 --set train.micro_batch=4 --set train.grad_accum=4 --set train.eval_every=0
    --set checkpoint.every=0 --set 'data.path=".carry/text/shards"')
run() { # name steps extra...
    local name=$1 steps=$2 t0=$SECONDS
    shift 2
    timeout "${LIMIT:-200}" .carry/launcher --gpus 1 configs/gpt-7b.toml "${A[@]}" --set train.steps="$steps" \
        --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1 &
    local pid=$!
    while kill -0 $pid 2>/dev/null; do
        sleep 10
        echo "$name t=$((SECONDS - t0)) s: $(tail -1 "$OUT/$name/logs/rank0.log" 2>/dev/null | cut -c1-100)" \
            "| host used $(free -g | awk '/Mem/{print $3}') GiB | GPU $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
    done
    wait $pid
    echo "$name exit $? after $((SECONDS - t0)) s"
}
run delayed 8 --set offload.optimizer=true --set offload.delayed_update=true --set offload.delayed_update_after=1
run gpu 5
run inorder 5 --set offload.optimizer=true
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
for name in ["gpu", "inorder", "delayed"]:
    try:
        recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    except OSError:
        print(f"{name}: no metrics"); continue
    steady = (recs[2:] if name == "delayed" else recs[1:]) or recs  # delayed from step 2
    dt = statistics.median(r["step_time_s"] for r in steady)
    m = recs[-1]["memory"][0]
    ho = [r["memory"][0].get("host_optimizer") for r in recs]
    ho = [h for h in ho if h and h["seconds"] > 0]
    hs = f", host AdamW {statistics.median(h['seconds'] for h in ho):.3f} s per update" if ho else ""
    print(f"{name}: median step {dt:.3f} s, {recs[-1]['tokens'] / dt:.0f} tok/s, "
          f"driver {(m.get('device_used') or 0) / 2**30:.2f} GiB, host {m.get('host')}{hs}")
    print("  step times", [round(r["step_time_s"], 3) for r in recs])
    print("  losses", " ".join(f"{r['loss']:.4f}" for r in recs))
PY
