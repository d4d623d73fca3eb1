"""PyTorch FSDP2's attempt at a large GPT, for the largest-model rows of scripts/multi-gpu.sh.

The same GPT as ../shared/reference/fsdp_gpt2.py (pre-LN blocks, tied embeddings, tanh GELU,
SDPA, bf16 mixed precision with fp32 reduction, fused AdamW), but built the way an FSDP2 user
builds a model that does not fit one GPU: on the meta device, sharded per block with
fully_shard, then materialised shard by shard (to_empty) and initialised in place. The shared
reference builds the whole fp32 model on every GPU first, which fails far below FSDP2's limit.

  torchrun --standalone --nproc_per_node=4 scripts/fsdp_large.py --layers 48 --embd 7168 \
      --heads 56 --batch 1 --ckpt [--offload]

Prints one `RESULT {json}` line per rank on success (rank 0 prints them all), or
`RESULT {"error": ...}` when it runs out of GPU memory, so a failed attempt is a table row too.
"""
import argparse, json, os, time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, required=True)
p.add_argument("--embd", type=int, required=True)
p.add_argument("--heads", type=int, required=True)
p.add_argument("--vocab", type=int, default=50304)
p.add_argument("--seq", type=int, default=1024)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--ckpt", action="store_true", help="activation checkpoint per block")
p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy: parameters, gradients and the optimizer on the host")
p.add_argument("--tag", default="")
p.add_argument("--cpu", action="store_true", help="gloo on CPU tensors (a smoke test of this script without a GPU)")
a = p.parse_args()


class Block(nn.Module):
    def __init__(s, d, h):
        super().__init__()
        s.ln1 = nn.LayerNorm(d); s.attn = nn.Linear(d, 3 * d); s.proj = nn.Linear(d, d)
        s.ln2 = nn.LayerNorm(d); s.fc = nn.Linear(d, 4 * d); s.fc2 = nn.Linear(4 * d, d); s.h = h

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.attn(s.ln1(x)).split(C, dim=2)
        q, k, v = (t.reshape(B, T, s.h, C // s.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + s.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + s.fc2(F.gelu(s.fc(s.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(s):
        super().__init__()
        s.wte = nn.Embedding(a.vocab, a.embd); s.wpe = nn.Embedding(a.seq, a.embd)
        s.blocks = nn.ModuleList([Block(a.embd, a.heads) for _ in range(a.layers)])
        s.lnf = nn.LayerNorm(a.embd)

    def forward(s, idx, tgt):
        x = s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in s.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if a.ckpt else b(x)
        logits = F.linear(s.lnf(x), s.wte.weight)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1))


dist.init_process_group("gloo" if a.cpu else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
if a.cpu:
    dev = torch.device("cpu")
else:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
nparam = 0
result = dict(tag=a.tag, world=world, rank=rank, layers=a.layers, embd=a.embd, batch=a.batch, offload=a.offload, ckpt=a.ckpt)
try:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT()
    nparam = sum(t.numel() for t in model.parameters())
    # bf16 compute is for the GPU; the CPU smoke test keeps fp32 (gloo has no bf16 matmul path worth testing).
    kw = {} if a.cpu else dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if a.offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    # With CPU offload the shards live on the host from the start (as torchtitan does).
    model.to_empty(device="cpu" if (a.offload or a.cpu) else dev)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".ln" in name or name.startswith("lnf"):
                (t.fill_(1.0) if name.endswith("weight") else t.zero_())
            elif name.endswith("bias"):
                t.zero_()
            else:
                nn.init.normal_(t, 0.0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not (a.offload or a.cpu))
    g = torch.Generator(device=dev); g.manual_seed(rank)
    if not a.cpu:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(a.steps):
        x = torch.randint(0, 50257, (a.batch, a.seq + 1), device=dev, generator=g)
        if not a.cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        times.append(time.perf_counter() - t0)
    steady = sorted(times[1:] or times)
    dt = steady[len(steady) // 2]
    tps = a.batch * a.seq / dt
    flops_tok = 6 * (nparam - a.seq * a.embd) + 12 * a.layers * a.seq * a.embd
    result.update(params_M=round(nparam / 1e6, 1), step_ms=round(dt * 1e3, 1), tok_s_rank=round(tps), mfu=round(tps * flops_tok / 989e12, 4),
                  losses=losses)
    if not a.cpu:
        result.update(peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2))
except torch.OutOfMemoryError as e:
    result.update(params_M=round(nparam / 1e6, 1), error="CUDA out of memory: " + str(e).splitlines()[0][:200])
outs = [None] * world
dist.all_gather_object(outs, result)
if rank == 0:
    for o in outs:
        print("RESULT", json.dumps(o), flush=True)
dist.destroy_process_group()
