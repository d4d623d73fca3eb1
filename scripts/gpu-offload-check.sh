#!/usr/bin/env bash
# Optimizer and parameter offload on a GPU against the optimizer on the GPU: a small GPT,
# ZeRO-3 on one GPU, 20 steps on the built-in corpus, three ways (device optimizer,
# offload.optimizer, offload.optimizer + offload.params). The per-step losses must agree
# within 1e-3 relative (the CUDA AdamW kernel fuses multiply-adds, the host AdamW does not,
# so the master weights differ in the last bits) and the host must hold the optimizer.
# Each variant runs twice: with gradient accumulation the host queues a micro-step ahead of
# the GPU, and the two runs must give the same losses bit for bit (a race between the host
# and the GPU, such as a staging buffer rewritten before its copy ran, shows up here).
#
#   scripts/gpu-offload-check.sh     # expects .carry/launcher; output in $OUT (default gpu-offload-out)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-gpu-offload-out}
BIN=${BIN:-.carry}
mkdir -p "$OUT"
SMALL=(--set model.n_layer=4 --set model.n_head=4 --set model.n_embd=256 --set model.seq_len=256
       --set train.micro_batch=4 --set train.grad_accum=2 --set train.steps=20 --set train.warmup_steps=2
       --set train.eval_every=0 --set checkpoint.every=0 --set zero.stage=3)
for v in device optimizer params device-again optimizer-again params-again; do
    case ${v%-again} in
        device) extra=() ;;
        optimizer) extra=(--set offload.optimizer=true) ;;
        params) extra=(--set offload.optimizer=true --set offload.params=true) ;;
    esac
    "$BIN/launcher" --gpus 1 configs/gpt2-124m.toml "${SMALL[@]}" "${extra[@]}" --set "output.dir=\"$OUT/$v\"" \
        > "$OUT/$v.log" 2>&1 || echo "FAIL: run $v (see $OUT/$v.log)"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
names = ("device", "optimizer", "params")
rec = {v: [json.loads(l) for l in open(f"{out}/{v}/metrics.jsonl")] for v in names + tuple(n + "-again" for n in names)}
ref = [r["loss"] for r in rec["device"]]
ok = len(ref) == 20
for v in ("optimizer", "params"):
    got = [r["loss"] for r in rec[v]]
    worst = max(abs(a - b) / b for a, b in zip(got, ref))
    host = rec[v][-1]["memory"][0].get("host") or {}
    good = len(got) == len(ref) and worst <= 1e-3 and host.get("optimizer", 0) > 0
    good &= (host.get("params", 0) > 0) == (v == "params")
    ok &= good
    print(f"offload {v}: max relative loss difference vs the GPU optimizer over {len(got)} steps = {worst:.2e}; host {host} {'ok' if good else 'FAIL'}")
for v in names:
    a, b = [r["loss"] for r in rec[v]], [r["loss"] for r in rec[v + "-again"]]
    same = a == b and len(a) == 20
    ok &= same
    print(f"{v}: two runs {'give the same losses bit for bit' if same else 'DIFFER: ' + str([i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y][:5])} {'ok' if same else 'FAIL'}")
print("losses (GPU optimizer):", " ".join(f"{x:.4f}" for x in ref))
print("GPU OFFLOAD CHECK " + ("PASSED" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
