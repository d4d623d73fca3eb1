#!/usr/bin/env bash
# prepare-data's tokenisation throughput against the Python `tokenizers` package's
# `Tokenizer.encode_batch`, on the same input, with the same tokenizer.json, on this machine
# (docs/bench-log/2026-11-25-data-preparation.md).
#
#   scripts/bench-prepare.sh [MB]        (default 40 MB of text; needs python3 and pip)
#
# The tokenizer is GPT-2's tokenizer.json, built from GPT-2's vocabulary and merges
# (scripts/bench_prepare.py tokenizer); the input is real text found on every machine
# with rustup's docs and Python (scripts/bench_prepare.py corpus), as JSON lines. One core
# is `taskset -c 0` for both sides (our reader thread included); "all cores" leaves both
# free. prepare-data's time is the whole run (read, parse JSON, tokenise, write shards);
# Python's is encode_batch alone (the texts already in memory).
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-40}
WORK=${BENCH_DIR:-/tmp/shardtrain-bench-prepare}
mkdir -p "$WORK"
if [ ! -d "$WORK/py" ]; then
    python3 -m pip install --quiet --target "$WORK/py" tokenizers
fi
export PYTHONPATH="$WORK/py"
cargo build --release -p launcher
L=target/release/launcher
python3 scripts/bench_prepare.py tokenizer "$WORK/gpt2-tokenizer.json"
python3 scripts/bench_prepare.py corpus "$WORK/corpus.jsonl" "$MB"
python3 -c "import tokenizers; print('python tokenizers', tokenizers.__version__)"
echo "cores: $(nproc); load: $(cut -d' ' -f1-3 /proc/loadavg)"

ours() { # $1 = taskset prefix or "", $2 = tokenizer
    rm -rf "$WORK/out"
    $1 "$L" prepare-data "$WORK/corpus.jsonl" "$WORK/out" --tokenizer "$2" | grep '^tokenizer:' | sed 's/.*(\(.* MB\/s\))$/\1/'
}
for run in 1 2; do
    echo "--- run $run"
    echo "python encode_batch, 1 core:   $(TOKENIZERS_PARALLELISM=false taskset -c 0 python3 scripts/bench_prepare.py encode "$WORK/gpt2-tokenizer.json" "$WORK/corpus.jsonl")"
    echo "python encode_batch, all cores: $(TOKENIZERS_PARALLELISM=true python3 scripts/bench_prepare.py encode "$WORK/gpt2-tokenizer.json" "$WORK/corpus.jsonl")"
    echo "prepare-data tokenizer.json, 1 core:   $(RAYON_NUM_THREADS=1 ours "taskset -c 0" "$WORK/gpt2-tokenizer.json")"
    echo "prepare-data tokenizer.json, all cores: $(ours "" "$WORK/gpt2-tokenizer.json")"
    echo "prepare-data gpt2 (built in), 1 core:   $(RAYON_NUM_THREADS=1 ours "taskset -c 0" gpt2)"
    echo "prepare-data gpt2 (built in), all cores: $(ours "" gpt2)"
done
