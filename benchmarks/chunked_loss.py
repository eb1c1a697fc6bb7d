"""How much memory the loss's logits take, plain against chunked: measured, and traced at Llama-3 size.

    python benchmarks/chunked_loss.py [--rounds 7]

Writes benchmarks/results/chunked_loss.json and prints a table. One step is the loss's forward and
backward, `colab_memopt.techniques.loss.make_loss_step` with chunk_tokens None (plain
`F.cross_entropy(F.linear(h, w).float(), y)`) or a number of tokens per chunk. For each step:
- peak_over_inputs_bytes: the peak minus the inputs (hidden, weight, labels): the logits, their
  softmax and gradient, and the input gradients while they are live;
- transient_bytes: the peak minus what stays live after backward (inputs and their gradients, the
  same for both): what the loss needs beyond its results, i.e. the logits and their gradient.

Parts:
1. trace_vs_real: at a small size, measured with `measure.measure_step` on real CPU tensors and
   traced under `FakeTensorMode` with the project's `TensorTracker` (as the planner does); they
   must agree within 1% (target: to the byte).
2. chunk_sweep: time (fastest of interleaved rounds) and measured memory for several chunk sizes at a
   moderate size on this CPU (each round's times kept: the machine is shared and they vary);
   `picked_chunk_tokens` is the smallest chunk whose fastest round is within 5% of the fastest chunk's
   (closer timings changed order between reruns on this shared machine),
   and `colab_memopt.techniques.loss.DEFAULT_CHUNK_TOKENS` is set from it (a test checks they agree).
3. large: traced at Llama-3.2-1B's head (vocabulary 128,256, hidden 2048) and 16,384 tokens, where
   the plain loss would need about 24 GiB: trainable head, frozen head (LoRA/QLoRA), fp16 autocast
   (whose fp16 copy of the (V, H) weight, made by the plain path too, counts as transient in both).
   Target: the chunked loss's transient bytes <= 5% of the plain loss's (fp32, default chunk).
Times are this CPU's, not a T4's.

    python benchmarks/chunked_loss.py --fp16-check

prints, and writes nothing, the relative error against fp32 of the gradients (hidden, weight) of the
plain and the chunked loss in fp16 (autocast with fp32 weights, and pure fp16) and bf16 at loss scales
2^10 and 2^16 (`gradient_errors`): the chunked loss's must be finite and within 2x the plain loss's
(the check exits 1 otherwise). IEEE fp16 casts round the same on a CPU and on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy, make_loss_step
from colab_memopt.core.measure import format_bytes, measure_step, time_interleaved
from colab_memopt.core.tracker import TensorTracker

OUT = Path(__file__).resolve().parent / "results" / "chunked_loss.json"

SMALL = {"tokens": 300, "vocab": 1000, "hidden": 64}
SMALL_CASES = [  # (label, chunk_tokens, case options)
    ("plain", None, {}),
    ("chunked 64", 64, {}),
    ("chunked 64, bias, ignored labels", 64, {"bias": True, "ignored_every": 3}),
    ("chunked 512 (>= tokens)", 512, {}),
    ("plain, frozen head", None, {"frozen_head": True}),
    ("chunked 64, frozen head", 64, {"frozen_head": True}),
]
SWEEP = {"tokens": 2048, "vocab": 16384, "hidden": 256}
SWEEP_CHUNKS = [32, 64, 128, 256, 512, 1024, 2048]
LARGE = {"tokens": 16384, "vocab": 128256, "hidden": 2048}  # Llama-3.2-1B's head
LARGE_CHUNKS = [128, 256, 1024, 4096]
TARGET_TRANSIENT_RATIO = 0.05


def make_inputs(tokens: int, vocab: int, hidden: int, *, bias: bool = False, frozen_head: bool = False,
                ignored_every: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor | None]:
    """Return hidden (N, H), weight (V, H), optional bias (V,) and labels (N,), seeded (real or fake)."""
    gen = None if _fake_active() else torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.02).requires_grad_(not frozen_head)
    b = torch.zeros(vocab, dtype=dtype, requires_grad=not frozen_head) if bias else None
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignored_every:
        y[::ignored_every] = -100
    return {"hidden": h, "weight": w, "bias": b, "labels": y}


def _fake_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _row(peak: int, inputs: int, after: int) -> dict[str, int]:
    return {"peak_bytes": peak, "input_bytes": inputs, "after_bytes": after,
            "peak_over_inputs_bytes": peak - inputs, "transient_bytes": peak - after}


def measured(shape: dict[str, int], chunk: int | None, *, autocast: torch.dtype | None = None, **options) -> dict[str, int]:
    """Measure one loss step on real CPU tensors with `measure_step` (warm-up, then a tracked run)."""
    data = make_inputs(**shape, **options)
    tensors = [t for t in data.values() if t is not None]
    step = _step(data, chunk, autocast)
    report = measure_step(step, track=tensors, device="cpu", warmup=1, repeat=1)
    return _row(report.peak_bytes, _storage_bytes(tensors), sum(report.resident_bytes.values()))


def traced(shape: dict[str, int], chunk: int | None, *, autocast: torch.dtype | None = None, **options) -> dict[str, int]:
    """Trace one loss step under fake tensors with the project's tracker: nothing is allocated."""
    with FakeTensorMode():
        data = make_inputs(**shape, **options)
        tensors = [t for t in data.values() if t is not None]
        step = _step(data, chunk, autocast)
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(*tensors)
        with tracker:
            step()
            after = tracker.live_bytes()
    return _row(tracker.peak_bytes, _storage_bytes(tensors), after)


