"""Host RAM of a 4-bit `from_pretrained` on the CPU, measured against `loading.quantized_load_bytes`' plan.

    python benchmarks/qlora_load.py [--layers 8] [--shard 80MB] [--transformers-path DIR]

Writes benchmarks/results/qlora_load.json. Random Llama checkpoints (hidden 1024, 16 heads, 4 KV heads, MLP 2816,
32,000 tokens, untied head; `--layers` layers) are written once in bf16 and in fp16 with `save_pretrained(
max_shard_size=--shard)` to a temporary folder (deleted at the end), then each is loaded in a fresh process with

    AutoModelForCausalLM.from_pretrained(folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
        bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype), device_map={"": "cpu"}, dtype=dtype)

(bitsandbytes' 4-bit layers quantize on the CPU), for three cases: bf16 kept as bf16, fp16 kept as fp16, and bf16
loaded as fp16 (a T4's choice: every tensor cast while it is read); each with glibc's heap as it is ("default":
freed blocks under its raised mmap threshold stay in the heap) and limited first ("limited":
`loading.limit_heap_retention()`, every block of 128 KiB or more handed back when freed). Each process first loads a
small checkpoint
the same way (every import and pool the load uses), hands freed heap back, resets the kernel's high-water mark
(writing 5 to /proc/self/clear_refs) and reads its RSS; the load's peak is then VmHWM less that baseline. A thread
samples RssAnon (what the process allocated) and RssFile (the checkpoint's mapped pages) every millisecond, so the
split of the peak is sampled while VmHWM is exact. The plan for each case (`quantized_load_bytes(folder,
device="cpu", dtype=...)`) stands beside the measurement.

`--transformers-path DIR` also loads the bf16-as-fp16 case (heap limited) with the transformers release installed
in DIR (`pip install --no-deps --target DIR transformers==5.3.0`) first on the path, as it is and with
HF_DEACTIVATE_ASYNC_LOAD=1, to see what a release that reads in threads does; its rows carry that version. The GPU side (the device's peak) is not measurable here: the plan gives
it from transformers' code path (quantized_load_bytes' docstring cites the lines). Figures are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "qlora_load.json"
SHAPE = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816,
             vocab_size=32000, tie_word_embeddings=False)
CASES = (("bfloat16", None), ("float16", None), ("bfloat16", "float16"))  # (checkpoint dtype, from_pretrained dtype)

CHILD = """
import ctypes, json, re, sys, threading, time, warnings
from pathlib import Path
warnings.simplefilter("ignore")
import torch, transformers
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
folder, warm, dtype_name, heap = sys.argv[1:5]
status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
ckpt = json.loads((Path(folder) / "config.json").read_text())["dtype"]
dtype = getattr(torch, dtype_name if dtype_name != "auto" else ckpt)
kwargs = dict(quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
              bnb_4bit_compute_dtype=dtype), device_map={"": "cpu"})
if dtype_name != "auto":
    kwargs["dtype"] = dtype
transformers.logging.set_verbosity_error()
if heap == "limited":
    from colab_memopt.training.loading import limit_heap_retention
    assert limit_heap_retention()
AutoModelForCausalLM.from_pretrained(warm, **kwargs)  # warm-up: every import the load makes
ctypes.CDLL("libc.so.6").malloc_trim(0)
peak = {"RssAnon": 0, "RssFile": 0}
done = threading.Event()
def sample():
    while not done.is_set():
        text = Path("/proc/self/status").read_text()
        for key in peak:
            peak[key] = max(peak[key], int(re.search(key + r":\\s+(\\d+) kB", text).group(1)) * 1024)
        time.sleep(0.001)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
before = {key: status(key) for key in ("VmRSS", "RssAnon", "RssFile")}
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
seconds = time.perf_counter() - start
done.set()
thread.join()
hwm = status("VmHWM")
quantized = kept = 0
seen = set()
for p in model.parameters():
    if id(p) in seen:
        continue
    seen.add(id(p))
    if type(p).__name__ == "Params4bit":
        qs = p.quant_state
        quantized += p.numel() * p.element_size() + qs.absmax.numel() * qs.absmax.element_size()
    else:
        kept += p.numel() * p.element_size()
print(json.dumps({"transformers": transformers.__version__, "heap": heap, "baseline_rss_bytes": before["VmRSS"],
                  "peak_rss_bytes": hwm, "added_bytes": hwm - before["VmRSS"],
                  "anon_added_bytes": peak["RssAnon"] - before["RssAnon"],
                  "file_added_bytes": peak["RssFile"] - before["RssFile"],
                  "after_added_bytes": status("VmRSS") - before["VmRSS"],
                  "quantized_bytes": quantized, "kept_bytes": kept, "seconds": round(seconds, 1)}))
