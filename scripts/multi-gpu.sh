#!/usr/bin/env bash
# The multi-GPU measurements (issue "Multi-GPU runs"), on a 2-, 4- or 8-GPU machine. Each part
# is meant to be one device call: it stops starting runs when its time budget (BUDGET seconds,
# default 560, under the device's 600 s limit) runs low, records what it skipped, and always
# ends with its Markdown table in $OUT/<part>.md (also printed).
#
#   scripts/multi-gpu.sh scaling-124m    # GPT-2 124M, ZeRO-1 and ZeRO-3, 1 -> NGPU GPUs
#   scripts/multi-gpu.sh scaling-1.5b    # GPT-2 1.5B, ZeRO-3 without and with activation checkpointing
#   scripts/multi-gpu.sh scaling-7b      # the 6.65B config (ZeRO-3, checkpointing, batch 4)
#   scripts/multi-gpu.sh largest         # the largest GPT that trains 10 steps here, without and with offload
#                                        # (LARGEST=true: only the offload row, LARGEST=false: only the other)
#   scripts/multi-gpu.sh two-node        # two launchers (NGPU/2 GPUs each) as one job vs one launcher
#   scripts/multi-gpu.sh memory-1.5b     # stages 0-3 at 2, 4, 8 ranks: predicted vs driver-measured per rank
#   scripts/multi-gpu.sh memory-7b
#   scripts/multi-gpu.sh tables          # rebuild every part's table from what is under $OUT
#   scripts/multi-gpu.sh two-node:130 largest:450   # several parts in one call, each with its
#                                        # own budget in seconds (the sum under the call's limit)
#
# What the parts took on 4 × H200 (BENCHMARKS.md run 18, GPUS="1 4", STEPS 15): two-node 55 s,
# scaling-124m 107 s, scaling-1.5b 153 s without its checkpointed rows (about 80 s more); add
# about 35 s for a machine's start. A whole session's standing order in two calls of a 4- or
# 8-GPU kind (the largest part first in the second, its runs are the longest):
#   scripts/multi-gpu.sh two-node:90 scaling-124m:160 scaling-1.5b:300
#   scripts/multi-gpu.sh largest:330 scaling-7b:230
# Every scaling row has PyTorch FSDP2 eager and torch.compile beside it, run in the same call
# (.carry/fsdp_gpt2.py); the largest-model rows have FSDP2's attempt at the same size
# (scripts/fsdp_large.py: meta-device init, as an FSDP2 user builds a model that size).
# Expects what scripts/build-gpu.sh puts in .carry/ (launcher, fsdp_gpt2.py, text/shards).
# GPUS="1 2 4 8" picks the GPU counts of the scaling parts (default: 1, NGPU, then the
# powers of two between, so that the weak-scaling ends come first if time runs out).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-multi-gpu-out}
BIN=${BIN:-.carry}
DATA=${DATA:-.carry/text/shards}
BUDGET=${BUDGET:-560}
STEPS=${STEPS:-15}
# DEV=cpus EXTRA="--set model.n_layer=2 ..." NGPU=4 runs the scaling, two-node and memory parts
# with CPU ranks and a smaller model: a dry run of this script (and of its tables) without a GPU.
DEV=${DEV:-gpus}
EXTRA=${EXTRA:-}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
PART=${1:-}
if [[ $# -gt 1 || $PART == *:* ]]; then
    # Several parts, one after another, each run by this script under its own budget.
    for p in "$@"; do
        BUDGET=$([[ $p == *:* ]] && echo "${p##*:}" || echo "$BUDGET") OUT=$OUT "$0" "${p%%:*}"
    done
    exit 0
fi
mkdir -p "$OUT"
LOG="$OUT/$PART.runs"   # one line per run: name, seconds, outcome (the table script reads it)

if [[ -z ${GPUS:-} ]]; then
    GPUS="1"
    [[ $NGPU -gt 1 ]] && GPUS+=" $NGPU"
    for k in 2 4; do [[ $k -lt $NGPU ]] && GPUS+=" $k"; done
fi

# bounded NAME MIN_SECONDS CMD...: run CMD under the seconds left (less a margin for the
# table), or record it as skipped when fewer than MIN_SECONDS are left.
bounded() {
    local name=$1 min=$2; shift 2
    local left=$((BUDGET - SECONDS - 20))
    if [[ $left -lt $min ]]; then
        echo "$name 0 skipped: ${left}s of this call's budget left, it needs about ${min}s" | tee -a "$LOG"
        return 1
    fi
    local t0=$SECONDS
    timeout --kill-after=10 "$left" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local what=ok
    [[ $rc == 124 || $rc == 137 ]] && what="timed out after $((SECONDS - t0))s (call budget)"
    [[ $rc != 0 && $what == ok ]] && what="failed (exit $rc): $(tail -2 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-300)"
    echo "$name $((SECONDS - t0)) $what" | tee -a "$LOG"
    # ARCHIVE=path.tgz: $OUT as it stands after every run (no checkpoints), so that a call
    # stopped by its limit still returns what finished (only a few files come back from a call).
    if [[ -n ${ARCHIVE:-} ]]; then
        tar czf "$ARCHIVE.part" --exclude='checkpoints' --exclude='*.safetensors' \
            --exclude="$(basename "$ARCHIVE")" --exclude="$(basename "$ARCHIVE").part" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
            && mv "$ARCHIVE.part" "$ARCHIVE"
    fi
}

# ours NAME K STAGE CONFIG EXTRA...: one `launcher sweep` run (K GPUs, one stage), which records
# predicted and measured memory beside the throughput.
ours() {
    local name=$1 k=$2 stage=$3 cfg=$4; shift 4
    # shellcheck disable=SC2086
    bounded "$name" 40 "$BIN/launcher" sweep --"$DEV" "$k" --stages "$stage" "$cfg" --out "$OUT/$name" \
        --set train.steps="$STEPS" --set train.warmup_steps=2 --set train.eval_every=0 --set checkpoint.every=0 "$@" $EXTRA
}
# fsdp NAME K LAYERS EMBD HEADS BATCH EXTRA...: the PyTorch reference on K GPUs (FSDP2 at every
# K, one GPU included, so that its weak scaling has the same baseline).
fsdp() {
    local name=$1 k=$2 l=$3 c=$4 h=$5 b=$6; shift 6
    bounded "$name" 40 torchrun --standalone --nproc_per_node="$k" "$BIN/fsdp_gpt2.py" --mode fsdp --layers "$l" \
        --embd "$c" --heads "$h" --batch "$b" --steps 10 --tag "$name" "$@"
}
tables() { python3 scripts/multi_gpu_tables.py "$OUT" "$@" | tee "$OUT/$PART.md"; }

scaling() { # model: 124m | 1.5b | 7b
    # Runner-major: each runner at every GPU count before the next runner, so that when the
    # call's budget runs low what is skipped is a whole runner, never one end of a scaling row.
    local m=$1 k
    case $m in
    124m)
        for k in $GPUS; do ours "124m-z1-g$k" "$k" 1 configs/gpt2-124m.toml --set train.micro_batch=16; done
        for k in $GPUS; do ours "124m-z3-g$k" "$k" 3 configs/gpt2-124m.toml --set train.micro_batch=16; done
        for k in $GPUS; do fsdp "ref-124m-fsdp-g$k" "$k" 12 768 12 16; done
        for k in $GPUS; do fsdp "ref-124m-fsdp-compile-g$k" "$k" 12 768 12 16 --compile --warmup 8; done ;;
    1.5b)
        for k in $GPUS; do ours "1.5b-z3-g$k" "$k" 3 configs/gpt2-1.5b.toml --set train.micro_batch=8; done
        for k in $GPUS; do fsdp "ref-1.5b-fsdp-g$k" "$k" 48 1600 25 8; done
        for k in $GPUS; do fsdp "ref-1.5b-fsdp-compile-g$k" "$k" 48 1600 25 8 --compile --warmup 8; done
        for k in $GPUS; do
            ours "1.5b-z3-ckpt-g$k" "$k" 3 configs/gpt2-1.5b.toml --set train.micro_batch=8 \
                --set checkpointing.activations='"every_layer"'
        done
        for k in $GPUS; do fsdp "ref-1.5b-fsdp-ckpt-g$k" "$k" 48 1600 25 8 --ckpt; done ;;
    7b)
        for k in $GPUS; do
            ours "7b-z3-ckpt-g$k" "$k" 3 configs/gpt-7b.toml --set train.micro_batch=4 --set train.grad_accum=1 \
                --set checkpointing.activations='"every_layer"'
        done
        for k in $GPUS; do fsdp "ref-7b-fsdp-ckpt-g$k" "$k" 32 4096 32 4 --ckpt; done
        for k in $GPUS; do fsdp "ref-7b-fsdp-ckpt-compile-g$k" "$k" 32 4096 32 4 --ckpt --compile --warmup 4; done ;;
    esac
    tables scaling "$m"
}

