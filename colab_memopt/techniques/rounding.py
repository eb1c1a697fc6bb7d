"""16-bit weights without an fp32 master copy, and updates that are not lost to rounding (notebook 16).

With pure 16-bit weights (precision 'bf16' or 'fp16') an update smaller than half the weight's
spacing rounds back to the old value: bf16 keeps 8 significant bits, so a weight of 1.0 ignores
any update below 2**-8 = 0.0039; fp16 keeps 11 bits (below 2**-11 = 0.00049). With a small learning
rate most updates then vanish and training stalls. Two fixes without a 4-byte master copy:

- 'kahan': Kahan-compensated update (Kahan 1965; for bf16 training Zamirai et al. 2020, "Revisiting
  BFloat16 Training"): one extra 16-bit buffer per parameter keeps what rounding cut off, and the
  next update adds it back. The weight is then `p + compensation`, about twice 16 bits of precision.
- 'stochastic': stochastic rounding (Gupta et al. 2015): round up or down at random, with the
  probability of each by its distance, so the expected weight is the exact one. No extra state.
- 'none': round to nearest (what a plain optimizer on 16-bit weights does); the failure shown.

`UpdateRounding` wraps any torch optimizer: for each parameter in turn it upcasts the weight (plus
its compensation), the gradient and the optimizer state to fp32, runs the wrapped optimizer's own
update on that one parameter, and stores the result back in 16 bits with the chosen rounding. So the
update is computed in fp32 whatever the optimizer, and only one parameter's fp32 copies exist at a
time. For optimizers whose update is elementwise (Adam, AdamW, SGD, Lion: `ELEMENTWISE_OPTIMIZERS`)
a large parameter is updated in chunks of rows (`chunk_elements` values at a time), so the fp32
transient (weight, gradient and state: about 16 bytes per value with AdamW) stays a few tens of MB
even for Llama-3's 128,256 x 4,096 embedding; other optimizers (Adafactor's factored moments, 8-bit
states) get the whole parameter in fp32 at once, traced as such by the planner. Optimizers written
for 16-bit weights (optimi's, below) update in place without any transient. The optimizer's state is stored in bfloat16 (2 bytes per value), also for fp16 weights: an
Adam second moment (squared gradients, 1e-8 and below) underflows to zero in fp16's range.

The field's own versions, compared in tests/test_rounding.py and notebook 16:
- `optimi` (`torch-optimi` on PyPI): its optimizers take `kahan_sum=True` for bf16 and fp16 weights
  (AdamW, Lion, SGD, ...), each written for it; `UpdateRounding` does the same for any optimizer.
- torchao's `torchao.optim._AdamW(bf16_stochastic_round=True)`: stochastic rounding, bf16 only.

`DynamicLossScaler` is the loss scaler for pure fp16. torch's `GradScaler` refuses it:
`GradScaler.unscale_` raises "Attempting to unscale FP16 gradients." for fp16 gradients (its
private `_unscale_grads_` has an `allow_fp16` flag that `unscale_` sets to False), because unscaling
in fp16 flushes small gradients to zero. This one checks the fp16 gradients for inf/NaN with two
reductions each (no copy), and hands the inverse scale to `UpdateRounding`, which unscales in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

UPDATE_ROUNDINGS = ("kahan", "stochastic", "none")
HALF_DTYPES = (torch.float16, torch.bfloat16)
# The dtype the wrapped optimizer's state is stored in between steps (see the module docstring).
STATE_DTYPE = torch.bfloat16
# Optimizer classes (by name) whose update of a value depends only on that value's own state: they
# can be stepped on row chunks of a parameter with sliced state.
ELEMENTWISE_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Lion")
CHUNK_ELEMENTS = 2**22  # values per chunk: 16 MiB per fp32 copy


def check_update_rounding(mode: str, name: str = "update_rounding") -> str:
    """Return `mode` if it is one of `UPDATE_ROUNDINGS`, else raise ValueError naming it."""
    if not isinstance(mode, str) or mode not in UPDATE_ROUNDINGS:
        raise ValueError(f"{name} must be one of {UPDATE_ROUNDINGS}, got {mode!r}")
    return mode


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Return fp32 `x` rounded to `dtype` up or down at random, the probability of each by its distance.

    The expected value of the result is `x` (where `x` is within `dtype`'s range). Works for any
    floating `dtype` through `torch.nextafter`: round to nearest, then move to the neighbour on the
    other side of `x` with probability |x - nearest| / spacing.
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"dtype must be one of {HALF_DTYPES}, got {dtype}")
    nearest = x.to(dtype)
    near32 = nearest.float()
    above = near32 > x  # (shape of x) the nearest value is above x: the other neighbour is below
    inf = torch.full((), float("inf"), dtype=dtype, device=x.device)
    other = torch.nextafter(nearest, torch.where(above, -inf, inf))
    prob = (x - near32).div_(other.float() - near32).nan_to_num_(0.0)  # in [0, 0.5]
    rand = torch.rand(x.shape, device=x.device, generator=generator)
    return torch.where(rand < prob, other, nearest)


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """Return the optimizer's step without torch's global step hooks (the wrapper's own step fires them once)."""
    step = type(optimizer).step
    inner = getattr(step, "__wrapped__", None)
    return (lambda: inner(optimizer)) if inner is not None else optimizer.step


class UpdateRounding(torch.optim.Optimizer):
    """Apply any optimizer's update to 16-bit weights in fp32, stored back with Kahan or stochastic rounding.

    Args:
        optimizer: any torch optimizer over the 16-bit parameters (made after the model is cast).
        mode: 'kahan' (one 16-bit compensation buffer per parameter), 'stochastic' (none) or 'none'
            (round to nearest from the fp32 update).
        generator: random numbers for 'stochastic' (default: the global generator).
        chunk_elements: for elementwise optimizers, the values updated in fp32 at a time (whole rows);
            None: `CHUNK_ELEMENTS`.

    `state` holds the wrapped optimizer's state plus each parameter's `compensation` (Kahan), so
    memory trackers see it all. `step(grad_scale=s)` multiplies the fp32 gradient copies by `s`
    first (the loss scaler's inverse scale). Parameters of fp32 are stepped as the wrapped optimizer
    steps them.

    Example:
        >>> model = build_model("tiny", dtype=torch.bfloat16)
        >>> opt = UpdateRounding(torch.optim.AdamW(model.parameters(), lr=1e-4), "kahan")
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "kahan", *,
                 generator: torch.Generator | None = None, chunk_elements: int | None = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.mode = check_update_rounding(mode, "mode")
        chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
        if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be an integer >= 1, got {chunk_elements!r}")
        self.chunk_elements = chunk_elements
        self.elementwise = type(optimizer).__name__ in ELEMENTWISE_OPTIMIZERS
        self.optimizer = optimizer
        self.generator = generator
        self.compensation: dict[torch.Tensor, torch.Tensor] = {}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        super().__init__(params, {})
        self.param_groups = optimizer.param_groups  # one set of groups: lr schedules reach the wrapped optimizer
        self.defaults = optimizer.defaults

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Return the wrapped optimizer's state, with each parameter's Kahan compensation added."""
        inner = getattr(self, "optimizer", None)
        out: dict[torch.Tensor, dict[str, Any]] = {p: dict(s) for p, s in inner.state.items()} if inner else {}
        for p, comp in getattr(self, "compensation", {}).items():
            out.setdefault(p, {})["compensation"] = comp
        return out

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns an empty dict
        del value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (by default free) the gradients of the wrapped optimizer's parameters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    takes_grad_scale = True  # `DynamicLossScaler.step` passes the inverse loss scale

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0) -> None:  # type: ignore[override]
        """Update every parameter that has a gradient, one at a time, computing the update in fp32."""
        if closure is not None:
            raise ValueError("UpdateRounding takes no closure: run forward and backward before step()")
        raw = _raw_step(self.optimizer)
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, saved):
                for p in params:
                    if p.grad is None:
                        continue
                    if self.elementwise and p.dim() >= 1 and p.numel() > self.chunk_elements and p.dtype in HALF_DTYPES:
                        self._step_chunked(p, group, raw, grad_scale)
                    else:
                        group["params"] = [p]
                        self._step_one(p, raw, grad_scale)
                    group["params"] = []
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    def _step_one(self, p: torch.Tensor, raw: Callable[[], Any], grad_scale: float) -> None:
        half = p.dtype
        if half not in HALF_DTYPES:  # an fp32 parameter (a LayerNorm kept in fp32, say): step it as it is
            if grad_scale != 1.0:
                p.grad.mul_(grad_scale)
            raw()
            return
        grad16, weight16 = p.grad, p.data
        w32 = weight16.float()  # fp32 working copy of the weight
        if self.mode == "kahan" and p in self.compensation:
            w32.add_(self.compensation[p])
        g32 = grad16.float()
        if grad_scale != 1.0:
            g32.mul_(grad_scale)
        state = self.optimizer.state.get(p, {})
        for key, value in state.items():  # the state in fp32 for the update
            if torch.is_tensor(value) and value.dtype == STATE_DTYPE and value.dim() > 0:
                state[key] = value.float()
        p.grad = None
        p.data = w32
        p.grad = g32
        try:
            raw()
        finally:
            new32 = p.data
            p.grad = None
            p.data = weight16
            p.grad = grad16
            state = self.optimizer.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.dtype == torch.float32 and value.dim() > 0:
                    state[key] = value.to(STATE_DTYPE)
        if self.mode == "stochastic":
            weight16.copy_(stochastic_round(new32, half, generator=self.generator))
        else:
            weight16.copy_(new32)  # round to nearest
        if self.mode == "kahan":
            comp = self.compensation.get(p)
            if comp is None:
                comp = self.compensation[p] = torch.empty_like(weight16)
            comp.copy_(new32.sub_(weight16))  # what rounding cut off, kept for the next update


    def _store(self, weight16: torch.Tensor, new32: torch.Tensor, comp: torch.Tensor | None) -> None:
        """Write fp32 `new32` into the 16-bit `weight16` with the mode's rounding (and `comp` for Kahan)."""
        if self.mode == "stochastic":
            weight16.copy_(stochastic_round(new32, weight16.dtype, generator=self.generator))
        else:
            weight16.copy_(new32)  # round to nearest
        if comp is not None:
            comp.copy_(new32.sub_(weight16))

    def _step_chunked(self, p: torch.Tensor, group: dict[str, Any], raw: Callable[[], Any], grad_scale: float) -> None:
        """Step an elementwise optimizer on row chunks of `p`, each with its slice of the state in fp32."""
        rows = p.shape[0]
        step_rows = max(1, self.chunk_elements // max(1, p.numel() // rows))
        weight16, grad16 = p.data, p.grad
        comp = None
        if self.mode == "kahan":
            comp = self.compensation.get(p)
            fresh = comp is None
            if fresh:
                comp = self.compensation[p] = torch.zeros_like(weight16)
        full = dict(self.optimizer.state.get(p, {}))
        before = dict(full)  # the state each chunk starts from (empty at the first step: each chunk initialises its own)
        last: dict[str, Any] = {}
        for start in range(0, rows, step_rows):
            r = slice(start, min(rows, start + step_rows))
            w32 = weight16[r].float()
            if comp is not None:
                w32.add_(comp[r])
            q = torch.nn.Parameter(w32)
            q.grad = grad16[r].float()
            if grad_scale != 1.0:
                q.grad.mul_(grad_scale)
            sliced = {}
            for key, value in before.items():  # per-value state sliced; scalars (the step count) copied per chunk
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape:
                    sliced[key] = value[r].float()
                else:
                    sliced[key] = value.clone() if torch.is_tensor(value) else value
            if sliced:
                self.optimizer.state[q] = sliced
            group["params"] = [q]
            raw()
            for key, value in self.optimizer.state.pop(q, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == q.shape:
                    if key not in full:
                        full[key] = torch.empty(p.shape, dtype=STATE_DTYPE, device=p.device)
                    full[key][r].copy_(value)
                else:
                    last[key] = value
            self._store(weight16[r], q.data, comp[r] if comp is not None else None)
        full.update(last)
        self.optimizer.state[p] = full


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


class DynamicLossScaler:
    """Dynamic loss scaling for pure fp16 weights and gradients, with torch's GradScaler interface.

    `scale(loss)` multiplies the loss (in fp32) by the scale; `step(optimizer)` checks the fp16
    gradients for inf/NaN (`amax`/`amin` per gradient: no copies), skips the update when it finds
    any, else unscales (in fp32 inside `UpdateRounding`, else in place) and steps; `update()` halves
    the scale after a skip and doubles it after `growth_interval` clean steps (GradScaler's policy and
    defaults). `get_scale()` and `is_enabled()` as in GradScaler, so `measure_step` reads skips alike.

    Example:
        >>> scaler = DynamicLossScaler()
        >>> scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"growth_factor must be > 1 and backoff_factor in (0, 1), got {growth_factor}, {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._growth_tracker = 0
        self._found_inf: bool | None = None
        self.skipped_steps = 0

    def is_enabled(self) -> bool:
        """Return True (a GradScaler may be disabled; this one is not)."""
        return True

    def get_scale(self) -> float:
        """Return the current scale."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return the loss times the scale, in fp32 (a 16-bit loss times 2**16 would overflow fp16)."""
        return loss.float() * self._scale

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step `optimizer` with unscaled gradients unless one is inf or NaN; return whether it stepped."""
        grads = self._grads(optimizer)
        flags = [torch.stack([g.amax().float(), g.amin().float()]) for g in grads]  # NaN and inf survive amax/amin
        finite = torch.isfinite(torch.cat(flags)).all() if flags else None
        # fake tensors (the planner traces fp16 in fp16) have no values: the trace takes a clean step
        self._found_inf = finite is not None and not (_is_fake(finite) or bool(finite))
        if self._found_inf:
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)
            return False
        inv = 1.0 / self._scale
        if getattr(optimizer, "takes_grad_scale", False):  # UpdateRounding, offload.StreamingOptimizer
            optimizer.step(grad_scale=inv)
        else:  # unscaled in the gradients' own dtype: small fp16 gradients may flush to zero
            for g in grads:
                g.mul_(inv)
            optimizer.step()
        return True

    def update(self) -> None:
        """Halve the scale after a skipped step; double it after `growth_interval` clean steps."""
        if self._found_inf is None:
            return
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._found_inf = None
