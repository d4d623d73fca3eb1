"""Markdown tables for scripts/multi-gpu.sh, from what its parts leave under OUT.

  python3 scripts/multi_gpu_tables.py OUT scaling 124m|1.5b|7b
  python3 scripts/multi_gpu_tables.py OUT largest
  python3 scripts/multi_gpu_tables.py OUT two-node
  python3 scripts/multi_gpu_tables.py OUT memory 1.5b|7b

Reads `launcher sweep`'s sweep.json, training runs' metrics.jsonl, the PyTorch references'
`RESULT {json}` lines and the part's `<part>.runs` log (runs skipped for time or failed are
listed under each table, so a missing row always says why; failures are in the table's cells).
"""
import glob, json, os, re, statistics, sys

GiB = 2**30
PEAK = 989e12  # H200 bf16 dense, the brief's MFU denominator
SHAPES = {"124m": (12, 768), "1.5b": (48, 1600), "7b": (32, 4096)}  # layers, width
V, T = 50304, 1024


def n_params(L, C, vocab=V, seq=T):
    return vocab * C + seq * C + 2 * C + L * (12 * C * C + 13 * C)


def flops_per_token(L, C, vocab=V, seq=T):
    # 6N for the matmuls (without the position table) + attention 12·L·T·C, as the reference counts
    return 6 * (n_params(L, C, vocab, seq) - seq * C) + 12 * L * seq * C


def model_flops_per_token(m):
    """Model FLOPs per token of a run's resolved `[model]` table, GPT-2 or Llama (the bench
    scripts' MFU). Llama as llama_ref.py counts it: 6 per parameter that multiplies (the
    embedding lookup is not one unless it is also the tied head) + 12·L·T·C for attention."""
    L, C, V_, T_ = m["n_layer"], m["n_embd"], m["vocab_size"], m["seq_len"]
    if m.get("family", "gpt2") != "llama":
        return flops_per_token(L, C, V_, T_)
    nh, nkv, F = m["n_head"], m.get("n_kv_head", m["n_head"]), m["intermediate_size"]
    hs, tied = C // nh, m.get("tie_embeddings", False)
    block = 2 * C + C * (nh + 2 * nkv) * hs + C * C + 3 * F * C
    n = V_ * C + L * block + C + (0 if tied else V_ * C)
    return 6 * (n - (0 if tied else V_ * C)) + 12 * L * T_ * C


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ref_results(out, name):
    """The RESULT lines of a reference run (one per rank), or its failure."""
    path = f"{out}/{name}.log"
    if not os.path.exists(path):
        return None, "not run"
    rows = []
    for line in open(path, errors="replace"):
        if line.startswith("RESULT "):
            rows.append(json.loads(line[7:]))
    if rows:
        return rows, None
    text = open(path, errors="replace").read()
    if "OutOfMemory" in text or "out of memory" in text:
        return None, "out of GPU memory"
    return None, "failed: " + (text.strip().splitlines() or ["no output"])[-1][:120]


def ref_ok(out, name):
    """(rows, None) when every rank of the reference run reported a result, else (None, why)."""
    rows, err = ref_results(out, name)
    if rows is None:
        return None, err
    if any("error" in r for r in rows):
        return None, next(r["error"] for r in rows if "error" in r)[:120]
    return rows, None


def ref_cell(out, name):
    rows, err = ref_ok(out, name)
    if rows is None:
        return None, err
    slowest = min(r["tok_s_rank"] for r in rows)
    mem = max(r.get("peak_reserved_GiB", 0) for r in rows)
    return slowest, f"{slowest / 1e3:.1f}k ({mem:.1f} GiB)"


def sweep_row(out, name):
    j = load(f"{out}/{name}/sweep.json")
    if not j or not j.get("rows"):
        return None
    return j["rows"][0]


def runs_log(out, part):
    path = f"{out}/{part}.runs"
    if not os.path.exists(path):
        return []
    notes = []
    for line in open(path):
        name, secs, what = (line.rstrip("\n").split(" ", 2) + ["", ""])[:3]
        if what.startswith(("skipped", "timed out", "not attempted")):
            notes.append(f"- `{name}`: {what}")
    return notes


def gpus_note(out):
    try:
        lines = [l.strip() for l in open(f"{out}/gpus.txt") if l.strip()]
    except OSError:
        return ""
    return f"{len(lines)} × {lines[0].split(',')[1].strip()}" if lines else ""