# The widest shapes that train at each node size (heads of 128); the planner then finds the
# most layers that fit this machine (its GPUs, less MARGIN GiB for NCCL at this rank count,
# and HOST_GIB of host memory), and the run proves it.
# The host's size is stated, not read: on the lent multi-GPU machines memory is plugged in as
# it is used (MemAvailable reads ~31 GiB at start on a 512 GiB machine). HOST_GIB defaults to
# ~94% of the kind's memory (2x: 256 GiB, 4x: 512, 8x: 560), the rest for the OS and the ranks.
MARGIN=${MARGIN:-3}
if [[ -z ${HOST_GIB:-} ]]; then
    case $NGPU in 1) HOST_GIB=118 ;; 2) HOST_GIB=240 ;; 4) HOST_GIB=480 ;; *) HOST_GIB=525 ;; esac
fi
largest_layers() { # width offload -> "n_layer parameters" (0 layers: none fits)
    local w=$1 off=$2 gpu_gib
    gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk -v m="$MARGIN" '{print $1/1024 - m}')
    python3 - "$BIN/launcher" "$w" "$off" "$NGPU" "$gpu_gib" "$HOST_GIB" <<'PY'
import json, subprocess, sys
exe, w, off, n, gpu, host = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
def plan(layers):  # `launcher memory --json` for this many layers (None: it failed)
    r = subprocess.run([exe, "memory", "configs/gpt-20b.toml", "--ranks", n, "--device", "gpu", "--json",
                        "--gpu-mem", gpu, "--host-mem", host, "--set", f"model.n_layer={layers}",
                        "--set", f"model.n_embd={w}", "--set", f"model.n_head={w // 128}",
                        "--set", "train.grad_accum=1", "--set", f"offload.optimizer={off}"],
                       capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else None
def fits(layers):
    p = plan(layers)
    return p is not None and p["fit"]["problem"] is None
lo, hi = 0, 512  # the most layers that fit: fits(lo), not fits(hi)
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
print(lo, plan(lo)["params"] if lo else 0)
PY
}
largest() {
    local w_gpu w_off
    case $NGPU in 1) w_gpu=4096 w_off=4096 ;; 2) w_gpu=5120 w_off=6144 ;; 4) w_gpu=7168 w_off=8192 ;; *) w_gpu=9216 w_off=8192 ;; esac
    for off in ${LARGEST:-false true}; do
        local w=$w_gpu; [[ $off == true ]] && w=$w_off
        local l params name
        read -r l params < <(largest_layers "$w" "$off")
        name="largest-g$NGPU-$([[ $off == true ]] && echo offload || echo gpu)"
        echo "$name: width $w, $l layers fit by the planner" | tee -a "$OUT/largest.plan"
        [[ $l -gt 0 ]] || continue
        local shape=(--set model.n_layer="$l" --set model.n_embd="$w" --set model.n_head=$((w / 128)))
        # The real-text shards where they were built; the built-in data otherwise (speed and
        # memory do not depend on the text).
        local data=(); [[ -e $DATA ]] && data=(--set "data.path=\"$DATA\"")
        bounded "$name" 120 "$BIN/launcher" --gpus "$NGPU" configs/gpt-20b.toml "${shape[@]}" --set train.grad_accum=1 \
            --set train.steps=10 --set train.eval_every=0 --set checkpoint.every=0 --set offload.optimizer="$off" \
            "${data[@]}" --set "output.dir=\"$OUT/$name\"" --host-mem "$HOST_GIB"
        # FSDP2 at the same size. With CPUOffloadPolicy it keeps fp32 parameters, gradients and
        # both AdamW moments on the host (16 bytes per parameter): attempted only where the host
        # has them, since running a host out of memory can take the machine with it.
        local ref=(--layers "$l" --embd "$w" --heads $((w / 128)) --batch 1 --ckpt --tag "ref-$name")
        if [[ $off == true ]]; then
            local need=$((16 * params >> 30))
            if [[ $need -ge ${HOST_GIB%.*} ]]; then
                echo "ref-$name 0 not attempted: FSDP2 CPUOffloadPolicy needs ${need} GiB of host memory (16 B/param), the host has ${HOST_GIB} GiB" | tee -a "$LOG"
                continue
            fi
            ref+=(--offload)
        fi
        bounded "ref-$name" 60 torchrun --standalone --nproc_per_node="$NGPU" scripts/fsdp_large.py "${ref[@]}"
    done
    tables largest
}

