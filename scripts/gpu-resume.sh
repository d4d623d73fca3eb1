#!/usr/bin/env bash
# Checkpoints on GPUs (issue 4), run on a machine with 4 GPUs:
#
#   scripts/gpu-resume.sh        # expects .carry/launcher and .carry/text/shards
#
# 1. train 20 steps on 2 GPUs (ZeRO-2), checkpoint every 10, validation at step 20;
# 2. resume step 10 on 1 GPU (ZeRO-0) and on 4 GPUs (ZeRO-3), same global batch: steps
#    11-20 must match the uninterrupted run within bf16 tolerance;
# 3. export step 20 as a Hugging Face model folder, load it with transformers'
#    from_pretrained as it is (no missing/unexpected keys), and check its validation loss on
#    the same windows equals shardtrain's (bf16 vs fp32 tolerance).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-resume-out}
BIN=${BIN:-.carry}
DATA=${DATA:-.carry/text/shards}
mkdir -p "$OUT"
fail=0
COMMON=(--set model.n_layer=4 --set model.n_head=4 --set model.n_embd=256 --set model.seq_len=256
        --set train.steps=20 --set train.warmup_steps=2 --set train.eval_every=20 --set train.eval_batches=4
        --set checkpoint.every=10 --set checkpoint.keep=5 --set "data.path=\"$DATA\"")
run() { local name=$1; shift; "$BIN/launcher" "$@" > "$OUT/$name.log" 2>&1 || { echo "FAIL: $name (see $name.log)"; tail -5 "$OUT/$name.log"; fail=1; }; }

run save2 --gpus 2 configs/gpt2-124m.toml "${COMMON[@]}" --set zero.stage=2 --set train.micro_batch=4 \
    --set "output.dir=\"$OUT/run\""
CK="$OUT/run/checkpoints/step_00000010"
run resume1 --gpus 1 configs/gpt2-124m.toml "${COMMON[@]}" --set zero.stage=0 --set train.micro_batch=4 \
    --set train.grad_accum=2 --set "output.dir=\"$OUT/r1\"" --set "checkpoint.dir=\"$OUT/r1/ck\"" --resume "$CK"
run resume4 --gpus 4 configs/gpt2-124m.toml "${COMMON[@]}" --set zero.stage=3 --set train.micro_batch=2 \
    --set "output.dir=\"$OUT/r4\"" --set "checkpoint.dir=\"$OUT/r4/ck\"" --resume "$CK"
rm -rf "$OUT/model"
run export "export" "$OUT/run/checkpoints/step_00000020" "$OUT/model"

python3 - "$OUT" "$DATA" <<'PY' || fail=1
import json, sys, glob, numpy as np, torch
out, data = sys.argv[1], sys.argv[2]
load = lambda d: {r["step"]: r for r in map(json.loads, open(f"{out}/{d}/metrics.jsonl"))}
ref, ok = load("run"), True
for name in ("r1", "r4"):
    got = load(name)
    steps = sorted(s for s in got if s > 10)
    worst = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in steps)
    good = steps == list(range(11, 21)) and worst <= 1e-2
    ok &= good
    print(f"resume step 10 -> {name}: steps {steps[0]}..{steps[-1]}, max relative loss difference vs uninterrupted = {worst:.2e} {'ok' if good else 'FAIL'}")
from transformers import AutoModelForCausalLM
model, info = AutoModelForCausalLM.from_pretrained(f"{out}/model", output_loading_info=True)
missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]  # tied to wte
print(f"transformers from_pretrained: {type(model).__name__}; missing {missing}; unexpected {info['unexpected_keys']}")
ok &= not missing and not info["unexpected_keys"]
model.eval().cuda()
val = np.fromfile(glob.glob(f"{data}/*val*.bin")[0], dtype=np.uint16, offset=1024).astype(np.int64)
T, n = 256, 4 * 2 * 4  # eval_batches x world x micro_batch windows, walked in order
x = torch.tensor(np.stack([val[i*T:i*T+T] for i in range(n)])).cuda()
y = torch.tensor(np.stack([val[i*T+1:i*T+T+1] for i in range(n)])).cuda()
with torch.no_grad():
    logits = model(x).logits.float()
    hf = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()
ours = ref[20]["val_loss"]
rel = abs(hf - ours) / ours
good = rel <= 2e-2
ok &= good
print(f"validation loss at step 20: shardtrain {ours:.4f}, transformers on the exported weights {hf:.4f} (rel {rel:.1e}) {'ok' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
[ $fail = 0 ] && echo "GPU CHECKPOINT TESTS PASSED" || echo "GPU CHECKPOINT TESTS FAILED"
exit $fail
