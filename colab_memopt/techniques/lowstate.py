"""Optimizers with almost no state, each from its own package: full fine-tuning in little memory (notebook 16).

`make_low_state_optimizer(name, params, lr=, model=)` returns one of `LOW_STATE_OPTIMIZERS`; every
package is imported inside its factory, so `import colab_memopt` stays fast and works without them.
- 'galore_adamw8bit' (`galore-torch`, Zhao et al. 2024): the gradient of each 2-D weight of a linear
  layer is projected on its top-`rank` singular vectors (refreshed every 200 steps) and bitsandbytes'
  8-bit AdamW runs in that space; other parameters get plain 8-bit AdamW. 'galore_adamw8bit_in_backward'
  (`optimizers.OptimizerInBackward`) is GaLore's "per layer" mode: one optimizer per parameter, stepped in
  backward, each gradient freed at once (GaLore's README, `register_post_accumulate_grad_hook`).
- 'apollo', 'apollo_mini' (`apollo-torch`, Zhu et al. 2024): AdamW moments of a random projection of
  the gradient (rank 256, or rank 1 for APOLLO-Mini) only scale the raw gradient, channel-wise or (Mini)
  tensor-wise; with Fira's norm-growth limiter, as the package does by default.
- 'torchao_adamw8bit', 'torchao_adamw4bit' (`torchao.optim`): AdamW with block-wise 8-bit / 4-bit moments
  (tensor subclasses); tensors under 4096 values keep fp32 moments. Their update runs eagerly, on CUDA
  too (torchao compiles it; a compiled step would differ from the measured and planned eager one).
- 'badam' (`badam`, Luo et al. 2024): block coordinate descent: one block of the model trains at a time
  (`switch_block_every` steps each, last block first) with an fp32 copy, gradients and AdamW state of
  that block only; the other blocks are frozen (and, as the package does by default, the embeddings and
  the output layer are never trained).

What each breaks: the '_in_backward' form cannot accumulate gradients or clip by the global norm, and
cannot run under a GradScaler (`Recipe.validate` refuses it); GaLore and APOLLO need 2-D weights to
project and do not apply to LoRA adapters; BAdam trains the blocks of a full model, not LoRA adapters.
`state_bytes` gives each one's exact optimizer state, which `estimate.optimizer_state_bytes` and the
tests compare with the memory tracker.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from colab_memopt.core.console import import_quietly, quiet

LOW_STATE_OPTIMIZERS = ("galore_adamw8bit", "apollo", "apollo_mini", "torchao_adamw8bit", "torchao_adamw4bit", "badam")
# Optimizers that project the gradient of 2-D weights: `rank` is their knob (None: the method's default).
PROJECTED = {"galore_adamw8bit": 128, "apollo": 256, "apollo_mini": 1}
# GaLore's README and torchrun_main defaults; APOLLO's README ('apollo': channel scaling, scale 1;
# 'apollo_mini': rank 1, tensor scaling, scale 128).
GALORE_DEFAULTS = {"update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
APOLLO_DEFAULTS = {
    "apollo": {"proj": "random", "scale_type": "channel", "scale": 1.0, "update_proj_gap": 200, "proj_type": "std"},
    "apollo_mini": {"proj": "random", "scale_type": "tensor", "scale": 128.0, "update_proj_gap": 200, "proj_type": "std"},
}
TORCHAO_BLOCK = {"torchao_adamw8bit": 256, "torchao_adamw4bit": 128}  # values per scale (torchao's defaults)
TORCHAO_QMAP_BYTES = {"torchao_adamw8bit": 256 * 4, "torchao_adamw4bit": 16 * 4}  # code book per state tensor
BADAM_SWITCH_EVERY = 50  # the package's default: optimizer steps per block
WEIGHT_DECAY = 0.01  # as the project's AdamW
_MIN_QUANT = 4096  # bitsandbytes and torchao keep 32-bit moments for smaller tensors
_BNB_BLOCK = 256
_BNB_QMAP_BYTES = 256 * 4


def check_rank(name: str, rank: Any) -> int:
    """Return the projection rank of optimizer `name` (its default for None), or raise ValueError naming it."""
    if name not in PROJECTED:
        if rank is not None:
            raise ValueError(f"optimizer_rank applies to {sorted(PROJECTED)}, not optimizer={name!r}; leave it None")
        return 0
    if rank is None:
        return PROJECTED[name]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"optimizer_rank must be None or an integer >= 1, got {rank!r}")
    if name == "apollo_mini" and rank != 1:
        raise ValueError(f"apollo_mini is APOLLO at rank 1; got optimizer_rank={rank}: use optimizer='apollo' for rank {rank}")
    return rank


def projected_weights(model: nn.Module | None, params: Iterable[torch.Tensor]) -> set[int]:
    """Return the ids of the parameters GaLore and APOLLO project: the 2-D weights of linear layers.

    As GaLore's and APOLLO's training scripts do (attention and MLP linears only): not the embeddings,
    not the output layer (or a linear tied to an embedding), not biases or norms. Without a model,
    every 2-D parameter.
    """
    if model is None:
        return {id(p) for p in params if p.dim() == 2}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and "lm_head" not in name and id(module.weight) not in embeddings:
            out.add(id(module.weight))
    return out


def _projected_shape(shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Return (projected gradient shape, projection matrix shape) of a (m, n) weight, 'std' projection,
    the rank capped at the smaller side (as the factories do)."""
    m, n = shape
    r = min(rank, m, n)
    return ((m, r), (r, n)) if m >= n else ((r, n), (m, r))