"""


def write_checkpoint(folder: Path, dtype: torch.dtype, layers: int, shard: str, shape: dict | None = None) -> dict:
    """Write a random Llama checkpoint of `shape` (default SHAPE) with `layers` layers in `dtype`, in shards of
    `shard`."""
    import transformers

    config = transformers.LlamaConfig(**(shape or SHAPE), num_hidden_layers=layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, max_shard_size=shard)
    shards = sorted(folder.glob("*.safetensors"))
    return {"dtype": str(dtype).removeprefix("torch."), "params": sum(p.numel() for p in model.parameters()),
            "checkpoint_bytes": sum(p.stat().st_size for p in shards), "shards": len(shards),
            "largest_shard_bytes": max(p.stat().st_size for p in shards)}


def measure(folder: Path, warm: Path, dtype: str | None, heap: str = "default", transformers_path: str | None = None,
            env: dict[str, str] | None = None) -> dict:
    """Load `folder` in 4 bits on the CPU in a fresh process; return its measured row."""
    path = os.pathsep.join([p for p in (transformers_path, str(ROOT)) if p])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(os.cpu_count() or 1), **(env or {})}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(folder), str(warm), dtype or "auto", heap],
                         capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"the load of {folder} failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_row(folder: Path, dtype: str | None, version: str | None = None) -> dict:
    from colab_memopt.training.loading import quantized_load_bytes

    plans = {}
    for device in ("cpu", "cuda"):
        p = quantized_load_bytes(str(folder), device=device, dtype=getattr(torch, dtype) if dtype else None,
                                 transformers_version=version)
        plans[device] = {"host_bytes": p.host_bytes, "host_anon_bytes": p.host_anon_bytes,
                         "device_bytes": p.device_bytes, "quantized_bytes": p.quantized_bytes,
                         "kept_bytes": p.kept_bytes, "transient_bytes": p.transient_bytes,
                         "transient_tensor": p.transient_tensor, "spikes": p.spikes, "fix": p.fix}
    return plans


def _row(folder: Path, warm: Path, ckpt: str, dtype: str | None, heap: str, rows: dict,
         transformers_path: str | None = None, env: dict[str, str] | None = None) -> None:
    row = measure(folder, warm, dtype, heap, transformers_path, env)
    version = row["transformers"]
    label = (f"{ckpt} checkpoint, dtype={dtype or 'auto'}, heap {heap}, transformers {version}"
             + "".join(f", {k}={v}" for k, v in (env or {}).items()))
    row["env"] = env or {}
    row["planned"] = plan_row(folder, dtype, version)
    if env and env.get("HF_DEACTIVATE_ASYNC_LOAD"):  # that setting makes the threaded release load as 5.4 does
        row["planned"] = plan_row(folder, dtype, "5.4.0")
    row["plan_covers_peak"] = row["added_bytes"] <= row["planned"]["cpu"]["host_bytes"]
    row["plan_covers_allocated"] = row["anon_added_bytes"] <= row["planned"]["cpu"]["host_anon_bytes"]
    rows[label] = row
    print(label, json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard", default="80MB")
    parser.add_argument("--transformers-path", default=None)
    args = parser.parse_args()

    import transformers

    from colab_memopt.core.fileio import write_json
    from colab_memopt.training.loading import quantized_load_bytes

    rows: dict = {}
    with tempfile.TemporaryDirectory(prefix="qlora_load_") as tmp:
        checkpoints = {}
        folders = {}
        for name in ("bfloat16", "float16"):
            folders[name] = Path(tmp) / name
            checkpoints[name] = write_checkpoint(folders[name], getattr(torch, name), args.layers, args.shard)
            write_checkpoint(Path(tmp) / f"warm_{name}", getattr(torch, name), 1, "2MB")
            print(f"wrote {checkpoints[name]}", flush=True)
        for ckpt, dtype in CASES:
            for heap in ("default", "limited"):
                _row(folders[ckpt], Path(tmp) / f"warm_{ckpt}", ckpt, dtype, heap, rows)
        if args.transformers_path:
            for env in ({}, {"HF_DEACTIVATE_ASYNC_LOAD": "1"}):
                _row(folders["bfloat16"], Path(tmp) / "warm_bfloat16", "bfloat16", "float16", "limited", rows,
                     args.transformers_path, env)
    eight_b = {}
    for version in (transformers.__version__, "5.3.0"):
        plan = quantized_load_bytes("llama-3.1-8b", device="cuda", dtype=torch.float16, transformers_version=version)
        eight_b[version] = {"device_bytes": plan.device_bytes, "host_bytes": plan.host_bytes,
                            "host_anon_bytes": plan.host_anon_bytes, "spikes": plan.spikes, "fix": plan.fix,
                            "source": plan.source}
    result = {
        "device": f"cpu ({os.cpu_count()} cores, {platform.machine()}), torch {torch.__version__}",
        "shape": {**SHAPE, "num_hidden_layers": args.layers, "max_shard_size": args.shard},
        "checkpoints": checkpoints,
        "measured": rows,
        "gpu_measured": "not measurable here (no GPU): the device peak is planned from transformers' code path",
        "llama_3_1_8b_to_a_gpu_in_fp16": eight_b,
        "written": time.strftime("%Y-%m-%d"),
    }
    write_json(OUT, result)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
