"""Weight quantization and QLoRA-style adapters (notebook 07).

Written here, because the notebook teaches it: symmetric int8 quantization with a dynamic range,
per tensor or per output channel (`quantize_int8`, `dequantize_int8`, `quantization_error`,
`Int8Linear`). Taken from the libraries that do it for real: bitsandbytes' `Linear8bitLt`
(LLM.int8) and `Linear4bit` (nf4, fp4), and peft's LoRA (`add_lora`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colab_memopt.core.console import import_quietly, quiet

GRANULARITIES = ("tensor", "channel")
SCHEMES = ("int8_tensor", "int8_channel", "bnb_int8", "nf4", "fp4")
# LLM.int8()'s outlier threshold (Dettmers et al. 2022, bitsandbytes' recommended value): input columns with a
# value of magnitude >= 6 are multiplied in 16 bits beside the int8 matmul (on CUDA; the CPU's training path
# dequantizes the whole weight instead and has no outliers).
INT8_THRESHOLD = 6.0
DEFAULT_LORA_TARGETS = ("qkv", "proj", "up", "down")


def _check_granularity(per: str) -> None:
    if per not in GRANULARITIES:
        raise ValueError(f"per must be one of {GRANULARITIES}, got {per!r}")


def int8_scale(w: torch.Tensor, per: str = "tensor") -> torch.Tensor:
    """Return the symmetric int8 scale: absmax / 127 of the tensor, or of each output row (shape (out, 1))."""
    _check_granularity(per)
    if per == "channel":
        if w.dim() < 2:
            raise ValueError(f"per='channel' needs a weight with >= 2 dims, got shape {tuple(w.shape)}")
        absmax = w.detach().abs().flatten(1).amax(dim=1).view(-1, *([1] * (w.dim() - 1)))
    else:
        absmax = w.detach().abs().amax()
    return (absmax.float() / 127.0).clamp_min(torch.finfo(torch.float32).tiny)


def quantize_int8(w: torch.Tensor, per: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 values, fp32 scale) with w ~ q * scale, q in [-127, 127].

    Symmetric with a dynamic range: the scale is the tensor's (or each output row's) absolute maximum
    over 127, so the largest value maps to +-127 and every value is off by at most scale / 2.

    Example:
        >>> q, scale = quantize_int8(linear.weight, per="channel")   # q: int8 (out, in), scale: (out, 1)
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_int8 takes a floating-point tensor, got {w.dtype}")
    scale = int8_scale(w, per)
    q = torch.round(w.detach().float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Return q * scale in `dtype`."""
    if q.dtype != torch.int8:
        raise TypeError(f"dequantize_int8 takes int8 values, got {q.dtype}")
    return (q.float() * scale).to(dtype)


@dataclass
class QuantError:
    """How far a round trip lands from the original: relative Frobenius error and the worst value.

    `max_abs_bound` (scale / 2, the largest scale's) bounds the worst value in exact arithmetic only.
    `quantize_int8` and `dequantize_int8` compute `w / scale` and `q * scale` in fp32, and their
    rounding can push a value near 127 * scale past it by up to about one fp32 ulp of the largest
    magnitude (seen: 1e-5 of the bound on (3072, 768) random matrices). `rounding_slack`, two ulps
    (2 * eps * max |w|), covers it: the worst value respects `max_abs_bound + rounding_slack`.
    """

    rel_error: float
    max_abs_error: float
    max_abs_bound: float  # scale / 2: the bound in exact arithmetic
    rounding_slack: float = 0.0  # 2 * fp32 eps * max |w|: what fp32 rounding may add to it


def quantization_error(w: torch.Tensor, per: str = "tensor") -> QuantError:
    """Return the round-trip error of int8 quantization of `w`."""
    q, scale = quantize_int8(w, per)
    w32 = w.detach().float()
    diff = dequantize_int8(q, scale) - w32
    return QuantError(
        rel_error=(diff.norm() / w32.norm().clamp_min(1e-30)).item(),
        max_abs_error=diff.abs().max().item(),
        max_abs_bound=(scale.max() / 2).item(),
        rounding_slack=2 * torch.finfo(torch.float32).eps * w32.abs().max().item(),
    )


class Int8Linear(nn.Module):
    """A frozen Linear whose weight is stored as int8 plus fp32 scales and dequantized in forward.

    Weight-only quantization: 1 byte per weight in memory; each forward makes a temporary fp32 copy
    of one layer's weight. The bias stays in fp32. The weight is frozen (no gradient).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("weight_int8", q)
        self.register_buffer("weight_scale", scale)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, per: str = "channel") -> Int8Linear:
        """Return an Int8Linear holding `linear`'s weight quantized per tensor or per output channel."""
        q, scale = quantize_int8(linear.weight, per)
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_int8(self.weight_int8, self.weight_scale, x.dtype), self.bias)