# Two launchers on this machine as two nodes (CUDA_VISIBLE_DEVICES splits the GPUs), one NCCL
# job of NGPU ranks, against one launcher with --gpus NGPU: the same config and seed must give
# the same losses.
two_node() {
    local half=$((NGPU / 2)) port=$((20000 + RANDOM % 20000))
    local lo hi
    lo=$(seq -s, 0 $((half - 1))); hi=$(seq -s, "$half" $((NGPU - 1)))
    for stage in 1 3; do
        local args=(configs/gpt2-124m.toml --set zero.stage=$stage --set train.micro_batch=8 --set train.steps=20
            --set train.eval_every=0 --set checkpoint.every=0)
        # shellcheck disable=SC2206
        args+=($EXTRA)
        bounded "one-launcher-z$stage" 40 "$BIN/launcher" --"$DEV" "$NGPU" "${args[@]}" --set "output.dir=\"$OUT/one-launcher-z$stage\""
        local t0=$SECONDS dir="$OUT/two-launchers-z$stage"
        export SHARDTRAIN_JOB_TOKEN="two-node-check-$RANDOM$RANDOM"
        CUDA_VISIBLE_DEVICES=$lo timeout 200 "$BIN/launcher" --"$DEV" "$half" "${args[@]}" --set "output.dir=\"$dir\"" \
            --nnodes 2 --node-rank 0 --master-addr "127.0.0.1:$port" > "$dir.node0.log" 2>&1 &
        local n0=$!
        CUDA_VISIBLE_DEVICES=$hi timeout 200 "$BIN/launcher" --"$DEV" "$half" "${args[@]}" --set "output.dir=\"$dir\"" \
            --nnodes 2 --node-rank 1 --master-addr "127.0.0.1:$port" > "$dir.node1.log" 2>&1
        local rc1=$? rc0=0
        wait $n0 || rc0=$?
        echo "two-launchers-z$stage $((SECONDS - t0)) node0 exit $rc0, node1 exit $rc1" | tee -a "$LOG"
        port=$((port + 1))
    done
    tables two-node
}

