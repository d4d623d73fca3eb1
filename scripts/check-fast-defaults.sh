#!/usr/bin/env bash
# The fast defaults (issue 26, item 5) on one H100/H200, in about 4 minutes:
#
#   scripts/check-fast-defaults.sh     # expects .carry/launcher (scripts/build-gpu.sh)
#
# (a) stored GEMM tuning gives the same bits:
#     - a1: GPT-2 124M, 16x1024, 20 steps from scratch with the defaults (train.gemm_tuning =
#       "timed", checkpointing.keep_gelu = "auto"), a checkpoint every 10 steps;
#     - a2: the same run again with train.gemm_tuning_from = a1's output.dir: every loss equal
#       to a1's, bit for bit (nothing timed);
#     - a3: --resume a1's step-10 checkpoint (its manifest carries the table): steps 11-20
#       equal to a1's, bit for bit.
# (b) tokens/s of the new defaults against the old best flags (timed + keep_gelu = true) and
#     the old defaults (heuristic, keep_gelu = false) at 124M 16x1024 (a1 is the defaults'
#     row) and 1.5B 8x1024, ZeRO-1, as scripts/bench.sh measures (median step from step 6).
#     OLD=path/to/launcher adds the old binary's best-flags rows (old-*).
# Prints PASS/FAIL lines, a Markdown table, and the keep_gelu and tuning lines the runs logged;
# raw logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-fast-defaults-out}
BIN=${BIN:-.carry}
rm -rf "$OUT"
mkdir -p "$OUT"
fail=0
run() { # name launcher args...
    local name=$1 exe=$2; shift 2
    "$exe" --gpus 1 "$@" > "$OUT/$name.log" 2>&1 || { echo "FAIL: run $name (see $OUT/$name.log)"; tail -5 "$OUT/$name.log"; fail=1; }
}
C124=(configs/gpt2-124m.toml --set zero.stage=1 --set train.micro_batch=16 --set train.warmup_steps=5
      --set train.eval_every=0)
C15=(configs/gpt2-1.5b.toml --set zero.stage=1 --set train.micro_batch=8 --set train.steps=15 --set train.warmup_steps=5
     --set train.eval_every=0 --set checkpoint.every=0)
OLD_BEST=(--set 'train.gemm_tuning="timed"' --set checkpointing.keep_gelu=true)
OLD_DEFAULTS=(--set 'train.gemm_tuning="heuristic"' --set checkpointing.keep_gelu=false)

# (a) same bits from stored choices.
A=(--set train.steps=20 --set checkpoint.every=10 --set checkpoint.keep=5)
run a1 "$BIN/launcher" "${C124[@]}" "${A[@]}" --set "output.dir=\"$OUT/a1\""
run a2 "$BIN/launcher" "${C124[@]}" "${A[@]}" --set "output.dir=\"$OUT/a2\"" --set "train.gemm_tuning_from=\"$OUT/a1\""
run a3 "$BIN/launcher" "${C124[@]}" "${A[@]}" --set "output.dir=\"$OUT/a3\"" --set "checkpoint.dir=\"$OUT/a3/ck\"" \
    --resume "$OUT/a1/checkpoints/step_00000010"

# (b) speed: the defaults against the old best flags and the old defaults.
run b-124m-oldbest "$BIN/launcher" "${C124[@]}" --set train.steps=20 --set checkpoint.every=0 "${OLD_BEST[@]}" \
    --set "output.dir=\"$OUT/b-124m-oldbest\""
run b-124m-olddefaults "$BIN/launcher" "${C124[@]}" --set train.steps=20 --set checkpoint.every=0 "${OLD_DEFAULTS[@]}" \
    --set "output.dir=\"$OUT/b-124m-olddefaults\""
run b-1.5b-defaults "$BIN/launcher" "${C15[@]}" --set "output.dir=\"$OUT/b-1.5b-defaults\""
run b-1.5b-oldbest "$BIN/launcher" "${C15[@]}" "${OLD_BEST[@]}" --set "output.dir=\"$OUT/b-1.5b-oldbest\""
run b-1.5b-olddefaults "$BIN/launcher" "${C15[@]}" "${OLD_DEFAULTS[@]}" --set "output.dir=\"$OUT/b-1.5b-olddefaults\""
if [[ -n ${OLD:-} ]]; then
    run old-124m-oldbest "$OLD" "${C124[@]}" --set train.steps=20 --set checkpoint.every=0 "${OLD_BEST[@]}" \
        --set "output.dir=\"$OUT/old-124m-oldbest\""
    run old-1.5b-oldbest "$OLD" "${C15[@]}" "${OLD_BEST[@]}" --set "output.dir=\"$OUT/old-1.5b-oldbest\""
fi