def _bnb_linear(linear: nn.Linear, scheme: str) -> nn.Module:
    try:
        bnb = import_quietly("bitsandbytes")
    except ImportError as err:
        raise RuntimeError(f"quantization {scheme!r} needs bitsandbytes: pip install bitsandbytes") from err
    w = linear.weight.detach().clone()
    has_bias = linear.bias is not None
    if scheme == "bnb_int8":
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=has_bias,
                                  has_fp16_weights=False, threshold=INT8_THRESHOLD)
        new.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    else:
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias,
                                compute_dtype=w.dtype, quant_type=scheme)
        new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type=scheme)
    if has_bias:
        new.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return new.to(linear.weight.device)  # bitsandbytes quantizes when the module is moved


def _as_linear(module: nn.Module) -> nn.Linear:
    """Return `module` as an nn.Linear: itself, or transformers' Conv1D (GPT-2's, weight stored (in, out)) converted."""
    if isinstance(module, nn.Linear):
        return module
    in_features, out_features = module.weight.shape
    linear = nn.Linear(in_features, out_features, bias=module.bias is not None,
                       device=module.weight.device, dtype=module.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(module.weight.t())
        if module.bias is not None:
            linear.bias.copy_(module.bias)
    return linear


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, Int8Linear) or type(module).__module__.startswith("bitsandbytes")


def quantize_linear(linear: nn.Module, scheme: str) -> nn.Module:
    """Return a frozen quantized copy of a linear layer (nn.Linear or a subclass, or transformers' Conv1D).

    `scheme` is one of `SCHEMES`.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not (isinstance(linear, nn.Linear) or _is_conv1d(linear)):
        raise TypeError(f"quantize_linear takes an nn.Linear (or a subclass, or transformers' Conv1D), got {type(linear).__name__}")
    linear = _as_linear(linear)
    if scheme.startswith("int8_"):
        return Int8Linear.from_linear(linear, per=scheme.split("_")[1])
    return _bnb_linear(linear, scheme)


def kept_in_high_precision(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> set[str]:
    """Return the names of the linear layers `quantize_model` leaves alone.

    Those whose name contains one of `skip`, the output head (`get_output_embeddings()`, often tied to
    the embedding), and the modules a transformers model declares must stay in fp32
    (`_keep_in_fp32_modules`, e.g. T5's 'wo', whose forward casts its input to the weight's dtype).
    Embeddings and norms are not linear layers and are never quantized.
    """
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    out = set()
    for name, mod in model.named_modules():
        if not (isinstance(mod, nn.Linear) or _is_conv1d(mod)) or _is_quantized(mod):
            continue
        if any(s in name for s in skip) or mod is head or any(k in name.split(".") for k in keep):
            out.add(name)
    return out


def linear_layers(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[tuple[str, nn.Module]]:
    """Return (name, module) of every layer `quantize_model` quantizes, found by what it is, not its class name.

    nn.Linear and its subclasses (a family's own `XLinear(nn.Linear)`), and transformers' Conv1D;
    not layers that are already quantized, nor those `kept_in_high_precision`.
    """
    kept = kept_in_high_precision(model, skip)
    return [(name, mod) for name, mod in model.named_modules()
            if (isinstance(mod, nn.Linear) or _is_conv1d(mod)) and not _is_quantized(mod) and name not in kept]


def check_quantizable(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[tuple[str, nn.Module]]:
    """Return `linear_layers(model, skip)`; raise ValueError naming the model and what was kept when there are none."""
    targets = linear_layers(model, skip)
    if not targets:
        kept = sorted(kept_in_high_precision(model, skip))
        raise ValueError(
            f"quantize_model found no linear layer to quantize in {type(model).__name__} "
            f"(nn.Linear, its subclasses or transformers' Conv1D); kept in high precision: {kept or 'none'}; skip={tuple(skip)}"
        )
    return targets


def quantize_model(model: nn.Module, scheme: str, *, skip: Sequence[str] = ("lm_head",)) -> nn.Module:
    """Replace every linear layer of `model` (in place) by a frozen quantized one; return the model.

    Which layers: `linear_layers` (nn.Linear and subclasses, transformers' Conv1D). Which stay:
    `kept_in_high_precision` (names containing one of `skip`, default the output layer; the output
    head; transformers' `_keep_in_fp32_modules`). Embeddings and norms stay in full precision.
    Works on decoder-only and encoder-decoder transformers models and on the reference model.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    names = []  # names only: a list of the layers would keep every original alive until the last one is quantized
    for name, mod in check_quantizable(model, skip):
        if not mod.weight.is_floating_point():
            raise ValueError(f"quantize_model: {name} ({type(mod).__name__}) has a {mod.weight.dtype} weight; "
                             "only floating-point weights can be quantized")
        names.append(name)
    del mod
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantize_linear(getattr(parent, child), scheme))  # the original is freed here
    return model


def _quant_state_tensors(weight: torch.Tensor, module: nn.Module | None = None) -> list[torch.Tensor]:
    """Return the tensors bitsandbytes keeps beside a quantized weight (scales, absmax, code book).

    Linear8bitLt moves its row scales (SCB) from the weight to `module.state` at the first forward,
    so both places are looked at.
    """
    out = []
    state = getattr(module, "state", None)
    for scb in (getattr(weight, "SCB", None), getattr(state, "SCB", None)):
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    qs = getattr(weight, "quant_state", None)
    while qs is not None:
        out += [t for t in (getattr(qs, "absmax", None), getattr(qs, "offset", None)) if isinstance(t, torch.Tensor)]
        qs = getattr(qs, "state2", None)
    return out


def linear_weight_bytes(model: nn.Module, *, skip: Sequence[str] = ()) -> int:
    """Return the bytes of the weights (and their scales) of every linear layer in `model`.

    Counts nn.Linear weights, Int8Linear's int8 values and scales, and bitsandbytes' packed weights
    with the scales they keep as attributes (SCB, quant_state.absmax: not parameters or buffers, so
    a parameter count misses them). Biases are not counted; each storage once. Modules whose name
    contains one of `skip` are left out (pass ("lm_head",) to count only what `quantize_model` changes).
    """
    seen, total = set(), 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for name, mod in model.named_modules():
        if any(s in name for s in skip):
            continue
        if isinstance(mod, Int8Linear):
            add(mod.weight_int8)
            add(mod.weight_scale)
        elif (isinstance(mod, nn.Linear) or _is_conv1d(mod)) and not hasattr(mod, "lora_A"):  # bnb layers subclass nn.Linear
            add(mod.weight)
            for t in _quant_state_tensors(mod.weight, mod):
                add(t)
    return total


def _is_target(name: str, targets: list[str]) -> bool:
    """Whether a module named `name` is a LoRA target, as in peft: its name is a target or ends with '.' + target."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def check_lora_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """Return the targets as a list; raise ValueError when none of `model`'s modules matches them (`_is_target`)."""
    targets = list(targets)
    if not targets:
        raise ValueError("targets must name at least one module, got none")
    if not any(_is_target(name, targets) for name, _ in model.named_modules()):
        leaves = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                         if name and (isinstance(m, nn.Linear) or _is_conv1d(m))})
        raise ValueError(f"no module matched the LoRA targets {targets} in {type(model).__name__}; "
                         f"its linear layers are named {leaves[:12]}")
    return targets


