"""Checks of scripts/multi_gpu_tables.py on a made-up $OUT (CI runs it: no GPU needed).

The largest-model table: the host column sums optimizer + params + staging per node (the
metrics' `pinned` is part of those, not more bytes), a reference run that trained shows its
slowest rank, one that failed shows why."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GiB = 2**30

with tempfile.TemporaryDirectory() as out:
    host = {"optimizer": GiB, "params": 0, "staging": GiB // 2, "pinned": GiB // 2}
    for name, h in [("largest-g2-gpu", None), ("largest-g2-offload", host)]:
        os.makedirs(f"{out}/{name}")
        open(f"{out}/{name}/config.resolved.toml", "w").write("n_layer = 4\nn_embd = 256\n")
        with open(f"{out}/{name}/metrics.jsonl", "w") as f:
            for s in range(1, 11):
                m = {"rank": 0, "device_used": 5 * GiB, **({"host": h} if h else {})}
                rec = {"step": s, "loss": 11 - 0.2 * s, "tokens": 2048, "step_time_s": 0.5, "memory": [m, dict(m, rank=1)]}
                f.write(json.dumps(rec) + "\n")
    open(f"{out}/ref-largest-g2-gpu.log", "w").write(
        'RESULT {"tok_s_rank": 100, "peak_reserved_GiB": 3.0, "losses": [11.0, 10.0]}\n'
        'RESULT {"tok_s_rank": 90, "peak_reserved_GiB": 3.5, "losses": [11.0, 10.0]}\n')
    open(f"{out}/ref-largest-g2-offload.log", "w").write('RESULT {"error": "CUDA out of memory"}\n')
    open(f"{out}/gpus.txt", "w").write("0, NVIDIA H200, 143771 MiB\n1, NVIDIA H200, 143771 MiB\n")
    table = subprocess.run([sys.executable, f"{HERE}/multi_gpu_tables.py", out, "largest"],
                           check=True, capture_output=True, text=True).stdout
    rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[1:-1]] for l in table.splitlines() if l.startswith("| largest")}
    assert rows["largest-g2-offload"][9] == "3.0", table  # 2 ranks x (1 + 0.5) GiB
    assert rows["largest-g2-gpu"][9] == "0.0", table
    assert rows["largest-g2-gpu"][10].startswith("trains: 90 tok/s/GPU, 3.5 GiB"), table
    assert rows["largest-g2-offload"][10] == "CUDA out of memory", table
    assert rows["largest-g2-gpu"][5] == "yes" and rows["largest-g2-gpu"][7] == "2048", table
# The model FLOPs the bench scripts' MFU divides by: GPT-2 124M as the reference counts it
# (6N without the position table + 12·L·T·C), and Llama as llama_ref.py does (untied: the
# embedding lookup multiplies nothing; tied: the head is the embedding and counts once).
sys.path.insert(0, HERE)
from multi_gpu_tables import flops_per_token, model_flops_per_token  # noqa: E402

gpt = {"n_layer": 12, "n_embd": 768, "vocab_size": 50304, "seq_len": 1024}
assert model_flops_per_token(gpt) == flops_per_token(12, 768) == 6 * (124_475_904 - 1024 * 768) + 12 * 12 * 1024 * 768
llama = {"family": "llama", "n_layer": 1, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "intermediate_size": 128,
         "vocab_size": 100, "seq_len": 32}
block = 2 * 64 + 64 * (4 + 2 * 2) * 16 + 64 * 64 + 3 * 128 * 64
assert model_flops_per_token({**llama, "tie_embeddings": True}) == 6 * (100 * 64 + block + 64) + 12 * 32 * 64
assert model_flops_per_token(llama) == 6 * (100 * 64 + block + 64) + 12 * 32 * 64  # the untied head, not the lookup
print("multi_gpu_tables: ok")