python3 - "$OUT" <<'PY' || fail=1
import json, glob, os, statistics, sys
sys.path.insert(0, "scripts")
from multi_gpu_tables import flops_per_token
out = sys.argv[1]
ok = True
def metrics(name):
    p = f"{out}/{name}/metrics.jsonl"
    return {r["step"]: r for r in map(json.loads, open(p))} if os.path.exists(p) else {}
a1, a2, a3 = metrics("a1"), metrics("a2"), metrics("a3")
def same(name, got, steps):
    global ok
    diff = [s for s in steps if s not in got or s not in a1 or got[s]["loss"] != a1[s]["loss"]]
    good = bool(steps) and not diff
    ok &= good
    first = f"; first differing step {diff[0]}: {got.get(diff[0], {}).get('loss')} vs {a1.get(diff[0], {}).get('loss')}" if diff else ""
    print(f"{'PASS' if good else 'FAIL'}: {name}: losses of steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'} "
          f"bit-identical to the first run{first}")
same("rerun with train.gemm_tuning_from", a2, sorted(a1))
same("resume from step 10", a3, [s for s in sorted(a1) if s > 10])
table = os.path.exists(f"{out}/a1/gemm_tuning.json") and json.load(open(f"{out}/a1/gemm_tuning.json"))
manifest = json.load(open(f"{out}/a1/checkpoints/step_00000010/manifest.json")) if os.path.exists(f"{out}/a1/checkpoints/step_00000010/manifest.json") else {}
good = bool(table and table["gemms"]) and manifest.get("gemm_tuning") == table
ok &= good
if table:
    print(f"{'PASS' if good else 'FAIL'}: a1 stored {len(table['gemms'])} GEMM choices ({sum(g['candidate'] != 0 for g in table['gemms'])} "
          f"not the heuristic's first) on {table['environment']['device']}, cuBLASLt {table['environment']['cublaslt_version']}, "
          f"the same table in its step-10 checkpoint: {manifest.get('gemm_tuning') == table}")
else:
    print("FAIL: a1 wrote no gemm_tuning.json")

GiB = 2**30
rows = []
for name in ["a1", "b-124m-oldbest", "b-124m-olddefaults", "old-124m-oldbest",
             "b-1.5b-defaults", "b-1.5b-oldbest", "b-1.5b-olddefaults", "old-1.5b-oldbest"]:
    recs = list(metrics(name).values())
    if not recs:
        continue
    cfg = open(f"{out}/{name}/config.resolved.toml").read()
    get = lambda k: next(l.split("=")[1].split("#")[0].strip() for l in cfg.splitlines() if l.strip().startswith(k + " "))
    L, C, V, T = (int(get(k)) for k in ("n_layer", "n_embd", "vocab_size", "seq_len"))
    dt = statistics.median(r["step_time_s"] for r in (recs[5:] or recs))
    tok = recs[-1]["tokens"] / dt
    peak = max(m.get("peak_total", 0) for r in recs for m in r["memory"]) / GiB
    dev = max((m.get("device_used", 0) or 0) for r in recs for m in r["memory"]) / GiB
    label = {"a1": "124m-defaults"}.get(name, name.removeprefix("b-"))
    rows.append((label, get("gemm_tuning"), get("keep_gelu"), tok, tok * flops_per_token(L, C, V, T) / 989e12, dt * 1e3, peak, dev, recs[-1]["loss"]))
print("\n| run (1 GPU, ZeRO-1) | gemm_tuning | keep_gelu (resolved) | tokens/s | MFU | step ms | peak GiB (tracked) | device GiB | loss at the last step |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]/1e3:.1f}k | {100*r[4]:.1f}% | {r[5]:.1f} | {r[6]:.2f} | {r[7]:.2f} | {r[8]:.6f} |")
sys.exit(0 if ok else 1)
PY
echo
for f in "$OUT"/a1.log "$OUT"/a2.log "$OUT"/a3.log "$OUT"/b-1.5b-defaults.log; do
    echo "$(basename "$f"):"
    grep -hE 'keep_gelu = "auto"|train.gemm_tuning|GEMM algorithms were timed' "$f" | sed 's/^/  /'
done
# The first step's cost of timing: step 1 against the median of the rest.
python3 - "$OUT" <<'PY'
import json, statistics, sys
for name in ("a1", "b-124m-olddefaults", "b-1.5b-defaults", "b-1.5b-olddefaults"):
    try:
        recs = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}/metrics.jsonl")]
    except OSError:
        continue
    print(f"{name}: first step {recs[0]['step_time_s']*1e3:.0f} ms, median of the rest {statistics.median(r['step_time_s'] for r in recs[1:])*1e3:.1f} ms")
PY
[ $fail = 0 ] && echo "FAST DEFAULTS CHECK PASSED" || echo "FAST DEFAULTS CHECK FAILED"
exit $fail
