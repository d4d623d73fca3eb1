#!/usr/bin/env bash
# The delayed update on a GPU (issue 9): a 5.0B GPT (configs/gpt-7b.toml at 24 layers), batch
# 4x1024, grad_accum 4, optimizer offload with offload.delayed_update. Prints the elapsed
# time, the rank's last log line, host and GPU memory every 10 s (the first attempt logged no
# step within 100 s), then the run's summary. Compare with the in-order and on-GPU rows of
# BENCHMARKS.md run 7 (same shape). Expects .carry/ from scripts/build-gpu.sh.
#   OUT=out LIMIT=400 scripts/offload-delayed.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-offload-delayed-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
A=(--set model.n_layer=24 --set train.micro_batch=4 --set train.grad_accum=4 --set train.eval_every=0
   --set checkpoint.every=0 --set 'data.path=".carry/text/shards"')
timeout "${LIMIT:-190}" .carry/launcher --gpus 1 configs/gpt-7b.toml "${A[@]}" --set train.steps="${STEPS:-8}" \
   --set "output.dir=\"$OUT/delayed\"" --set offload.optimizer=true --set offload.delayed_update=true \
   --set offload.delayed_update_after=1 > "$OUT/delayed.log" 2>&1 &
pid=$!
t0=$SECONDS
while kill -0 $pid 2>/dev/null; do
  sleep 10
  echo "t=$((SECONDS - t0)) s: $(tail -1 "$OUT/delayed/logs/rank0.log" 2>/dev/null | cut -c1-120) | host used $(free -g | awk '/Mem/{print $3}') GiB | gpu $(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"
done
wait $pid; echo "exit $?"
tail -12 "$OUT/delayed.log"
