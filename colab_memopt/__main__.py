"""Command line: `python -m colab_memopt plan --model gpt2 --batch 8 --seq 1024 --target t4 [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


def _recipe_fields(items: list[str]) -> dict[str, Any]:
    fields = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--recipe takes field=value pairs, got {item!r}")
        key, value = item.split("=", 1)
        fields[key.strip()] = _value(value.strip())
    return fields


def _parser() -> argparse.ArgumentParser:
    from colab_memopt.architectures import model_names
    from colab_memopt.planner import TARGETS

    parser = argparse.ArgumentParser(prog="python -m colab_memopt", description="colab-memopt tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="predict a training step's peak memory on a target, without a GPU")
    p.add_argument("--model", required=True, help=f"one of: {', '.join(model_names())}")
    p.add_argument("--batch", type=int, required=True, help="sequences per step (>= 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--target", default="t4", help=f"one of {', '.join(TARGETS)} (or give --device-bytes and --host-bytes)")
    p.add_argument("--device-bytes", type=int, help="an explicit device memory size in bytes")
    p.add_argument("--host-bytes", type=int, help="an explicit host RAM size in bytes")
    p.add_argument("--recipe", nargs="*", default=[], metavar="FIELD=VALUE", help="recipe fields, e.g. optimizer=sgd")
    p.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"])
    p.add_argument("--no-max-batch", action="store_true", help="skip the search for the largest batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from colab_memopt.planner import plan

    try:
        target: Any = args.target
        if args.device_bytes is not None or args.host_bytes is not None:
            if args.device_bytes is None or args.host_bytes is None:
                raise ValueError("--device-bytes and --host-bytes go together")
            target = {"name": "custom", "device_bytes": args.device_bytes, "host_bytes": args.host_bytes}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallbacks are reported in the plan's own warnings
            result = plan(
                args.model, args.batch, seq_len=args.seq, recipe=_recipe_fields(args.recipe), target=target,
                method=args.method, find_max_batch=not args.no_max_batch,
            )
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
