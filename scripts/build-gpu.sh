#!/usr/bin/env bash
# Build what the GPU scripts run, here (the GPU machine has no Rust toolchain), into the
# ignored folder .carry/ that a device call carries:
#   .carry/launcher, .carry/gpu-timing, .carry/gpu-nccl   (release, stripped)
#   .carry/gpu-kernels, .carry/gpu-model                  (the GPU test binaries)
#   .carry/fsdp_gpt2.py                                   (the PyTorch reference, if found)
#   .carry/text/shards                                    (real text for the loss runs: GPT-2 tokens of
#       the Rust books' prose and Python's standard library found on this machine, 60 MB of it as
#       JSON lines through prepare-data with its built-in GPT-2 tokenizer; made once, kept)
# Usage: scripts/build-gpu.sh [PATH_TO_fsdp_gpt2.py]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry
cargo build --release -p launcher -p gpu-tools --features trainer/cuda --bins
for b in launcher gpu-timing gpu-nccl; do
    strip -o ".carry/$b" "target/release/$b"
done
# The test binaries' paths carry a hash: ask cargo for them.
cargo test --release -p trainer --features cuda --test gpu_kernels --test gpu_model --no-run --message-format=json \
    | python3 -c '
import json, shutil, subprocess, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"].replace("_", "-")
        subprocess.run(["strip", "-o", f".carry/{name}", m["executable"]], check=True)
        print("built", name)
'
if [ ! -d .carry/text/shards ]; then
    python3 scripts/bench_prepare.py corpus /tmp/shardtrain-real-text.jsonl 60
    target/release/launcher prepare-data /tmp/shardtrain-real-text.jsonl .carry/text/shards
fi
# torchao (PyTorch's FP8 training) as a wheel for scripts/bench-fp8.sh: the GPU machine has no
# network. Pinned to the release that was current with PyTorch 2.11; skipped without a network.
ls .carry/torchao-*.whl > /dev/null 2>&1 || python3 -m pip download --quiet --no-deps torchao==0.18.0 -d .carry \
    || echo "no torchao wheel (no network?): bench-fp8.sh runs without its row"
ref=${1:-../shared/reference/fsdp_gpt2.py}
[ -f "$ref" ] && cp "$ref" .carry/fsdp_gpt2.py
du -sh .carry/* | sort -h