def scaling(out, model):
    L, C = SHAPES[model]
    fpt = flops_per_token(L, C)
    variants = {
        "124m": [("124m-z1", "ZeRO-1", ["ref-124m-fsdp", "ref-124m-fsdp-compile"]),
                 ("124m-z3", "ZeRO-3", ["ref-124m-fsdp", "ref-124m-fsdp-compile"])],
        "1.5b": [("1.5b-z3", "ZeRO-3", ["ref-1.5b-fsdp", "ref-1.5b-fsdp-compile"]),
                 ("1.5b-z3-ckpt", "ZeRO-3 + act. ckpt", ["ref-1.5b-fsdp-ckpt"])],
        "7b": [("7b-z3-ckpt", "ZeRO-3 + act. ckpt", ["ref-7b-fsdp-ckpt", "ref-7b-fsdp-ckpt-compile"])],
    }[model]
    names = [p for p in glob.glob(f"{out}/*-g*") if os.path.basename(p).startswith((f"{model}-", f"ref-{model}-"))]
    ks = sorted({int(m.group(1)) for p in names if (m := re.search(r"-g(\d+)(\.log)?$", p))})
    print(f"### Scaling: {model} ({gpus_note(out)}; tokens/s per GPU, MFU vs 989 TFLOP/s; memory = driver peak per rank)\n")
    print("| run | GPUs | shardtrain tok/s/GPU | MFU | weak scaling | step ms | GiB measured (predicted) | FSDP2 eager | FSDP2 compile | vs best FSDP2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for prefix, label, refs in variants:
        base, base_k = None, 1
        for k in ks:
            r = sweep_row(out, f"{prefix}-g{k}")
            cells = [ref_cell(out, f"{ref}-g{k}") for ref in refs]
            if r is None and all(c[0] is None and c[1] == "not run" for c in cells):
                continue
            eager = cells[0][1] if cells else "—"
            comp = next((c[1] for ref, c in zip(refs, cells) if "compile" in ref), "—")
            best = max((c[0] for c in cells if c[0] is not None), default=None)
            if r is None or r["status"] != "ok":
                why = "not run" if r is None else f"{r['status']}: {(r.get('error') or '')[:100]}"
                print(f"| {label} | {k} | {why} | | | | | {eager} | {comp} | |")
                continue
            tok = r["tokens_per_s_per_rank"]
            shape = next((resolved_shape(os.path.dirname(c)) for c in glob.glob(f"{out}/{prefix}-g{k}/runs/*/config.resolved.toml")), None)
            fpt = flops_per_token(*(shape or (L, C)))
            if base is None:  # the fewest GPUs that ran (1 unless it failed or did not fit)
                base, base_k = tok, k
            eff = f"{100 * tok / base:.1f}%" if base else "—"
            if base_k != 1:  # say what the efficiency is of when it is not the 1-GPU rate
                eff += f" of {base_k} GPUs"
            meas = (r.get("measured_device_peak_bytes") or 0) / GiB
            pred = (r.get("predicted_device_peak_bytes") or 0) / GiB
            ratio = f"{tok / best:.2f}×" if best else "—"
            print(f"| {label} | {k} | {tok / 1e3:.1f}k | {100 * tok * fpt / PEAK:.1f}% | {eff} | {1e3 * r['step_time_s']:.1f} | "
                  f"{meas:.2f} ({pred:.2f}) | {eager} | {comp} | {ratio} |")
    notes = runs_log(out, f"scaling-{model}")
    if notes:
        print("\nNot in the table:\n" + "\n".join(notes))
    print()


def metrics(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        return []


def resolved_shape(run_dir):
    try:
        cfg = open(f"{run_dir}/config.resolved.toml").read()
    except OSError:
        return None
    get = lambda k: int(re.search(rf"^{k}\s*=\s*(\d+)", cfg, re.M).group(1))
    return get("n_layer"), get("n_embd")


def largest(out):
    print(f"### Largest GPT that trains 10 steps ({gpus_note(out)}; batch 1×1024, activation checkpointing, ZeRO-3, real text)\n")
    print("| run | parameters | layers × width | steps | losses (first → last 3) | falling | median step s | tok/s per GPU | GPU GiB per rank (driver) | host GiB per node | FSDP2 at the same size |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run_dir in sorted(glob.glob(f"{out}/largest-g*")):
        if not os.path.isdir(run_dir):
            continue
        name = os.path.basename(run_dir)
        shape = resolved_shape(run_dir)
        recs = metrics(f"{run_dir}/metrics.jsonl")
        ref_rows, ref = ref_ok(out, f"ref-{name}")
        if ref_rows:
            ok = ref_rows[0]
            ref = (f"trains: {min(r['tok_s_rank'] for r in ref_rows):.0f} tok/s/GPU, "
                   f"{max(r.get('peak_reserved_GiB', 0) for r in ref_rows):.1f} GiB reserved, losses {ok['losses'][0]} → {ok['losses'][-1]}")
        if not shape:
            print(f"| {name} | | | 0 | did not start (see {name}.log) | | | | | | {ref} |")
            continue
        L, C = shape
        n = n_params(L, C) / 1e9
        if not recs:
            print(f"| {name} | {n:.2f}B | {L} × {C} | 0 | no step finished (see {name}.log) | no | | | | | {ref} |")
            continue
        losses = [r["loss"] for r in recs]
        falling = len(losses) >= 4 and statistics.mean(losses[-3:]) < losses[0]
        dt = statistics.median(r["step_time_s"] for r in (recs[1:] or recs))
        ranks = len(recs[-1]["memory"])
        tok = recs[-1]["tokens"] / ranks / dt
        dev = max((m.get("device_used") or 0) for r in recs for m in r["memory"]) / GiB
        # optimizer + params + staging (the entry's `pinned` is a part of those, not more bytes)
        host = sum(sum((m.get("host") or {}).get(k, 0) for k in ("optimizer", "params", "staging"))
                   for m in recs[-1]["memory"]) / GiB
        shown = f"{losses[0]:.2f} → " + " ".join(f"{x:.2f}" for x in losses[-3:])
        print(f"| {name} | {n:.2f}B | {L} × {C} | {len(recs)} | {shown} | {'yes' if falling else 'no'} | {dt:.2f} | {tok:.0f} | "
              f"{dev:.2f} | {host:.1f} | {ref} |")
    try:
        print("\nPlanner's choice: " + "; ".join(l.strip() for l in open(f"{out}/largest.plan")))
    except OSError:
        pass
    notes = runs_log(out, "largest")
    if notes:
        print("\nNot in the table:\n" + "\n".join(notes))
    print()


def two_node(out):
    print(f"### Two launchers as two nodes vs one launcher ({gpus_note(out)}; GPT-2 124M, batch 8 per rank, 20 steps)\n")
    print("| stage | steps (one / two) | max relative loss difference | one launcher tok/s | two launchers tok/s | losses step 1, 10, 20 (one / two) |")
    print("|---|---|---|---|---|---|")
    for stage in (1, 3):
        a = metrics(f"{out}/one-launcher-z{stage}/metrics.jsonl")
        b = metrics(f"{out}/two-launchers-z{stage}/metrics.jsonl")
        if not a or not b:
            print(f"| {stage} | {len(a)} / {len(b)} | not comparable: a run did not finish | | | |")
            continue
        diff = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
        tps = lambda recs: statistics.median(r["tokens"] / r["step_time_s"] for r in recs[2:] or recs) / 1e3
        pick = lambda recs: " ".join(f"{recs[i]['loss']:.4f}" for i in (0, 9, 19) if i < len(recs))
        print(f"| {stage} | {len(a)} / {len(b)} | {diff:.2e} | {tps(a):.1f}k | {tps(b):.1f}k | {pick(a)} / {pick(b)} |")
    notes = runs_log(out, "two-node")
    if notes:
        print("\nRuns:\n" + "\n".join(notes))
    print()


def memory(out, model):
    print(f"### Memory per rank, predicted vs measured: {model} ({gpus_note(out)}; highest rank, GiB)\n")
    print("| ranks | stage | status | driver measured | predicted (with runtime) | error | ledger measured | ledger predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(f"{out}/memory-{model}-g*/sweep.json"), key=lambda p: int(re.search(r"-g(\d+)/", p).group(1))):
        for r in load(path)["rows"]:
            pred = (r.get("predicted_device_peak_bytes") or 0) / GiB
            lpred = (r.get("predicted_peak_bytes") or 0) / GiB
            if r["status"] != "ok":
                print(f"| {r['ranks']} | {r['stage']} | {r['status']}: {(r.get('error') or '')[:90]} | | {pred:.2f} | | | {lpred:.2f} |")
                continue
            meas = (r.get("measured_device_peak_bytes") or 0) / GiB
            lmeas = (r.get("measured_peak_bytes") or 0) / GiB
            err = f"{100 * (pred - meas) / meas:+.1f}%" if meas else "—"
            print(f"| {r['ranks']} | {r['stage']} | ok | {meas:.2f} | {pred:.2f} | {err} | {lmeas:.2f} | {lpred:.2f} |")
    notes = runs_log(out, f"memory-{model}")
    if notes:
        print("\nNot in the table:\n" + "\n".join(notes))
    print()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, kind, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    {"scaling": lambda: scaling(out, rest[0]), "largest": lambda: largest(out), "two-node": lambda: two_node(out),
     "memory": lambda: memory(out, rest[0])}[kind]()
