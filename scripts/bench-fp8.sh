#!/usr/bin/env bash
# train.precision = "fp8" beside bf16 on one GPU (Hopper: compute capability 9.0), same
# model, same batch, in the same call. Run on the GPU machine:
#
#   scripts/bench-fp8.sh [speed|gemm|parity|gap|all]
#       # expects .carry/launcher, .carry/gpu-timing, .carry/fsdp_gpt2.py and, for parity,
#       # the real-text shards .carry/text/shards (scripts/build-gpu.sh builds the rest)
#
# speed:  GPT-2 1.5B 8×1024 (ZeRO-1, gemm_tuning = "timed") bf16 and fp8 (and fp8 with
#         gemm_tuning = "searched", the best flags: speed-1.5b-fp8-searched; fp8 with the
#         attention projection kept in bf16: speed-1.5b-fp8-bf16proj), beside PyTorch
#         eager and torch.compile (fsdp_gpt2.py --mode single) and torch.compile with torchao's
#         float8 layers (scripts/torchao_fp8_ref.py, tensorwise; needs .carry/torchao-*.whl); the 6.65B (configs/gpt-7b.toml,
#         4×1024, checkpointing + keep_attention, ZeRO-1) bf16 and fp8; the Llama-3-8B shape
#         (configs/llama-3-8b.toml, 1×4096, ZeRO-3, checkpointing + keep_attention) bf16 and
#         fp8; the Llama-3.2-1B shape (8×2048, ZeRO-1) bf16 and fp8.
#         Targets (issue 26): 1.5B fp8 >= 1.3x our bf16 step and >= 1.45x torch.compile.
# gemm:   gpu-timing fp8: each linear layer of GPT-2 1.5B and Llama-3-8B, bf16 beside fp8
#         (the casts included), 8×1024 rows.
# parity: GPT-2 124M, 2000 steps (16×1024), GPT-2 1.5B, 500 steps (8×1024), and the Llama-3.2-1B
#         shape, 500 steps (4×2048), on real text,
#         bf16 and fp8 from the same initialisation and data order: both loss curves as CSV
#         ($OUT/parity-*.csv), an SVG per model ($OUT/parity-*.svg, scripts/plot_losses.py:
#         the losses smoothed over 20 steps) and the mean of the last 100 steps' losses.
#         PARITY_VARIANTS adds the FP8 backward's other recipes and a second bf16 seed (below).
#
# gap:    where the FP8 step loses what its GEMMs gain (GPT-2 1.5B widths, 8×1024, ZeRO-1):
#         gpu-timing fp8 (each linear layer alone, then as the model calls it, with its
#         residual/GELU/GELU' epilogues, naming those cuBLASLt has no FP8 algorithm for); the
#         step time's slope per block (6 and 18 blocks, bf16 and fp8: what one block costs in a
#         real step, beside the layers' sums); the fused epilogues each run logged as composed;
#         and, where ncu can read the GPU, every kernel of 3 steps of a 2-block model, bf16 and
#         fp8, summed by kernel name ($OUT/gap-kernels.txt).
#
# ONLY=REGEX runs the matching rows (e.g. ONLY='1.5b' or ONLY='parity-124m'); each row is a
# separate launch, so a device call's 10 minutes can take the rows a few at a time with the
# same $OUT: the tables are made from whatever $OUT holds. STEPS (default 30) is the speed
# rows' length; RUN_TIMEOUT (seconds, default 3600) bounds each row; EXTRA="--set k=v ..." is
# added to every shardtrain row. OLD=path/to/launcher also runs that binary on every speed
# row (rows named speed-old-*), for before/after comparisons in one call.
# ARCHIVE=path.tgz rewrites that archive of $OUT (logs, metrics, CSVs; no checkpoints) after
# every row, so a call stopped by its time limit still returns the rows it finished: point it
# under the device's $OUT and OUT elsewhere (only a few files come back from a call).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench-fp8-out}
mkdir -p "$OUT"
BIN=${BIN:-.carry}
DATA=${DATA:-.carry/text/shards}
WHAT=${1:-all}
STEPS=${STEPS:-30}
EXTRA=${EXTRA:-}
# Seconds one row may run (a slow compile then costs that row, not the rest of the call).
RUN_TIMEOUT=${RUN_TIMEOUT:-3600}

