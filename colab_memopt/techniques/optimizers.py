"""Lean optimizers: less optimizer state per parameter (notebook 06).

`make_optimizer(name, params)` returns any optimizer of `OPTIMIZERS` by name: PyTorch's own
('adamw', 'adam', 'sgd', 'sgd_momentum') and the lean ones (`LEAN_OPTIMIZERS`):
- 'adafactor': `torch.optim.Adafactor` (torch >= 2.5): a factored second moment (one row and one
  column vector per matrix) and no first moment.
- 'adam8bit', 'adamw8bit', 'paged_adamw8bit', 'lion8bit': bitsandbytes' block-wise 8-bit states.
- 'lion': a 32-bit Lion (Chen et al. 2023), one momentum buffer, sign update. Written here.
- 'adam_mini': Adam-mini (Zhang et al. 2024), one second-moment value per parameter block. Written here.
- 'lomo', 'adalomo': LOMO and AdaLomo from `lomo-optim` (`colab_memopt.techniques.lomo`): the update fused into
  backward by the optimizer itself (`fused_backward`), no gradients kept; they need the model.
- the optimizers with almost no state of `lowstate` (`LOW_STATE_OPTIMIZERS`), each from its own package:
  GaLore 8-bit, APOLLO, APOLLO-Mini, torchao's 8-bit and 4-bit AdamW, BAdam.
- '<name>_in_backward' (e.g. 'adamw_in_backward'): the optimizer step fused into backward with
  `register_post_accumulate_grad_hook`: each parameter is updated and its gradient freed as soon as
  its gradient is complete (PyTorch's "How to save memory by fusing the optimizer step into the
  backward pass" tutorial).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from colab_memopt.core.console import import_quietly

from colab_memopt.techniques.lomo import LOMO_OPTIMIZERS
from colab_memopt.techniques.lowstate import LOW_STATE_OPTIMIZERS, make_low_state_optimizer

BNB_OPTIMIZERS = {
    "adam8bit": "Adam8bit",
    "adamw8bit": "AdamW8bit",
    "paged_adamw8bit": "PagedAdamW8bit",
    "lion8bit": "Lion8bit",
}
LEAN_OPTIMIZERS = ("adafactor", *BNB_OPTIMIZERS, "lion", "adam_mini")
IN_BACKWARD_SUFFIX = "_in_backward"
BASE_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
# Any of these can have its step fused into backward ('<name>_in_backward').
# 'galore_adamw8bit_in_backward' is GaLore's per-layer mode.
_FUSABLE = ("adamw", "adam", "sgd", "sgd_momentum", "lion", "adafactor", "adam8bit", "adamw8bit", "galore_adamw8bit")
# Optimizers that run their own backward (`lomo.fused_step`): no `step()`, no gradient buffers.
FUSED_BACKWARD_OPTIMIZERS = LOMO_OPTIMIZERS
OPTIMIZERS = (BASE_OPTIMIZERS + LEAN_OPTIMIZERS + LOW_STATE_OPTIMIZERS + tuple(n + IN_BACKWARD_SUFFIX for n in _FUSABLE)
              + FUSED_BACKWARD_OPTIMIZERS)


def steps_in_backward(name: str) -> bool:
    """Return True for an optimizer that updates each parameter inside backward, so no full set of gradients is
    ever held and `step()` does nothing afterwards: '<name>_in_backward', LOMO and AdaLomo."""
    return name.endswith(IN_BACKWARD_SUFFIX) or name in FUSED_BACKWARD_OPTIMIZERS


def _check_lr(lr: float) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): 4 B/param of state.

    update = sign(beta1 * m + (1 - beta1) * g); p -= lr * (update + wd * p); m = beta2 * m + (1 - beta2) * g.
    """

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        _check_lr(lr)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def adam_mini_blocks(name: str, param: torch.Tensor, *, n_head: int | None = None) -> int | None:
    """Return how many second-moment blocks Adam-mini gives a parameter, or None for full Adam.

    The partition (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More", section 2
    and the official implementation):
    - embedding and output layer (token rows; tied here): Adam's per-coordinate v (returns None);
    - query and key: one block per head (the first two thirds of the reference model's fused `qkv`);
    - value, attention output and MLP weights: one block per output neuron (per row);
    - biases and LayerNorm weights (1-D): one block per tensor.
    The fused `qkv` weight (3*C, C) gets n_head blocks for q, n_head for k and C rows for v.
    """
    if any(key in name for key in ("wte", "wpe", "embed", "lm_head")):
        return None
    if param.dim() < 2:
        return 1
    if name.endswith("qkv.weight"):
        if n_head is None:
            raise ValueError(f"adam_mini needs n_head to partition {name!r} by heads")
        return 2 * n_head + param.shape[0] // 3
    return param.shape[0]


