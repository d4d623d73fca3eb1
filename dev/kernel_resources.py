# Registers, spills and shared memory of every kernel in a CUDA kernel file, without a GPU:
# NVRTC (libnvrtc, as the trainer compiles) to PTX, then ptxas -v for the target.
#   python3 dev/kernel_resources.py attention [sm_90a] [-DNAME=VALUE ...] [--sass=KERNEL]
# Needs libnvrtc.so.13 on LD_LIBRARY_PATH and ptxas on PATH (PyPI: nvidia-cuda-nvrtc and
# nvidia-cuda-nvcc 13.0 carry both). Defines default to what the trainer passes. --sass=KERNEL
# also prints that kernel's SASS and its instruction mix (cuobjdump on PATH: PyPI's
# nvidia-cuda-cuobjdump).
import ctypes, os, re, subprocess, sys, tempfile
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer", "src", "backend", "cuda")
sass = [a[7:] for a in sys.argv[1:] if a.startswith("--sass=")]
sys.argv = [a for a in sys.argv if not a.startswith("--sass=")]
name = sys.argv[1] if len(sys.argv) > 1 else "attention"
arch = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("-D") else "sm_90a"
defs = [a for a in sys.argv[2:] if a.startswith("-D")] or ["-DTILE=64", "-DNTHREADS=256", "-DLDP=80"]
src = open(os.path.join(root, "common.cuh")).read() + f'\n#line 1 "{name}.cu"\n' + open(os.path.join(root, name + ".cu")).read()
nv = ctypes.CDLL("libnvrtc.so.13")
prog = ctypes.c_void_p()
assert nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None) == 0
opts = [f"--gpu-architecture=compute_{arch[3:]}", "--std=c++17"] + defs
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
nv.nvrtcGetProgramLog(prog, log)
if rc != 0:
    sys.exit("NVRTC failed:\n" + log.value.decode())
nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
nv.nvrtcGetPTX(prog, ptx)
with tempfile.TemporaryDirectory() as d:
    p = os.path.join(d, "k.ptx")
    open(p, "wb").write(ptx.value)
    r = subprocess.run(["ptxas", "-v", f"-arch={arch}", p, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    for k in sass:
        dump = subprocess.run(["cuobjdump", "-sass", "-fun", k, os.path.join(d, "k.cubin")], capture_output=True,
                              text=True, check=True).stdout
        print(dump)
        ops = {}
        for ln in dump.splitlines():
            m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
            if m:
                op = m.group(1).split(".")[0]
                ops[op] = ops.get(op, 0) + 1
        print(f"{k}: {sum(ops.values())} instructions;", ", ".join(f"{o} {n}" for o, n in sorted(ops.items(), key=lambda x: -x[1])))
if r.returncode != 0:
    sys.exit("ptxas failed:\n" + r.stderr)
for line in r.stderr.splitlines():
    if "warning" in line.lower() or re.search(r"\(C7\d{3}\)", line):  # e.g. wgmma serialized or fenced
        print(line)
fn = None
for line in r.stderr.splitlines():
    m = re.search(r"Compiling entry function '(\w+)'", line)
    if m:
        fn = m.group(1)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and fn:
        spill = f"stack {m.group(1)} spill st/ld {m.group(2)}/{m.group(3)}"
    m = re.search(r"Used (\d+) registers", line)
    if m and fn:
        print(f"{fn:<28} {m.group(1):>4} registers  {spill}")
        fn = None