wanted() { [[ -z ${ONLY:-} || $1 =~ $ONLY ]]; }
archive() { # after each row: $OUT as it stands, into $ARCHIVE (written aside, then moved)
    [[ -n ${ARCHIVE:-} ]] || return 0
    tar czf "$ARCHIVE.part" --exclude='checkpoints' --exclude='*.safetensors' \
            --exclude="$(basename "$ARCHIVE")" --exclude="$(basename "$ARCHIVE").part" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
        && mv "$ARCHIVE.part" "$ARCHIVE"
}
run_ours() { # launcher name config extra...
    local exe=$1 name=$2 cfg=$3; shift 3
    wanted "$name" || return 0
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$RUN_TIMEOUT" "$exe" --gpus 1 "$cfg" --set train.eval_every=0 --set checkpoint.every=0 \
        --set "output.dir=\"$OUT/$name\"" "$@" $EXTRA > "$OUT/$name.log" 2>&1 || echo "run $name failed: see $OUT/$name.log"
    archive
}
ours() { # name config extra...
    run_ours "$BIN/launcher" "$@"
}
speed() { # name config extra...: STEPS steps, both precisions (and the OLD binary's)
    local name=$1 cfg=$2; shift 2
    for p in bf16 fp8; do
        local args=("$cfg" --set train.steps="$STEPS" --set train.warmup_steps=5 --set "train.precision=\"$p\"" "$@")
        ours "speed-$name-$p" "${args[@]}"
        if [[ -n ${OLD:-} ]]; then run_ours "$OLD" "speed-old-$name-$p" "${args[@]}"; fi
    done
}
ncu_2blocks() { # name metrics launcher-args...: ncu's METRICS for every kernel of 3 steps of a
    # 2-block model of GPT-2 1.5B's width (8×1024, ZeRO-1) into $OUT/name.csv. Eager (no CUDA
    # graphs) so ncu sees each kernel; the heuristic's algorithms (no timing launches); no
    # watchdog (ncu serialises and slows every kernel). Caches are not flushed between kernels
    # (--cache-control none): a step's small kernels read what the kernel before just wrote;
    # with ncu's default flush, kernels it timed at 1-1.3 TB/s (attention's D, the LayerNorm
    # statistics) were rewritten with wide loads and the step did not measurably move
    # (BENCHMARKS.md run 26).
    local name=$1 metrics=$2; shift 2
    timeout 200 ncu --clock-control none --cache-control none --target-processes all --metrics "$metrics" --csv --print-units base \
        "$BIN/launcher" --gpus 1 configs/gpt2-1.5b.toml --set model.n_layer=2 --set train.steps=3 \
        --set zero.stage=1 --set train.micro_batch=8 --set train.eval_every=0 --set checkpoint.every=0 \
        --set train.cuda_graphs=false --set train.gemm_tuning='"heuristic"' --set watchdog.timeout_s=0 \
        --set "output.dir=\"$OUT/$name\"" "$@" > "$OUT/$name.csv" 2> "$OUT/$name.err" \
        || echo "ncu $name failed: see $OUT/$name.err"
}
torchao() { # name args...: the reference with torchao's float8 layers (tensorwise), where its wheel was carried
    local name=$1 whl; shift
    wanted "$name" || return 0
    whl=$(ls "$BIN"/torchao-*.whl 2>/dev/null | head -1)
    if [[ -z $whl ]]; then echo "$name: no torchao wheel in $BIN (scripts/build-gpu.sh downloads one)"; return 0; fi
    [[ -d /tmp/torchao-py ]] || python3 -m pip install --quiet --no-deps --no-index --target /tmp/torchao-py "$whl" \
        > "$OUT/$name.install.log" 2>&1 || { echo "$name: installing $whl failed: see $OUT/$name.install.log"; return 0; }
    PYTHONPATH=/tmp/torchao-py timeout --kill-after=10 "$RUN_TIMEOUT" torchrun --standalone --nproc_per_node=1 scripts/torchao_fp8_ref.py \
        "$BIN/fsdp_gpt2.py" tensorwise -- --steps 20 --tag "$name" "$@" > "$OUT/$name.log" 2>&1 \
        || echo "reference $name failed: see $OUT/$name.log"
    archive
}
ref() { # name args...
    local name=$1; shift
    wanted "$name" || return 0
    timeout --kill-after=10 "$RUN_TIMEOUT" torchrun --standalone --nproc_per_node=1 "$BIN/fsdp_gpt2.py" --steps 20 \
        --tag "$name" "$@" > "$OUT/$name.log" 2>&1 \
        || echo "reference $name failed: see $OUT/$name.log"
    archive
}

