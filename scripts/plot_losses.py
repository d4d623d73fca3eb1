#!/usr/bin/env python3
"""Loss curves of runs (their metrics.jsonl) as one SVG and a CSV, with the standard library
only (the GPU machines need not have matplotlib). scripts/bench-fp8.sh draws its bf16/fp8
parity runs with it:

    plot_losses.py --title T --svg out.svg --csv out.csv [--smooth 20] LABEL=metrics.jsonl...

The CSV has one row per step: step, then each run's loss (empty past a run's end). The SVG
draws each run's loss smoothed by a moving mean over --smooth steps (raw values in the CSV).
"""
import argparse
import json

# Ten colours (then again, dashed the other way): a parity run over seeds can draw a dozen curves.
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--title", default="loss")
    ap.add_argument("--svg", required=True)
    ap.add_argument("--csv")
    ap.add_argument("--smooth", type=int, default=20)
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/metrics.jsonl")
    a = ap.parse_args()
    runs = []
    for spec in a.runs:
        label, path = spec.split("=", 1)
        recs = [json.loads(line) for line in open(path)]
        runs.append((label, [(r["step"], r["loss"]) for r in recs]))
    if a.csv:
        steps = sorted({s for _, pts in runs for s, _ in pts})
        by = [dict(pts) for _, pts in runs]
        with open(a.csv, "w") as f:
            f.write("step," + ",".join(label for label, _ in runs) + "\n")
            for s in steps:
                f.write(f"{s}," + ",".join("" if s not in d else f"{d[s]:.6f}" for d in by) + "\n")
    smoothed = []
    for label, pts in runs:
        out, acc = [], []
        for s, v in pts:
            acc.append(v)
            if len(acc) > a.smooth:
                acc.pop(0)
            out.append((s, sum(acc) / len(acc)))
        smoothed.append((label, out))
    xs = [s for _, pts in smoothed for s, _ in pts]
    ys = [v for _, pts in smoothed for _, v in pts[len(pts) // 20:]]  # leave out the first steps' height
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
    W, H, L, R, T, B = 900, 560, 80, 30, 50, 60
    px = lambda x: L + (x - x0) / max(x1 - x0, 1) * (W - L - R)
    py = lambda y: T + (y1 - min(max(y, y0), y1)) / max(y1 - y0, 1e-9) * (H - T - B)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="30" text-anchor="middle" font-size="20">{a.title}</text>',
           f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="black"/>']
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        svg.append(f'<text x="{L - 8}" y="{py(y) + 4:.1f}" text-anchor="end" font-size="12">{y:.2f}</text>')
        x = x0 + (x1 - x0) * i / 5
        svg.append(f'<text x="{px(x):.1f}" y="{H - B + 18}" text-anchor="middle" font-size="12">{x:.0f}</text>')
    svg.append(f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle" font-size="14">step</text>')
    svg.append(f'<text x="18" y="{H / 2}" text-anchor="middle" font-size="14" transform="rotate(-90 18 {H / 2})">'
               f'loss (mean of {a.smooth} steps)</text>')
    for i, (label, pts) in enumerate(smoothed):
        c = COLORS[i % len(COLORS)]
        path = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in pts)
        dash = ' stroke-dasharray="6 4"' if (i + i // len(COLORS)) % 2 else ""  # overlapping curves stay visible
        svg.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5"{dash} points="{path}"/>')
        svg.append(f'<line x1="{W - R - 140}" y1="{T + 20 + 20 * i}" x2="{W - R - 110}" y2="{T + 20 + 20 * i}" '
                   f'stroke="{c}" stroke-width="2"{dash}/>')
        svg.append(f'<text x="{W - R - 100}" y="{T + 24 + 20 * i}" font-size="14">{label}</text>')
    svg.append("</svg>")
    open(a.svg, "w").write("\n".join(svg))


if __name__ == "__main__":
    main()
