#!/usr/bin/env bash
# Benchmarks: shardtrain and the PyTorch FSDP2/DDP reference on the same GPUs, same model,
# same batch, in the same call (so both see the same machine). Run on the GPU machine:
#
#   scripts/bench.sh [124m|1.5b|7b|all]   # expects .carry/launcher and .carry/fsdp_gpt2.py
#
# PyTorch runs eager and torch.compile: on one GPU `--mode single` (autocast), on several
# FSDP2 (and DDP at 124M). OLD=path/to/launcher also runs that binary on every shardtrain
# row (rows named old-*), for before/after comparisons in one call. Plain rows run the
# defaults: since issue 26 those are train.gemm_tuning = "timed" and checkpointing.keep_gelu =
# "auto" (kept where it fits); rows ending in -timed set "timed" explicitly (the defaults'
# tuning, and the old binary's way to it); they run the new binary only.
# scripts/check-fast-defaults.sh compares the defaults with the old flags. ONLY=REGEX runs only the rows whose name matches (e.g.
# ONLY='z3|fsdp' for the ZeRO-3 rows and FSDP2 beside them), to fit a call's time limit.
# Prints a Markdown table (tokens/s per GPU, MFU vs 989 TFLOP/s bf16 dense, step time,
# peak memory per rank) and writes raw logs to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
BIN=${BIN:-.carry}
WHAT=${1:-all}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-30}

wanted() { [[ -z ${ONLY:-} || $1 =~ $ONLY ]]; }
run_ours() { # launcher name config stage batch extra...
    local exe=$1 name=$2 cfg=$3 stage=$4 batch=$5; shift 5
    wanted "$name" || return 0
    "$exe" --gpus "$NGPU" "$cfg" --set zero.stage="$stage" --set train.micro_batch="$batch" \
        --set train.steps="$STEPS" --set train.warmup_steps=5 --set train.eval_every=0 --set checkpoint.every=0 \
        --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1 || echo "run $name failed: see $OUT/$name.log"
}
ours() { # name config stage batch extra...
    local name=$1; shift
    run_ours "$BIN/launcher" "ours-${name#ours-}" "$@"
    if [[ -n ${OLD:-} ]]; then run_ours "$OLD" "old-${name#ours-}" "$@"; fi
}
timed() { # name config stage batch extra...: the new binary with timed GEMM tuning
    local name=$1; shift
    run_ours "$BIN/launcher" "ours-${name}-timed" "$@" --set train.gemm_tuning='"timed"'
}
ref() { # name mode layers embd heads batch extra...
    local name=$1 mode=$2 l=$3 c=$4 h=$5 b=$6; shift 6
    wanted "$name" || return 0
    torchrun --standalone --nproc_per_node="$NGPU" "$BIN/fsdp_gpt2.py" --mode "$mode" --layers "$l" --embd "$c" \
        --heads "$h" --batch "$b" --steps 20 --tag "$name" "$@" > "$OUT/$name.log" 2>&1 || echo "reference $name failed"
}

# PyTorch in eager mode and compiled: `single` (autocast) on one GPU, FSDP2 on several.
refs() { # name layers embd heads batch extra...
    local name=$1; shift
    if [[ $NGPU == 1 ]]; then
        ref "ref-$name-eager" single "$@"
        ref "ref-$name-compile" single "$@" --compile --warmup 8
    else
        ref "ref-$name-fsdp" fsdp "$@"
        ref "ref-$name-fsdp-compile" fsdp "$@" --compile --warmup 8
    fi
}
if [[ $WHAT == 124m || $WHAT == all ]]; then
    ours 124m-z1 configs/gpt2-124m.toml 1 16
    ours 124m-z3 configs/gpt2-124m.toml 3 16
    timed 124m-z1 configs/gpt2-124m.toml 1 16
    timed 124m-z3 configs/gpt2-124m.toml 3 16
    timed 124m-z1-keepgelu configs/gpt2-124m.toml 1 16 --set checkpointing.keep_gelu=true
    # Several GPUs: the same ZeRO-3 run with the step not recorded (collectives eager).
    [[ $NGPU == 1 ]] || ours 124m-z3-eager configs/gpt2-124m.toml 3 16 --set train.cuda_graphs=false
    refs 124m 12 768 12 16
    [[ $NGPU == 1 ]] || ref ref-124m-ddp ddp 12 768 12 16