def _step(data: dict, chunk: int | None, autocast: torch.dtype | None):
    step = make_loss_step(data["hidden"], data["weight"], data["labels"], bias=data["bias"], chunk_tokens=chunk)
    if autocast is None:
        return step

    def autocast_step():
        with torch.autocast("cpu", dtype=autocast):
            return step()

    return autocast_step


def trace_vs_real() -> list[dict]:
    rows = []
    for label, chunk, options in SMALL_CASES:
        real = measured(SMALL, chunk, **options)
        fake = traced(SMALL, chunk, **options)
        rel = abs(fake["peak_bytes"] - real["peak_bytes"]) / real["peak_bytes"]
        rows.append({"label": label, "chunk_tokens": chunk, **options, "measured": real, "traced": fake,
                     "peak_rel_diff": rel, "equal_to_the_byte": fake == real})
    return rows


def chunk_sweep(rounds: int) -> dict:
    data = make_inputs(**SWEEP)
    steps = {"plain": make_loss_step(data["hidden"], data["weight"], data["labels"])}
    for chunk in SWEEP_CHUNKS:
        steps[str(chunk)] = make_loss_step(data["hidden"], data["weight"], data["labels"], chunk_tokens=chunk)
    # one interleaved round at a time, to keep every round's times (the machine is shared: they vary)
    load_before = os.getloadavg()[0]
    per_round = [time_interleaved(steps, rounds=1, warmup=1 if i == 0 else 0, device="cpu") for i in range(rounds)]
    rows = []
    for key in steps:
        chunk = None if key == "plain" else int(key)
        times = [r[key] for r in per_round]
        rows.append({"chunk_tokens": chunk, "step_seconds": min(times), "median_step_seconds": statistics.median(times),
                     "round_seconds": times, **measured(SWEEP, chunk)})
    fastest = min(r["step_seconds"] for r in rows if r["chunk_tokens"] is not None)
    picked = min(r["chunk_tokens"] for r in rows if r["chunk_tokens"] is not None and r["step_seconds"] <= 1.05 * fastest)
    load = {"load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    return {**SWEEP, "rounds": rounds, **load, "rows": rows, "rule": "smallest chunk within 5% of the fastest chunk (best rounds)",
            "picked_chunk_tokens": picked}


