#!/usr/bin/env bash
# Hugging Face interop on CPU, against transformers itself (needs python3 with torch and
# transformers; e.g. Debian's python3-torch and `pip install transformers==4.30.2`):
# 1. train configs/tiny.toml 20 steps on 1 CPU rank with a validation loss at step 20;
# 2. export step 20 as a folder, and sharded (--max-shard-size 2MB): from_pretrained loads
#    both as they are (no missing or unexpected keys) and its loss on the same validation
#    windows equals shardtrain's;
# 3. save_pretrained in bfloat16 (sharded) and float16: each starts a run as train.init_from.
set -euo pipefail
cd "$(dirname "$0")/.."
L=${L:-target/release/launcher}
OUT=${OUT:-hf-check-out}
rm -rf "$OUT" && mkdir -p "$OUT"
"$L" --cpus 1 configs/tiny.toml --set train.steps=20 --set train.eval_every=20 --set train.eval_batches=4 \
    --set checkpoint.every=20 --set "output.dir=\"$OUT/run\"" > "$OUT/train.log"
"$L" export "$OUT/run/checkpoints/step_00000020" "$OUT/hf"
"$L" export "$OUT/run/checkpoints/step_00000020" "$OUT/hf-sharded" --max-shard-size 2MB
python3 - "$OUT" <<'PY'
import glob, json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
out = sys.argv[1]
T, n = 64, 16  # seq_len; eval_batches 4 x micro_batch 4 windows, walked in order
val = np.fromfile(glob.glob(f"{out}/run/builtin-data/*val*.bin")[0], dtype=np.uint16, offset=1024).astype(np.int64)
x = torch.tensor(np.stack([val[i*T:i*T+T] for i in range(n)]))
y = torch.tensor(np.stack([val[i*T+1:i*T+T+1] for i in range(n)]))
ours = json.loads(open(f"{out}/run/metrics.jsonl").read().splitlines()[-1])["val_loss"]
ok = True
for d in ("hf", "hf-sharded"):
    model, info = AutoModelForCausalLM.from_pretrained(f"{out}/{d}", output_loading_info=True)
    with torch.no_grad():
        logits = model.eval()(x).logits
        hf = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    good = not info["missing_keys"] and not info["unexpected_keys"] and abs(hf - ours) / ours < 1e-5
    ok &= good
    print(f"{d}: {type(model).__name__}, missing {info['missing_keys']}, unexpected {info['unexpected_keys']}; "
          f"validation loss transformers {hf:.6f}, shardtrain {ours:.6f} {'ok' if good else 'FAIL'}")
model = AutoModelForCausalLM.from_pretrained(f"{out}/hf")
model.to(torch.bfloat16).save_pretrained(f"{out}/bf16", safe_serialization=True, max_shard_size="5MB")
AutoModelForCausalLM.from_pretrained(f"{out}/hf").to(torch.float16).save_pretrained(f"{out}/f16", safe_serialization=True)
sys.exit(0 if ok else 1)
PY
for d in bf16 f16; do
    "$L" --cpus 1 configs/tiny.toml --set train.steps=2 --set "train.init_from=\"$OUT/$d\"" \
        --set "data.path=\"$OUT/run/builtin-data\"" --set "output.dir=\"$OUT/from-$d\"" > "$OUT/from-$d.log"
    echo "train.init_from = $d (save_pretrained): step 1 loss $(head -1 "$OUT/from-$d/metrics.jsonl" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["loss"], 4))') (random init: ~10.8)"
done
echo "HF CHECK PASSED"
