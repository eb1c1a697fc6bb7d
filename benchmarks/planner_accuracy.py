"""How far is the planner from measurement? Predicted vs measured peak over a grid of configurations.

    python benchmarks/planner_accuracy.py [--grid all|full|foreach|quick|cuda] [--out FILE]

Writes benchmarks/results/planner_accuracy.json (or --out): one row per configuration (predicted,
measured, relative error, device, `optimizer_impl`), the time and memory of planning a ~1B-parameter
model, and the worst error, which is printed last.

Each row names the optimizer implementation it planned and measured: 'single-tensor' (torch's choice
on the CPU) or 'foreach' (torch's choice on CUDA, forced on the CPU with `faketrace.set_optimizer_impl`
for the measurement and traced the same way by the planner). On CUDA the implementation is torch's
own choice and like is compared with like: the prediction is `Plan.step_peak_bytes` (the tensors at the
peak plus the step's own transients the trace cannot see, such as 4-bit dequantization) and the
measurement the foreign-corrected step peak (`MemoryReport.peak_bytes`): both leave out the fixed costs
(the cuBLAS and cuBLASLt workspaces, allocated in the warm-up). The raw `max_memory_allocated` and
`Plan.allocator_peak_bytes` (which adds every workspace) are recorded beside them. CUDA rows are the
configurations planned at 64 MiB or more (smaller ones are left out and counted). A run labelled
'<gpu> emulating t4' (`--label`, as gpucheck passes it) makes its GPU a T4 first (`env.apply_emulation`, in
this process), so that its rows are what the label says. Plans are given CPU-built factories. Pass: CPU within 1%
everywhere; CUDA within 5%; a ~1B plan under 20 s and 1 GB of RAM.

`--zero` plans `Recipe(zero_stage=1|2|3)` and measures the engine `Recipe.build` makes (one process on the
CPU, `measure_step` reading DeepSpeed's flat buffers too), and compares 2 ranks' per-rank model states with
the ZeRO paper's per-rank formula; it writes benchmarks/results/planner_accuracy_zero.json.

`--architectures` runs the second grid instead: six transformers families beyond our named
models, built from small configs (`architectures.small_config`), odd batches, sequences up to 2048,
with and without full checkpointing, LoRA on the family's layers and 8-bit optimizer state (with
--quick: batch 3, sequences 128 and 2048); it writes benchmarks/results/planner_accuracy_architectures.json.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

import colab_memopt as cm
from colab_memopt import env, faketrace, planner
from colab_memopt.core.fileio import write_json

OUT = Path(__file__).resolve().parent / "results" / "planner_accuracy.json"
CUDA_REL_PCT, CUDA_ABS_BYTES, CUDA_SMALL_BYTES = 5.0, 2**20, 64 * 2**20

GRID = {
    "size": ["tiny", "small", "medium"],
    "batch": [2, 8],
    "seq_len": [32, 128],
    "recipe": [
        {}, {"optimizer": "sgd"}, {"attention": "naive"}, {"precision": "bf16-autocast"}, {"checkpointing": "full"},
        {"accumulation_steps": 2}, {"lora_rank": 4}, {"optimizer": "adamw8bit"},
    ],
}
QUICK = {"size": ["tiny", "small"], "batch": [1, 4], "seq_len": [32], "recipe": [{}, {"attention": "naive"}]}
ARCH_OUT = Path(__file__).resolve().parent / "results" / "planner_accuracy_architectures.json"
ARCH_GRID = {
    "family": ["llama", "qwen2", "mistral", "phi3", "gemma2", "gpt_neox"],
    "batch": [1, 3, 5],
    "seq_len": [128, 1024, 2048],
    "recipe": [{}, {"checkpointing": "full"}, {"lora_rank": 4}, {"optimizer": "adamw8bit"}],
}
ARCH_QUICK = {**ARCH_GRID, "batch": [3], "seq_len": [128, 2048]}
# Where the foreach temporaries matter: small batches, where the optimizer phase can be the peak.
FOREACH = {
    "size": ["tiny", "small", "medium"],
    "batch": [1, 2],
    "seq_len": [32, 128],
    "recipe": [{}, {"optimizer": "adam"}, {"optimizer": "sgd_momentum"}, {"accumulation_steps": 2}, {"lora_rank": 4},
               {"optimizer": "adamw_in_backward"}],
}
# On CUDA (make test-gpu): the grid at sizes whose steps peak at 64 MiB or more, notebook 01's check configurations,
# the T4's fp16 path, QLoRA (4-bit dequantization inside bitsandbytes' op) and two real models.
CUDA_GRID = {**GRID, "size": ["medium"], "batch": [8, 16], "seq_len": [128, 256]}
CUDA_EXTRA = [
    *[("%s" % size, b, 256, {}) for size in ("medium", "gpt2-small") for b in (1, 4, 8)],
    ("medium", 8, 256, {"quantization": "nf4", "lora_rank": 4}),
    ("medium", 8, 256, {"quantization": "nf4", "lora_rank": 4, "precision": "fp16-autocast", "base_dtype": "fp16"}),
    ("medium", 8, 256, {"precision": "fp16-autocast"}), ("medium", 8, 256, {"precision": "fp16-autocast", "attention": "naive"}),
    ("medium", 8, 256, {"precision": "bf16-autocast"}),
    ("smollm2-135m", 1, 512, {}), ("qwen2.5-0.5b", 1, 512, {}),
]
# QLoRA (4-bit bases traced through quantized.traced_linear4bit, the 8-bit base, bnb_int8, through
# quantized.traced_linear8bit), on the reference sizes and two transformers families. Each row keeps the analytic
# cross-check's error. On the CPU bitsandbytes' 8-bit training path dequantizes the weight and has no outlier
# columns; LLM.int8's outlier columns (CUDA) depend on the inputs, so bnb_int8 rows also count, on one more step
# after the measured one, the input columns that would be outliers (a value of magnitude >= the threshold).
QLORA = {
    "size": ["tiny", "small"],
    "batch": [1, 4],
    "seq_len": [64],
    "recipe": [{"quantization": q, "lora_rank": 4} for q in ("nf4", "fp4", "bnb_int8")],
}
HF_LORA = {"lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]}
QLORA_FAMILIES = [(model, 1, 64, {"quantization": q, **HF_LORA}) for model in ("smollm2-135m", "qwen2.5-0.5b")
                  for q in ("nf4", "fp4", "bnb_int8")]
GRIDS = {"qlora": [(QLORA, "single-tensor")], "full": [(GRID, "single-tensor")], "foreach": [(FOREACH, "foreach")], "quick": [(QUICK, "single-tensor")],
         "all": [(GRID, "single-tensor"), (FOREACH, "foreach")]}

# The child's own peak RSS: VmHWM starts afresh at exec, while ru_maxrss keeps the parent's peak.
PLAN_1B = """
import re, time, warnings
warnings.simplefilter("ignore")
from colab_memopt.planning.planner import plan
start = time.perf_counter()
p = plan("1b", 1, seq_len=2048, target="t4")
seconds = time.perf_counter() - start
hwm_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(seconds, hwm_kib * 1024, p.method, p.max_batch)
"""


def _factory(size: str, device: torch.device | None = None):
    """Return a function that builds `size` on `device`, or on the CPU when none is given (what the planner is given)."""
    from colab_memopt import architectures

    if size in cm.MODEL_SIZES:
        return (lambda: cm.build_model(size, device=device)) if device is not None else (lambda: cm.build_model(size))
    build = architectures.model_factory(size)
    return (lambda: build().to(device)) if device is not None else build


def measure(size: str, batch: int, seq_len: int, recipe: cm.Recipe, device: torch.device, corpus: cm.TextCorpus,
            optimizer_impl: str | None, outliers: dict | None = None) -> cm.MemoryReport:
    """Return the report of one step; `optimizer_impl` forces the implementation (None: torch's own choice).

    With `outliers` (a dict), bitsandbytes 8-bit layers' LLM.int8 outlier columns are counted into it on
    one more step, after the measured ones (`int8_outlier_columns`).
    """
    model, opt = recipe.build(_factory(size, device)())
    if optimizer_impl is not None:
        faketrace.set_optimizer_impl(opt, optimizer_impl)
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, recipe=recipe)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    if outliers is not None:
        outliers.update(int8_outlier_columns(model, step))
    del model, opt, step
    return report


def int8_outlier_columns(model: torch.nn.Module, step) -> dict:
    """Run one step; return how many input columns of the 8-bit layers LLM.int8 would multiply in 16 bits.

    A column is an outlier when any of its values has a magnitude >= the layer's threshold (6.0): on CUDA
    bitsandbytes keeps those columns for backward, which the planner's trace assumes do not occur.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    seen = {"outlier_columns": 0, "columns": 0, "layer_calls": 0, "layer_calls_with_outliers": 0, "max_abs_input": 0.0}

    def count(module, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1])  # (tokens, in_features)
        n = int((x.abs() >= module.state.threshold).any(dim=0).sum())
        seen["outlier_columns"] += n
        seen["columns"] += x.shape[-1]
        seen["layer_calls"] += 1
        seen["layer_calls_with_outliers"] += n > 0
        seen["max_abs_input"] = max(seen["max_abs_input"], float(x.abs().max()))

    hooks = [m.register_forward_pre_hook(count) for m in layers]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return {"threshold": layers[0].state.threshold if layers else None, **seen}


