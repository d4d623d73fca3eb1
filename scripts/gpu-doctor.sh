#!/usr/bin/env bash
# `launcher doctor` on GPUs (issue 27, item 5). Run on the GPU machine (about a minute):
#
#   scripts/gpu-doctor.sh        # expects .carry/launcher (scripts/build-gpu.sh)
#
# 1. one GPU: the check starts and says there is nothing to judge (exit 0);
# 2. two ranks sharing GPU 0 (--gpu-map 0,0: NCCL's network transport, slow by
#    design): NCCL all-reduce / all-gather at 1M-1G and the pair test run, the report prints
#    what the driver and sysfs say (PCIe link; NVLink needs two GPUs), and --expect-gbps 0.01
#    makes the verdict about the plumbing, not the shared GPU's speed (exit 0);
# 3. with 2+ GPUs: the real check against NVLink/PCIe (exit 0 when the GPUs are healthy, 4 and
#    the slow link named otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-gpu-doctor-out}
BIN=${BIN:-.carry}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
fail=0
check() { # name expected-code args...
    local name=$1 want=$2; shift 2
    "$@" > "$OUT/$name.log" 2>&1
    local got=$?
    cat "$OUT/$name.log"
    if [[ $got != "$want" ]]; then echo "FAIL: $name exited $got, expected $want"; fail=1; else echo "ok: $name"; fi
    echo
}
check one-gpu 0 "$BIN/launcher" doctor --gpus 1 --out "$OUT/one"
check shared-gpu 0 "$BIN/launcher" doctor --gpus 2 --gpu-map 0,0 --expect-gbps 0.01 \
    --json "$OUT/shared.json" --out "$OUT/shared"
if ((NGPU > 1)); then
    "$BIN/launcher" doctor --gpus "$NGPU" --json "$OUT/all.json" --out "$OUT/all" 2>&1 | tee "$OUT/all-gpus.log"
    echo "all $NGPU GPUs: exit ${PIPESTATUS[0]} (4 = a link below half of what the hardware should give)"
fi
exit $fail