# Stages 0-3 at 2, 4, 8 ranks (those this machine has): the planner's per-rank prediction
# beside the driver's measurement (a 3-step sweep; plans that do not fit are refused by the
# launcher's fit check before they allocate, and recorded so).
memory() { # model: 1.5b | 7b
    local m=$1 cfg=configs/gpt2-1.5b.toml extra=(--set train.micro_batch=8)
    [[ $m == 7b ]] && cfg=configs/gpt-7b.toml extra=(--set train.micro_batch=4 --set train.grad_accum=1 \
        --set checkpointing.activations='"every_layer"')
    for k in 2 4 8; do
        [[ $k -le $NGPU ]] || continue
        # shellcheck disable=SC2086
        bounded "memory-$m-g$k" 60 "$BIN/launcher" sweep --"$DEV" "$k" --stages 0,1,2,3 "$cfg" --out "$OUT/memory-$m-g$k" \
            --set train.steps=3 --set train.warmup_steps=1 --set train.eval_every=0 --set checkpoint.every=0 "${extra[@]}" $EXTRA
    done
    tables memory "$m"
}

if [[ $DEV == gpus ]]; then
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
else
    for _ in $(seq "$NGPU"); do echo "-, CPU ranks (dry run), -"; done > "$OUT/gpus.txt"
fi
case $PART in
scaling-124m | scaling-1.5b | scaling-7b) scaling "${PART#scaling-}" ;;
largest) largest ;;
two-node) two_node ;;
memory-1.5b | memory-7b) memory "${PART#memory-}" ;;
tables)
    for p in "scaling 124m" "scaling 1.5b" "scaling 7b" largest two-node "memory 1.5b" "memory 7b"; do
        # shellcheck disable=SC2086
        python3 scripts/multi_gpu_tables.py "$OUT" $p
    done ;;
*) sed -n '2,16p' "$0"; exit 2 ;;
esac