def _configs(grid_name: str, device: torch.device) -> list[tuple[str, int, int, dict, str]]:
    out = []
    for grid, impl in GRIDS.get(grid_name, []):
        for size, batch, seq_len, fields in itertools.product(*grid.values()):
            out.append((size, batch, min(seq_len, cm.get_config(size).seq_len), fields, impl))
    if grid_name == "cuda":
        out = [(s, b, min(t, cm.get_config(s).seq_len), f, "foreach") for s, b, t, f in
               itertools.product(CUDA_GRID["size"], CUDA_GRID["batch"], CUDA_GRID["seq_len"], CUDA_GRID["recipe"])]
        out += [(s, b, t, f, "foreach") for s, b, t, f in CUDA_EXTRA]
    if grid_name == "qlora":
        out += [(s, b, t, f, "single-tensor") for s, b, t, f in QLORA_FAMILIES]
    # The batch is the effective batch: a recipe that splits it needs at least that many rows.
    return [c for c in out if c[1] >= c[3].get("accumulation_steps", 1)]


BF16_UNDER_EMULATION = ("a T4 has no bf16, so no T4 recipe runs it; the emulating GPU would run its own bf16 kernels "
                        "(the memory-efficient SDPA kernel takes bf16 from sm_80), not a T4's: not a T4 measurement")


