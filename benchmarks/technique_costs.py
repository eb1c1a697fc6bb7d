"""What each memory-saving technique costs in step time on this device.

    python benchmarks/technique_costs.py [--model small] [--batch 8] [--seq 128] [--rounds 7] [--out FILE]

Times one training step of the reference model per technique of `costs.TECHNIQUES` (each alone,
through `Recipe.build` + `make_train_step`), paired round by round with the plain fp32 AdamW
step, and writes the median ratio per technique (each step timed right after a plain step) with the device and its device class named, by default to the package data file of that class
(`costs.COSTS_FILES`: technique_costs.json for 'cpu', technique_costs_t4.json for a T4 or a GPU
emulating one under CM_EMULATE=t4, technique_costs_ampere.json for sm_80+), shipped in the wheel.
`recommend` reads the table of its target's class: ratios measured on a CPU describe that CPU and are
never applied to a T4. Run this on the GPU you target (Colab: `!python benchmarks/technique_costs.py`),
or `make test-gpu` on a lent GPU (it writes build/gpu/technique_costs_<class>.json).
"""

from __future__ import annotations

import argparse
import sys
import time

from colab_memopt.planning.costs import COSTS_FILES, measure_technique_costs
from colab_memopt.core.fileio import write_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--layers", type=int, default=8, help="the reference model's depth (checkpointing intervals need >= 8)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="the JSON to write (default: the package data file of the device's class)")
    args = parser.parse_args(argv)
    from colab_memopt.core.env import apply_emulation

    apply_emulation(args.device)  # CM_EMULATE=t4 (make test-gpu on a bigger GPU): the T4's code paths, labelled
    start = time.perf_counter()
    costs = measure_technique_costs(model_size=args.model, batch=args.batch, seq_len=args.seq, rounds=args.rounds, device=args.device,
                                   n_layer=args.layers)
    data = {**costs.to_dict(), "seconds": time.perf_counter() - start}
    data.pop("citations", None)  # measured rows cite the device, not a paper
    out = args.out or str(COSTS_FILES[costs.device_class])
    write_json(out, data)
    print(f"device: {costs.device} (class {costs.device_class}); model {costs.model}, batch {costs.batch} x {costs.seq_len}, {costs.rounds} rounds")
    for name, ratio in sorted(costs.ratios.items(), key=lambda kv: kv[1]):
        print(f"  {name:22s} x{ratio:.2f}")
    print(costs.source)
    print(f"wrote {out} in {data['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