fi
if [[ $WHAT == 1.5b || $WHAT == all ]]; then
    ours 1.5b-z1 configs/gpt2-1.5b.toml 1 8
    timed 1.5b-z1 configs/gpt2-1.5b.toml 1 8
    ours 1.5b-z3 configs/gpt2-1.5b.toml 3 8
    timed 1.5b-z3 configs/gpt2-1.5b.toml 3 8
    timed 1.5b-z1-keepgelu configs/gpt2-1.5b.toml 1 8 --set checkpointing.keep_gelu=true
    timed 1.5b-z3-keepgelu configs/gpt2-1.5b.toml 3 8 --set checkpointing.keep_gelu=true
    ours 1.5b-z3-ckpt configs/gpt2-1.5b.toml 3 8 --set checkpointing.activations='"every_layer"'
    [[ $NGPU == 1 ]] || ours 1.5b-z3-eager configs/gpt2-1.5b.toml 3 8 --set train.cuda_graphs=false
    refs 1.5b 48 1600 25 8
    [[ $NGPU == 1 ]] || ref ref-1.5b-fsdp-ckpt fsdp 48 1600 25 8 --ckpt
fi
if [[ $WHAT == 7b ]]; then
    ours 7b-z3-ckpt configs/gpt-7b.toml 3 4 --set train.grad_accum=1 --set checkpointing.activations='"every_layer"'
    ours 7b-z3-ckpt-keepattn configs/gpt-7b.toml 3 4 --set train.grad_accum=1 --set checkpointing.activations='"every_layer"' \
        --set checkpointing.keep_attention=true
    timed 7b-z3-ckpt-keepattn configs/gpt-7b.toml 3 4 --set train.grad_accum=1 --set checkpointing.activations='"every_layer"' \
        --set checkpointing.keep_attention=true
    # One GPU with room for ZeRO-1's persistent bf16 weights (115.5 GiB on an H200, `launcher
    # memory`): no per-step cast of every block's master weights (ZeRO-3 casts twice a step).
    timed 7b-z1-ckpt-keepattn configs/gpt-7b.toml 1 4 --set train.grad_accum=1 --set checkpointing.activations='"every_layer"' \
        --set checkpointing.keep_attention=true
    ref ref-7b-fsdp-ckpt fsdp 32 4096 32 4 --ckpt
fi

python3 - "$OUT" "$NGPU" <<'PY'
import json, glob, os, statistics, sys
sys.path.insert(0, "scripts")
from multi_gpu_tables import flops_per_token as model_flops  # the reference's count, one copy
out, ngpu = sys.argv[1], int(sys.argv[2])
GiB = 2**30
rows = []
for d in sorted(glob.glob(f"{out}/ours-*/metrics.jsonl") + glob.glob(f"{out}/old-*/metrics.jsonl")):
    name = d.split("/")[-2]
    cfg = open(f"{out}/{name}/config.resolved.toml").read()
    get = lambda k: int(next(l.split("=")[1].split("#")[0] for l in cfg.splitlines() if l.strip().startswith(k + " ")))
    L, C, V, T = get("n_layer"), get("n_embd"), get("vocab_size"), get("seq_len")
    recs = [json.loads(l) for l in open(d)]
    steady = recs[5:] or recs
    dt = statistics.median(r["step_time_s"] for r in steady)
    tok = recs[-1]["tokens"] / ngpu / dt
    peak = max(m.get("peak_total", 0) for r in recs for m in r["memory"]) / GiB
    dev = max((m.get("device_used", 0) or 0) for r in recs for m in r["memory"]) / GiB
    rows.append((name, tok, tok * model_flops(L, C, V, T) / 989e12, dt * 1e3, peak, dev))
for f in sorted(glob.glob(f"{out}/ref-*.log")):
    for line in open(f):
        if line.startswith("RESULT"):
            r = json.loads(line[7:])
            if r["rank"] == 0:
                rows.append((r["tag"], r["tok_s_rank"], r["mfu"], r["step_ms"], r["peak_alloc_GiB"], r["peak_reserved_GiB"]))
print(f"| run ({ngpu} GPUs) | tokens/s per GPU | MFU | step ms | peak GiB (tracked / allocated) | device GiB (driver / reserved) |")
print("|---|---|---|---|---|---|")
for name, tok, mfu, ms, peak, dev in rows:
    print(f"| {name} | {tok/1e3:.1f}k | {100*mfu:.1f}% | {ms:.1f} | {peak:.2f} | {dev:.2f} |")
# Where the driver's figure goes at the last step (rank 0): ledger + measured runtime parts.
MiB = 2**20
for d in sorted(glob.glob(f"{out}/ours-*/metrics.jsonl")):
    m = [json.loads(l) for l in open(d)][-1]["memory"][0]
    r = m.get("runtime")
    if r:
        print(f"{d.split('/')[-2]} rank 0, last step (MiB): tracked {m['total']/MiB:.0f} + context {r['context']/MiB:.0f}"
              f" + nccl {r['comm_library']/MiB:.0f} + lazy libraries {r.get('lazy_libraries', 0)/MiB:.0f} + scratch {r['scratch']/MiB:.0f} + pool slack {r['pool_slack']/MiB:.0f}"
              f" + untracked {m['untracked']/MiB:.0f} = driver {m['device_used']/MiB:.0f}")
PY
