#!/usr/bin/env bash
# The losses of one launcher build on CPU ranks over the combinations a redesign must keep bit
# for bit: configs/tiny.toml and configs/tiny-llama.toml, bf16 and fp8, ZeRO stages 0-3, 2 ranks.
# Prints one line a run, `CONFIG PRECISION STAGE md5-of-losses last-loss`, to compare two builds:
#
#   scripts/cpu-parity.sh target/release/launcher > new.txt
#   scripts/cpu-parity.sh /tmp/old/launcher > old.txt && diff old.txt new.txt
#
# STEPS (default 20) and OUT (default a temporary folder) are read from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
EXE=${1:?usage: scripts/cpu-parity.sh LAUNCHER}
STEPS=${STEPS:-20}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
for cfg in tiny tiny-llama; do
    for prec in bf16 fp8; do
        for stage in 0 1 2 3; do
            dir="$OUT/$cfg-$prec-z$stage"
            rm -rf "$dir"
            "$EXE" --cpus 2 "configs/$cfg.toml" --set "train.precision=\"$prec\"" --set "zero.stage=$stage" \
                --set "train.steps=$STEPS" --set "output.dir=\"$dir\"" > "$dir.log" 2>&1 \
                || { echo "$cfg $prec z$stage FAILED (see $dir.log)"; continue; }
            python3 - "$dir/metrics.jsonl" "$cfg $prec z$stage" <<'PY'
import hashlib, json, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1]) if '"loss"' in l]
print(sys.argv[2], hashlib.md5(repr(losses).encode()).hexdigest()[:12], len(losses), repr(losses[-1]))
PY
        done
    done
done