if [[ $WHAT == speed || $WHAT == all ]]; then
    speed 1.5b configs/gpt2-1.5b.toml --set zero.stage=1 --set train.micro_batch=8 --set train.gemm_tuning='"timed"'
    # The fp8 row with train.gemm_tuning = "searched" (cuBLASLt's configurations near the
    # heuristic's candidates timed too; a first step about 45 s longer): the best flags.
    ours speed-1.5b-fp8-searched configs/gpt2-1.5b.toml --set zero.stage=1 --set train.micro_batch=8 \
        --set train.gemm_tuning='"searched"' --set train.steps="$STEPS" --set train.warmup_steps=5 \
        --set 'train.precision="fp8"'
    # The attention projection kept in bf16 (train.fp8_bf16_layers): at 1600 wide its FP8 GEMMs
    # gain nothing before their casts (BENCHMARKS.md run 21's gpu-timing).
    ours speed-1.5b-fp8-bf16proj configs/gpt2-1.5b.toml --set zero.stage=1 --set train.micro_batch=8 \
        --set train.gemm_tuning='"timed"' --set train.steps="$STEPS" --set train.warmup_steps=5 \
        --set 'train.precision="fp8"' --set 'train.fp8_bf16_layers=["proj"]'
    ref ref-1.5b-eager --mode single --layers 48 --embd 1600 --heads 25 --batch 8
    ref ref-1.5b-compile --mode single --layers 48 --embd 1600 --heads 25 --batch 8 --compile --warmup 8
    torchao ref-1.5b-torchao-fp8 --mode single --layers 48 --embd 1600 --heads 25 --batch 8 --compile --warmup 8
    speed 7b configs/gpt-7b.toml --set zero.stage=1 --set train.micro_batch=4 --set train.grad_accum=1 \
        --set checkpointing.activations='"every_layer"' --set checkpointing.keep_attention=true \
        --set train.gemm_tuning='"timed"'
    speed llama-8b configs/llama-3-8b.toml --set train.grad_accum=1 --set train.gemm_tuning='"timed"'
    # The same fp8 row with every weight cast at each use: what `fp8_weight_cache = "auto"`'s
    # blocks (at ZeRO-3, as many as fit) save, on the speed row's stored algorithms.
    ours speed-llama-8b-fp8-percast configs/llama-3-8b.toml --set train.grad_accum=1 --set train.steps="$STEPS" \
        --set train.warmup_steps=5 --set 'train.precision="fp8"' --set train.fp8_weight_cache=false \
        --set "train.gemm_tuning_from=\"$OUT/speed-llama-8b-fp8\""
    # The Llama-3.2-1B shape at 8×2048, ZeRO-1 (its bf16 row beside HF + torch.compile: run 15).
    speed llama-1b configs/llama-3.2-1b.toml
fi
if [[ $WHAT == gemm || $WHAT == all ]] && wanted gemm; then
    "$BIN/gpu-timing" fp8 8 1024 > "$OUT/gemm.log" 2>&1 || echo "gpu-timing fp8 failed: see $OUT/gemm.log"
    grep -E "linear layers|workspace|fwd|bwd|->|x$" "$OUT/gemm.log"
