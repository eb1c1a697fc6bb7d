"""Host RAM of loading a checkpoint to int8 weights: `cm.load_int8` against from_pretrained + quantizing in memory.

    python benchmarks/int8_load.py [--model llama-3.2-1b] [--limit-gb 1.5]

Writes benchmarks/results/int8_load.json. A random checkpoint of `--model`'s architecture in bf16 (Llama-3.2-1B:
1.24B parameters, 2.47 GB) is written once with `save_pretrained(max_shard_size="500MB")` to a temporary folder
(deleted at the end), then loaded to int8 weights on this CPU in two fresh processes:

- from_pretrained: `AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)`, then
  `int8train.quantize_model_int8`: the 16-bit model whole in host RAM, then its int8 copy;
- load_int8: `cm.load_int8(folder, dtype=torch.bfloat16, device="cpu")`: one memory-mapped tensor at a time.

Each process imports everything and loads a small checkpoint first, then resets the kernel's high-water mark
(writing 5 to /proc/self/clear_refs) and reads its RSS (the baseline); its peak RSS is then VmHWM, the load's own.
`added_bytes` = peak - baseline. (Not `ru_maxrss`: a child started by vfork and exec inherits the parent's
high-water mark, which here held the 2.47 GB written; both loads then read the parent's 2.98 GB.) On a GPU the int8 weights go to the device, so the
host RAM a load needs there is what it holds beyond them: `beyond_int8_bytes` = added - the int8 model's bytes.
Colab's 12.7 GB against an 8B model's 16 GB of bf16 is emulated at this scale by `--limit-gb` (1.5 GB against
2.47 GB): the load fits when `beyond_int8_bytes` stays under it. The plan's figures (`loading.load_host_bytes`
with an int8-weight recipe, to 'cpu' as measured here and to 'cuda') stand beside, and the 8B load is planned
against Colab's 12.7 GB. Figures are this CPU's.
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

OUT = ROOT / "benchmarks" / "results" / "int8_load.json"
RECIPE = dict(weight_dtype="int8", optimizer="adalomo", precision="fp16")

_CHILD = """
import json, re, sys, time
from pathlib import Path
import torch, transformers, accelerate, safetensors
import colab_memopt as cm
from colab_memopt.techniques.architectures import small_config
from colab_memopt.techniques.int8train import int8_state_bytes, int8_weights, quantize_model_int8
folder = sys.argv[1]
with torch.device("meta"):
    transformers.AutoModelForCausalLM.from_config(small_config("llama"))
cm.load_int8(sys.argv[2], dtype=torch.bfloat16, device="cpu")  # warm-up: every import the load makes
status = lambda key: int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
before = status("VmRSS")
start = time.perf_counter()
if sys.argv[3] == "load_int8":
    model = cm.load_int8(folder, dtype=torch.bfloat16, device="cpu")
else:
    model = quantize_model_int8(transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16))
seconds = time.perf_counter() - start
peak = status("VmHWM")
held = int8_state_bytes(int8_weights(model)) + sum(p.numel() * p.element_size() for p in model.parameters()
                                                   if p.dtype != torch.int8 and p.dtype != torch.float32)
print(json.dumps({"baseline_rss_bytes": before, "peak_rss_bytes": peak, "added_bytes": peak - before,
                  "after_rss_bytes": status("VmRSS"), "int8_model_bytes": held, "seconds": round(seconds, 1)}))
"""


def _write_checkpoint(model: str, folder: Path) -> dict:
    """Write a random bf16 checkpoint of `model`'s architecture with save_pretrained in 500 MB shards."""
    import transformers

    from colab_memopt.techniques.architectures import resolve_model

    config = resolve_model(model).config
    with torch.device("meta"):
        shape = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)  # tied weights: once
             for name, p in shape.named_parameters()}
    shape.save_pretrained(folder, state_dict=state, max_shard_size="500MB")
    del state
    shards = sorted(folder.glob("*.safetensors"))
    return {"model": model, "params": sum(p.numel() for p in shape.parameters()), "dtype": "bfloat16",
            "checkpoint_bytes": sum(p.stat().st_size for p in shards), "shards": len(shards),
            "largest_shard_bytes": max(p.stat().st_size for p in shards)}