def large() -> list[dict]:
    rows = []
    variants = [("fp32, trainable head", {}, None), ("fp32, frozen head", {"frozen_head": True}, None),
                ("fp16 autocast, fp32 weights", {}, torch.float16)]
    for label, options, autocast in variants:
        plain = traced(LARGE, None, autocast=autocast, **options)
        chunks = sorted(set(LARGE_CHUNKS) | {DEFAULT_CHUNK_TOKENS}) if not options and autocast is None else sorted({DEFAULT_CHUNK_TOKENS, 1024})
        for chunk in chunks:
            row = traced(LARGE, chunk, autocast=autocast, **options)
            rows.append({"label": label, **LARGE, "chunk_tokens": chunk, "plain": plain, "chunked": row,
                         "peak_over_inputs_ratio": row["peak_over_inputs_bytes"] / plain["peak_over_inputs_bytes"],
                         "transient_ratio": row["transient_bytes"] / plain["transient_bytes"]})
    return rows


CHECK = {"tokens": 512, "vocab": 8192, "hidden": 64}  # p / N about 2.4e-7: subnormal in fp16 unless scaled
CHECK_SCALES = (2.0**10, 2.0**16)  # 2^16: GradScaler's and DynamicLossScaler's initial scale


def _rel_error(got: torch.Tensor | None, ref: torch.Tensor) -> float:
    """Return |got - ref| / |ref| (Frobenius norms), inf where got is missing or not finite."""
    if got is None or not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def gradient_errors(tokens: int = CHECK["tokens"], vocab: int = CHECK["vocab"], hidden: int = CHECK["hidden"], *,
                    dtype: torch.dtype = torch.float16, mode: str = "autocast", scales: tuple[float, ...] = CHECK_SCALES,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, seed: int = 0) -> list[dict]:
    """Return, per loss scale, the relative gradient errors against fp32 of the plain and the chunked loss.

    mode 'autocast': fp32 hidden states and head under `torch.autocast(dtype=dtype)`; 'pure': both in
    `dtype`. The loss is multiplied by the scale before backward and the gradients divided by it after,
    in fp32, as a loss scaler does. The inputs are rounded to `dtype` first, so the fp32 reference sees
    the same values. Each row: scale, and per method ('plain', 'chunked') the errors of d/d hidden and
    d/d weight (inf where a gradient is not finite) and `ratio`, chunked over plain (the larger of the two).
    """
    if mode not in ("autocast", "pure"):
        raise ValueError(f"mode must be 'autocast' or 'pure', got {mode!r}")
    gen = torch.Generator().manual_seed(seed)
    h32 = torch.randn(tokens, hidden, generator=gen).to(dtype).float()  # (N, H)
    w32 = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dtype).float()  # (V, H)
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    losses = {"plain": lambda h, w: F.cross_entropy(F.linear(h, w).float(), y),
              "chunked": lambda h, w: chunked_cross_entropy(h, w, y, chunk_tokens=chunk_tokens)}
    h, w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
    losses["plain"](h, w).backward()
    ref = {"hidden": h.grad, "weight": w.grad}
    rows = []
    for scale in scales:
        row: dict = {"scale": scale}
        for name, loss_fn in losses.items():
            cast = dtype if mode == "pure" else torch.float32
            h, w = h32.to(cast, copy=True).requires_grad_(), w32.to(cast, copy=True).requires_grad_()
            with torch.autocast("cpu", dtype=dtype, enabled=mode == "autocast"):
                loss = loss_fn(h, w)
            (loss * scale).backward()
            row[name] = {key: _rel_error(t.grad.float() / scale, ref[key]) for key, t in (("hidden", h), ("weight", w))}
        row["ratio"] = max(row["chunked"][k] / row["plain"][k] for k in ("hidden", "weight"))
        rows.append(row)
    return rows


def fp16_check() -> int:
    """Print the gradient errors of `gradient_errors` in fp16 (autocast, pure) and bf16; return 1 if one fails."""
    failed = False
    print(f"relative gradient error against fp32 at {CHECK}, chunk {DEFAULT_CHUNK_TOKENS} tokens")
    print(f"  {'precision':16} {'scale':>7} {'plain d/dh':>11} {'chunked d/dh':>13} {'plain d/dW':>11} {'chunked d/dW':>13} {'ratio':>6}")
    for dtype, mode in ((torch.float16, "autocast"), (torch.float16, "pure"), (torch.bfloat16, "autocast"), (torch.bfloat16, "pure")):
        for r in gradient_errors(dtype=dtype, mode=mode):
            ok = r["ratio"] <= 2.0
            failed |= not ok
            precision, scale = f"{str(dtype).split('.')[1]} {mode}", f"2^{int(r['scale']).bit_length() - 1}"
            print(f"  {precision:16} {scale:>7} "
                  f"{r['plain']['hidden']:11.2e} {r['chunked']['hidden']:13.2e} {r['plain']['weight']:11.2e} "
                  f"{r['chunked']['weight']:13.2e} {r['ratio']:6.2f}{'' if ok else '  FAIL (> 2x plain)'}")
    return 1 if failed else 0