fi
if [[ $WHAT == gap ]]; then
    if wanted gap-gemm; then
        "$BIN/gpu-timing" fp8 8 1024 > "$OUT/gap-gemm.log" 2>&1 || echo "gpu-timing fp8 failed: see $OUT/gap-gemm.log"
        grep -E "linear layers|fused|composed|as the model|x\)?$" "$OUT/gap-gemm.log"
    fi
    for L in 6 18; do
        for p in bf16 fp8; do
            ours "gap-L$L-$p" configs/gpt2-1.5b.toml --set model.n_layer=$L --set train.steps=12 \
                --set train.warmup_steps=2 --set zero.stage=1 --set train.micro_batch=8 \
                --set train.gemm_tuning='"timed"' --set "train.precision=\"$p\""
        done
    done
    grep -h -A8 "no cuBLASLt algorithm" "$OUT"/gap-L*-fp8.log 2>/dev/null | sort -u | head -20
    if command -v ncu > /dev/null && wanted gap-ncu; then
        for p in bf16 fp8; do
            ncu_2blocks "gap-ncu-$p" gpu__time_duration.sum --set "train.precision=\"$p\""
        done
        python3 - "$OUT" <<'PY' | tee "$OUT/gap-kernels.txt"
import collections, csv, sys
out = sys.argv[1]
def kernels(p):
    sums, counts = collections.Counter(), collections.Counter()
    try:
        lines = [l for l in open(f"{out}/gap-ncu-{p}.csv") if l.startswith('"')]
    except OSError:
        return sums, counts
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0][:130]
        sums[name] += float(r["Metric Value"].replace(",", "")) / 1e6 / 3  # ms per step (3 steps)
        counts[name] += 1
    return sums, counts
(b, bc), (f, fc) = kernels("bf16"), kernels("fp8")
print("kernel time per step, 2 blocks of GPT-2 1.5B width, 8x1024, eager (ncu gpu__time_duration)")
print(f"{'kernel':132} {'bf16 ms':>9} {'fp8 ms':>9} {'calls b/f':>10}")
for k in sorted(set(b) | set(f), key=lambda k: -max(b[k], f[k])):
    print(f"{k:132} {b[k]:9.3f} {f[k]:9.3f} {bc[k]:>4}/{fc[k]:<4}")
print(f"{'total':132} {sum(b.values()):9.3f} {sum(f.values()):9.3f}")
PY
    fi
