"""Command line.

    python -m colab_memopt plan --model gpt2 --batch 8 --seq 1024 --target t4 [--json]
    python -m colab_memopt recommend --model llama-3.2-1b --seq 512 --target t4 [--mode auto] [--json]
"""

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

    from colab_memopt.presets import MODES
    from colab_memopt.recommender import OBJECTIVES

    r = sub.add_parser("recommend", help="the recipe that fits a target at the least expected slowdown")
    r.add_argument("--model", required=True, help=f"one of: {', '.join(model_names())}")
    r.add_argument("--batch", type=int, default=1, help="effective batch (sequences per optimizer step; default 1)")
    r.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    r.add_argument("--target", default="t4", help=f"one of {', '.join(TARGETS)} (or give --device-bytes and --host-bytes)")
    r.add_argument("--device-bytes", type=int, help="an explicit device memory size in bytes")
    r.add_argument("--host-bytes", type=int, help="an explicit host RAM size in bytes")
    r.add_argument("--mode", default="auto", choices=["auto", *MODES], help="what is trained (auto: full, else LoRA, else QLoRA)")
    r.add_argument("--objective", default="fastest", choices=list(OBJECTIVES))
    r.add_argument("--headroom", type=float, default=0.10, help="fraction of device memory kept free (default 0.10)")
    r.add_argument("--costs", default=None, help="technique_costs.json to read (default: the one shipped in the package)")
    r.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"], help="planner method for the confirming plans")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _target(args: argparse.Namespace) -> Any:
    if args.device_bytes is not None or args.host_bytes is not None:
        if args.device_bytes is None or args.host_bytes is None:
            raise ValueError("--device-bytes and --host-bytes go together")
        return {"name": "custom", "device_bytes": args.device_bytes, "host_bytes": args.host_bytes}
    return args.target


def _recommend(args: argparse.Namespace) -> int:
    from colab_memopt.costs import load_technique_costs
    from colab_memopt.recommender import NoRecipeFits, recommend

    try:
        result = recommend(
            args.model, args.batch, seq_len=args.seq, target=_target(args), objective=args.objective, mode=args.mode,
            headroom=args.headroom, costs=load_technique_costs(args.costs), method=args.method,
        )
    except NoRecipeFits as exc:
        print(f"no recipe fits: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "recommend":
        return _recommend(args)
    from colab_memopt.planner import plan

    try:
        target: Any = _target(args)
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