def emulates_t4_without_bf16(device: torch.device, fields: dict) -> bool:
    """Return whether a row is a bf16 recipe on a GPU emulating a T4: left out of the grid (cuda-readiness-2, R2)."""
    return device.type == "cuda" and env.emulated_gpu(device) == "t4" and str(fields.get("precision", "")).startswith("bf16")


def _emulation(label: str) -> str | None:
    """Return the GPU a label '<gpu> emulating t4' says this run emulates ('t4'), else None."""
    match = re.search(r"\bemulating\s+(\S+)\s*$", label)
    return match.group(1).lower() if match else None


def _device(label: str) -> tuple[torch.device, str]:
    """Return the device and its name for the results. A run labelled '<gpu> emulating t4' makes its GPU a T4 first,
    in this process (`env.apply_emulation`: the allocator capped, the T4's attention kernels, TF32 off), so that the
    CUDA rows are measured on the code paths the label names; without a GPU to emulate on, it stops. Unlabelled,
    CM_EMULATE decides, as everywhere else."""
    device = cm.pick_device("auto")
    labelled = _emulation(label)
    applied = env.apply_emulation(device, labelled)  # None: CM_EMULATE's choice (nothing on the CPU)
    if labelled is not None and applied != labelled:
        raise SystemExit(f"--label {label!r} says emulating {labelled}, but {device} cannot emulate it (a CUDA GPU can)")
    name = f"{device} ({env.device_label(device)})" if device.type == "cuda" else f"cpu ({platform.machine()})"
    return device, name