fi
if [[ $WHAT == parity || $WHAT == all ]]; then
    # PARITY_VARIANTS (default "bf16 fp8"): also fp8-e4m3g (e4m3 output gradients), fp8-bf16wg
    # (the weight gradient's GEMM in bf16), fp8-e4m3g-bf16wg (both), and bf16-seed2 (bf16 with
    # another seed: the spread between two bf16 runs that an fp8 difference is read against).
    # A variant may name its seed: "fp8@1339" runs fp8 with train.seed = 1339 (rows
    # parity-*-fp8-s1339), so that each recipe's difference can be read over several seeds.
    for vs in ${PARITY_VARIANTS:-bf16 fp8}; do
        v=${vs%@*} seed=""
        [[ $vs == *@* ]] && seed=${vs#*@}
        case $v in
            bf16 | fp8) va=(--set "train.precision=\"$v\"") ;;
            fp8-e4m3g) va=(--set 'train.precision="fp8"' --set 'train.fp8_grad_format="e4m3"') ;;
            fp8-bf16wg) va=(--set 'train.precision="fp8"' --set 'train.fp8_weight_grad="bf16"') ;;
            fp8-e4m3g-bf16wg) va=(--set 'train.precision="fp8"' --set 'train.fp8_grad_format="e4m3"'
                --set 'train.fp8_weight_grad="bf16"') ;;
            bf16-seed2) va=(--set 'train.precision="bf16"' --set train.seed=1338) ;;
            *) echo "PARITY_VARIANTS: unknown variant $v (bf16, fp8, fp8-e4m3g, fp8-bf16wg, fp8-e4m3g-bf16wg, bf16-seed2)"
               exit 2 ;;
        esac
        [[ -n $seed ]] && va+=(--set train.seed="$seed") && v+="-s$seed"
        ours "parity-124m-$v" configs/gpt2-124m.toml --set "data.path=\"$DATA\"" --set train.steps=2000 \
            --set zero.stage=1 "${va[@]}"
        ours "parity-1.5b-$v" configs/gpt2-1.5b.toml --set "data.path=\"$DATA\"" --set train.steps=500 \
            --set zero.stage=1 --set train.warmup_steps=50 "${va[@]}"
        # The Llama family: the 3.2-1B shape (its 128k vocabulary over GPT-2's token ids).
        ours "parity-llama1b-$v" configs/llama-3.2-1b.toml --set "data.path=\"$DATA\"" --set train.steps=500 \
            --set train.micro_batch=4 --set zero.stage=1 --set train.warmup_steps=50 "${va[@]}"
    done
    for m in 124m 1.5b llama1b; do
        # Every variant this $OUT holds for the model, bf16 first.
        runs=()
        for d in "$OUT/parity-$m-bf16" "$OUT"/parity-"$m"-*; do
            [[ -f $d/metrics.jsonl ]] || continue
            label=${d##*/parity-"$m"-}
            [[ " ${runs[*]} " == *" $label="* ]] || runs+=("$label=$d/metrics.jsonl")
        done
        if [[ ${#runs[@]} -ge 2 ]]; then
            python3 scripts/plot_losses.py --title "$m on real text: bf16 and fp8" --csv "$OUT/parity-$m.csv" \
                --svg "$OUT/parity-$m.svg" "${runs[@]}"
        fi
    done
fi

python3 - "$OUT" <<'PY'
import glob, json, os, re, statistics, sys, tomllib
out = sys.argv[1]
GiB = 2**30

sys.path.insert(0, "scripts")
from multi_gpu_tables import model_flops_per_token as flops_per_token  # GPT-2 and Llama

rows = {}
for d in sorted(glob.glob(f"{out}/speed-*/metrics.jsonl")):
    name = d.split("/")[-2]
    m = tomllib.load(open(f"{out}/{name}/config.resolved.toml", "rb"))["model"]
    recs = [json.loads(l) for l in open(d)]
    steady = recs[5:] or recs
    dt = statistics.median(r["step_time_s"] for r in steady)
    tok = recs[-1]["tokens"] / dt
    peak = max(x.get("peak_total", 0) for r in recs for x in r["memory"]) / GiB
    dev = max((x.get("device_used", 0) or 0) for r in recs for x in r["memory"]) / GiB
    rows[name] = (tok, tok * flops_per_token(m) / 989e12, dt * 1e3, peak, dev, recs[-1]["loss"])
refs = {}
for f in sorted(glob.glob(f"{out}/ref-*.log")):
    for line in open(f):
        if line.startswith("RESULT"):
            r = json.loads(line[7:])
            refs[r["tag"]] = r
if rows or refs:
    print("| run (1 GPU) | tokens/s | model TFLOP/s as MFU of 989 | step ms | peak GiB (tracked) | device GiB | last loss | fp8 vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (tok, mfu, ms, peak, dev, loss) in rows.items():
        # Against the same model's bf16 row (speed-1.5b-fp8-bf16proj against speed-1.5b-bf16).
        base = rows.get(name.split("-fp8")[0] + "-bf16") if "-fp8" in name else None
        vs = f"**{base[2] / ms:.2f}x**" if base else ""
        print(f"| {name} | {tok/1e3:.2f}k | {100*mfu:.1f}% | {ms:.1f} | {peak:.2f} | {dev:.2f} | {loss:.4f} | {vs} |")
    for tag, r in refs.items():
        print(f"| {tag} | {r['tok_s_rank']/1e3:.2f}k | {100*r['mfu']:.1f}% | {r['step_ms']:.1f} | {r['peak_alloc_GiB']:.2f} "
              f"| {r['peak_reserved_GiB']:.2f} | {r['loss']:.4f} | |")
    comp = refs.get("ref-1.5b-compile")
    for name in ("speed-1.5b-fp8", "speed-1.5b-fp8-searched"):
        if rows.get(name) and comp:
            print(f"\n1.5B {name} vs torch.compile (same call): {comp['step_ms'] / rows[name][2]:.3f}x")
def gap_run(name):
    """A gap run's median step in ms (after its first 4 steps) and last loss, or None."""
    f = f"{out}/{name}/metrics.jsonl"
    if not os.path.exists(f):
        return None
    recs = [json.loads(l) for l in open(f)]
    return statistics.median(r["step_time_s"] for r in (recs[4:] or recs)) * 1e3, recs[-1]["loss"]

slope = {}
for p in ("bf16", "fp8"):
    t6, t18 = gap_run(f"gap-L6-{p}"), gap_run(f"gap-L18-{p}")
    if t6 and t18:
        slope[p] = (t18[0] - t6[0]) / 12
        print(f"gap {p}: step {t6[0]:.1f} ms at 6 blocks, {t18[0]:.1f} ms at 18: {slope[p]:.3f} ms a block")
if len(slope) == 2:
    print(f"gap: one block in a real step, bf16 {slope['bf16']:.3f} ms, fp8 {slope['fp8']:.3f} ms "
          f"({slope['bf16'] / slope['fp8']:.2f}x); compare gpu-timing's sums in gap-gemm.log")
for m in ("124m", "1.5b", "llama1b"):
    curves = {}
    for f in sorted(glob.glob(f"{out}/parity-{m}-*/metrics.jsonl")):
        curves[f.split(f"parity-{m}-")[1].split("/")[0]] = [json.loads(l)["loss"] for l in open(f)]
    if len(curves) < 2:
        continue
    n = min(len(c) for c in curves.values())
    tail = {p: statistics.mean(c[n - 100:n]) for p, c in curves.items()}
    if "bf16" in tail:
        others = ", ".join(f"{p} {t:.4f} ({100 * (t - tail['bf16']) / tail['bf16']:+.2f}%)"
                           for p, t in tail.items() if p != "bf16")
        print(f"parity {m}, {n} steps: mean loss of the last 100: bf16 {tail['bf16']:.4f}, {others}")
    # Over seeds: each recipe's difference from bf16 at each seed both ran, and their means.
    # Labels: "fp8" (seed 1337, the configs'), "bf16-seed2" (1338), "fp8-s1339" (VARIANT@SEED).
    by = {}  # recipe -> {seed: tail}
    for label, t in tail.items():
        recipe, seed = (label[:-6], 1338) if label.endswith("-seed2") else (label, 1337)
        if re.fullmatch(r".*-s[0-9]+", label):
            recipe, seed = label.rsplit("-s", 1)[0], int(label.rsplit("-s", 1)[1])
        by.setdefault(recipe, {})[seed] = t
    base = by.get("bf16", {})
    if len(base) >= 2:
        spread = max(base.values()) / min(base.values()) - 1
        print(f"parity {m}, {n} steps, over seeds: bf16 {statistics.mean(base.values()):.4f} "
              f"({len(base)} seeds, largest/smallest {100 * spread:+.2f}%)")
    for recipe, ts in by.items():
        both = [s for s in sorted(ts) if s in base]
        if recipe == "bf16" or len(both) < (2 if len(ts) > 1 else 1) or len(base) < 2:
            continue
        mean = statistics.mean(ts[s] for s in both) / statistics.mean(base[s] for s in both)
        print(f"  {recipe}: {len(both)} seeds, mean {100 * (mean - 1):+.2f}% against bf16 at the same seeds; "
              f"per seed " + " ".join(f"{100 * (ts[s] / base[s] - 1):+.2f}%" for s in both))
PY
archive   # the plots and CSVs made above too
