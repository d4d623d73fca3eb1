#!/usr/bin/env bash
# Llama benchmarks: shardtrain and Hugging Face transformers' LlamaForCausalLM (the
# reference a user would otherwise run, ../shared/reference/llama_ref.py) on the same GPU,
# same shapes, same batch, in one call. Run on the GPU machine:
#
#   scripts/bench-llama.sh [1b|8b|all]   # expects .carry/launcher and .carry/llama_ref.py
#
# 1b: the Llama-3.2-1B shape at 8×2048 (ZeRO-1; one GPU has nothing to shard), beside HF
#     eager and HF + torch.compile. 8b: the Llama-3-8B shape at 1×4096 with activation
#     checkpointing (ZeRO-3), beside FSDP2 (one rank) with checkpointing; then the largest
#     micro-batch that fits, on the GPU and with the optimizer offloaded.
# ONLY=REGEX runs the matching rows. EXTRA="--set k=v ..." is added to every shardtrain row.
# Prints a Markdown table (tokens/s per GPU, MFU vs 989 TFLOP/s counted as llama_ref.py
# counts it, step time, peak memory) and writes raw logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
BIN=${BIN:-.carry}
WHAT=${1:-all}
STEPS=${STEPS:-20}
EXTRA=${EXTRA:-}

wanted() { [[ -z ${ONLY:-} || $1 =~ $ONLY ]]; }
ours() { # name config extra...
    local name=ours-$1 cfg=$2; shift 2
    wanted "$name" || return 0
    # shellcheck disable=SC2086
    "$BIN/launcher" --gpus 1 "$cfg" --set train.steps="$STEPS" --set train.warmup_steps=5 --set train.eval_every=0 \
        --set checkpoint.every=0 --set "output.dir=\"$OUT/$name\"" "$@" $EXTRA > "$OUT/$name.log" 2>&1 \
        || echo "run $name failed: see $OUT/$name.log"
}
ref() { # name args...
    local name=ref-$1; shift
    wanted "$name" || return 0
    python3 "$BIN/llama_ref.py" --tag "$name" "$@" > "$OUT/$name.log" 2>&1 || echo "reference $name failed: see $OUT/$name.log"
}
reffsdp() { # name args...
    local name=ref-$1; shift
    wanted "$name" || return 0
    torchrun --standalone --nproc_per_node=1 "$BIN/llama_ref.py" --mode fsdp --tag "$name" "$@" > "$OUT/$name.log" 2>&1 \
        || echo "reference $name failed: see $OUT/$name.log"
}

if [[ $WHAT == 1b || $WHAT == all ]]; then
    ours 1b-z1 configs/llama-3.2-1b.toml
    ours 1b-z1-timed configs/llama-3.2-1b.toml --set train.gemm_tuning='"timed"'
    ours 1b-z1-timed-keepact configs/llama-3.2-1b.toml --set train.gemm_tuning='"timed"' --set checkpointing.keep_gelu=true
    ref 1b-eager --size 1b --seq 2048 --batch 8
    ref 1b-compile --size 1b --seq 2048 --batch 8 --compile --warmup 8
fi
if [[ $WHAT == 8b || $WHAT == all ]]; then
    ours 8b-z3-ckpt configs/llama-3-8b.toml --set train.grad_accum=1
    ours 8b-z3-ckpt-timed configs/llama-3-8b.toml --set train.grad_accum=1 --set train.gemm_tuning='"timed"'
    ours 8b-z3-ckpt-keepattn configs/llama-3-8b.toml --set train.grad_accum=1 --set checkpointing.keep_attention=true
    # The largest micro-batch that fits an H200 (`launcher memory --max-batch`: 7), and the
    # same with the optimizer offloaded (in order: the delayed update's 134.6 GiB of host
    # memory does not fit this 128 GiB host).
    ours 8b-z3-ckpt-mb7 configs/llama-3-8b.toml --set train.grad_accum=1 --set train.micro_batch=7
    ours 8b-z3-ckpt-mb7-offload configs/llama-3-8b.toml --set train.grad_accum=1 --set train.micro_batch=7 \
        --set offload.optimizer=true
    reffsdp 8b-fsdp-ckpt --size 8b --ckpt --batch 1 --seq 4096
fi

python3 - "$OUT" <<'PY'
import glob, json, statistics, sys, tomllib
out = sys.argv[1]
GiB = 2**30

sys.path.insert(0, "scripts")
from multi_gpu_tables import model_flops_per_token as flops_per_token  # as llama_ref.py counts it

rows = []
for d in sorted(glob.glob(f"{out}/ours-*/metrics.jsonl")):
    name = d.split("/")[-2]
    m = tomllib.load(open(f"{out}/{name}/config.resolved.toml", "rb"))["model"]
    recs = [json.loads(l) for l in open(d)]
    steady = recs[5:] or recs
    dt = statistics.median(r["step_time_s"] for r in steady)
    tok = recs[-1]["tokens"] / dt
    peak = max(x.get("peak_total", 0) for r in recs for x in r["memory"]) / GiB
    dev = max((x.get("device_used", 0) or 0) for r in recs for x in r["memory"]) / GiB
    rows.append((name, tok, tok * flops_per_token(m) / 989e12, dt * 1e3, peak, dev, recs[-1]["loss"]))
for f in sorted(glob.glob(f"{out}/ref-*.log")):
    for line in open(f):
        if line.startswith("RESULT"):
            r = json.loads(line[7:])
            if r["rank"] == 0:
                rows.append((r["tag"], r["tok_s_rank"], r["mfu"], r["step_ms"], r["peak_alloc_GiB"], r["peak_reserved_GiB"], r["loss"]))
print("| run (1 GPU) | tokens/s | MFU | step ms | peak GiB (tracked / allocated) | device GiB (driver / reserved) | last loss |")
print("|---|---|---|---|---|---|---|")
for name, tok, mfu, ms, peak, dev, loss in rows:
    print(f"| {name} | {tok/1e3:.2f}k | {100*mfu:.1f}% | {ms:.1f} | {peak:.2f} | {dev:.2f} | {loss:.4f} |")
PY