def _passes(row: dict, cuda: bool) -> bool:
    if not cuda:
        return abs(row["rel_error_pct"]) <= 1.0
    return abs(row["rel_error_pct"]) <= CUDA_REL_PCT  # rows are 64 MiB and more (main leaves smaller ones out)


def architecture_grid(grid: dict, device: torch.device, corpus: cm.TextCorpus, target: object) -> list[dict]:
    """Return one row per (family, batch, seq_len, recipe): the trace against the measured step."""
    from colab_memopt.techniques.architectures import resolve_model, small_config
    from colab_memopt.training.presets import LORA_TARGETS_BY_FAMILY

    rows = []
    for family, batch, seq_len, fields in itertools.product(*grid.values()):
        spec = resolve_model(small_config(family))
        if fields.get("lora_rank"):
            fields = {**fields, "lora_targets": LORA_TARGETS_BY_FAMILY[family]}
        recipe = cm.Recipe.from_dict(fields)
        start = time.perf_counter()
        predicted = planner.plan(spec.build, batch, seq_len=seq_len, recipe=recipe, target=target, find_max_batch=False)
        plan_seconds = time.perf_counter() - start
        model, opt = recipe.build(spec.build().to(device))
        step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, recipe=recipe)
        measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1).peak_bytes
        error = 100.0 * (predicted.peak_bytes - measured) / measured
        shown = {k: v for k, v in fields.items() if k != "lora_targets"}
        rows.append({"family": family, "batch": batch, "seq_len": seq_len, "recipe": shown, "method": predicted.method,
                     "predicted_bytes": predicted.peak_bytes, "measured_bytes": measured, "rel_error_pct": error,
                     "plan_seconds": plan_seconds})
        print(f"{family:9s} b={batch} s={seq_len:<5d} {str(shown):28s} predicted {cm.format_bytes(predicted.peak_bytes):>11s} "
              f"measured {cm.format_bytes(measured):>11s} error {error:+.3f}%", flush=True)
    return rows


ZERO_OUT = Path(__file__).resolve().parent / "results" / "planner_accuracy_zero.json"
ZERO_GRID = {"size": ["tiny", "small"], "stage": [1, 2, 3], "batch": 2, "seq_len": 32}


