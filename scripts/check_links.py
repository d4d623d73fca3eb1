#!/usr/bin/env python3
"""Check every relative link (and #anchor) in README.md, BENCHMARKS.md, dev/README.md and
docs/**/*.md (the run logs in docs/bench-log/ aside: they are kept as written) resolves.
CI runs it. Usage: check_links.py REPO_ROOT [EXPECTED_MISSING...]  (paths relative to the root)."""
import os, re, sys
root = os.path.abspath(sys.argv[1]); expected = set(sys.argv[2:])
link = re.compile(r'(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)')
def slug(h):
    h = h.strip().lower()
    h = re.sub(r'[^\w\- ]', '', h)  # GitHub: drop punctuation except - and _
    return h.replace(' ', '-')
def anchors(path):
    out, seen, fence = set(), {}, False
    for line in open(path, encoding='utf-8'):
        if line.startswith('```'): fence = not fence; continue
        if fence: continue
        m = re.match(r'#{1,6}\s+(.*)', line)
        if m:
            s = slug(re.sub(r'`', '', m.group(1)))
            n = seen.get(s, 0); seen[s] = n + 1
            out.add(s if n == 0 else f'{s}-{n}')
    return out
files = [os.path.join(root, f) for f in ('README.md', 'BENCHMARKS.md', 'dev/README.md')]
for d, _, fs in os.walk(os.path.join(root, 'docs')):
    if '/docs/bench-log' in d + '/': continue
    files += [os.path.join(d, f) for f in fs if f.endswith('.md')]
bad, missing_expected = [], set()
for f in sorted(files):
    text = open(f, encoding='utf-8').read()
    text = re.sub(r'```.*?```', '', text, flags=re.S)
    text = re.sub(r'`[^`\n]*`', '', text)
    for m in link.finditer(text):
        t = m.group(1) or m.group(2)
        if re.match(r'[a-z]+:', t): continue
        path, _, frag = t.partition('#')
        target = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        rel = os.path.relpath(target, root)
        if not os.path.exists(target):
            if any(rel == e or rel.startswith(e.rstrip('/') + '/') for e in expected):
                missing_expected.add(rel); continue
            bad.append(f'{os.path.relpath(f, root)}: {t} (no {rel})'); continue
        if frag and target.endswith('.md') and frag not in anchors(target):
            bad.append(f'{os.path.relpath(f, root)}: {t} (no anchor #{frag} in {rel})')
print(f'{len(files)} files checked; expected to exist (written by others): {sorted(missing_expected)}')
for b in bad: print('BROKEN', b)
sys.exit(1 if bad else 0)