def add_lora(model: nn.Module, rank: int, *, targets: Iterable[str] = DEFAULT_LORA_TARGETS, alpha: int | None = None) -> nn.Module:
    """Inject peft LoRA adapters of `rank` into the modules named `targets`; freeze everything else.

    Works on the reference model and on transformers models, with plain, int8 or bitsandbytes layers
    underneath (QLoRA when the base is 4-bit). Returns the same model (adapters injected in place).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    targets = check_lora_targets(model, targets)
    with quiet():  # the library's import notes (torchao's, DeepSpeed's): nothing about this run
        from peft import LoraConfig, inject_adapter_in_model

    for p in model.parameters():
        p.requires_grad_(False)
    matched = [m for name, m in model.named_modules() if _is_target(name, targets)]
    # transformers' Conv1D (GPT-2's layers, unless quantized into Linear layers) stores its weight transposed: peft
    # adapts it with fan_in_fan_out (it would set that itself, with a warning)
    conv1d = bool(matched) and all(_is_conv1d(m) for m in matched)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, lora_dropout=0.0, bias="none",
                        fan_in_fan_out=conv1d)
    model = inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"no module matched the LoRA targets {targets}")
    return model


def quantized_copy(model: nn.Module, scheme: str = "int8_channel") -> nn.Module:
    """Return a quantized deep copy of `model` for forward-only phases (evaluation, generation)."""
    return quantize_model(copy.deepcopy(model), scheme)


def load_4bit_state(model: nn.Module) -> nn.Module:
    """Let `model.load_state_dict` take back what `model.state_dict()` saved from its 4-bit layers; return the model.

    bitsandbytes' `Linear4bit` saves its quantization state (absmax, quant map, ...) beside the packed weight but
    does not load it back: a state dict saved from a QLoRA model fails to load into one built the same way
    ("Unexpected key(s) ... weight.absmax"). A pre-hook per 4-bit layer rebuilds the layer's quantization state from
    those keys; the packed weight then loads as any tensor does.
    """
    QuantState = import_quietly("bitsandbytes.functional").QuantState
    Linear4bit = import_quietly("bitsandbytes.nn").Linear4bit

    def hook(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        key = prefix + "weight."
        stats = {k[len(key):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(key)}
        if stats:
            module.weight.quant_state = QuantState.from_dict(stats, device=module.weight.device)

    for m in model.modules():
        if isinstance(m, Linear4bit) and not getattr(m, "_cm_loads_4bit_state", False):
            m._register_load_state_dict_pre_hook(hook, with_module=True)
            m._cm_loads_4bit_state = True
    return model
