"""Full fine-tuning with 8-bit weights: int8 storage, updates fused into backward, stochastic rounding (notebook 16).

With 16-bit weights an 8B model's weights alone are 16 GB, more than a T4's 14.56 GiB. Stored as int8
with one fp32 scale per group of `GROUP_SIZE` values of a row, they take 1.03 bytes per value. Training
them needs three things, each here:

- Dequantize per layer: `Int8Linear` keeps `qweight` (int8, out x in) and `scale` (fp32, out x
  in/group) and dequantizes the weight into the input's dtype for its matmul, in forward and again in
  backward (only the layer's input is saved, never the 16-bit weight); `Int8Embedding` dequantizes only
  the rows it looks up.
- Update inside backward: as soon as a layer's weight gradient is computed (in the layer's own
  backward), `Int8Optimizer` updates the weight and drops the gradient, as LOMO does (Lv et al. 2023),
  so no set of gradients and no fp32 master copy ever exists. The update is computed in fp32 by row
  chunks (`CHUNK_ELEMENTS` values at a time), so the fp32 transients stay a few MB. Rules: 'lomo'
  (SGD, `w -= lr * g`) and 'adalomo' (AdaLomo, Lv et al. 2023: Adafactor's factored second moment,
  one fp32 row and column vector per matrix, the step scaled by the weight's RMS; the same formulas as
  `lomo_optim.AdaLomo` 0.1.1). Norms, biases and other small float parameters are updated by the same
  rule from a gradient hook and stored back in 16 bits with stochastic rounding.
- Stochastic rounding onto the int8 grid (Gupta et al. 2015): the new value `w / scale` is rounded up
  with probability equal to its fractional part, down otherwise, so E[rounded] = w exactly: an update
  far smaller than the grid spacing (absmax/127 of its group) still moves the weight on average,
  where round-to-nearest would drop it every time.

Scale rule (stated once): at conversion each group's scale is its absmax / 127. At every update, a group
whose new values would leave [-127, 127] gets the scale of its new absmax / 127 before rounding, so
nothing is ever clipped (clipping would bias the rounding); scales never shrink unless
`rescale_interval` > 0, which re-derives every group's scale from its absmax every that many updates.

Fp16 (a T4): the loss is multiplied by a loss scale (initially 2**16) before backward and each gradient
is unscaled in fp32; a weight whose gradient has an inf or NaN is not updated, and the scale halves for
the next step (it doubles after `GROWTH_INTERVAL` steps without one). Other weights of that step are
already updated (their gradients were finite): the update happens before the step's end is known.

The field's versions: Q-GaLore (Zhang et al. 2024, `q-galore-torch` 1.0) stores weights as uint8 with a
scale and zero point per 256-value group, re-derived from min/max at every update, and rounds
stochastically; it dequantizes the whole weight to float inside its GaLore-AdamW8bit `step()` after
backward, and needs bitsandbytes' CUDA kernels. torchao's `prototype.quantized_training`
(`Int8QuantizedTrainingLinearWeight`, row-wise scales, stochastic rounding in its in-place ops) is a
tensor subclass updated by an ordinary optimizer after backward, so the whole gradient of the weight
exists. Neither updates inside backward nor was checked under the planner's fake tensors; this module
is plain PyTorch so that the planner traces it (`planner.plan`).

Example:
    >>> model = build_model("tiny", dtype=torch.bfloat16)
    >>> opt = make_int8_optimizer("adalomo", quantize_model_int8(model), lr=1e-3)
    >>> opt.fused_backward(model(x, labels=x).loss, opt.lomo_lr)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_DTYPES = ("int8",)
INT8_RULES = ("lomo", "adalomo")
GROUP_SIZE = 128  # values of a row per fp32 scale (falls back to whole rows where it does not divide them)
QMAX = 127
CHUNK_ELEMENTS = 2**22  # values per fp32 chunk of an update: 16 MiB per fp32 copy
QUANTIZE_FP32_COPIES = 1  # fp32 copies of a chunk quantize_int8 holds at once (3 before 2026-11-28)
FP16_INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 1000
ADALOMO_EPS = (1e-30, 1e-3)  # lomo_optim.AdaLomo's defaults
ADALOMO_DECAY_RATE = -0.8
CLIP_THRESHOLD = 1.0


def check_weight_dtype(value: Any, name: str = "weight_dtype") -> str | None:
    """Return `value` if it is None or one of `WEIGHT_DTYPES`, else raise ValueError naming it."""
    if value is not None and (not isinstance(value, str) or value not in WEIGHT_DTYPES):
        raise ValueError(f"{name} must be None or one of {WEIGHT_DTYPES}, got {value!r}")
    return value


def stochastic_round_int8(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Return fp32 `x` (in grid units, |x| <= 127) rounded to int8 up or down at random: E[result] = x.

    Rounds up with probability equal to the fractional part of `x`, down otherwise.
    """
    low = torch.floor(x)
    rand = torch.rand(x.shape, device=x.device, generator=generator)
    return (low + (rand < x - low)).clamp_(-QMAX, QMAX).to(torch.int8)


