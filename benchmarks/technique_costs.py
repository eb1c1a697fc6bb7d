"""What each memory-saving technique costs in step time on this device.

    python benchmarks/technique_costs.py [--model small] [--batch 8] [--seq 128] [--rounds 7]

Times one training step of the reference model per technique of `costs.TECHNIQUES` (each alone,
through `Recipe.build` + `make_train_step`), paired round by round with the plain fp32 AdamW
step, and writes the median ratio per technique (each step timed right after a plain step) with the device named to colab_memopt/technique_costs.json (package data:
the recommender's default, shipped in the wheel).
`recommend` reads them. Ratios measured on a CPU describe that CPU, not a T4: run this on the GPU
you target (Colab: `!python benchmarks/technique_costs.py`) to recommend for it.
"""

from __future__ import annotations

import argparse
import sys
import time

from colab_memopt.costs import COSTS_FILE, measure_technique_costs
from colab_memopt.fileio import write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--layers", type=int, default=8, help="the reference model's depth (checkpointing intervals need >= 8)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=str(COSTS_FILE))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    costs = measure_technique_costs(model_size=args.model, batch=args.batch, seq_len=args.seq, rounds=args.rounds, device=args.device,
                                   n_layer=args.layers)
    data = {**costs.to_dict(), "seconds": time.perf_counter() - start}
    write_json(args.out, data)
    print(f"device: {costs.device}; model {costs.model}, batch {costs.batch} x {costs.seq_len}, {costs.rounds} rounds")
    for name, ratio in sorted(costs.ratios.items(), key=lambda kv: kv[1]):
        print(f"  {name:22s} x{ratio:.2f}")
    print(costs.source)
    print(f"wrote {args.out} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
