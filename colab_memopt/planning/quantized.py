"""bitsandbytes' 4-bit and 8-bit layers as a plan traces them, and what they allocate on CUDA that no trace sees.

`traced_linear4bit` and `traced_linear8bit` stand in for bitsandbytes' layers under fake tensors (their tensor
subclasses cannot wrap one), with the exact storage of the real ones; `_fake_safe_bitsandbytes` builds them, and the
8-bit optimizers' code books, while a step is traced; `_int8_as_on_cuda` traces the 8-bit matmul as CUDA runs it
(LLM.int8 with no outlier column: a lower bound). What CUDA allocates inside bitsandbytes' ops is a plan line: the
4-bit weight dequantized at each layer call (`four_bit_step_costs`), the peak of loading a 4-bit base
(`four_bit_load_costs`), the quantization scales kept beside the weights (`quantization_scale_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from colab_memopt.core.console import import_quietly
from colab_memopt.core.measure import format_bytes
from colab_memopt.training.recipe import Recipe
from colab_memopt.core.tracker import _CUDA_MIN_BLOCK
from colab_memopt.planning.prediction import Cost
from colab_memopt.planning.targets import Target


FOUR_BIT_BLOCKSIZE = 64  # bitsandbytes' Linear4bit / Params4bit default, as quantization._bnb_linear builds them


def traced_linear4bit(linear: nn.Module, scheme: str, *, compress_statistics: bool = True) -> nn.Module:
    """Return a stand-in for `quantization._bnb_linear(linear, scheme)` that works on fake tensors.

    bitsandbytes' `Params4bit` is a tensor subclass that cannot wrap a fake tensor. This module holds
    the exact storage of a real `Linear4bit` as a plain frozen parameter, made by bitsandbytes' own
    `quantize_4bit` (which has fake kernels): the packed weight ((out * in + 1) // 2 bytes of uint8),
    the nested quantization state (uint8 absmax per 64-value block, fp32 absmax per 256 of those,
    the offset and both code books), and the bias. Its forward is `Linear4bit.forward` itself, so the
    step traces bitsandbytes' `matmul_4bit` (dequantize, linear; dequantize again in backward) and
    peft wraps it as it wraps a real 4-bit layer. `tests/test_planner.py` pins its bytes to a real
    `Linear4bit` per quant type. `compress_statistics=False`: one fp32 absmax per block, not nested
    (BitsAndBytesConfig's default `bnb_4bit_use_double_quant=False`).
    """
    bnb = import_quietly("bitsandbytes")

    class TracedLinear4bit(bnb.nn.Linear4bit):
        def __init__(self) -> None:  # noqa: D107 - built from `linear` below, not from sizes
            nn.Module.__init__(self)

    from colab_memopt.techniques.quantization import _as_linear

    linear = _as_linear(linear)
    w = linear.weight.detach()
    packed, state = bnb.functional.quantize_4bit(w, blocksize=FOUR_BIT_BLOCKSIZE, quant_type=scheme,
                                                 compress_statistics=compress_statistics, quant_storage=torch.uint8)
    new = TracedLinear4bit()
    new.in_features, new.out_features = linear.in_features, linear.out_features
    weight = nn.Parameter(packed, requires_grad=False)
    for name, value in (("quant_state", state), ("blocksize", FOUR_BIT_BLOCKSIZE),
                        ("compress_statistics", compress_statistics), ("quant_type", scheme),
                        ("quant_storage", torch.uint8), ("bnb_quantized", True)):
        setattr(weight, name, value)
    new.weight = weight
    new.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    new.compute_dtype, new.compute_type_is_set = w.dtype, True
    new.quant_state, new.quant_storage, new.support_avx512bf16_for_cpu = None, torch.uint8, False
    return new


def traced_linear8bit(linear: nn.Module, threshold: float | None = None) -> nn.Module:
    """Return a stand-in for `quantization._bnb_linear(linear, 'bnb_int8')` that works on fake tensors.

    bitsandbytes' `Int8Params` is a tensor subclass that cannot wrap a fake tensor. This module is a
    `Linear8bitLt` holding the exact storage of a real one after its first forward, made by bitsandbytes'
    own `int8_vectorwise_quant` (which has a fake kernel) from the fp16 weight, as `Int8Params` does: the
    int8 weight (out x in bytes) as a plain frozen parameter, which is also `state.CB`; the fp32 row
    scales `state.SCB` (4 bytes per output row, kept in the layer's state, not as a parameter); and the
    bias. Its forward is `Linear8bitLt.forward` itself, so the step traces `bitsandbytes.matmul` (on the
    CPU, in training: the whole weight dequantized to the input's dtype in forward and again in
    backward) and peft wraps it as it wraps a real 8-bit layer. `tests/test_planner.py` pins its tensors
    to a real `Linear8bitLt`.
    """
    bnb = import_quietly("bitsandbytes")

    from colab_memopt.techniques.quantization import INT8_THRESHOLD, _as_linear

    class TracedLinear8bitLt(bnb.nn.Linear8bitLt):
        def __init__(self) -> None:  # noqa: D107 - built from `linear` below, not from sizes
            nn.Module.__init__(self)

    linear = _as_linear(linear)
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(torch.float16))  # (out, in) int8, (out,) fp32
    new = TracedLinear8bitLt()
    new.in_features, new.out_features, new.index = linear.in_features, linear.out_features, None
    weight = nn.Parameter(cb, requires_grad=False)
    weight.CB, weight.SCB, weight.has_fp16_weights = None, None, False  # moved to `state` at the first forward
    new.weight = weight
    new.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    new.state = bnb.MatmulLtState()
    new.state.threshold = INT8_THRESHOLD if threshold is None else threshold
    new.state.has_fp16_weights = False
    new.state.use_pool = new.state.threshold > 0.0
    new.state.CB, new.state.SCB = cb, scb
    return new


def _int8_layers(model: nn.Module) -> list[nn.Module]:
    """Return the bitsandbytes 8-bit linear layers of `model` (real or stand-ins)."""
    try:
        bnb = import_quietly("bitsandbytes")
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]


@contextlib.contextmanager
def _int8_as_on_cuda() -> Iterator[None]:
    """Trace bitsandbytes' 8-bit matmul as CUDA runs it, with no outlier column, for the duration.

    On CUDA, `bitsandbytes.matmul` runs `MatMul8bitLt` (LLM.int8: the input quantized to int8 per row,
    an int8 matmul, the input's columns holding a value of magnitude >= the threshold multiplied in 16
    bits beside it and kept for backward); on the CPU, in training, it runs `MatMul8bitFp` (the weight
    dequantized). The fake tensors here are CPU tensors, so `bitsandbytes.matmul` is pointed at
    `MatMul8bitLt` for the duration. Which columns are outliers depends on the values: bitsandbytes'
    fake kernels give them a size fake tensors cannot count, so for the duration the fake kernels of
    `int8_vectorwise_quant`, `int8_double_quant` and `int8_mixed_scaled_mm` say "no outlier column",
    as the real kernels do on inputs below the threshold. The plan then is a lower bound for inputs
    that have outliers (the plan's warning gives the bytes per outlier column). Restored afterwards.
    """
    import logging

    bnb = import_quietly("bitsandbytes")
    functions = import_quietly("bitsandbytes.autograd._functions")
    MatMul8bitLt, MatmulLtState = functions.MatMul8bitLt, functions.MatmulLtState
    from torch._library.simple_registry import singleton
    from torch._library.utils import Kernel

    def vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = A.numel() // A.shape[-1]
        outliers = None if threshold == 0.0 else A.new_empty(0, dtype=torch.int64)
        return torch.empty(A.shape, device=A.device, dtype=torch.int8), torch.empty(rows, device=A.device, dtype=torch.float32), outliers

    def double_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, ...]:
        rows = A.numel() // A.shape[-1]
        return (torch.empty_like(A, dtype=torch.int8), torch.empty_like(A, dtype=torch.int8),
                torch.empty(rows, device=A.device, dtype=torch.float32), torch.empty(A.shape[-1], device=A.device, dtype=torch.float32),
                A.new_empty(0, dtype=torch.int64))

    def mixed_scaled_mm(A: torch.Tensor, CA: torch.Tensor, CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
                        outlier_cols: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # bitsandbytes' own no-outlier branch: the output, and an empty `subA` of the input's dtype
        return torch.empty((*CA.shape[:-1], CB.shape[0]), device=A.device, dtype=A.dtype), torch.empty(0, device=A.device, dtype=A.dtype)

    def matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, state: MatmulLtState | None = None,
               threshold: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    kernels = [(singleton.find(f"bitsandbytes::{name}").fake_impl, Kernel(fn, "colab_memopt.planning.quantized: no outlier column"))
               for name, fn in (("int8_vectorwise_quant", vectorwise_quant), ("int8_double_quant", double_quant),
                                ("int8_mixed_scaled_mm", mixed_scaled_mm))]
    log = logging.getLogger(MatMul8bitLt.__module__)  # "inputs will be cast ... to float16", once per layer and step
    original_matmul, level = bnb.matmul, log.level
    for holder, kernel in kernels:
        holder.kernels.append(kernel)  # the newest fake kernel is the one that runs
    bnb.matmul = matmul
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        bnb.matmul = original_matmul
        log.setLevel(level)
        for holder, kernel in kernels:
            holder.kernels.remove(kernel)


def quantization_scale_bytes(model: nn.Module, *, cuda_rounding: bool = False) -> int:
    """Return the bytes bitsandbytes keeps beside the quantized weights of `model`, outside its parameters.

    `Linear8bitLt`'s fp32 row scales (`state.SCB`) and `Linear4bit`'s absmax and offset
    (`quantization._quant_state_tensors`), each tensor once. Neither the tracker (which counts
    parameters, buffers, gradients, optimizer state and what the step allocates) nor a plan's tensors at
    peak include them; on CUDA they are inside `max_memory_allocated` (`cuda_rounding`: each rounded
    up to the caching allocator's 512-byte blocks).
    """
    from colab_memopt.techniques.quantization import _quant_state_tensors

    try:
        bnb = import_quietly("bitsandbytes")
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return 0
    seen: dict[int, int] = {}
    for mod in model.modules():
        weight = getattr(mod, "weight", None)
        if isinstance(mod, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) and isinstance(weight, torch.Tensor):
            for t in _quant_state_tensors(weight, mod):
                nbytes = t.numel() * t.element_size()
                seen[id(t)] = -(-nbytes // _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK if cuda_rounding else nbytes
    return sum(seen.values())


def _int8_outlier_warning(model: nn.Module, batch: int, seq_len: int, recipe: Recipe, target: Target) -> str:
    """Return the plan's warning for 8-bit bases traced as CUDA runs them: what the trace cannot know."""
    from colab_memopt.techniques.quantization import INT8_THRESHOLD

    tokens = -(-batch // max(1, recipe.accumulation_steps)) * seq_len
    value_bytes = 2 if recipe.precision in ("bf16", "bf16-autocast", "fp16-autocast") else 4
    per_column, every_column = int8_outlier_bytes(model, tokens, value_bytes)
    scratch = max((tokens * m.out_features * (4 + 2) for m in _int8_layers(model)), default=0)
    return (f"bnb_int8 on {target.name} is traced as CUDA runs LLM.int8 (MatMul8bitLt) with no outlier column: this "
            f"plan is a lower bound. Input columns holding a value of magnitude >= {INT8_THRESHOLD} are kept in the "
            f"input's dtype until backward: {format_bytes(per_column)} for one such column in each of the "
            f"{len(_int8_layers(model))} 8-bit layers, {format_bytes(every_column)} if every column were one; the int8 matmul's own scratch "
            f"(an int32 and a 16-bit copy of a layer's output, up to {format_bytes(scratch)}) is not traced either. "
            "Not yet checked against a GPU measurement; on the CPU the 8-bit path is traced exactly")


def int8_outlier_bytes(model: nn.Module, tokens: int, value_bytes: int) -> tuple[int, int]:
    """Return (bytes per outlier column, bytes if every column were one) that LLM.int8 keeps for backward.

    On CUDA each 8-bit layer keeps, until backward, its input's outlier columns in the input's dtype
    (`subA`: `tokens` values of `value_bytes` per column); the trace assumes none. The first figure is
    one outlier column in every 8-bit layer, the second every input column of every layer an outlier.
    """
    layers = _int8_layers(model)
    return tokens * value_bytes * len(layers), sum(tokens * value_bytes * m.in_features for m in layers)


@contextlib.contextmanager
def _fake_safe_bitsandbytes(mode: Any, recipe: Recipe, *, cuda: bool = False) -> Iterator[None]:
    """Let bitsandbytes' 8-bit optimizers and its 4-bit and 8-bit layers be built under fake tensors, for the duration.

    Both build the 256-value dynamic code book with `.tolist()` on a tensor, a value fake tensors
    cannot give; here the code book is built for real and handed to the fake mode, and bitsandbytes'
    cache of it is emptied for the duration and restored afterwards (a real code book cannot enter a
    fake op, and a fake one left there would break later real calls).
    4-bit layers are built as `traced_linear4bit` stand-ins, 8-bit ones as `traced_linear8bit`. The steps
    themselves trace: bitsandbytes registers fake implementations of its update, quantize and dequantize
    ops. With `cuda`, 8-bit layers are traced as CUDA runs them (`_int8_as_on_cuda`).
    """
    from colab_memopt.techniques import quantization
    from colab_memopt.techniques.optimizers import BNB_OPTIMIZERS, IN_BACKWARD_SUFFIX

    four_bit = recipe.quantization in ("nf4", "fp4") and recipe.quantization_phase == "all"
    eight_bit = recipe.quantization == "bnb_int8" and recipe.quantization_phase == "all"
    # GaLore's 8-bit optimizer is bitsandbytes' with a projection: the same code book.
    if (recipe.optimizer.removesuffix(IN_BACKWARD_SUFFIX) not in (*BNB_OPTIMIZERS, "galore_adamw8bit") and not four_bit
            and not eight_bit):
        yield
        return
    bnb_functional = import_quietly("bitsandbytes.functional")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original_map, original_linear = bnb_functional.create_dynamic_map, quantization._bnb_linear
    cached = dict(bnb_functional.name2qmap)

    def create_dynamic_map(*args: Any, **kwargs: Any) -> torch.Tensor:
        with unset_fake_temporarily():
            real = original_map(*args, **kwargs)
        return mode.from_tensor(real, static_shapes=True)

    def bnb_linear(linear: nn.Module, scheme: str) -> nn.Module:
        if scheme == "bnb_int8":
            return traced_linear8bit(linear)
        return traced_linear4bit(linear, scheme) if scheme in ("nf4", "fp4") else original_linear(linear, scheme)

    bnb_functional.create_dynamic_map = create_dynamic_map
    bnb_functional.name2qmap.clear()  # a real code book cached by an earlier real call cannot enter a fake op
    quantization._bnb_linear = bnb_linear
    try:
        with _int8_as_on_cuda() if cuda and eight_bit else contextlib.nullcontext():
            yield
    finally:
        bnb_functional.create_dynamic_map = original_map
        quantization._bnb_linear = original_linear
        bnb_functional.name2qmap.clear()
        bnb_functional.name2qmap.update(cached)


# bitsandbytes 0.50.2, backends/cuda/ops.py: the `gemm_4bit` CUDA kernel's dispatch. At or below 4 rows (tokens)
# the fused cgemm_4bit kernel always runs; above 1536 the unfused fallback always does; between, a per-GPU heuristic.
FOUR_BIT_FUSED_MAX_TOKENS = 4  # _GEMM_4BIT_CUSTOM_FLOOR_M
FOUR_BIT_FALLBACK_ABOVE_TOKENS = 1536  # _gemm_4bit_custom_max_m (CUDA)
_BNB_CUDA_OPS = "bitsandbytes 0.50.2 backends/cuda/ops.py"


def _round_block(nbytes: int) -> int:
    return -(-nbytes // _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK


def four_bit_dequant_bytes(numel: int, itemsize: int, *, nested: bool, blocksize: int = FOUR_BIT_BLOCKSIZE) -> int:
    """Return the device bytes bitsandbytes allocates on CUDA to dequantize (or to quantize) one 4-bit weight.

    The weight in `itemsize`-byte floats and, with nested (double-quantized) statistics, the per-block fp32
    absmax twice (dequantized, then shifted by the offset; `_dequant_linear_fallback`, `quantize_4bit`), each
    rounded up to the caching allocator's 512-byte blocks.

    Example:
        >>> four_bit_dequant_bytes(4096 * 4096, 2, nested=True)   # 32 MiB + 2 x 1 MiB
        35651584
    """
    blocks = -(-numel // blocksize)
    return _round_block(numel * itemsize) + (2 * _round_block(blocks * 4) if nested else 0)


def _four_bit_numels(meta_model: nn.Module) -> list[int]:
    """Return the weight sizes of the layers a 4-bit recipe quantizes (`quantization.linear_layers`: lm_head kept)."""
    from colab_memopt.techniques.quantization import linear_layers

    return [mod.weight.numel() for _, mod in linear_layers(meta_model)]


def _four_bit_path(spec: Any, recipe: Recipe, target: Target, meta_model: nn.Module) -> tuple[bool, torch.dtype]:
    """Return (quantized by transformers while loading, the dtype the weights are quantized from and computed in)."""
    from colab_memopt.training.checkpoints import has_weights
    from colab_memopt.training.loadplan import load_dtype
    from colab_memopt.techniques.precision import BASE_DTYPES
    from colab_memopt.training.presets import BF16_TARGETS
    from colab_memopt.techniques.quantization import linear_layers

    if has_weights(spec):  # loading.load_model: BitsAndBytesConfig, compute dtype = load dtype
        return True, load_dtype(recipe, "cuda", native_bf16=target.name in BF16_TARGETS)
    if recipe.base_dtype is not None:  # Recipe.build: the frozen base cast before quantize_model
        return False, BASE_DTYPES[recipe.base_dtype]
    weights = [mod.weight.dtype for _, mod in linear_layers(meta_model)]
    return False, weights[0] if weights else torch.float32


def four_bit_step_costs(meta_model: nn.Module, spec: Any, recipe: Recipe, target: Target, batch: int,
                        seq_len: int) -> list[Cost]:
    """Return the plan lines of what a 4-bit (QLoRA) step allocates on CUDA that a CPU trace does not see.

    bitsandbytes' `MatMul4Bit.forward` calls the `gemm_4bit` op. Its CUDA kernel either runs the fused
    `cgemm_4bit` kernel (output only) or, above 1536 tokens per micro-batch always and between 5 and 1536 by
    a per-GPU heuristic, `_dequant_linear_fallback`: the layer's whole weight dequantized to the compute dtype
    (and a nested absmax to fp32, twice), `F.linear`, then freed. That happens inside the op: the fake kernel
    the trace runs allocates only the output, and the CUDA tracker cannot see inside an op either (it lands in
    `untracked`). One layer at a time, so the largest layer's bytes are added once, to the peak of the phase it
    happens in (`Plan.step_peak_bytes`): forward, and backward too where checkpointing recomputes the forward
    there; an upper bound within that phase. Backward's dequantization (`MatMul4Bit.backward`:
    `F.dequantize_4bit`) is a Python call of ops the trace runs, so it is traced already. Empty unless the
    recipe trains a 4-bit base.
    """
    if recipe.quantization not in ("nf4", "fp4") or recipe.quantization_phase != "all":
        return []
    numels = _four_bit_numels(meta_model)
    tokens = -(-batch // recipe.accumulation_steps) * seq_len
    if not numels:
        return []
    by_transformers, dtype = _four_bit_path(spec, recipe, target, meta_model)
    # in forward; in backward too where checkpointing recomputes the forward there
    recomputes = recipe.checkpointing != "none" or recipe.compression_checkpointing
    return four_bit_dequant_costs(max(numels), dtype, tokens, nested=not by_transformers, recomputes=recomputes)


def four_bit_dequant_costs(numel: int, dtype: torch.dtype, tokens: int, *, nested: bool, recomputes: bool) -> list[Cost]:
    """Return the in-step line of bitsandbytes' CUDA `gemm_4bit` dequantizing the largest 4-bit weight (`numel`
    values) to `dtype` at `tokens` tokens per micro-batch (`four_bit_step_costs`); empty where the fused kernel
    always runs. `nested`: double-quantized statistics (dequantized to fp32 twice); `recomputes`: checkpointing runs
    the forward again in backward."""
    if tokens <= FOUR_BIT_FUSED_MAX_TOKENS:
        return []
    nbytes = four_bit_dequant_bytes(numel, dtype.itemsize, nested=nested)
    when = (f"{tokens} tokens per micro-batch > {FOUR_BIT_FALLBACK_ABOVE_TOKENS}: always this path" if tokens > FOUR_BIT_FALLBACK_ABOVE_TOKENS
            else f"{tokens} tokens per micro-batch: the fused kernel or this path by a per-GPU heuristic "
                 "(_gemm_4bit_use_custom_cuda); planned as this path, an upper bound")
    return [Cost("4-bit dequantized weight", nbytes,
                 f"{_BNB_CUDA_OPS} _dequant_linear_fallback: the largest 4-bit layer's weight ({numel:,} values) "
                 f"dequantized to {str(dtype).removeprefix('torch.')}"
                 f"{' with its nested absmax in fp32 twice' if nested else ''} inside gemm_4bit, once per "
                 f"layer call ({when}); not in the trace (the fake kernel allocates only the output)",
                 in_allocator=True, in_step=True, phases=("forward", "backward") if recomputes else ("forward",))]


def trainer_four_bit_costs(model: nn.Module, bnb: Any, tokens: int, *, recomputes: bool,
                           half: torch.dtype | None = None) -> list[Cost]:
    """Return `four_bit_dequant_costs` for the 4-bit layers of a Trainer's model (traced stand-ins or bitsandbytes'
    own): the largest layer's weight in its compute dtype (`bnb.bnb_4bit_compute_dtype` where a layer has none set;
    `half` stands for float16, as traced), nested where its statistics are double-quantized
    (`bnb_4bit_use_double_quant`)."""
    try:
        bnb_lib = import_quietly("bitsandbytes")
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return []
    layers = [m for m in model.modules() if isinstance(m, bnb_lib.nn.Linear4bit)]
    if not layers:
        return []
    largest = max(layers, key=lambda m: m.in_features * m.out_features)
    dtype = getattr(largest, "compute_dtype", None) or getattr(bnb, "bnb_4bit_compute_dtype", None) or torch.float32
    dtype = torch.float16 if dtype == half else dtype  # the run's float16, traced as `half`
    state = getattr(largest.weight, "quant_state", None)
    nested = bool(getattr(state, "nested", getattr(bnb, "bnb_4bit_use_double_quant", False)))
    return four_bit_dequant_costs(largest.in_features * largest.out_features, dtype, tokens, nested=nested,
                                  recomputes=recomputes)


def four_bit_load_costs(meta_model: nn.Module, spec: Any, recipe: Recipe, target: Target, model_bytes: int) -> list[Cost]:
    """Return the plan lines of the device at the peak of loading a 4-bit base onto CUDA (empty otherwise).

    Two paths, as `loading.load_model` and `Recipe.build` take them:
    - a checkpoint (hub id or folder with weights): transformers quantizes each weight as it arrives on the
      device (`integrations/bitsandbytes.py`: `Params4bit(value, ...).to(value.device)`, per tensor), so the
      peak is the loaded model (`model_bytes`: the step's parameters and buffers, and the quantization scales)
      plus one weight in the load dtype (an upper bound: the largest one, as if it came last);
    - no checkpoint (our named models, random weights): the whole model is on the device in its own dtype
      before `quantize_model` replaces its layers one by one, each cloned (`quantization._bnb_linear`) and
      quantized there (`Params4bit._quantize` -> `quantize_4bit`: its absmax in fp32, and again less the
      offset for nested statistics), so the peak is the unquantized model plus one clone and its absmax.
    The CUDA context is a line of both, as in the step.
    """
    if not target.cuda or recipe.quantization not in ("nf4", "fp4") or recipe.quantization_phase != "all":
        return []
    numels = _four_bit_numels(meta_model)
    if not numels:
        return []
    by_transformers, dtype = _four_bit_path(spec, recipe, target, meta_model)
    context = Cost("CUDA context", target.cuda_context_bytes, target.context_source)
    name = str(dtype).removeprefix("torch.")
    if by_transformers:
        return [context,
                Cost("loaded 4-bit model", model_bytes, "the step's parameters and buffers (traced; adapters included) "
                     "and the quantization scales: what loading leaves on the device", in_allocator=True),
                Cost("weight being quantized", four_bit_dequant_bytes(max(numels), dtype.itemsize, nested=False),
                     f"transformers loads each weight to the device in {name} and quantizes it there "
                     "(integrations/bitsandbytes.py, Params4bit.to -> bitsandbytes quantize_4bit); the largest, "
                     "counted as if it came last", in_allocator=True)]
    seen: dict[int, torch.Tensor] = {id(t): t for t in [*meta_model.parameters(), *meta_model.buffers()]}
    quantize = four_bit_dequant_bytes(max(numels), dtype.itemsize, nested=True)
    # precision.half_frozen_base casts tensor by tensor (Module.to): the whole model plus one tensor in base_dtype
    cast = max((_round_block(t.numel() * dtype.itemsize) for t in seen.values() if t.is_floating_point()
                and t.dtype != dtype), default=0) if recipe.base_dtype is not None else 0
    lines = [context,
             Cost("unquantized model", sum(_round_block(t.numel() * t.element_size()) for t in seen.values()),
                  "the model as built, on the device before it is cast (base_dtype) and quantized", in_allocator=True)]
    if cast > quantize:
        return [*lines, Cost("tensor being cast", cast, f"the model is cast to {name} tensor by "
                             "tensor before it is quantized (Module.to): the largest tensor's new copy", in_allocator=True)]
    return [*lines, Cost("weight being quantized", quantize,
                         f"each layer's weight ({name}) is cloned and bitsandbytes quantizes the clone "
                         f"on the device (quantize_4bit: absmax in fp32, then less its offset: {_BNB_CUDA_OPS}); the "
                         "largest layer", in_allocator=True)]
