#!/usr/bin/env bash
# ZeRO-3's FP8 weight gathers (zero.fp8_gather) beside compute-precision gathers, on 2 GPUs
# in the same call (issue 26, item 2). Run on a 2-GPU machine:
#
#   scripts/bench-fp8-gather.sh      # expects .carry/launcher and .carry/gpu-kernels
#
# 1. the GPU test of the pack/unpack kernels against the CPU (gpu-kernels fp8_gather);
# 2. GPT-2 1.5B, MB15×1024 per rank (default 4), ZeRO-3 on 2 ranks: bf16; fp8 with bf16 gathers; fp8 with
#    FP8 gathers; STEPS (default 25) steps each, the same seed and data;
# 3. the Llama-3.2-1B shape, MBL×2048 per rank (default 2), ZeRO-3 on 2 ranks, fp8 with and without.
# Prints a table (median step time of the steps after the fifth, tokens/s per GPU, driver
# peak per rank, last loss). ONLY=REGEX picks rows.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench-fp8-gather-out}
mkdir -p "$OUT"
BIN=${BIN:-.carry}
STEPS=${STEPS:-25}
NGPU=${NGPU:-2}
wanted() { [[ -z ${ONLY:-} || $1 =~ $ONLY ]]; }
run() { # name config extra...
    local name=$1 cfg=$2; shift 2
    wanted "$name" || return 0
    timeout "${RUN_TIMEOUT:-100}" "$BIN/launcher" --gpus "$NGPU" "$cfg" --set train.eval_every=0 --set checkpoint.every=0 \
        --set train.steps="$STEPS" --set train.warmup_steps=5 --set zero.stage=3 \
        --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1 || echo "run $name failed: see $OUT/$name.log"
    tail -n 3 "$OUT/$name.log"
}
if wanted kernels; then
    "$BIN/gpu-kernels" --include-ignored --test-threads=1 fp8_gather > "$OUT/kernels.log" 2>&1 || echo "gpu-kernels fp8_gather failed"
    tail -n 30 "$OUT/kernels.log"
fi
B15=(configs/gpt2-1.5b.toml --set train.micro_batch="${MB15:-4}")
run 1.5b-fp8-bf16-gathers "${B15[@]}" --set 'train.precision="fp8"' --set zero.fp8_gather=false
run 1.5b-fp8-fp8-gathers "${B15[@]}" --set 'train.precision="fp8"' --set zero.fp8_gather=true
run 1.5b-bf16 "${B15[@]}" --set 'train.precision="bf16"'
L1=(configs/llama-3.2-1b.toml --set train.micro_batch="${MBL:-2}")
run llama1b-fp8-bf16-gathers "${L1[@]}" --set 'train.precision="fp8"' --set zero.fp8_gather=false
run llama1b-fp8-fp8-gathers "${L1[@]}" --set 'train.precision="fp8"' --set zero.fp8_gather=true
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
GiB = 2**30
print("| run (2 GPUs, ZeRO-3) | step ms | tokens/s per GPU | driver peak GiB per rank | last loss | vs bf16 gathers |")
print("|---|---|---|---|---|---|")
rows = {}
for f in sorted(glob.glob(f"{out}/*/metrics.jsonl")):
    name = f.split("/")[-2]
    recs = [json.loads(l) for l in open(f)]
    steady = recs[5:] or recs
    dt = statistics.median(r["step_time_s"] for r in steady)
    ranks = max(len(r["memory"]) for r in recs)
    dev = max((x.get("device_used", 0) or 0) for r in recs for x in r["memory"]) / GiB
    rows[name] = (dt * 1e3, recs[-1]["tokens"] / ranks / dt, dev, recs[-1]["loss"])
for name, (ms, tok, dev, loss) in rows.items():
    base = rows.get(name.replace("fp8-gathers", "bf16-gathers")) if name.endswith("fp8-fp8-gathers") else None
    vs = f"{base[0] / ms:.3f}x" if base else ""
    print(f"| {name} | {ms:.1f} | {tok/1e3:.2f}k | {dev:.2f} | {loss:.4f} | {vs} |")
PY