def state_bytes(name: str, params: Iterable[Any], *, rank: int | None = None, model: nn.Module | None = None,
                per_parameter: bool = False, element_size: int | None = None) -> int:
    """Return the exact optimizer-state bytes `make_low_state_optimizer(name, ...)` keeps after a step.

    `params` as the optimizer gets them (the trainable ones); `model` picks the projected weights
    (`projected_weights`) and BAdam's blocks; `per_parameter` counts one optimizer per parameter (the
    '_in_backward' form: GaLore's 8-bit code books per tensor).
    - GaLore: per projected weight, the projection matrix (fp32) and 8-bit moments of the projected
      gradient (1 byte + an fp32 absmax per 256 values, each; fp32 under 4096 values); the rest 8-bit
      moments of the full gradient; two 256-entry code books per optimizer.
    - APOLLO: per projected weight, the random projection, fp32 moments of the projected gradient and
      the limiter's last norm (a 0-d fp32); the rest fp32 AdamW moments.
    - torchao: per tensor a 0-d fp32 step; moments as 1 (8-bit) or 1/2 (4-bit) byte per value, an fp32
      scale per 256 (128) values and a code book per moment, where the tensor has >= 4096 values and a
      whole number of blocks; else fp32 moments.
    - BAdam: the largest block (the one trained holds the state): its fp32 master copy, fp32 AdamW
      moments and a step per tensor (12 B/param of the block + 4 B per tensor).
    `element_size` counts the parameters as that many bytes each (2: pure 16-bit weights planned on an
    fp32 meta model); None reads each parameter's own.
    """
    if name not in LOW_STATE_OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {LOW_STATE_OPTIMIZERS}")
    ps = _unique([p[1] if isinstance(p, tuple) else p for p in params])
    if name == "badam":
        if model is None:
            raise ValueError("badam's state needs the model (its blocks)")
        return max(12 * sum(p.numel() for p in block) + 4 * len(block) for block in badam_blocks(model)[1])
    ps = [p for p in ps if p.requires_grad]
    if name in TORCHAO_BLOCK:
        block, qmap = TORCHAO_BLOCK[name], TORCHAO_QMAP_BYTES[name]
        total = 0
        for p in ps:
            n = p.numel()
            if n >= _MIN_QUANT and n % block == 0:
                codes = n if name == "torchao_adamw8bit" else n // 2
                total += 2 * (codes + 4 * (n // block) + qmap)
            else:
                total += 2 * n * (element_size or p.element_size())
            total += 4
        return total
    r = check_rank(name, rank)
    targets = projected_weights(model, ps)
    total, quantized = 0, 0
    for p in ps:
        size = element_size or p.element_size()  # the projection (and APOLLO's moments) are in the weight's dtype
        if id(p) in targets and p.dim() == 2:
            (gm, gn), (pm, pn) = _projected_shape(tuple(p.shape), r)
            moments, proj = gm * gn, pm * pn * size
        else:
            moments, proj = p.numel(), 0
        if name == "galore_adamw8bit":  # bitsandbytes: uint8 moments and an fp32 absmax per 256, or fp32
            if moments >= _MIN_QUANT:
                total += 2 * (moments + 4 * -(-moments // _BNB_BLOCK))
                quantized += 1
            else:
                total += 2 * 4 * moments
            total += proj
        else:  # apollo, apollo_mini: moments in the weight's dtype, and the limiter's 0-d norm
            total += 2 * moments * size + proj + (size if proj else 0)
    if name == "galore_adamw8bit":
        total += 2 * _BNB_QMAP_BYTES * (quantized if per_parameter else min(quantized, 1))
    return total


def _unique(params: list[Any]) -> list[Any]:
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


# -- GaLore --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _cuda_synchronize_is_a_no_op() -> Iterator[None]:
    """Let code that calls `torch.cuda.synchronize()` unconditionally run on a CPU-only torch, for the duration."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize = original  # type: ignore[assignment]


def _galore(params: list[torch.Tensor], lr: float, rank: int, model: nn.Module | None) -> torch.optim.Optimizer:
    try:
        Optimizer2State = import_quietly("bitsandbytes.optim.optimizer").Optimizer2State
        from galore_torch import GaLoreAdamW8bit
    except ImportError as err:
        raise RuntimeError("optimizer 'galore_adamw8bit' needs galore-torch and bitsandbytes: pip install galore-torch") from err

    class GaLore8bit(GaLoreAdamW8bit):
        """galore-torch's GaLoreAdamW8bit, fixed for bitsandbytes >= 0.45 and the CPU; its step is the package's.

        - Its `__init__` passes bitsandbytes' arguments by position, written for an older signature: with
          bitsandbytes 0.50 its `percentile_clipping=100` lands in `max_unorm` (update-norm clipping at
          100x) and `block_wise=True` in `skip_zeros`. Here the base is built by keyword, as intended.
        - Its step calls `torch.cuda.synchronize()` unconditionally, which fails on a CPU-only torch:
          here it is a no-op where CUDA is not available.
        - The projection matrix lives in a `GaLoreProjector` object in the state, which memory trackers
          (they read the state's tensors) cannot see: after each step it is also kept as
          `state['projection']` (the same tensor, no copy).
        - The projector keeps `Vh[:rank]` (or `U[:, :rank]`) of the SVD: a view that holds the whole factor's
          storage, e.g. a 2048 x 2048 fp32 matrix (16 MiB) per projected weight of Llama-3.2-1B instead of
          rank x 2048 (1 MiB at rank 128); measured here on the small model at rank 8: 3.3x the state of the
          formula. After each step the view is copied, so only the rank rows stay (GaLore's intended memory).
        """

        def __init__(self, groups: list[dict[str, Any]], lr: float) -> None:
            Optimizer2State.__init__(self, "adam", groups, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=WEIGHT_DECAY, optim_bits=8, min_8bit_size=_MIN_QUANT)

        @torch.no_grad()
        def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
            with _cuda_synchronize_is_a_no_op():
                loss = super().step(closure)
            for state in self.state.values():
                projector = state.get("projector")
                if projector is not None and projector.ortho_matrix is not None:
                    m = projector.ortho_matrix
                    if m.untyped_storage().nbytes() > m.numel() * m.element_size():  # a view of the whole factor
                        projector.ortho_matrix = m = m.clone(memory_format=torch.contiguous_format)
                    state["projection"] = m
            return loss

    targets = projected_weights(model, params)
    projected = [p for p in params if id(p) in targets and p.dim() == 2]
    rest = [p for p in params if not (id(p) in targets and p.dim() == 2)]
    groups: list[dict[str, Any]] = [{"params": [p], "rank": min(rank, *p.shape), **GALORE_DEFAULTS} for p in projected]
    if rest:
        groups.append({"params": rest})
    return GaLore8bit(groups, lr)


# -- APOLLO --------------------------------------------------------------------------------------------

def _apollo(name: str, params: list[torch.Tensor], lr: float, rank: int, model: nn.Module | None) -> torch.optim.Optimizer:
    try:
        from apollo_torch import APOLLOAdamW
    except ImportError as err:
        raise RuntimeError(f"optimizer {name!r} needs apollo-torch: pip install apollo-torch") from err

    class Apollo(APOLLOAdamW):
        """apollo-torch's APOLLOAdamW; its step is the package's. The random projection lives in a
        projector object in the state, which memory trackers cannot see: after each step it is also kept
        as `state['projection']` (the same tensor, no copy)."""

        @torch.no_grad()
        def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
            loss = super().step(closure)
            for state in self.state.values():
                projector = state.get("projector")
                if projector is not None and projector.ortho_matrix is not None:
                    state["projection"] = projector.ortho_matrix
            return loss

    targets = projected_weights(model, params)
    projected = [p for p in params if id(p) in targets and p.dim() == 2]
    rest = [p for p in params if not (id(p) in targets and p.dim() == 2)]
    # The rank is capped at the weight's smaller side: a random projection to more dimensions than the
    # weight has would hold more state than Adam (the package does not cap it).
    groups: list[dict[str, Any]] = [{"params": [p], "rank": min(rank, *p.shape), **APOLLO_DEFAULTS[name]} for p in projected]
    if rest:
        groups.append({"params": rest})
    return Apollo(groups, lr=lr, weight_decay=WEIGHT_DECAY)


# -- torchao -------------------------------------------------------------------------------------------

def _torchao(name: str, params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    try:
        with quiet():  # the library's import notes (torchao's CUDA extensions, torch's deprecations)
            from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as err:
        raise RuntimeError(f"optimizer {name!r} needs torchao: pip install torchao") from err
    base = AdamW8bit if name == "torchao_adamw8bit" else AdamW4bit

    class TorchaoAdamW(base):  # type: ignore[valid-type, misc]
        """torchao's low-bit AdamW, its update run eagerly everywhere, CUDA included.

        torchao compiles its `single_param_adam` with torch.compile per tensor shape. torch.compile
        refuses to run under a memory tracker ("non-infra torch dispatch mode present"), so a measured or
        traced step can only be eager; compiled training steps would then differ from what was measured
        and planned (the compiled kernel fuses away the dequantized fp32 moments that eager holds for one
        parameter at a time). Here every step is eager, so what trains is what was measured and planned.
        Compiling also costs time: about 20 s for the first shape on this project's 2-core CPU, once per
        distinct shape (torchao lifts the recompile limit), and on a T4 it needs Triton on sm_75."""

        @torch.no_grad()
        def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
            original = torch.compile
            torch.compile = lambda fn=None, **kwargs: fn  # type: ignore[assignment]
            try:
                return super().step(closure)
            finally:
                torch.compile = original  # type: ignore[assignment]

    return TorchaoAdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)


def torchao_state_tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    """Return the plain tensors that hold one parameter's torchao state (a subclass's codes, scale, code book)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    out = []
    for value in state.values():
        if is_traceable_wrapper_subclass(value):
            out += [getattr(value, attr) for attr in value.__tensor_flatten__()[0]]
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


# -- BAdam ---------------------------------------------------------------------------------------------

def badam_blocks(model: nn.Module) -> tuple[list[list[str]], list[list[nn.Parameter]]]:
    """Return BAdam's block prefixes (one per repeated block of the model) and each block's parameters."""
    from colab_memopt.techniques.checkpointing import find_blocks

    try:
        blocks = find_blocks(model)
    except ValueError:  # a one-block model: its one-element list of blocks
        blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == 1), None)
        if blocks is None:
            raise
    prefix = next(name for name, module in model.named_modules() if module is blocks)
    prefixes = [[f"{prefix}.{i}."] for i in range(len(blocks))]
    params = [list(block.parameters()) for block in blocks]
    return prefixes, params


def _badam(params: list[torch.Tensor], lr: float, model: nn.Module | None) -> torch.optim.Optimizer:
    if model is None:
        raise ValueError("optimizer 'badam' needs the model (it trains one block of it at a time): pass model=")
    try:
        from badam import BlockOptimizer
    except ImportError as err:
        raise RuntimeError("optimizer 'badam' needs badam: pip install badam") from err
    prefixes, _ = badam_blocks(model)

    class BAdam(BlockOptimizer):
        """badam's BlockOptimizer over torch's AdamW; its step and block switching are the package's.

        `state` shows what the optimizer keeps for the block being trained: AdamW's moments and step and
        the fp32 master copy BAdam trains (key 'master_weight'), so memory trackers see them; BAdam keeps
        that copy even for an fp32 model (it expects 16-bit weights, and warns; the warning is silenced
        here, this docstring says it). ZeRO counts the fp32 master weights with the optimizer state too.
        """

        @property  # type: ignore[override]
        def state(self) -> dict[torch.Tensor, dict[str, Any]]:
            base = getattr(self, "base_optimizer", None)
            if base is None:
                return {}
            out = {p: dict(s) for p, s in base.state.items()}
            for hp in getattr(self, "param_idx2hp", {}).values():
                out.setdefault(hp, {})["master_weight"] = hp
            return out

        @state.setter
        def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns an empty dict
            del value

        def switch_trainable_params(self, verbose: int | None = None) -> None:
            super().switch_trainable_params(verbose=0)  # the package prints each switch unless told 0

    base = torch.optim.AdamW([p for p in params if p.requires_grad] or params, lr=lr, weight_decay=WEIGHT_DECAY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BAdam(base, list(model.named_parameters()), block_prefix_list=prefixes,
                     switch_block_every=BADAM_SWITCH_EVERY, switch_mode="descending", verbose=0)


def make_low_state_optimizer(name: str, params: Iterable[Any], *, lr: float, model: nn.Module | None = None,
                             rank: int | None = None) -> torch.optim.Optimizer:
    """Return an optimizer of `LOW_STATE_OPTIMIZERS` from its package.

    Args:
        params: the trainable parameters (or (name, parameter) pairs).
        model: the model they belong to: picks the projected weights (GaLore, APOLLO) and the blocks (BAdam,
            which needs it).
        rank: the projection rank of GaLore (default 128) and APOLLO (256); APOLLO-Mini is rank 1.

    Example:
        >>> opt = make_low_state_optimizer("apollo_mini", model.parameters(), lr=1e-3, model=model)
    """
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    r = check_rank(name, rank) if name in LOW_STATE_OPTIMIZERS else 0
    ps = _unique([p[1] if isinstance(p, tuple) else p for p in params])
    if name == "galore_adamw8bit":
        return _galore(ps, lr, r, model)
    if name in APOLLO_DEFAULTS:
        return _apollo(name, ps, lr, r, model)
    if name in TORCHAO_BLOCK:
        return _torchao(name, ps, lr)
    if name == "badam":
        return _badam(ps, lr, model)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {LOW_STATE_OPTIMIZERS}")
