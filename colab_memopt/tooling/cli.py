"""Command line.

    python -m colab_memopt plan --model gpt2 --batch 8 --seq 1024 --target t4 [--json]
    python -m colab_memopt plan --model ID --training-args sft.yaml [--lora FILE] [--bnb FILE] [--dtype bfloat16] --target t4
    python -m colab_memopt recommend --model llama-3.2-1b --seq 512 --target t4 [--mode auto] [--json]
    python -m colab_memopt doctor --model Qwen/Qwen2.5-0.5B --recipe precision=bf16-autocast --target t4 [--json]

Exit codes: 0 an answer, 1 it does not fit (plan) or no recipe fits (recommend), 2 bad input (one
line naming the value and what is allowed), 3 an internal error (with its traceback on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, NoReturn


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"none": None, "true": True, "false": False}.get(text.lower(), text)


# What --help lists, written here so that --help and a bad argument answer before torch and transformers are imported
# (seconds on two cores); tests/test_cli.py holds each equal to the package's own: the margin every plan keeps free
# (core.env.PLAN_MARGIN), the model names (architectures.model_names()), the targets (targets.TARGETS), the modes
# (presets.MODES) and recommend's objectives (recommender.OBJECTIVES).
HEADROOM = 0.05
MODEL_NAMES = ("tiny", "small", "medium", "large", "gpt2-small", "gpt2-medium", "gpt2-large", "1b", "gpt2",
               "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b",
               "llama-3.2-3b", "llama-3.1-8b")
# Each name's longest sequence (architectures.max_seq_len): a --seq over it is refused before the imports too.
MAX_SEQ_LEN = {"tiny": 64, "small": 128, "medium": 256, "large": 512, "gpt2-small": 1024, "gpt2-medium": 1024,
               "gpt2-large": 1024, "1b": 2048, "gpt2": 1024, "smollm2-135m": 8192, "smollm2-360m": 8192,
               "smollm2-1.7b": 8192, "qwen2.5-0.5b": 32768, "qwen2.5-1.5b": 32768, "llama-3.2-1b": 131072,
               "llama-3.2-3b": 131072, "llama-3.1-8b": 131072}
TARGET_NAMES = ("t4", "l4", "a100-40gb", "a100-80gb", "h100-80gb")
MODES = ("full", "lora", "qlora")
OBJECTIVES = ("fastest", "least_memory")
# The Recipe's fields (--recipe FIELD=VALUE), held equal to `dataclasses.fields(Recipe)` by tests/test_cli.py.
RECIPE_FIELDS = ("optimizer", "lr", "attention", "optimizer_rank", "quantization", "quantization_phase", "lora_rank",
                 "lora_targets", "base_dtype", "activation_compression", "compression_checkpointing", "phase_offload",
                 "precision", "eval_precision", "update_rounding", "checkpointing", "checkpoint_interval",
                 "accumulation_steps", "attention_window", "layer_offload_active", "layer_offload_prefetch",
                 "optimizer_state_offload", "zero_stage", "offload_optimizer", "offload_param", "loss_chunk_tokens",
                 "mlp_tile_tokens", "norm_tile_tokens", "offload_keep_blocks", "weight_dtype")

# Fields whose value is a tuple: given as comma-separated names (lora_targets=c_attn,c_proj).
_TUPLE_FIELDS = ("lora_targets",)


def _recipe_fields(items: list[str]) -> dict[str, Any]:
    fields = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--recipe takes field=value pairs, got {item!r}")
        key, value = item.split("=", 1)
        key, value = key.strip(), value.strip()
        fields[key] = tuple(v.strip() for v in value.split(",") if v.strip()) if key in _TUPLE_FIELDS else _value(value)
    return fields


class UsageError(Exception):
    """A command line argparse refuses (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so that --json can answer with JSON."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    model_names = ", ".join(MODEL_NAMES)
    targets = ", ".join(TARGET_NAMES)
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("colab-memopt")
    except PackageNotFoundError:  # run from a checkout that was not pip-installed
        __version__ = "(not installed)"
    parser = _Parser(prog="python -m colab_memopt", description="colab-memopt tools. Exit codes: 0 an answer, "
                     "1 does not fit / no recipe fits, 2 bad input, 3 an internal error.")
    parser.add_argument("--version", action="version", version=f"colab-memopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,recommend,doctor,context}")
    p = sub.add_parser("plan", help="predict a training step's peak memory on a target, without a GPU")
    p.add_argument("--model", default=None, help=f"one of: {model_names}; or a Hugging Face id, a local folder or a config.json "
                   "(with --training-args, default: the file's model_name_or_path)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (>= 1; with --training-args, from the file)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--target", default="t4", help=f"one of {targets} (or give --device-bytes and --host-bytes)")
    p.add_argument("--device-bytes", type=int, help="an explicit device memory size in bytes")
    p.add_argument("--host-bytes", type=int, help="an explicit host RAM size in bytes")
    p.add_argument("--recipe", nargs="*", default=[], metavar="FIELD=VALUE", help="recipe fields, e.g. optimizer=sgd")
    p.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"])
    p.add_argument("--no-max-batch", action="store_true", help="skip the search for the largest batch")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--training-args", default=None, metavar="FILE",
                   help="plan a Trainer run: a TrainingArguments / SFTConfig JSON or YAML (a TRL CLI config too)")
    p.add_argument("--lora", nargs="+", default=None, metavar="FILE|FIELD=VALUE", help="a peft LoraConfig file or fields")
    p.add_argument("--bnb", nargs="+", default=None, metavar="FILE|FIELD=VALUE", help="a BitsAndBytesConfig file or fields")
    p.add_argument("--prepare-model-for-kbit-training", nargs="*", default=None, metavar="FIELD=VALUE",
                   help="with --training-args and --bnb: you call peft's prepare_model_for_kbit_training(model) before "
                        "training (bare: its defaults; or the arguments you pass it, e.g. use_gradient_checkpointing=false)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
                   help="with --training-args: the dtype you load the model in (default: as the run loads it: "
                        "model_init_kwargs' dtype, else fp32, for TRL given the model id; the config's for a model you load)")

    r = sub.add_parser("recommend", help="the settings that fit a target with the shortest expected step time")
    r.add_argument("--model", required=True, help=f"one of: {model_names}; or a Hugging Face id, a local folder or a config.json")
    r.add_argument("--batch", type=int, default=1, help="effective batch (sequences per optimizer step; default 1)")
    r.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    r.add_argument("--target", default="t4", help=f"one of {targets} (or give --device-bytes and --host-bytes)")
    r.add_argument("--device-bytes", type=int, help="an explicit device memory size in bytes")
    r.add_argument("--host-bytes", type=int, help="an explicit host RAM size in bytes")
    r.add_argument("--mode", default="auto", choices=["auto", *MODES], help="what is trained (auto: full, else LoRA, else QLoRA)")
    r.add_argument("--objective", default="fastest", choices=list(OBJECTIVES))
    r.add_argument("--headroom", type=float, default=HEADROOM,
                   help=f"fraction of device memory and host RAM kept free (default {HEADROOM}, as every plan)")
    r.add_argument("--costs", default=None, help="a technique costs JSON of the target's device class (default: the "
                   "package's table for the target's class: measured rows, published priors for the rest)")
    r.add_argument("--no-half-precision", action="store_true",
                   help="forbid 16-bit compute: every candidate trains in fp32 (default on CUDA: fp16 autocast on a T4, "
                        "bf16 where native, and LoRA's frozen base in that dtype)")
    r.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"], help="planner method for the confirming plans")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    c = sub.add_parser("context", help="the longest trainable sequence per mode on a target, and the recipe that reaches it")
    c.add_argument("--model", required=True, help="a name, a Hugging Face id, a local folder or a config.json")
    c.add_argument("--target", default="t4", help=f"one of {targets} (or give --device-bytes and --host-bytes)")
    c.add_argument("--device-bytes", type=int, help="an explicit device memory size in bytes")
    c.add_argument("--host-bytes", type=int, help="an explicit host RAM size in bytes")
    c.add_argument("--mode", action="append", choices=list(MODES), help="a mode to search (repeatable; default all)")
    c.add_argument("--step", type=int, default=1024, help="the search's step in tokens (default 1024)")
    c.add_argument("--max-plans", type=int, default=12, help="plans per mode at most (default 12)")
    c.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"])
    c.add_argument("--json", action="store_true", help="print one JSON object")
    d = sub.add_parser("doctor", help="the T4 pitfalls of a model and recipe, found before the first step")
    d.add_argument("--model", default=None, help="a name, a Hugging Face id, a local folder or a config.json "
                   "(with --training-args, default: the file's model_name_or_path)")
    d.add_argument("--recipe", nargs="*", default=[], metavar="FIELD=VALUE", help="recipe fields, e.g. precision=bf16-autocast")
    d.add_argument("--target", default="t4", help="a target name or auto (this GPU, else a T4)")
    d.add_argument("--batch", type=int, default=None, help="sequences per step (default 1; with --training-args, "
                   "from the file)")
    d.add_argument("--training-args", default=None, metavar="FILE",
                   help="check a Trainer run: a TrainingArguments / SFTConfig JSON or YAML, planned as plan does")
    d.add_argument("--lora", nargs="+", default=None, metavar="FILE|FIELD=VALUE", help="a peft LoraConfig file or fields")
    d.add_argument("--bnb", nargs="+", default=None, metavar="FILE|FIELD=VALUE", help="a BitsAndBytesConfig file or fields")
    d.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
                   help="with --training-args: the dtype you load the model in (as plan's --dtype)")
    d.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: min(512, the model's maximum))")
    d.add_argument("--method", default="auto", choices=["auto", "trace", "analytic"])
    d.add_argument("--json", action="store_true", help="print one JSON object")
    for command in (p, r, c, d):
        command.add_argument("--verbose", action="store_true",
                             help="print every figure with its source and derivation, and let the libraries' own "
                                  "notes and warnings through to stderr (default: the answer, short)")
    return parser


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Hide third-party notes (torchao's missing CUDA libraries, bitsandbytes' kernels note, transformers'
    config and loss-type notes, torch's deprecation lines): logging below ERROR and Python warnings."""
    import logging

    if verbose:
        yield
        return
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _target(args: argparse.Namespace) -> Any:
    if args.device_bytes is not None or args.host_bytes is not None:
        if args.device_bytes is None or args.host_bytes is None:
            raise ValueError("--device-bytes and --host-bytes go together")
        return {"name": "custom", "device_bytes": args.device_bytes, "host_bytes": args.host_bytes}
    return args.target


def _recommend(args: argparse.Namespace) -> tuple[int, Any]:
    from colab_memopt.planning.costs import load_technique_costs
    from colab_memopt.planning.recommender import recommend

    result = recommend(
        args.model, args.batch, seq_len=args.seq, target=_target(args), objective=args.objective, mode=args.mode,
        headroom=args.headroom, costs=None if args.costs is None else load_technique_costs(args.costs), method=args.method,
        half_precision=not args.no_half_precision,
    )
    return 0, result


def _file_or_fields(items: list[str] | None) -> Any:
    from colab_memopt.planning.hfconfig import inline_fields

    if items is None:
        return None
    return items[0] if len(items) == 1 and "=" not in items[0] else inline_fields(items)


def _kbit_preparation(items: list[str] | None) -> bool | dict[str, Any]:
    """Return --prepare-model-for-kbit-training as plan_trainer takes it: False (not given), True (bare) or fields."""
    from colab_memopt.planning.hfconfig import inline_fields

    if items is None:
        return False
    return inline_fields(items) if items else True


def _plan_trainer(args: argparse.Namespace) -> tuple[int, Any]:
    from colab_memopt.planning.hfconfig import read_training_config
    from colab_memopt.planning.trainer import plan_trainer

    cfg = read_training_config(args.training_args, lora=_file_or_fields(args.lora), bnb=_file_or_fields(args.bnb))
    model = args.model or cfg.model
    if model is None:
        raise ValueError("--training-args: give --model (the file names no model_name_or_path)")
    if args.seq is None and getattr(cfg.args, "max_length", None) is None:
        raise ValueError("--training-args: the file sets no max_length: give --seq (tokens per sequence)")
    from colab_memopt.planning.hfconfig import check_tokens
    from colab_memopt.planning.planner import get_target

    tgt = get_target(_target(args))
    check_tokens(args.seq if args.seq is not None else cfg.args.max_length, cfg.args.per_device_train_batch_size,
                 tgt.host_bytes, seq_name="--seq" if args.seq is not None else "max_length", target_name=tgt.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = plan_trainer(cfg.args, model=model, lora=cfg.lora, bnb=cfg.bnb, target=_target(args), seq_len=args.seq,
                              find_max_batch=not args.no_max_batch, dtype=args.dtype,
                              prepare_model_for_kbit_training=_kbit_preparation(args.prepare_model_for_kbit_training))
    result.warnings += [f"read, no effect on memory: {k}" for k in cfg.ignored] + cfg.notes
    return (0 if result.fits else 1), result


def _plan(args: argparse.Namespace) -> tuple[int, Any]:
    from colab_memopt.planning.planner import plan

    if args.training_args is not None:
        return _plan_trainer(args)
    target: Any = _target(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are reported in the plan's own warnings
        result = plan(
            args.model, args.batch, seq_len=args.seq, recipe=_recipe_fields(args.recipe), target=target,
            method=args.method, find_max_batch=not args.no_max_batch,
        )
    return (0 if result.fits else 1), result


def _context(args: argparse.Namespace) -> tuple[int, Any]:
    from colab_memopt.planning.capacity import check_max_plans, longest_context

    check_max_plans(args.max_plans, "--max-plans")
    if args.step < 1:
        raise ValueError(f"--step must be an integer >= 1 (tokens), got {args.step}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = longest_context(args.model, target=_target(args), modes=tuple(args.mode or ()) or ("full", "lora", "qlora"),
                                 step_tokens=args.step, max_plans=args.max_plans, method=args.method)
    return (0 if any(r.max_seq_len for r in result.results.values()) else 1), result


def _doctor(args: argparse.Namespace) -> tuple[int, Any]:
    from colab_memopt.planning.doctor import doctor

    given: dict[str, Any] = {"recipe": _recipe_fields(args.recipe)}
    model = args.model
    if args.training_args is not None:  # the run as plan --training-args plans it
        from colab_memopt.planning.hfconfig import read_training_config

        cfg = read_training_config(args.training_args, lora=_file_or_fields(args.lora), bnb=_file_or_fields(args.bnb))
        model = model or cfg.model
        if model is None:
            raise ValueError("--training-args: give --model (the file names no model_name_or_path)")
        given = {"recipe": cfg.args, "lora": cfg.lora, "bnb": cfg.bnb, "dtype": args.dtype}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctor(model, target=args.target, batch=args.batch, seq_len=args.seq, method=args.method, **given)
    return (0 if result.ok else 1), result


# The counts a command line gives, each with its unit: refused when not >= 1 before anything heavy is imported.
_COUNTS = {"batch": "sequences", "seq": "tokens", "step": "tokens", "max_plans": "plans per search",
           "device_bytes": "bytes", "host_bytes": "bytes"}


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse a count below 1 (--batch 0, --seq -5, --max-plans 0), naming the flag, its unit and the value."""
    for name, unit in _COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1 ({unit}), got {value}")


def _check_model(model: str | None) -> None:
    """Refuse a --model that is none of our names, no local folder or file, and no Hugging Face id ('org/name'), as
    `architectures.resolve_model` does (tests/test_cli.py holds the two equal), before anything heavy is imported."""
    from colab_memopt.core.modelref import is_hub_id, local_path

    if model is None or model in MODEL_NAMES:
        return
    if not model.strip():
        raise ValueError("model must not be empty: give a name, a Hugging Face id, a folder or a config.json")
    path = local_path(model)
    if path.is_dir() or path.is_file() or is_hub_id(model):  # the planner reads it (and says what it lacks)
        return
    raise ValueError(f"unknown model {model!r}: not one of our names ({', '.join(MODEL_NAMES)}), not a local folder or "
                     "config.json, and not a Hugging Face id ('org/name')")


def _check_target(args: argparse.Namespace) -> None:
    """Refuse an unknown --target (doctor's 'auto' too) and --device-bytes without --host-bytes, as the planner does."""
    if getattr(args, "device_bytes", None) is not None or getattr(args, "host_bytes", None) is not None:
        _target(args)  # they go together
        return
    allowed = TARGET_NAMES + (("auto",) if args.command == "doctor" else ())
    if args.target not in allowed:
        bytes_given = "" if args.command == "doctor" else " or give --device-bytes and --host-bytes"
        raise ValueError(f"unknown target {args.target!r}; choose one of {sorted(allowed)}{bytes_given}")


def _check_arguments(args: argparse.Namespace) -> None:
    """What a command line alone says is wrong, said before torch and transformers are imported (seconds): the
    counts, the model, the target, the recipe's fields and the flags each verb takes together."""
    _check_counts(args)
    _check_model(args.model)
    _check_target(args)
    if getattr(args, "recipe", None):
        unknown = sorted(set(_recipe_fields(args.recipe)) - set(RECIPE_FIELDS))
        if unknown:
            raise ValueError(f"unknown recipe field(s) {unknown}; known fields: {sorted(RECIPE_FIELDS)}")
    seq, limit = getattr(args, "seq", None), MAX_SEQ_LEN.get(args.model)
    if args.command in ("plan", "recommend") and seq is not None and limit is not None and seq > limit:
        raise ValueError(f"seq_len {seq} exceeds {args.model!r}'s maximum of {limit}")  # as the planner says it
    headroom = getattr(args, "headroom", None)
    if headroom is not None and not 0 <= headroom < 1:
        raise ValueError(f"--headroom must be in [0, 1) (the fraction of memory kept free), got {headroom}")
    for flag in ("training_args", "costs"):
        given = getattr(args, flag, None)
        if given is not None and not Path(given).exists():  # a folder: the reader says what it is
            raise ValueError(f"--{flag.replace('_', '-')}: no such file: {given!r}")
    with_file = getattr(args, "training_args", None) is not None  # plan and doctor take it
    if with_file and (args.batch is not None or args.recipe):
        raise ValueError("--training-args gives the batch and the settings: leave --batch and --recipe out")
    if args.command == "plan" and with_file:
        if args.method == "analytic":
            raise ValueError("--method analytic: a --training-args run is planned by tracing its Trainer's step; "
                             "leave --method out (or give --method trace)")
    elif args.command == "plan":
        if args.lora is not None or args.bnb is not None:
            raise ValueError("--lora and --bnb go with --training-args (for a Recipe, use --recipe lora_rank=16 "
                             "quantization=nf4)")
        if args.prepare_model_for_kbit_training is not None:
            raise ValueError("--prepare-model-for-kbit-training goes with --training-args and --bnb")
        if args.dtype is not None:
            raise ValueError("--dtype goes with --training-args (for a Recipe's frozen base, use --recipe base_dtype=fp16)")
        if args.model is None or args.batch is None:
            raise ValueError("plan needs --model and --batch (or --training-args FILE)")
    elif args.command == "doctor" and not with_file:
        if args.lora is not None or args.bnb is not None or args.dtype is not None:
            raise ValueError("--lora, --bnb and --dtype go with --training-args (for a Recipe, use --recipe lora_rank=16 "
                             "quantization=nf4 base_dtype=fp16)")
        if args.model is None:
            raise ValueError("doctor needs --model (or --training-args FILE)")


def _finite(value: Any) -> Any:
    """Return `value` with every non-finite float as None: --json prints strict JSON (no Infinity, no NaN)."""
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (0 an answer, 1 does not fit, 2 bad input, 3 internal error).

    With --json, stdout holds exactly one JSON object, an error too ({"error": ..., "exit_code": ...});
    whatever the libraries print while planning (DeepSpeed's accelerator line, ...) goes to stderr.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    stdout = sys.stdout

    def answer(code: int, message: str) -> int:
        from colab_memopt.core.wording import wrap

        # bad input (2), a bug (3) or --json: one line. No recipe fits (1): each mode's reason a paragraph of lines
        # of at most 100 characters
        text = message if code != 1 or as_json else "\n".join(line for part in message.split(" | ") for line in wrap(part, rest="  "))
        print(text, file=sys.stderr)
        if as_json:
            print(json.dumps({"error": message.removeprefix("error: "), "exit_code": code}), file=stdout)
        return code

    try:  # --help and a bad argument answer here, before the planner (torch, transformers) is imported
        args = _parser().parse_args(argv)
        _check_arguments(args)
    except (UsageError, ValueError) as exc:
        return answer(2, f"error: {exc}" + (" (see --help)" if isinstance(exc, UsageError) else ""))
    with _quiet(getattr(args, "verbose", False)):  # importing the planner imports torchao, bitsandbytes, transformers
        from colab_memopt.planning.recommender import NoRecipeFits
    try:
        with contextlib.redirect_stdout(sys.stderr), _quiet(getattr(args, "verbose", False)):  # the answer alone on stdout
            code, result = {"recommend": _recommend, "doctor": _doctor, "context": _context}.get(args.command, _plan)(args)
    except NoRecipeFits as exc:
        return answer(1, f"no recipe fits: {exc}")
    except (ValueError, TypeError, OSError) as exc:  # the user's input: one line naming the value
        message = str(exc).strip() or type(exc).__name__
        return answer(2, f"error: {message}")
    except Exception as exc:  # noqa: BLE001 - a bug, not the input: say so, with the traceback on stderr
        traceback.print_exc()
        return answer(3, f"internal error ({type(exc).__name__}: {exc}); please report it with the command line")
    verbose = getattr(args, "verbose", False) and hasattr(result, "explain")
    text = result.explain() if verbose else result  # the sources and derivations behind each figure
    print(json.dumps(_finite(result.to_dict()), indent=2, allow_nan=False) if as_json else text, file=stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
