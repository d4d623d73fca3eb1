#!/usr/bin/env bash
# The hang watchdog on GPU ranks, on a machine with one GPU (or more):
#
#   scripts/gpu-watchdog.sh        # expects $BIN/launcher (BIN defaults to .carry; BIN=target/release works too)
#
# Two GPU ranks share GPU 0 (--gpu-map 0,0: the launcher gives each its own NCCL_HOSTID,
# so NCCL accepts them and connects them through its socket transport; loopback here). Once the
# job trains, rank 1 is stopped with SIGSTOP: rank 0 then waits in an NCCL collective forever.
# Passes when the job ends with the watchdog's exit code (3) within the timeout plus a margin,
# the report names rank 1 as the rank behind, rank 0 was told to stop (it aborts its NCCL
# communicator, ncclCommAbort) and no rank process is left. Output goes to $OUT
# (default gpu-watchdog-out). Exits non-zero if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Two "hosts" on one machine: sockets over loopback, no InfiniBand loopback needed.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
OUT=${OUT:-gpu-watchdog-out}
BIN=${BIN:-.carry}
TIMEOUT=${TIMEOUT:-20}
rm -rf "$OUT" && mkdir -p "$OUT"
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }

# A small GPT (head size 64, as the GPU tests use) on the built-in corpus.
"$BIN/launcher" --gpus 2 --gpu-map 0,0 configs/gpt2-124m.toml \
    --set model.n_layer=2 --set model.n_head=4 --set model.n_embd=256 --set model.seq_len=256 \
    --set train.micro_batch=4 --set train.steps=1000000 --set train.eval_every=0 --set checkpoint.every=0 \
    --set "watchdog.timeout_s=$TIMEOUT" --set "output.dir=\"$OUT/run\"" \
    > "$OUT/launcher.out" 2> "$OUT/launcher.err" &
LAUNCHER=$!

steps() { { wc -l < "$OUT/run/metrics.jsonl"; } 2>/dev/null || echo 0; }
# Wait for a few trained steps (metrics.jsonl lines), at most 5 minutes.
for _ in $(seq 1 600); do
    [ "$(steps)" -ge 5 ] && break
    kill -0 "$LAUNCHER" 2>/dev/null || break
    sleep 0.5
done
if ! kill -0 "$LAUNCHER" 2>/dev/null || [ "$(steps)" -lt 5 ]; then
    echo "FAIL: the 2-rank job did not train 5 steps; launcher output:"
    tail -30 "$OUT/launcher.out" "$OUT/launcher.err" "$OUT"/run/logs/rank*.log 2>/dev/null
    kill -KILL "$LAUNCHER" 2>/dev/null
    exit 1
fi
read -r RANK0 RANK1 < <(grep -o 'pids \[[0-9, ]*\]' "$OUT/launcher.out" | tr -d 'pids[],')
echo "training: rank pids $RANK0 $RANK1; stopping rank 1 (SIGSTOP), watchdog.timeout_s = $TIMEOUT"
kill -STOP "$RANK1"
start=$(date +%s)
wait "$LAUNCHER"
code=$?
took=$(( $(date +%s) - start ))
kill -KILL "$RANK1" 2>/dev/null   # only if the launcher left it behind (a check below fails then)

echo "launcher exit code $code after ${took}s; its report:"
sed 's/^/    /' "$OUT/launcher.err"
check "exit code 3 (the watchdog's)" '[ "$code" -eq 3 ]'
check "stopped after the timeout and within 60 s more" '[ "$took" -ge "$TIMEOUT" ] && [ "$took" -le $((TIMEOUT + 60)) ]'
check "the report names rank 1 as behind" 'grep -q "ranks behind: 1 " "$OUT/launcher.err"'
check "the report says where rank 0 waited" 'grep -q "rank 0: step .*collective #" "$OUT/launcher.err"'
check "rank 0 was told to stop (and aborted its NCCL communicator)" \
    'grep -q "stopped by the launcher: the job is hung" "$OUT/run/logs/rank0.log" && ! grep -q "aborting the NCCL communicator failed" "$OUT/run/logs/rank0.log"'
check "no rank process is left" '! kill -0 "$RANK0" 2>/dev/null && ! kill -0 "$RANK1" 2>/dev/null'
exit $fail