class AdamMini(torch.optim.Optimizer):
    """Adam-mini: Adam with one second-moment value per parameter block (see `adam_mini_blocks`).

    State per parameter: `exp_avg` (fp32, like Adam's m), `v` (one fp32 value per block) and a step
    counter, so about 4 B/param instead of Adam's 8 (the embedding keeps 8). Decoupled weight decay as in
    AdamW, skipped for 1-D parameters.

    Args:
        named_params: (name, parameter) pairs, e.g. `model.named_parameters()`; names pick the partition.
        n_head: attention heads, to split query and key by head.

    Example:
        >>> opt = AdamMini(model.named_parameters(), lr=1e-3, n_head=model.config.n_head)
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        n_head: int | None = None,
    ) -> None:
        _check_lr(lr)
        groups, seen = [], set()
        for item in named_params:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"AdamMini takes (name, parameter) pairs such as model.named_parameters(), got {item!r}")
            name, p = item
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            groups.append({"params": [p], "name": name, "blocks": adam_mini_blocks(name, p, n_head=n_head),
                           "weight_decay": weight_decay if p.dim() >= 2 else 0.0})
        if not groups:
            raise ValueError("AdamMini got no trainable parameters")
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.n_head = n_head

    @staticmethod
    def _block_view(t: torch.Tensor, name: str, blocks: int, n_head: int | None) -> list[torch.Tensor]:
        """Return views of `t` whose rows are the blocks: [(blocks_i, numel_i), ...]."""
        if t.dim() < 2:
            return [t.reshape(1, -1)]
        if name.endswith("qkv.weight"):
            assert n_head is not None
            c = t.shape[0] // 3
            qk = t[: 2 * c].reshape(2 * n_head, -1)  # (2 * heads, head rows x C)
            return [qk, t[2 * c :].reshape(c, -1)]  # value: (C rows, C)
        return [t.reshape(blocks, -1)]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["params"]:  # UpdateRounding steps one parameter at a time: the other groups are empty then
                continue
            (p,) = group["params"]
            if p.grad is None:
                continue
            beta1, beta2 = group["betas"]
            lr, eps, blocks = group["lr"], group["eps"], group["blocks"]
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                v_numel = p.numel() if blocks is None else blocks
                state["v"] = torch.zeros(v_numel, dtype=torch.float32, device=p.device)
            state["step"] += 1
            t = state["step"].item()
            g = p.grad.float()
            m = state["exp_avg"]
            m.lerp_(g, 1 - beta1)
            if group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            if blocks is None:
                state["v"].view_as(p).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["v"].view_as(p) / (1 - beta2**t)).sqrt_().add_(eps)
            else:
                # mean of g^2 over each block: (blocks,)
                g2 = torch.cat([view.pow(2).mean(dim=1) for view in self._block_view(g, group["name"], blocks, self.n_head)])
                state["v"].mul_(beta2).add_(g2, alpha=1 - beta2)
                per_block = (state["v"] / (1 - beta2**t)).sqrt_().add_(eps)  # (blocks,)
                denom = torch.empty_like(m)
                start = 0
                for view in self._block_view(denom, group["name"], blocks, self.n_head):
                    view.copy_(per_block[start : start + view.shape[0], None].expand_as(view))
                    start += view.shape[0]
            p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1 - beta1**t))
        return loss


class OptimizerInBackward(torch.optim.Optimizer):
    """Run one optimizer per parameter inside backward and free each gradient right after its update.

    Each parameter gets its own optimizer (made by `make`); a `register_post_accumulate_grad_hook`
    steps it as soon as the parameter's gradient is complete and sets the gradient to None, so at
    most a few gradients are alive at once. `step()` and `zero_grad()` then have nothing left to do:
    the ordinary training step (`zero_grad`, `backward`, `step`) works unchanged.

    It cannot be combined with gradient accumulation: the hook fires on every backward, so each
    micro-batch would update the weights and drop its gradient instead of adding to it.

    `state` is the union of the per-parameter optimizers' states, so memory trackers that read
    `optimizer.state` see it. Call `remove()` to take the hooks off the parameters.
    """

    def __init__(self, params: Iterable[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("OptimizerInBackward got no trainable parameters")
        self.optimizers: dict[nn.Parameter, torch.optim.Optimizer] = {}
        super().__init__(params, {})
        for p in dict.fromkeys(params):
            self.optimizers[p] = make([p])
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self.optimizers]

    def _step_param(self, p: torch.Tensor) -> None:
        self.optimizers[p].step()
        self.optimizers[p].zero_grad(set_to_none=True)

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Return the per-parameter optimizers' states, keyed by parameter."""
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in getattr(self, "optimizers", {}).values():
            out.update(opt.state)
        return out

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns an empty dict
        del value

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Do nothing: every parameter was updated during backward."""
        if closure is not None:
            raise ValueError("OptimizerInBackward takes no closure: the steps run inside backward")

    def remove(self) -> None:
        """Remove the gradient hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _adafactor(params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Adafactor"):
        raise RuntimeError(f"'adafactor' needs torch.optim.Adafactor (torch >= 2.5); this torch is {torch.__version__}")
    return torch.optim.Adafactor(params, lr=lr)


def _bnb(name: str, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    try:
        bnb = import_quietly("bitsandbytes")
    except ImportError as err:
        raise RuntimeError(f"optimizer {name!r} needs bitsandbytes: pip install bitsandbytes") from err
    cls = getattr(bnb.optim, BNB_OPTIMIZERS[name])
    kwargs: dict[str, Any] = {"lr": lr}
    if name in ("adamw8bit", "paged_adamw8bit"):
        kwargs["weight_decay"] = 0.01
    import warnings

    with warnings.catch_warnings():  # paged optimizers on the CPU fall back to non-paged, with a warning
        warnings.simplefilter("ignore")
        return cls(params, **kwargs)


def make_lean_optimizer(
    name: str, params: Iterable[Any], *, lr: float, model: nn.Module | None = None
) -> torch.optim.Optimizer:
    """Return a lean optimizer by name (one of `LEAN_OPTIMIZERS`).

    `params` may be parameters or (name, parameter) pairs; 'adam_mini' needs names (pass
    `model.named_parameters()` or `model=`) and reads `n_head` from `model.config` when given.
    """
    _check_lr(lr)
    if name == "adafactor":
        return _adafactor(_plain(params), lr)
    if name in BNB_OPTIMIZERS:
        return _bnb(name, _plain(params), lr)
    if name == "lion":
        return Lion(_plain(params), lr=lr, weight_decay=0.01)
    if name == "adam_mini":
        named = list(model.named_parameters()) if model is not None else list(params)
        n_head = getattr(getattr(model, "config", None), "n_head", None)
        return AdamMini(named, lr=lr, weight_decay=0.01, n_head=n_head)
    raise ValueError(f"unknown lean optimizer {name!r}; choose one of {LEAN_OPTIMIZERS}")


def _plain(params: Iterable[Any]) -> list[Any]:
    return [p[1] if isinstance(p, tuple) else p for p in params]


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], *, lr: float = 1e-3, model: nn.Module | None = None,
    rank: int | None = None,
) -> torch.optim.Optimizer:
    """Return an optimizer by name (one of `OPTIMIZERS`).

    'adamw', 'adam', 'sgd', 'sgd_momentum' are PyTorch's; the lean ones are `make_lean_optimizer`'s
    ('adam_mini' reads parameter names and heads from `model`); those of `lowstate` come from their
    packages (`model` picks the projected weights and BAdam's blocks; `rank` is GaLore's and APOLLO's
    projection rank, None for the default); '<name>_in_backward' fuses that optimizer's step into
    backward (`OptimizerInBackward`).

    Example:
        >>> opt = make_optimizer("adamw8bit", model.parameters(), lr=2e-4)
    """
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    params = list(params)
    if not params:
        raise ValueError(f"make_optimizer({name!r}): params is empty: nothing to train (every parameter frozen? "
                         "pass the trainable ones, e.g. [p for p in model.parameters() if p.requires_grad])")
    if name.endswith(IN_BACKWARD_SUFFIX):
        inner = name[: -len(IN_BACKWARD_SUFFIX)]
        return OptimizerInBackward(params, lambda ps: make_optimizer(inner, ps, lr=lr, model=model, rank=rank))
    if name in FUSED_BACKWARD_OPTIMIZERS:
        if model is None:
            raise ValueError(f"optimizer {name!r} hooks the model's parameters itself: pass model=")
        if rank is not None:
            raise ValueError(f"rank applies to GaLore and APOLLO, not optimizer={name!r}; leave it None")
        from colab_memopt.techniques.lomo import make_lomo

        return make_lomo(name, model, lr=lr)
    if name in LOW_STATE_OPTIMIZERS:
        return make_low_state_optimizer(name, params, lr=lr, model=model, rank=rank)
    if rank is not None:
        raise ValueError(f"rank applies to GaLore and APOLLO, not optimizer={name!r}; leave it None")
    if name in LEAN_OPTIMIZERS:
        return make_lean_optimizer(name, params, lr=lr, model=model)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