def zero_grid(corpus: cm.TextCorpus, target: object) -> dict:
    """Plans of `Recipe(zero_stage=...)` against `measure_step` of the engine `Recipe.build` makes (one process, the
    CPU, fp32), and the per-rank model states of 2 ranks (`zero.run_zero`) against the ZeRO paper's per-rank formula."""
    from colab_memopt import zero

    rows = []
    for size in ZERO_GRID["size"]:
        for stage in ZERO_GRID["stage"]:
            recipe = cm.Recipe(zero_stage=stage)
            b, s = ZERO_GRID["batch"], ZERO_GRID["seq_len"]
            predicted = planner.plan(_factory(size), b, seq_len=s, recipe=recipe, target=target, find_max_batch=False)
            engine, opt = recipe.build(_factory(size)())
            step = cm.make_train_step(engine, opt, corpus, batch_size=b, seq_len=s, recipe=recipe)
            report = cm.measure_step(step, model=engine, optimizer=opt, repeat=1)
            error = 100.0 * (predicted.peak_bytes - report.peak_bytes) / report.peak_bytes
            rows.append({"size": size, "batch": b, "seq_len": s, "recipe": {"zero_stage": stage}, "world_size": 1,
                         "method": predicted.method, "predicted_bytes": predicted.peak_bytes,
                         "measured_bytes": report.peak_bytes, "rel_error_pct": error,
                         "predicted_by_category": predicted.by_category, "measured_by_category": report.by_category})
            print(f"{size:6s} zero_stage={stage} predicted {cm.format_bytes(predicted.peak_bytes):>11s} "
                  f"measured {cm.format_bytes(report.peak_bytes):>11s} error {error:+.2f}%")
            del engine, opt, step
    # Per rank, 2 ranks: what each rank holds (DeepSpeed's own buffers, read by zero.rank_state_bytes) against the
    # per-rank formula in fp32 (4 B weights, 4 B gradients, 12 B optimizer state: fp32 master, m, v).
    result = zero.run_zero(zero.ZeroJob(model_size="small", stages=(1, 2, 3), steps=2), world_size=2)
    per_rank = []
    for stage in (1, 2, 3):
        for rank in range(2):
            held = result.bytes_of(f"zero{stage}", rank)
            formula = zero.zero_state_bytes(result.n_params, stage, 2, weight_bytes=4, grad_bytes=4, optimizer_bytes=12,
                                            persistent_params=held.get("persistent_params", 0))
            error = 100.0 * (formula["total"] - held["total"]) / held["total"]
            per_rank.append({"model": "small", "stage": stage, "rank": rank, "world_size": 2, "formula_bytes": formula,
                             "measured_bytes": held, "rel_error_pct": error})
            print(f"small zero{stage} rank {rank}/2: formula {cm.format_bytes(formula['total']):>11s} "
                  f"held {cm.format_bytes(held['total']):>11s} error {error:+.2f}%")
    return {"rows": rows, "per_rank": per_rank,
            "worst_rel_error_pct": max((r["rel_error_pct"] for r in rows), key=abs),
            "worst_per_rank_rel_error_pct": max((r["rel_error_pct"] for r in per_rank), key=abs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted([*GRIDS, "cuda"]), default=None,
                        help="which configurations: 'all' (full + foreach; the default on the CPU), 'full', 'foreach', "
                             "'qlora' (4-bit and 8-bit bases, reference sizes and two transformers families), "
                             "'quick', or 'cuda' (the default on CUDA)")
    parser.add_argument("--quick", action="store_true", help="same as --grid quick")
    parser.add_argument("--out", default=str(OUT), help=f"where to write the JSON (default {OUT})")
    parser.add_argument("--label", default="", help="a device label to record (make test-gpu: '<gpu> emulating t4')")
    parser.add_argument("--architectures", action="store_true",
                        help="the second grid: six transformers families from small configs (--quick: a smaller one)")
    parser.add_argument("--zero", action="store_true",
                        help="DeepSpeed ZeRO plans against measured engines (one process) and 2 ranks' per-rank states; "
                             f"writes {ZERO_OUT.name}")
    args = parser.parse_args()
    if args.zero:
        device = cm.pick_device("auto")
        if device.type == "cuda":
            parser.error("--zero runs on the CPU (gloo ranks, fp32): run it without a GPU")
        target = {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
        result = {"device": f"cpu ({platform.machine()})", "torch": torch.__version__, **zero_grid(cm.load_corpus(), target)}
        write_json(ZERO_OUT, result)
        print(f"wrote {ZERO_OUT}\nworst relative error: {result['worst_rel_error_pct']:+.2f}% (plans, one process), "
              f"{result['worst_per_rank_rel_error_pct']:+.2f}% (formula per rank, 2 ranks)")
        return
    if args.architectures:
        device = cm.pick_device("auto")
        target = "t4" if device.type == "cuda" else {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
        rows = architecture_grid(ARCH_QUICK if args.quick else ARCH_GRID, device, cm.load_corpus(), target)
        worst = max(rows, key=lambda r: abs(r["rel_error_pct"]))
        device_name = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else f"cpu ({platform.machine()})"
        result = {"device": device_name, "torch": torch.__version__, "grid": "quick" if args.quick else "full", "rows": rows,
                  "worst_rel_error_pct": worst["rel_error_pct"], "target_rel_error_pct": 5.0 if device.type == "cuda" else 1.0}
        write_json(ARCH_OUT, result)
        print(f"wrote {ARCH_OUT}\nworst relative error over {len(rows)} configurations on {device_name}: "
              f"{worst['rel_error_pct']:+.3f}% ({worst['family']}, batch {worst['batch']}, seq {worst['seq_len']}, {worst['recipe']})")
        return
    device, device_name = _device(args.label)
    cuda = device.type == "cuda"
    grid_name = "quick" if args.quick else args.grid or ("cuda" if cuda else "all")
    if cuda and grid_name != "cuda":
        parser.error(f"on CUDA use --grid cuda (torch picks the optimizer implementation there), got {grid_name!r}")
    corpus = cm.load_corpus()
    target = "t4" if cuda else {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
    rows, small, not_t4 = [], [], []
    for size, batch, seq_len, fields, impl in _configs(grid_name, device):
        if emulates_t4_without_bf16(device, fields):
            not_t4.append({"size": size, "batch": batch, "seq_len": seq_len, "recipe": fields})
            continue
        recipe = cm.Recipe.from_dict(fields)
        predicted = planner.plan(_factory(size), batch, seq_len=seq_len, recipe=recipe, target=target,
                                 find_max_batch=False, optimizer_impl=impl)
        if cuda and predicted.step_peak_bytes < CUDA_SMALL_BYTES:
            small.append({"size": size, "batch": batch, "seq_len": seq_len, "recipe": fields,
                          "planned_step_peak_bytes": predicted.step_peak_bytes})
            continue
        outliers = {} if recipe.quantization == "bnb_int8" else None
        report = measure(size, batch, seq_len, recipe, device, corpus, None if cuda else impl, outliers)
        predicted_bytes = predicted.step_peak_bytes if cuda else predicted.peak_bytes
        measured = report.peak_bytes  # on CUDA the foreign-corrected step peak: fixed costs out, as in the prediction
        error = 100.0 * (predicted_bytes - measured) / measured
        row = {
            "size": size, "batch": batch, "seq_len": seq_len, "recipe": fields, "method": predicted.method,
            "optimizer_impl": predicted.optimizer_impl, "predicted_bytes": predicted_bytes, "measured_bytes": measured,
            "rel_error_pct": error, "abs_error_bytes": predicted_bytes - measured,
        }
        row["analytic_rel_error_pct"] = 100.0 * (predicted.analytic_peak_bytes - measured) / measured  # the cross-check
        if outliers is not None:
            row["int8_outliers"] = outliers
            row["int8_trace_is_bound"] = any("lower bound" in w for w in predicted.warnings)
        if cuda:  # the raw figures beside them: max_memory_allocated against the plan with every workspace
            row.update(raw_allocator_peak_bytes=report.allocator_peak_bytes, foreign_bytes=report.foreign_bytes,
                       planned_allocator_peak_bytes=predicted.allocator_peak_bytes,
                       raw_rel_error_pct=100.0 * (predicted.allocator_peak_bytes - report.allocator_peak_bytes) / report.allocator_peak_bytes,
                       planned_tensor_peak_bytes=predicted.peak_bytes, planned_step_costs={
                           c.name: c.bytes for c in predicted.device_costs if c.in_step},
                       workspace_bytes=sum(c.bytes for c in predicted.device_costs if c.in_allocator and not c.in_step))
        row["passes"] = _passes(row, cuda)
        rows.append(row)
        print(f"{size:12s} b={batch:<2d} s={seq_len:<4d} {impl:13s} {str(fields):28s} predicted {cm.format_bytes(predicted_bytes):>11s} "
              f"measured {cm.format_bytes(measured):>11s} error {error:+.3f}%" + ("" if row["passes"] else "  FAIL"))

    out = subprocess.run([sys.executable, "-c", PLAN_1B], capture_output=True, text=True, check=True).stdout.split()
    plan_1b = {"model": "1b", "params": cm.get_config("1b").n_params, "batch": 1, "seq_len": 2048,
               "seconds": float(out[0]), "max_rss_bytes": int(out[1]), "method": out[2], "max_batch": int(out[3])}
    worst = max(rows, key=lambda r: abs(r["rel_error_pct"]))
    worst_by_method = {
        method: max(abs(r["rel_error_pct"]) for r in rows if r["method"] == method)
        for method in sorted({r["method"] for r in rows})
    }
    worst_by_impl = {impl: max(abs(r["rel_error_pct"]) for r in rows if r["optimizer_impl"] == impl)
                     for impl in sorted({r["optimizer_impl"] for r in rows})}
    result = {
        "device": device_name, "label": args.label or device_name, "torch": torch.__version__, "grid": grid_name,
        "rows": rows, "plan_1b": plan_1b,
        "worst_rel_error_pct": worst["rel_error_pct"], "worst_abs_error_pct_by_method": worst_by_method,
        "worst_abs_error_pct_by_optimizer_impl": worst_by_impl,
        "target_rel_error_pct": CUDA_REL_PCT if cuda else 1.0,
        "target": ("Plan.step_peak_bytes within 5% of the foreign-corrected step peak, rows of 64 MiB and more" if cuda
                   else "within 1% of the tracker's peak everywhere"),
        "left_out_under_64_mib": small,
        "left_out_bf16_under_t4_emulation": {"rows": not_t4, "why": BF16_UNDER_EMULATION} if not_t4 else None,
        "failed": sum(not r["passes"] for r in rows),
    }
    int8_rows = [r for r in rows if "int8_outliers" in r]
    if int8_rows:  # LLM.int8's data-dependent part, which the trace for a CUDA target assumes absent
        result["int8_outlier_columns"] = {
            "rows": len(int8_rows), "outlier_columns": sum(r["int8_outliers"]["outlier_columns"] for r in int8_rows),
            "columns": sum(r["int8_outliers"]["columns"] for r in int8_rows),
            "max_abs_input": max(r["int8_outliers"]["max_abs_input"] for r in int8_rows),
            "note": "counted on one step after the measured one, on these random-weight models and this corpus; on the CPU "
                    "bitsandbytes' training path has no outlier columns (it dequantizes the weight), so CPU rows are exact "
                    "whatever the count; on CUDA each outlier column adds to the plan, which is then a lower bound",
        }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, result)
    print(f"\nplanning the 1B model ({plan_1b['params'] / 1e9:.2f}B params, batch 1 x 2048): {plan_1b['seconds']:.1f} s, "
          f"{cm.format_bytes(plan_1b['max_rss_bytes'])} peak RSS, method {plan_1b['method']}")
    print(f"wrote {out_path}")
    for method, err in worst_by_method.items():
        n = sum(r["method"] == method for r in rows)
        print(f"  {method:8s}: {n} configurations, worst |error| {err:.3f}%")
    print(f"worst relative error over {len(rows)} configurations on {device_name}: {worst['rel_error_pct']:+.3f}% "
          f"({worst['size']}, batch {worst['batch']}, seq {worst['seq_len']}, {worst['recipe']}); target {result['target_rel_error_pct']}%")
    for impl, err in worst_by_impl.items():
        print(f"  optimizer {impl:13s}: {sum(r['optimizer_impl'] == impl for r in rows)} configurations, worst |error| {err:.3f}%")
    if int8_rows:
        o = result["int8_outlier_columns"]
        print(f"  bnb_int8: {o['outlier_columns']} LLM.int8 outlier columns of {o['columns']} layer input columns over "
              f"{o['rows']} configurations (largest |input| {o['max_abs_input']:.2f})")
    if result["failed"]:
        print(f"{result['failed']} configuration(s) outside the target: {result['target']}")
        sys.exit(1)


if __name__ == "__main__":
    main()
