"""PyTorch's FP8 training beside ours: the carried PyTorch reference (fsdp_gpt2.py) with
torchao's float8 linear layers (tensorwise scaling, the recipe torchao reports +25% at
Llama-3-8B with) swapped in, for scripts/bench-fp8.sh's table.

  python3 scripts/torchao_fp8_ref.py REFERENCE.py [RECIPE] -- REFERENCE'S ARGS...
      e.g. scripts/torchao_fp8_ref.py .carry/fsdp_gpt2.py tensorwise -- --mode single --layers 48 \\
           --embd 1600 --heads 25 --batch 8 --compile --warmup 8 --tag ref-1.5b-torchao-fp8

torchao comes from a wheel carried beside it (scripts/build-gpu.sh downloads it into .carry/;
the GPU machine has no network): put its install directory on PYTHONPATH. The reference builds
its model and moves it to the GPU before sharding, the optimizer and torch.compile; the swap
happens at that move, so every later step sees the float8 layers (the LM head is F.linear on
the embedding, not an nn.Linear, so it stays in bf16 as ours does).
"""
import runpy
import sys

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

if len(sys.argv) < 3 or "--" not in sys.argv:
    sys.exit(__doc__)
split = sys.argv.index("--")
ref, recipe = sys.argv[1], (sys.argv[2] if split > 2 else "tensorwise")
config = Float8LinearConfig.from_recipe_name(recipe)
_to = torch.nn.Module.to


def to_then_float8(self, *args, **kwargs):
    out = _to(self, *args, **kwargs)
    if type(self).__name__ == "GPT" and not getattr(self, "_float8_done", False):
        self._float8_done = True
        convert_to_float8_training(out, config=config)
        swapped = sum(1 for m in out.modules() if type(m).__name__ == "Float8Linear")
        print(f"torchao {recipe}: {swapped} linear layers in float8", flush=True)
    return out


torch.nn.Module.to = to_then_float8
sys.argv = [ref] + sys.argv[split + 1 :]
runpy.run_path(ref, run_name="__main__")