def write_whole(path: Path, data: dict) -> None:
    """Write JSON to a temporary file beside `path`, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds of the chunk sweep")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--fp16-check", action="store_true",
                        help="only print the fp16/bf16 gradient errors against fp32 at loss scales 2^10 and 2^16")
    args = parser.parse_args(argv)
    if args.fp16_check:
        return fp16_check()
    start = time.perf_counter()
    checks = trace_vs_real()
    sweep = chunk_sweep(args.rounds)
    big = large()
    at_default = next(r for r in big if r["label"] == "fp32, trainable head" and r["chunk_tokens"] == DEFAULT_CHUNK_TOKENS)
    data = {
        "device": f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), torch {torch.__version__}, "
                  f"{torch.get_num_threads()} threads",
        "default_chunk_tokens": DEFAULT_CHUNK_TOKENS,
        "trace_vs_real": checks,
        "trace_equals_real": all(r["equal_to_the_byte"] for r in checks),
        "trace_worst_rel_diff": max(r["peak_rel_diff"] for r in checks),
        "chunk_sweep": sweep,
        "large": big,
        "target_transient_ratio": TARGET_TRANSIENT_RATIO,
        "transient_ratio_at_default": at_default["transient_ratio"],
        "logits_saving_pct_chunked": 100.0 * (1 - at_default["transient_ratio"]),
        "target_met": at_default["transient_ratio"] <= TARGET_TRANSIENT_RATIO,
        "seconds": time.perf_counter() - start,
    }
    write_whole(Path(args.out), data)

    print(f"device: {data['device']}")
    print(f"trace vs real at {SMALL}: worst difference {data['trace_worst_rel_diff']:.3%} "
          f"(to the byte: {data['trace_equals_real']})")
    print(f"\nchunk sweep at {SWEEP} (time: fastest of {args.rounds} interleaved rounds; load average "
          f"{sweep['load_average_1min_before']:.1f} before, {sweep['load_average_1min_after']:.1f} after, {os.cpu_count()} cores)")
    print(f"  {'chunk':>6} {'best ms':>9} {'median ms':>10} {'transient':>11}")
    for r in sweep["rows"]:
        print(f"  {str(r['chunk_tokens'] or 'plain'):>6} {r['step_seconds'] * 1e3:9.1f} {r['median_step_seconds'] * 1e3:10.1f} "
              f"{format_bytes(r['transient_bytes']):>11}")
    print(f"  picked: {sweep['picked_chunk_tokens']} tokens ({sweep['rule']}); default in loss.py: {DEFAULT_CHUNK_TOKENS}")
    print(f"\ntraced at vocab {LARGE['vocab']:,}, {LARGE['tokens']:,} tokens, hidden {LARGE['hidden']}")
    print(f"  {'case':28} {'chunk':>6} {'plain peak':>11} {'chunked peak':>13} {'ratio':>6} {'transient ratio':>16}")
    for r in big:
        print(f"  {r['label']:28} {r['chunk_tokens']:>6} {format_bytes(r['plain']['peak_over_inputs_bytes']):>11} "
              f"{format_bytes(r['chunked']['peak_over_inputs_bytes']):>13} {r['peak_over_inputs_ratio']:6.1%} "
              f"{r['transient_ratio']:16.2%}")
    print(f"\ntarget: transient ratio <= {TARGET_TRANSIENT_RATIO:.0%} at the default chunk: "
          f"{data['transient_ratio_at_default']:.2%} ({'met' if data['target_met'] else 'NOT met'}); "
          f"{data['seconds']:.0f} s")
    return 0 if data["trace_worst_rel_diff"] <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
