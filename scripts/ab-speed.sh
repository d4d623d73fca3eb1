#!/usr/bin/env bash
# Alternating A/B speed rows on one GPU: two launcher builds (or one build with two
# environments) on the same config, K pairs, every row after the first on the first row's
# stored GEMM algorithms (train.gemm_tuning_from), so the rows differ only in what is being
# compared. Single pairs move by ±0.5 ms a step at GPT-2 1.5B (BENCHMARKS.md run 28): take
# three pairs or more. Prints each row's median step (after the first five), its last loss
# and a hash of all its losses (the same bits or not), then each side's median of its rows.
#
#   A=.carry/launcher B=.carry/old/launcher scripts/ab-speed.sh [K]
#
# CONFIG (default configs/gpt2-1.5b.toml), ARGS (default: ZeRO-1, micro-batch 8, fp8, 60
# steps), OUT (default /tmp/ab-speed) and A_ENV/B_ENV (VAR=VALUE ..., exported for that
# side's rows) are read from the environment. To compare two ways of tuning (the one thing
# stored algorithms cannot share), B_TUNING (a train.gemm_tuning value, e.g. timed while
# A_TUNING is searched; both default to timed) gives B a first row b0 of its own, whose
# algorithms B's rows then run:
#   A=.carry/launcher B=.carry/launcher A_TUNING=searched scripts/ab-speed.sh 3
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
K=${1:-3}
A=${A:?set A to a launcher}
B=${B:?set B to a launcher}
CONFIG=${CONFIG:-configs/gpt2-1.5b.toml}
ARGS=${ARGS:---set zero.stage=1 --set train.micro_batch=8 --set train.precision=\"fp8\" --set train.steps=60 --set train.warmup_steps=5}
OUT=${OUT:-/tmp/ab-speed}
mkdir -p "$OUT"
row() { # name launcher env extra...
    local name=$1 exe=$2 envs=$3; shift 3
    # shellcheck disable=SC2086
    env $envs "$exe" --gpus 1 "$CONFIG" $ARGS --set train.eval_every=0 --set checkpoint.every=0 \
        --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name failed: see $OUT/$name.log"; return; }
    python3 - "$OUT/$name" "$name" <<'PY'
import hashlib, json, statistics, sys
recs = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
ms = statistics.median(r["step_time_s"] for r in (recs[5:] or recs)) * 1e3
h = hashlib.md5(str([r["loss"] for r in recs]).encode()).hexdigest()[:8]
print(f"{sys.argv[2]:<12} {ms:8.2f} ms  last loss {recs[-1]['loss']:.4f}  losses {h}")
PY
}
# The first row times the algorithms (train.gemm_tuning = A_TUNING) and stores them.
A_TUNING=${A_TUNING:-timed}
B_TUNING=${B_TUNING:-timed}
row a0 "$A" "${A_ENV:-}" --set "train.gemm_tuning=\"$A_TUNING\""
tuned="train.gemm_tuning_from=\"$OUT/a0\""
b_tuned=$tuned
if [[ $B_TUNING != "$A_TUNING" ]]; then
    row b0 "$B" "${B_ENV:-}" --set "train.gemm_tuning=\"$B_TUNING\""
    b_tuned="train.gemm_tuning_from=\"$OUT/b0\""
fi
for i in $(seq 1 "$K"); do
    row "b$i" "$B" "${B_ENV:-}" --set "$b_tuned"
    row "a$i" "$A" "${A_ENV:-}" --set "$tuned"
done
python3 - "$OUT" "$K" <<'PY'
import json, statistics, sys
out, k = sys.argv[1], int(sys.argv[2])
def med(name):
    recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    return statistics.median(r["step_time_s"] for r in (recs[5:] or recs)) * 1e3
for side in "ab":
    try:
        rows = [med(f"{side}{i}") for i in range(1, k + 1)]
        print(f"{side.upper()}: median of {k} rows {statistics.median(rows):.2f} ms ({', '.join(f'{r:.2f}' for r in rows)})")
    except (FileNotFoundError, ValueError):
        print(f"{side.upper()}: rows missing")
PY