def _measure(folder: Path, warm: Path, how: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(folder), str(warm), how],
                         capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{how} failed: {out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["beyond_int8_bytes"] = row["added_bytes"] - row["int8_model_bytes"]
    return row


EIGHT_B_ROWS = {"llama-3.1-8b (the published checkpoint: bfloat16)": None,
                "llama-3.1-8b in float32 (a float32 copy of the checkpoint)": torch.float32}


def eight_b_rows(recipe) -> dict:
    """Return the 8B host-RAM plans of load_int8 against the classic load, per checkpoint dtype (computed, not
    measured: this machine cannot hold the 8B's classic load)."""
    from colab_memopt.planning.targets import get_target
    from colab_memopt.techniques.architectures import resolve_model
    from colab_memopt.training.loading import load_host_bytes

    t4 = get_target("t4")
    rows = {}
    for label, dtype in EIGHT_B_ROWS.items():
        model = "llama-3.1-8b"
        if dtype is not None:
            model = resolve_model("llama-3.1-8b").config
            model.dtype = dtype
        plan = load_host_bytes(model, recipe, "cuda")
        rows[label] = {"host_bytes": plan.host_bytes, "classic_host_bytes": plan.classic_host_bytes,
                       "colab_host_bytes": t4.host_bytes, "fits": plan.host_bytes < t4.host_bytes, "path": plan.path}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--limit-gb", type=float, default=1.5)
    parser.add_argument("--plans-only", action="store_true",
                        help="recompute only the 8B plans in the committed results (no measurement)")
    args = parser.parse_args()
    if args.plans_only:
        import colab_memopt as cm

        result = json.loads(OUT.read_text())
        result["llama_3_1_8b_on_colab"] = eight_b_rows(cm.Recipe(**result["recipe"]))
        OUT.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["llama_3_1_8b_on_colab"], indent=2))
        return

    import transformers

    import colab_memopt as cm
    from colab_memopt.techniques.architectures import small_config
    from colab_memopt.training.loading import load_host_bytes, safetensors_largest_bytes

    limit = int(args.limit_gb * 1e9)
    recipe = cm.Recipe(**RECIPE)
    with tempfile.TemporaryDirectory(prefix="int8_load_") as tmp:
        folder, warm = Path(tmp) / "model", Path(tmp) / "warm"
        start = time.perf_counter()
        checkpoint = _write_checkpoint(args.model, folder)
        checkpoint["largest_tensor_bytes"] = safetensors_largest_bytes(folder)
        checkpoint["write_seconds"] = round(time.perf_counter() - start, 1)
        transformers.AutoModelForCausalLM.from_config(small_config("llama")).save_pretrained(warm)
        print(f"wrote {checkpoint}", flush=True)
        rows = {}
        for how in ("load_int8", "from_pretrained"):
            rows[how] = _measure(folder, warm, how)
            print(how, rows[how], flush=True)
        planned = {dev: load_host_bytes(str(folder), recipe, dev).host_bytes for dev in ("cpu", "cuda")}
    eight_b = eight_b_rows(recipe)
    result = {
        "device": f"cpu ({os.cpu_count()} cores, {platform.machine()}), torch {torch.__version__}",
        "recipe": RECIPE,
        "checkpoint": checkpoint,
        "emulated_limit_bytes": limit,
        "measured": rows,
        "planned_host_bytes": planned,
        "load_int8_within_limit": rows["load_int8"]["beyond_int8_bytes"] <= limit,
        "from_pretrained_within_limit": rows["from_pretrained"]["beyond_int8_bytes"] <= limit,
        "plan_covers_measured": rows["load_int8"]["added_bytes"] <= planned["cpu"],
        "llama_3_1_8b_on_colab": eight_b,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    gb = 1e9
    print(f"{args.model}: checkpoint {checkpoint['checkpoint_bytes'] / gb:.2f} GB in {checkpoint['shards']} shards; "
          f"emulated host limit {limit / gb:.2f} GB beyond the int8 weights")
    for how, row in rows.items():
        print(f"  {how:16s} +{row['added_bytes'] / gb:.2f} GB peak, {row['beyond_int8_bytes'] / gb:.2f} GB beyond "
              f"the int8 weights, {row['seconds']} s")
    print(f"  planned (load_int8 to cpu) {planned['cpu'] / gb:.2f} GB, to cuda {planned['cuda'] / gb:.2f} GB")
    for label, row in eight_b.items():
        print(f"  {label}: {row['host_bytes'] / gb:.2f} GB of {row['colab_host_bytes'] / gb:.1f} GB")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
