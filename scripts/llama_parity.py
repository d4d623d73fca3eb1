# Hugging Face transformers' side of scripts/llama-parity.sh (run on the GPU machine):
#   python3 llama_parity.py make DIR [--dtype float32|bfloat16]   a random LlamaForCausalLM, save_pretrained(DIR)
#   python3 llama_parity.py loss DIR SHARDS --seq T --windows N     its mean loss on the first N windows
# The windows are `launcher eval`'s: the validation shards (llm.c format, *val*.bin, in
# file-name order) read as one stream; window i = tokens i*T .. i*T+T, targets one later.
import argparse, glob, json, math, os
import numpy as np
import torch

def windows(shards, t, n):
    need = n * t + 1
    toks = []
    for f in sorted(glob.glob(os.path.join(shards, "*val*.bin"))):
        with open(f, "rb") as fh:
            header = np.frombuffer(fh.read(256 * 4), dtype=np.int32)
            wide = header[0] == 20240801  # llm.c's 32-bit shards; 20240520: 16-bit
            data = np.frombuffer(fh.read(), dtype=np.uint32 if wide else np.uint16)[: int(header[2])]
        toks.append(data.astype(np.int64))
        if sum(map(len, toks)) >= need:
            break
    s = np.concatenate(toks)[:need]
    assert len(s) == need, f"{len(s)} tokens, need {need}"
    x = torch.from_numpy(s[:-1].reshape(n, t).copy())
    y = torch.from_numpy(s[1:].reshape(n, t).copy())
    return x, y

p = argparse.ArgumentParser()
sub = p.add_subparsers(dest="cmd", required=True)
m = sub.add_parser("make")
m.add_argument("dir")
m.add_argument("--dtype", default="float32")
m.add_argument("--layers", type=int, default=4)
m.add_argument("--hidden", type=int, default=512)
m.add_argument("--heads", type=int, default=8)
m.add_argument("--kv-heads", type=int, default=2)
m.add_argument("--mlp", type=int, default=1408)
m.add_argument("--tied", action="store_true")
l = sub.add_parser("loss")
l.add_argument("dir")
l.add_argument("shards")
l.add_argument("--seq", type=int, required=True)
l.add_argument("--windows", type=int, required=True)
a = p.parse_args()

from transformers import LlamaConfig, LlamaForCausalLM
if a.cmd == "make":
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=a.hidden, intermediate_size=a.mlp, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=a.tied, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    model = LlamaForCausalLM(cfg)
    # transformers draws every matrix with std 0.02 and RMSNorm weights 1: give the norms
    # values of their own, so a norm applied to the wrong tensor shows in the loss.
    with torch.no_grad():
        for n, t in model.named_parameters():
            if n.endswith("norm.weight"):
                t.uniform_(0.5, 1.5)
    model.to(getattr(torch, a.dtype)).save_pretrained(a.dir)
    print(json.dumps({"made": a.dir, "params": sum(t.numel() for t in model.parameters()), "dtype": a.dtype}))
else:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32).to(dev).eval()
    x, y = windows(a.shards, a.seq, a.windows)
    out = {"device": dev}
    modes = [("fp32", torch.autocast(dev, enabled=False))]
    if dev == "cuda":
        modes.append(("bf16_autocast", torch.autocast("cuda", dtype=torch.bfloat16)))
    for name, ctx in modes:
        total = 0.0
        with torch.no_grad(), ctx:
            for i in range(a.windows):
                logits = model(x[i : i + 1].to(dev)).logits.float()
                total += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y[i].to(dev)).item()
        out[name] = total / a.windows
    out["perplexity_fp32"] = math.exp(out["fp32"])
    print(json.dumps(out))