def _group(cols: int, group_size: int) -> int:
    return group_size if 0 < group_size <= cols and cols % group_size == 0 else cols


def quantize_int8(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 values, fp32 scales of shape (rows, cols / group)) of a 2-D weight, rounded to nearest."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    g = _group(cols, group_size)
    q = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, cols // g, dtype=torch.float32, device=weight.device)
    if weight.is_meta:  # the layout only (loading.load_int8's skeleton): meta ops run in Python, seconds per model
        return q, scale
    for r in _row_chunks(rows, cols):
        # one fp32 copy of the chunk, worked on in place (a copy even of an fp32 weight, which is never modified)
        w = weight[r].to(torch.float32, copy=True).view(-1, cols // g, g)  # (rows, groups, g)
        low, high = torch.aminmax(w, dim=-1)  # the absolute max without an abs() copy of the chunk: the same value
        s = torch.maximum(high, low.neg_(), out=high).div_(QMAX).clamp_(min=torch.finfo(torch.float32).tiny)
        del low, high  # s is `high`, divided in place
        scale[r] = s
        q[r] = w.div_(s[..., None]).round_().clamp_(-QMAX, QMAX).view(-1, cols)  # the int8 cast happens in the copy
        del w, s
    return q, scale


def quantize_int8_transient_bytes(rows: int, cols: int, group_size: int = GROUP_SIZE) -> int:
    """Return the most bytes `quantize_int8` of a (rows, cols) weight allocates beyond its input and its two outputs.

    One fp32 copy of a row chunk (`QUANTIZE_FP32_COPIES`; the chunk is `CHUNK_ELEMENTS` values of whole rows, at
    least one row, at most the weight) and the chunk's per-group min and max in fp32. Measured equal on the CPU
    (tests/test_int8train.py); CUDA rounds each allocation up to 512 bytes. A load that quantizes one tensor on the
    device (`load_int8`) holds, beyond the int8 weights loaded before it: the 16-bit tensor, these bytes and the
    tensor's own int8 values and scales.
    """
    g = _group(cols, group_size)
    chunks = _row_chunks(rows, cols)
    values = (chunks[0].stop - chunks[0].start) * cols if chunks else 0  # the first chunk is the largest
    return QUANTIZE_FP32_COPIES * 4 * values + 2 * 4 * (values // g)


def _row_chunks(rows: int, cols: int, chunk_elements: int = CHUNK_ELEMENTS) -> list[slice]:
    step = max(1, chunk_elements // max(1, cols))
    return [slice(s, min(rows, s + step)) for s in range(0, rows, step)]


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: slice | None = None) -> torch.Tensor:
    """Return `q * scale` (rows `rows`, default all) in `dtype`, computed in fp32 by row chunks."""
    rows = rows if rows is not None else slice(0, q.shape[0])
    q, scale = q[rows], scale[rows]
    n, cols = q.shape
    groups = scale.shape[1]
    if dtype == torch.float32:
        return (q.float().view(n, groups, -1) * scale[..., None]).view(n, cols)
    out = torch.empty(n, cols, dtype=dtype, device=q.device)
    for r in _row_chunks(n, cols):
        out[r] = (q[r].float().view(-1, groups, cols // groups) * scale[r, :, None]).view(-1, cols)
    return out


class _Int8Weight:
    """What the layers sharing one int8 weight (a tied embedding and head) hold in common."""

    def __init__(self, qweight: nn.Parameter, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qweight, self.scale = qweight, scale
        self.dtype = dtype  # the dtype of the float weight it replaced: what `dequantized()` and lookups give
        self.uses = 0  # modules that read it: a gradient is complete once each has sent its part
        self.optimizer: Int8Optimizer | None = None
        self.pending: torch.Tensor | None = None  # the parts of the gradient received so far (tied weights)
        self.received = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _Int8Weight:
        """Copy the weight, not its optimizer (a copied model, e.g. for evaluation, is not trained by it)."""
        import copy

        out = _Int8Weight(copy.deepcopy(self.qweight, memo), copy.deepcopy(self.scale, memo), self.dtype)
        out.uses = self.uses
        return out

    def receive(self, grad: torch.Tensor) -> None:
        """Take one use's gradient; update the weight once all uses have sent theirs."""
        if self.optimizer is None:
            raise RuntimeError("an int8 weight got a gradient but has no Int8Optimizer: make one with make_int8_optimizer")
        self.received += 1
        if self.uses > 1:
            self.pending = grad if self.pending is None else self.pending.add_(grad)
            if self.received < self.uses:
                return
            grad, self.pending = self.pending, None
        self.received = 0
        self.optimizer.update_int8(self, grad)


class _Int8LinearFn(torch.autograd.Function):
    """y = x @ dequantize(W).T + b; saves x only, dequantizes again in backward and hands dW to the optimizer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, shared: _Int8Weight) -> torch.Tensor:  # type: ignore[override]
        w = dequantize_int8(shared.qweight, shared.scale, x.dtype)  # (out, in), freed after the matmul
        ctx.save_for_backward(x)
        ctx.shared, ctx.has_bias = shared, bias is not None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        shared = ctx.shared
        w = dequantize_int8(shared.qweight, shared.scale, grad_out.dtype)
        grad_x = grad_out @ w  # (..., in)
        del w
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        grad_w = g2.T @ x.reshape(-1, x.shape[-1]).to(g2.dtype)  # (out, in), in the compute dtype
        grad_b = g2.sum(0) if ctx.has_bias else None
        shared.receive(grad_w)
        return grad_x, grad_b, None


class _DequantizeFn(torch.autograd.Function):
    """The whole dequantized weight as a differentiable tensor (for the chunked loss); its gradient goes to the optimizer."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, shared: _Int8Weight, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.shared = shared
        return dequantize_int8(shared.qweight, shared.scale, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.shared.receive(grad)
        return None, None, None


class _Int8EmbeddingFn(torch.autograd.Function):
    """Rows of the dequantized table; backward builds the table's gradient (index_add) and hands it over."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, anchor: torch.Tensor, shared: _Int8Weight, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        flat = ids.reshape(-1)
        q, scale = shared.qweight[flat], shared.scale[flat]  # (N, C) int8, (N, groups)
        rows = (q.float().view(flat.numel(), scale.shape[1], -1) * scale[..., None]).view(flat.numel(), -1)
        ctx.save_for_backward(ids)
        ctx.shared, ctx.dtype = shared, dtype
        return rows.to(dtype).view(*ids.shape, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        shared = ctx.shared
        table = torch.zeros(shared.qweight.shape, dtype=grad.dtype, device=grad.device)  # (V, C)
        table.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]))
        shared.receive(table)
        return None, None, None, None


def _anchor(shared: _Int8Weight, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor that requires grad, so that autograd runs the backward of a function of int8 data."""
    return torch.zeros((), dtype=dtype, device=device, requires_grad=torch.is_grad_enabled())


class _Int8Module(nn.Module):
    """What the int8 layers share: `qweight` and `scale` registered as (frozen) parameters, so memory trackers count
    them as model weights and tied layers keep one copy; `.to()`, `.half()`, `.float()` move them to the new device
    but keep their dtypes (int8, fp32), and change only the dtype the weight is dequantized to."""

    shared: _Int8Weight

    def _register(self, shared: _Int8Weight) -> None:
        self.shared = shared
        self.qweight = shared.qweight  # (out, in) int8
        self.scale = shared.scale  # (out, in / group) fp32

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:  # type: ignore[override]
        probe = fn(torch.empty(0, dtype=self.shared.dtype, device=self.qweight.device))
        for t in (self.qweight, self.scale):
            if t.device != probe.device:
                t.data = t.data.to(probe.device)
        self.shared.dtype = probe.dtype
        for name, p in self._parameters.items():
            if p is not None and name not in ("qweight", "scale"):
                p.data = fn(p.data)
        return self


class Int8Linear(_Int8Module):
    """A Linear layer whose weight is int8 with fp32 group scales, trained by `Int8Optimizer` inside backward."""

    def __init__(self, shared: _Int8Weight, bias: nn.Parameter | None) -> None:
        super().__init__()
        self._register(shared)
        self.bias = bias
        self.out_features, self.in_features = shared.qweight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return F.linear(x, dequantize_int8(self.qweight, self.scale, x.dtype), self.bias)
        return _Int8LinearFn.apply(x, self.bias, self.shared)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return the whole weight in `dtype` (default: the replaced weight's); its gradient updates the weight."""
        dtype = dtype or self.shared.dtype
        if not torch.is_grad_enabled():
            return dequantize_int8(self.qweight, self.scale, dtype)
        return _DequantizeFn.apply(_anchor(self.shared, dtype, self.qweight.device), self.shared, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, groups={self.scale.shape[1]}"


class Int8Embedding(_Int8Module):
    """An embedding table stored as int8 with fp32 group scales; looks up and dequantizes only the rows it needs."""

    def __init__(self, shared: _Int8Weight) -> None:
        super().__init__()
        self._register(shared)
        self.num_embeddings, self.embedding_dim = shared.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows it returns (the replaced table's; `.float()` and the like change it)."""
        return self.shared.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            q, s = self.qweight[ids.reshape(-1)], self.scale[ids.reshape(-1)]
            rows = (q.float().view(q.shape[0], s.shape[1], -1) * s[..., None]).view(q.shape[0], -1)
            return rows.to(self.dtype).view(*ids.shape, -1)
        return _Int8EmbeddingFn.apply(ids, _anchor(self.shared, self.dtype, self.qweight.device), self.shared, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8, groups={self.scale.shape[1]}"


def int8_weights(model: nn.Module) -> list[_Int8Weight]:
    """Return the distinct int8 weights of a model converted by `quantize_model_int8`."""
    out: dict[int, _Int8Weight] = {}
    for m in model.modules():
        if isinstance(m, (Int8Linear, Int8Embedding)):
            out.setdefault(id(m.shared), m.shared)
    return list(out.values())


def quantize_model_int8(model: nn.Module, *, group_size: int = GROUP_SIZE, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every nn.Linear and nn.Embedding of `model` by its int8 version, in place; return the model.

    Weights shared by several modules (a tied embedding and head) stay shared: one int8 tensor, whose
    gradient is the sum of each use's. `compute_dtype` is what an embedding's rows are dequantized to
    (default: the embedding's own dtype). Norms and biases are left as they are.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    shared: dict[int, _Int8Weight] = {}
    targets = [(name, m) for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    if not targets and int8_weights(model):
        raise ValueError(f"{type(model).__name__} is already int8 (quantize_model_int8 or weight_dtype='int8' converted "
                         "its linear and embedding layers): convert a fresh model")
    if not targets:
        raise ValueError(f"quantize_model_int8 found no nn.Linear or nn.Embedding in {type(model).__name__}")
    for name, m in targets:
        w = m.weight
        if id(w) not in shared:
            with torch.no_grad():
                q, scale = quantize_int8(w.detach(), group_size)
            shared[id(w)] = _Int8Weight(nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False),
                                        compute_dtype or w.dtype)
        sw = shared[id(w)]
        sw.uses += 1
        if isinstance(m, nn.Linear):
            new: nn.Module = Int8Linear(sw, m.bias)
        else:
            new = Int8Embedding(sw)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
    return model


class Int8Optimizer(torch.optim.Optimizer):
    """Update int8 weights (and the model's float parameters) inside backward with stochastic rounding.

    Made by `make_int8_optimizer`. `fused_backward(loss, lr)` runs backward (the loss scaled for fp16
    weights) and every weight is updated as its gradient is computed; `step()` and `zero_grad()` then
    have nothing to do. `state` holds each weight's fp32 factored moments ('adalomo'), so memory trackers
    see them.

    Args:
        rule: 'lomo' (SGD) or 'adalomo'.
        lr: learning rate (> 0).
        weight_decay: decoupled weight decay for matrices (AdaLomo's form, `w *= 1 - lr_t * wd`).
        rescale_interval: re-derive every group's scale from its absmax every this many updates of a
            weight (0: only grow a scale where the update would leave the grid; see the module docstring).
        generator: random numbers for the rounding (default: the global generator).
    """

    def __init__(self, model: nn.Module, rule: str, *, lr: float, weight_decay: float = 0.0, rescale_interval: int = 0,
                 generator: torch.Generator | None = None) -> None:
        if rule not in INT8_RULES:
            raise ValueError(f"rule must be one of {INT8_RULES}, got {rule!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if isinstance(rescale_interval, bool) or not isinstance(rescale_interval, int) or rescale_interval < 0:
            raise ValueError(f"rescale_interval must be an integer >= 0, got {rescale_interval!r}")
        self.weights = int8_weights(model)
        if not self.weights:
            raise ValueError("Int8Optimizer found no int8 weight: convert the model with quantize_model_int8 first")
        floats = [p for p in model.parameters() if p.requires_grad]
        params = [w.qweight for w in self.weights] + floats
        super().__init__(params, {"lr": lr})
        self.rule, self.lomo_lr, self.weight_decay = rule, lr, weight_decay
        self.rescale_interval, self.generator = rescale_interval, generator
        dtype = next((p.dtype for p in floats if p.is_floating_point()), torch.bfloat16)
        self.loss_scale = FP16_INIT_SCALE if dtype == torch.float16 else 1.0
        self.found_inf = False
        self.skipped_steps = 0
        self._clean_steps = 0
        self.steps = 0
        for w in self.weights:
            w.optimizer = self
            rows, cols = w.qweight.shape
            self.state[w.qweight]["updates"] = 0
            if rule == "adalomo":
                self.state[w.qweight]["exp_avg_sq_row"] = torch.zeros(rows, dtype=torch.float32, device=w.qweight.device)
                self.state[w.qweight]["exp_avg_sq_col"] = torch.zeros(cols, dtype=torch.float32, device=w.qweight.device)
        for p in floats:
            if rule == "adalomo":
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        self._handles = [p.register_post_accumulate_grad_hook(self._update_float) for p in floats]

    # -- the step, inside backward ------------------------------------------------------------------
    def fused_backward(self, loss: torch.Tensor, lr: float) -> None:
        """Run backward on `loss`; each weight is updated (learning rate `lr`) as soon as its gradient exists."""
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        for group in self.param_groups:
            group["lr"] = lr
        self.lomo_lr = lr
        self.steps += 1
        self.found_inf = False
        for w in self.weights:  # a forward with grad enabled but no backward (evaluation) leaves nothing behind
            w.received, w.pending = 0, None
        (loss.float() * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
        if self.loss_scale != 1.0:  # fp16: the dynamic loss scale (GradScaler's policy)
            if self.found_inf:
                self.loss_scale /= 2
                self.skipped_steps += 1
                self._clean_steps = 0
            else:
                self._clean_steps += 1
                if self._clean_steps >= GROWTH_INTERVAL:
                    self.loss_scale *= 2
                    self._clean_steps = 0

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Do nothing: every weight was updated during backward (`fused_backward`)."""
        if closure is not None:
            raise ValueError("Int8Optimizer takes no closure: the updates run inside fused_backward")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Do nothing: no gradient outlives its update."""

    def remove(self) -> None:
        """Remove the gradient hooks from the float parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _finite(self, grad: torch.Tensor) -> bool:
        """fp16 only (one device sync): False, and the step marked, when `grad` holds an inf or NaN.

        One fp32 sum, no copy of the gradient (an inf or NaN makes it inf or NaN; fp16 values cannot overflow it).
        Fake tensors (the planner's trace) have no values: the same sum is computed and the update taken."""
        from torch._subclasses.fake_tensor import is_fake

        if self.loss_scale == 1.0:
            return True
        finite = torch.isfinite(grad.sum(dtype=torch.float32))
        if is_fake(finite) or bool(finite):
            return True
        self.found_inf = True
        return False

    @torch.no_grad()
    def _update_float(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is None or not self._finite(grad):
            return
        lr = self.param_groups[0]["lr"]
        g = grad.float().div_(self.loss_scale)
        w = p.float()
        if self.rule == "lomo":
            w.add_(g, alpha=-lr)
        else:
            v = self.state[p]["exp_avg_sq"]
            beta2t = 1.0 - math.pow(max(1, self.steps), ADALOMO_DECAY_RATE)
            v.mul_(beta2t).add_(g * g + ADALOMO_EPS[0], alpha=1.0 - beta2t)
            u = v.rsqrt().mul_(g)
            u.div_((_rms(u) / CLIP_THRESHOLD).clamp_(min=1.0))
            w.sub_(u * (lr * torch.clamp(_rms(w), min=ADALOMO_EPS[1])))
        if p.dtype in (torch.float16, torch.bfloat16):
            from colab_memopt.techniques.rounding import stochastic_round

            p.copy_(stochastic_round(w, p.dtype, generator=self.generator))
        else:
            p.copy_(w)

    @torch.no_grad()
    def update_int8(self, shared: _Int8Weight, grad: torch.Tensor) -> None:
        """Apply the rule's update for `grad` (the whole gradient of one int8 weight, any float dtype) by row chunks."""
        if not self._finite(grad):
            return
        q, scale = shared.qweight, shared.scale
        rows, cols = q.shape
        chunks = _row_chunks(rows, cols)
        lr = self.param_groups[0]["lr"]
        inv = 1.0 / self.loss_scale
        state = self.state[q]
        state["updates"] += 1
        rescale = self.rescale_interval > 0 and state["updates"] % self.rescale_interval == 0

        def g32(r: slice) -> torch.Tensor:
            return grad[r].to(torch.float32, copy=True).mul_(inv)  # a copy also when the gradient is fp32

        if self.rule == "lomo":
            for r in chunks:
                self._write(q, scale, r, g32(r).mul_(lr), rescale)
            return
        # AdaLomo: the factored second moment from the whole gradient, then the clipped, RMS-scaled step.
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        beta2t = 1.0 - math.pow(max(1, self.steps), ADALOMO_DECAY_RATE)
        col_sum = torch.zeros_like(col)
        row_new = torch.empty_like(row)
        for r in chunks:
            g2 = g32(r).square_().add_(ADALOMO_EPS[0])
            row_new[r] = g2.mean(-1)
            col_sum += g2.sum(0)
        row.mul_(beta2t).add_(row_new, alpha=1.0 - beta2t)
        col.mul_(beta2t).add_(col_sum / rows, alpha=1.0 - beta2t)
        r_factor = (row / row.mean()).rsqrt_()  # (rows,)
        c_factor = col.rsqrt()  # (cols,)
        u_sq = torch.zeros((), dtype=torch.float32, device=q.device)
        w_sq = torch.zeros((), dtype=torch.float32, device=q.device)
        for r in chunks:
            u_sq += (g32(r).mul_(r_factor[r, None]).mul_(c_factor)).square_().sum()
            w_sq += dequantize_int8(q, scale, torch.float32, r).square_().sum()
        numel = q.numel()
        clip = (torch.sqrt(u_sq / numel) / CLIP_THRESHOLD).clamp_(min=1.0)
        step = torch.clamp(torch.sqrt(w_sq / numel), min=ADALOMO_EPS[1]) * lr  # lr scaled by the weight's RMS
        for r in chunks:
            u = g32(r).mul_(r_factor[r, None]).mul_(c_factor).mul_(step / clip)
            self._write(q, scale, r, u, rescale, decay=step * self.weight_decay if self.weight_decay else None)

    def _write(self, q: torch.Tensor, scale: torch.Tensor, r: slice, update: torch.Tensor, rescale: bool,
               decay: torch.Tensor | None = None) -> None:
        """q[r] <- stochastic_round((q[r] * scale[r] - update) / new scale), the new scale by the module's rule."""
        n, cols = update.shape
        groups = scale.shape[1]
        w = dequantize_int8(q, scale, torch.float32, r).view(n, groups, -1)  # (n, groups, g) fp32
        if decay is not None:
            w.mul_(1.0 - decay)
        w.sub_(update.view(n, groups, -1))
        need = w.abs().amax(-1) / QMAX  # (n, groups): the scale that keeps every value on the grid
        s = need.clamp_(min=torch.finfo(torch.float32).tiny) if rescale else torch.maximum(scale[r], need)
        scale[r] = s
        q[r] = stochastic_round_int8(w.div_(s[..., None]), generator=self.generator).view(n, cols)


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.norm(2) / math.sqrt(max(1, t.numel()))


def make_int8_optimizer(rule: str, model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                        rescale_interval: int = 0) -> Int8Optimizer:
    """Return an `Int8Optimizer` ('lomo' or 'adalomo') over a model converted by `quantize_model_int8`.

    Example:
        >>> opt = make_int8_optimizer("lomo", quantize_model_int8(model), lr=1e-3)
        >>> opt.fused_backward(model(x, labels=x).loss, opt.lomo_lr)
    """
    return Int8Optimizer(model, rule, lr=lr, weight_decay=weight_decay, rescale_interval=rescale_interval)


def int8_state_bytes(weights: Iterable[_Int8Weight]) -> int:
    """Return the bytes of int8 values plus fp32 scales of `weights`."""
    return sum(w.qweight.numel() + w.scale.numel() * 4 for w in weights)


def int8_weight_bytes(model: nn.Module, group_size: int = GROUP_SIZE) -> tuple[int, int]:
    """Return (bytes of `model`'s weights once converted by `quantize_model_int8`: int8 matrices with fp32
    scales and the rest in 16 bits; values of its largest matrix) by rule, for any device ('meta' too)."""
    seen: set[int] = set()
    total, largest = 0, 0
    for m in model.modules():
        if type(m) in (nn.Linear, nn.Embedding) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            rows, cols = m.weight.shape
            total += rows * cols + 4 * rows * (cols // _group(cols, group_size))
            largest = max(largest, rows * cols)
    rest = {id(p): p for p in model.parameters() if id(p) not in seen}  # norms, biases: 16-bit
    return total + 2 * sum(p.numel() for p in rest.values()), largest
