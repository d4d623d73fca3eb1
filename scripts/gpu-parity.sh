#!/usr/bin/env bash
# Two launcher builds on one GPU, the rows a redesign must keep bit for bit: GPT-2 1.5B and
# Llama-3.2-1B (ZeRO-1, micro-batch 8), bf16 and fp8, K alternating pairs each through
# scripts/ab-speed.sh, every row after the first on the first row's stored GEMM algorithms
# (train.gemm_tuning_from). Each row prints its median step, last loss and a hash of every
# step's loss: the same hash is the same bits.
#
#   A=.carry/launcher B=.carry/old/launcher scripts/gpu-parity.sh [K] [ROW_REGEX]
#
# OUT (default /tmp/gpu-parity) and STEPS (default 40) are read from the environment.
set -uo pipefail
cd "$(dirname "$0")/.."
K=${1:-2}
ONLY=${2:-.}
OUT=${OUT:-/tmp/gpu-parity}
STEPS=${STEPS:-40}
row() { # name config precision
    [[ $1 =~ $ONLY ]] || return 0
    echo "== $1"
    CONFIG=$2 OUT="$OUT/$1" ARGS="--set zero.stage=1 --set train.micro_batch=8 --set train.precision=\"$3\" --set train.steps=$STEPS --set train.warmup_steps=5" \
        scripts/ab-speed.sh "$K"
}
row gpt2-1.5b-bf16 configs/gpt2-1.5b.toml bf16
row gpt2-1.5b-fp8 configs/gpt2-1.5b.toml fp8
row llama-1b-bf16 configs/llama-3.2-1b.toml bf16
row llama-1b-fp8 configs/llama-3.2-1b.toml fp8
