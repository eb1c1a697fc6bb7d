"""The one adapter over PyTorch's tensor-level memory tracker.

`torch.distributed._tools.mem_tracker.MemTracker` is a private API. Everything this project reads
from it goes through `TensorTracker`, and `tests/test_tracker.py` pins the behaviour we rely on, so
a PyTorch upgrade that changes it fails loudly instead of producing wrong numbers.

What it adds to MemTracker:
- categories under stable names (`CATEGORIES`);
- the peak of each training phase (forward, backward, optimizer step) and of each category;
- several forward passes per step (gradient accumulation), which MemTracker refuses;
- categories that mean what they say at the optimizer step: MemTracker files every tensor made
  inside `optimizer.step()` as optimizer state; here they are temporaries, and only what the
  optimizer keeps in `optimizer.state` (moments, step counters, 8-bit states and their scales) is
  optimizer state, re-filed by MemTracker's own post-step hook. Likewise autocast's 16-bit copies
  of the weights, kept for backward, are temporaries, not activations.

With `in_op_buffers` (what a plan for a CUDA target counts), it also counts what some operations allocate and free
inside themselves on CUDA, which no tensor tracker sees but the CUDA allocator does (`in_op_bytes`): softmax's backward
`grad * output`, the softmax kernels' contiguous copies of strided inputs, and `_safe_softmax`'s mask of the fully
masked rows (SDPA's math kernel).
For that one moment those bytes are temporaries on top of everything live.

With `units` (each repeated block's module and its unit's index: `planning.stack`), it also records the step's
timeline: after every operation that changes the live bytes, the phase, the unit whose forward or backward runs, the
operation and the live bytes per category (`timeline`), which a trace of a few blocks extrapolates to the whole stack.

MemTracker's module tracker (`ModTracker`) also keeps each step's autograd graph alive for good: the hook it puts on
every module's inputs (`register_multi_grad_hook`) holds their autograd nodes, the nodes hold the hook, and the cycle
runs through autograd's C++, where Python's collector cannot see it. What the graph still holds after backward stays:
with LoRA and checkpointing, the embedding's output that peft's `enable_input_require_grads` makes a leaf (one hidden
state per step, and two in a plan that traced two micro-batches, where the run itself frees it in backward).
`TensorTracker` uses `_AcyclicModTracker`, whose hook lets the nodes go once it has counted them.

`LiveBytesMode` is the lean counterpart used by `MemoryBudget`: live bytes only, no module hooks.
MemTracker's module hooks (`register_multi_grad_hook`) keep an aborted forward's activations alive
after an error, which would make an emulated OOM leak; `LiveBytesMode` has no such hooks.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools import mem_tracker as _mt
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
from torch._subclasses.fake_tensor import _device_handler as _fake_mode_device
from torch._subclasses.fake_tensor import FakeTensorMode as _FakeTensorMode
from torch.autograd.graph import _get_grad_fn_or_grad_acc as _grad_fn_or_grad_acc
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModMemStats, _ModState, _WeakRefInfo
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
    "other",
)
PHASES = ("forward", "backward", "optimizer")
_PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}

_CATEGORY_OF = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "other",
}


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    index_a = a.index if a.index is not None else torch.cuda.current_device()
    index_b = b.index if b.index is not None else torch.cuda.current_device()
    return index_a == index_b


class _NoHook:
    """Stands in for a hook handle on a frozen parameter (nothing to remove)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()
# `tensor.device` asked of a tensor subclass (a fake tensor answers it in Python).
_DEVICE_QUERY = torch.ops.prim.device.default


def fake_device(func: Any, args: Any) -> Any:
    """The answer to `tensor.device` of a fake tensor, from the fake mode's own handler (torch's `_device_handler`:
    the meta device inside a kernel, the tensor's own device outside), or None where this is no such question. A
    dispatch mode above the fake mode answers it itself: passed down, the question goes through every mode in
    between, and a trace asks it about twice per operation (14,000 times in an 8B QLoRA plan: 11% of a warm plan)."""
    if func is _DEVICE_QUERY and len(args) == 1 and isinstance(args[0], _FakeTensor):
        return _fake_mode_device(args)
    return None


# torch 2.13 wraps every dispatch mode's `__torch_dispatch__` in `torch._disable_dynamo` when its class is made
# (TorchDispatchMode.__init_subclass__, "a temporary measure to roll out" skipping torch.compile inside those frames):
# each operation then passes through two more Python frames per mode, which set and reset Dynamo's frame hook. A trace
# runs every operation through three or four modes (this tracker, MemTracker, the fake-tensor mode, the Trainer trace's
# scalar answers), and the wrappers were 10-18% of a plan's time. Nothing compiles inside a trace or a measured step,
# and torch up to 2.12 (Colab's among them) calls these methods unwrapped: the modes here opt out
# (`_should_skip_dynamo`, torch's own switch for it) and call the methods they build on unwrapped.
class NoDynamoWrap:
    """Mixin for a dispatch mode class: its `__torch_dispatch__` is left as written (see above)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def unwrapped_dispatch(cls: type) -> Any:
    """Return `cls.__torch_dispatch__` as its class wrote it (without torch 2.13's Dynamo wrapper, if it has one)."""
    method = cls.__dict__["__torch_dispatch__"]
    return getattr(method, "__wrapped__", method)


_DTENSOR = _mt.DTensor
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class PlanningFakeTensorMode(NoDynamoWrap, _FakeTensorMode):
    """FakeTensorMode, its operations dispatched without torch 2.13's Dynamo wrapper (see above)."""

    __torch_dispatch__ = unwrapped_dispatch(_FakeTensorMode)


def fake_tensor_mode(**kwargs: Any) -> PlanningFakeTensorMode:
    """Return the fake-tensor mode every plan traces under: `FakeTensorMode(**kwargs)`, without the Dynamo wrapper."""
    return PlanningFakeTensorMode(**kwargs)


def _all_grads_hook(tensors: list[torch.Tensor], fn: Any) -> list[Any]:
    """`torch.autograd.graph.register_multi_grad_hook(tensors, fn)` (mode "all": `fn(grads)` once per backward, after
    every gradient of `tensors` that the backward computes, None for the others), without its reference cycle: torch's
    hook keeps the tensors' autograd nodes for good, and each node holds the graph below it. This one counts the
    gradients the first backward computes from the nodes on its first call, and lets the nodes go; a later backward
    through the same graph (`retain_graph`) gets `fn` at its end, as does a backward that computes fewer of them than
    counted (torch's would keep those gradients for good and never call). Return the handles (one per tensor)."""
    lock = threading.Lock()
    nodes: list[Any] | None = [_grad_fn_or_grad_acc(t) for t in tensors]
    n_tensors = len(tensors)  # the hooks hold no tensor: one on `t` holding `t` is a cycle too
    first: list[int] = []  # the first backward's id, and the gradients it computes
    count: dict[int, int] = {}
    buffer: dict[int, list[torch.Tensor | None]] = {}

    def flush(task: int) -> None:
        with lock:
            grads = buffer.pop(task, None)
            count.pop(task, None)
        if grads is not None:
            fn(grads)

    def hook_for(idx: int) -> Any:
        def inner(grad: torch.Tensor) -> None:
            nonlocal nodes
            task = torch._C._current_graph_task_id()
            with lock:
                calls = count.get(task, 0)
                count[task] = calls + 1
                buffer.setdefault(task, [None] * n_tensors)[idx] = grad
                if calls == 0:  # fn when this backward ends, unless every gradient it computes came first
                    torch.autograd.Variable._execution_engine.queue_callback(lambda: flush(task))
                if calls == 0 and nodes is not None:
                    first[:] = [task, sum(map(torch._C._will_engine_execute_node, nodes))]
                    nodes = None
                done = bool(first) and task == first[0] and calls == first[1] - 1
            if done:
                flush(task)
        return inner

    return [t.register_hook(hook_for(i)) for i, t in enumerate(tensors)]


class _AcyclicModTracker(ModTracker):
    """torch's ModTracker whose forward pre-hook registers `_all_grads_hook` (see the module's docstring)."""

    def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:  # torch 2.13's, the hook swapped
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        name = self._get_mod_name(mod)
        w_mod = weakref.ref(mod)
        self._get_append_fn(w_mod, name, False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)
        args, _ = tree_flatten(input)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if not self.is_bw:
            if tensors:
                _all_grads_hook(tensors, self._get_pop_fn(w_mod, name, True))
            else:
                self._post_bw_callbacks_to_enqueue.append(self._get_pop_fn(w_mod, name, True))


class TensorTracker(NoDynamoWrap, MemTracker):
    """Track live tensor storage by category and by phase of the step.

    Args:
        device: count only storage on this device; None counts every device together.
        cuda_rounding: count every storage as the CUDA caching allocator would (rounded up to 512
            bytes), also on the CPU and under fake tensors: what the planner uses for a CUDA target.
        units: {id(block module): unit index} of a stack of repeated blocks: record the `timeline`,
            one event per operation: (phase index in PHASES, the unit running or -1, the operation,
            the live bytes per category in CATEGORIES' order).
        in_op_buffers: count what each of `IN_OP_BUFFER_OPS` allocates and frees inside itself on CUDA (`in_op_bytes`), at the
            moment they are alive (temporaries): what a CUDA allocator's peak holds.
    """

    def __init__(self, *, device: torch.device | None = None, cuda_rounding: bool = False,
                 units: dict[int, int] | None = None, in_op_buffers: bool = False, module_stats: bool = True) -> None:
        super().__init__()
        self.module_stats = module_stats
        self._mod_tracker = _AcyclicModTracker()
        self.in_op_buffers = in_op_buffers
        self.in_op_calls = 0  # operations whose inside buffer was counted
        self.units = units
        self.timeline: list[tuple[int, int, Any, tuple[int, ...]]] | None = [] if units is not None else None
        self._unit = -1  # the unit whose forward or backward runs now (-1: none)
        self._unit_in_bw = False  # the unit was entered in backward: left when backward ends
        self._func: Any = None
        self.device = device
        self.cuda_rounding = cuda_rounding
        self._saved_winfo_cls: Any = None
        self.phase_peaks: dict[str, int] = {}
        self.category_peaks: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_categories: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.phase_peak_categories: dict[str, dict[str, int]] = {}
        self._device_match: dict[Any, bool] = {}
        self._casting_param = False

    # -- reading -----------------------------------------------------------------------------
    def _device_snaps(self, snap: dict) -> list[dict]:
        return [s for dev, s in snap.items() if self._counts(dev)]

    def _categories(self, snap: dict) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for dev_snap in self._device_snaps(snap):
            for ref, nbytes in dev_snap.items():
                if ref != _TOTAL_KEY:
                    out[_CATEGORY_OF[ref]] += nbytes
        return out

    def live_bytes(self) -> int:
        """Return the bytes of tracked storage alive now (on the tracked device)."""
        return sum(s.get(_TOTAL_KEY, 0) for s in self._device_snaps(self._curr_mem_snap))

    def current_categories(self) -> dict[str, int]:
        """Return the live bytes per category now."""
        return self._categories(self._curr_mem_snap)

    @property
    def phase(self) -> str:
        """Return the phase of the step being run: forward, backward or optimizer."""
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            return "backward"
        return "forward"

    def module_activation_bytes(self, max_depth: int = 3) -> dict[str, int]:
        """Return the bytes each module left alive after its forward (its saved activations)."""
        out = {}
        for stats in self.memory_tracking.values():
            if stats.mod_fqn.count(".") + 1 > max_depth:
                continue
            pre = stats.snapshots.get("Pre-Forward") or []
            post = stats.snapshots.get("Post-Forward") or []
            if pre and post:
                before = sum(s.get(_TOTAL_KEY, 0) for s in self._device_snaps(pre[0]))
                after = sum(s.get(_TOTAL_KEY, 0) for s in self._device_snaps(post[0]))
                out[stats.mod_fqn] = after - before
        return out

    # -- MemTracker overrides ----------------------------------------------------------------
    def _round_like_cuda(self, on: bool) -> None:
        # MemTracker builds its storage records with the module-level `_WeakRefInfo` class, which
        # rounds only storages on CUDA devices; swap in a class that always rounds while we track.
        if not self.cuda_rounding:
            return
        if on:
            self._saved_winfo_cls = _mt._WeakRefInfo
            _mt._WeakRefInfo = _CudaRoundedInfo
        elif self._saved_winfo_cls is not None:
            _mt._WeakRefInfo = self._saved_winfo_cls
            self._saved_winfo_cls = None

    def track_external(self, *external: Any) -> None:
        self._round_like_cuda(True)
        try:
            with _quiet_storage_walk():
                super().track_external(*external)
        finally:
            self._round_like_cuda(False)

    def track_as(self, category: str, *tensors: Any) -> None:
        """Track tensors made before the step under a category of `CATEGORIES` (what `track_external` cannot
        classify: DeepSpeed's flat parameter, gradient and fp32 master buffers)."""
        reftype = {name: ref for ref, name in _CATEGORY_OF.items()}.get(category)
        if reftype is None:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        self._round_like_cuda(True)
        try:
            with _quiet_storage_walk():
                for t in tensors:
                    if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes():
                        self._update_and_maybe_create_winfos(t, reftype)
        finally:
            self._round_like_cuda(False)

    def __enter__(self) -> TensorTracker:
        self._round_like_cuda(True)
        self._quiet = _quiet_storage_walk()
        self._quiet.__enter__()
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            self._round_like_cuda(False)
            quiet, self._quiet = getattr(self, "_quiet", None), None
            if quiet is not None:
                quiet.__exit__(None, None, None)

    def _update_peak_stats(self, peak_state: Any, inside: int = 0) -> None:
        # Called after every operation. MemTracker's own version also rescans every module's
        # per-module peak on each op, which is most of the tracking time on a large model and which
        # we never read (per-module figures come from the pre/post-forward snapshots); so only the
        # global peak (what get_tracker_snapshot("peak") returns) and our peaks are updated here.
        # `inside`: bytes the operation just run held inside itself beside its output (`IN_OP_BUFFER_OPS`): one
        # moment with that many more bytes of temporaries, then the live bytes as they are (called again with 0).
        live = 0
        cats = dict.fromkeys(CATEGORIES, 0)
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)
            if self._counts(dev):
                live += total
                for ref, nbytes in dev_snap.items():
                    if ref != _TOTAL_KEY:
                        cats[_CATEGORY_OF[ref]] += nbytes
        if inside:
            live += inside
            cats["temporaries"] += inside
        phase = self.phase
        if self.timeline is not None:
            if self._unit_in_bw and phase != "backward":  # backward ended: no block runs now
                self._unit, self._unit_in_bw = -1, False
            event = (_PHASE_INDEX[phase], self._unit, self._func, tuple(cats.values()))
            last = self.timeline[-1] if self.timeline else None
            # an operation that leaves every byte as it was (a metadata query, a view) tells nothing: not recorded
            # (how many of those run can differ between two depths: torch's prim.device, in bitsandbytes' layers)
            if last is None or last[0] != event[0] or last[1] != event[1] or last[3] != event[3]:
                self.timeline.append(event)
        if live > self.phase_peaks.get(phase, 0):
            self.phase_peaks[phase] = live
            self.phase_peak_categories[phase] = cats
        for name, nbytes in cats.items():
            if nbytes > self.category_peaks[name]:
                self.category_peaks[name] = nbytes
        if live > self.peak_bytes:
            self.peak_bytes = live
            self.peak_categories = cats

    def _counts(self, dev: Any) -> bool:
        if self.device is None:
            return True
        verdict = self._device_match.get(dev)
        if verdict is None:
            verdict = self._device_match[dev] = _same_device(torch.device(dev), self.device)
        return verdict

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient, and `register_hook` raises on a frozen one
        # (LoRA, quantized bases). Frozen parameters get no gradient: mark them as hooked already.
        if install_grad_hooks:
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        # Inside optimizer.step() MemTracker files every new tensor as optimizer state, so an AdamW
        # step's two fp32 temporaries of a parameter's size showed as state. File them as temporaries:
        # the post-step hook re-files what the optimizer keeps in `optimizer.state` as optimizer state.
        if reftype == _MemRefType.OPT and self._in_opt:
            reftype = _MemRefType.TEMP
        elif reftype == _MemRefType.ACT and self._casting_param:
            reftype = _MemRefType.TEMP
        super()._track(reftype, t)

    def _is_parameter(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        try:
            winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
        except (RuntimeError, NotImplementedError):
            return False
        return winfo is not None and winfo.reftype == _MemRefType.PARAM

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE_QUERY:
            # `tensor.device` of a fake tensor: no memory, and two of every three calls a trace dispatches (autograd
            # and the kernels ask each input's device). Skipping MemTracker's bookkeeping of it (a peak update per
            # call) made a 9-block plan 14% quicker; answering it here rather than in the fake mode below, 11% more.
            device = fake_device(func, args)
            return device if device is not None else func(*args, **(kwargs or {}))
        # Autocast casts each weight to 16 bits in forward and keeps the copy for backward. MemTracker
        # files it as an activation; it is a copy of a weight for the step's duration: a temporary.
        self._casting_param = func is torch.ops.aten._to_copy.default and bool(args) and self._is_parameter(args[0])
        self._func = func
        try:
            out = self._dispatch_tracked(func, types, args, kwargs)
        finally:
            self._casting_param = False
        if self.in_op_buffers and func in IN_OP_BUFFER_OPS:
            inside = in_op_bytes(func, args)
            if inside:
                self.in_op_calls += 1
                self._update_peak_stats(None, inside)  # the moment inside the op: its buffers and its output alive
                self._update_peak_stats(None)  # after it: the buffers freed
        return out

    def _dispatch_tracked(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """MemTracker's `__torch_dispatch__` (torch 2.13) with less Python per operation, the same bookkeeping: each
        output tensor tracked without rebuilding the output's tree (`tree_map_only`)."""
        if any(t is _DTENSOR for t in types):
            return NotImplemented
        if func is _WAIT_TENSOR and active_fake_mode() is not None:
            res = args[0]
        else:
            res = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:
            in_bw = self._mod_tracker.is_bw
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif in_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            else:
                for leaf in tree_flatten(res)[0]:
                    if isinstance(leaf, torch.Tensor):
                        self._track(reftype, leaf)
            self._update_peak_stats(_ModState.PEAK_BW if in_bw else _ModState.PEAK_FW)
        return res

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        # MemTracker refuses a second forward of the root module ("multiple iterative calls"). Gradient
        # accumulation and OOM retries do exactly that; we only need each module's latest forward.
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            del self.memory_tracking[module]
        if self.units is not None and id(module) in self.units:  # a block's forward (or its recomputation)
            self._unit = self.units[id(module)]
            self._unit_in_bw = self._mod_tracker.is_bw
        if self.module_stats:
            super()._pre_fw_hook(module, inputs)
            return
        # MemTracker's hook without its per-module figures (two deep-copied snapshots per module call, its inputs'
        # bytes): the parameters tracked, and a recomputation in backward marked, as it does
        if module not in self.memory_tracking:
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
            self.memory_tracking[module] = _ModMemStats(self._mod_tracker.get_known_fqn(module))
        elif self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        # In forward, a block's end leaves no block running; a recomputation inside backward stays in its block's
        # backward.
        if self.units is not None and id(module) in self.units and not self._mod_tracker.is_bw:
            self._unit = -1
        if self.module_stats:
            super()._post_fw_hook(module, inputs, outputs)
        elif self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.units is not None and module is not None and id(module) in self.units:  # a block's backward begins
            self._unit, self._unit_in_bw = self.units[id(module)], True
        if self.module_stats:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self.module_stats:
            super()._post_bw_hook(module, args)


@contextlib.contextmanager
def _quiet_storage_walk() -> Any:
    """Hide the one note torch's MemTracker gives while it walks a tensor's storages: "Expected a tensor or a traceable
    wrapper-subclass of tensor, but got ..." (torch.distributed._tools.common_utils.get_untyped_storages), for an
    object it skips and counts as nothing. It says nothing a user can act on; every other warning stays."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass of tensor",
                                category=UserWarning)
        yield


# The CUDA caching allocator rounds every block up to 512 bytes; MemTracker counts the same way.
_CUDA_MIN_BLOCK = 512


def _cuda_rounded(nbytes: int) -> int:
    return -(-nbytes // _CUDA_MIN_BLOCK) * _CUDA_MIN_BLOCK


# What CUDA operations allocate and free inside themselves (`in_op_bytes`), read from aten's CUDA kernels and measured
# on an emulated T4 (benchmarks/cuda_in_op_buffers.py, benchmarks/results/cuda/). SoftMax.cu: the forward kernels run
# on `input.contiguous()`, the backward ones on `grad.contiguous()` and `output.contiguous()` (a copy each where the
# tensor is strided), and softmax's backward first makes `tmp = grad * output`, a tensor of the gradient's size.
# SoftMax.cpp's `_safe_softmax` (what SDPA's math kernel runs) also holds a bool mask of its input's size, the rows that
# are all -inf and a scalar.
_ATEN = torch.ops.aten
_SOFTMAX_FORWARD = frozenset(getattr(_ATEN, name).default for name in ("_softmax", "_log_softmax", "_safe_softmax")
                             if hasattr(_ATEN, name))
_SOFTMAX_BACKWARD = frozenset(getattr(_ATEN, name).default for name in ("_softmax_backward_data", "_log_softmax_backward_data")
                              if hasattr(_ATEN, name))
_SAFE_SOFTMAX = _ATEN._safe_softmax.default if hasattr(_ATEN, "_safe_softmax") else None
_SOFTMAX_BACKWARD_DATA = _ATEN._softmax_backward_data.default
IN_OP_BUFFER_OPS = _SOFTMAX_FORWARD | _SOFTMAX_BACKWARD


def _copy_bytes(t: Any) -> int:
    """Return the bytes of `t.contiguous()`'s copy as CUDA's allocator holds them (0 where `t` is contiguous)."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return 0
    return _cuda_rounded(t.numel() * t.element_size())


def in_op_bytes(func: Any, args: Any) -> int:
    """Return the bytes CUDA's kernel of `func` allocates and frees inside itself for these arguments (0 if none known).

    Measured on an NVIDIA H200 emulating a T4 (torch 2.11, benchmarks/results/cuda/): a grouped-query Llama's math
    attention, fp32, 4 x 512, held 16,777,216 B inside `_softmax_backward_data` (`grad * output`: its (4, 4, 512, 512)
    fp32 gradient's size) and 4,203,008 B inside `_safe_softmax` (4,194,304 B of mask, 8,192 B of rows, a 512-byte
    scalar); `_log_softmax_backward_data` on contiguous tensors held nothing: what this returns for those calls.
    """
    if func in _SOFTMAX_BACKWARD:
        grad, output = args[0], args[1]
        inside = _copy_bytes(output)
        if func is _SOFTMAX_BACKWARD_DATA and isinstance(grad, torch.Tensor) and isinstance(output, torch.Tensor):
            itemsize = torch.promote_types(grad.dtype, output.dtype).itemsize
            return inside + _cuda_rounded(grad.numel() * itemsize)  # tmp = grad * output
        return inside + _copy_bytes(grad)
    if func in _SOFTMAX_FORWARD:
        x = args[0]
        inside = _copy_bytes(x)
        if func is _SAFE_SOFTMAX and isinstance(x, torch.Tensor) and x.dim() > 0:
            rows = x.numel() // max(1, x.size(args[1] if len(args) > 1 else -1))
            inside += _cuda_rounded(x.numel()) + _cuda_rounded(rows) + _CUDA_MIN_BLOCK
        return inside
    return 0


class _CudaRoundedInfo(_WeakRefInfo):
    """A storage record counted as the CUDA allocator would, whatever the storage's device."""

    def _calculate_mem_consumed(self) -> int:
        return _cuda_rounded(self.size * self.element_size)


def tensors_bytes(tensors: Any, *, cuda_rounding: bool = False) -> int:
    """Return the bytes the storages of `tensors` take, each storage once, as `TensorTracker` counts them (rounded up
    to the CUDA caching allocator's 512-byte blocks with `cuda_rounding`)."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            storages[id(s)] = s  # kept alive while counting: ids stay unique
    sizes = [s.nbytes() for s in storages.values()]
    return sum(_cuda_rounded(n) if cuda_rounding else n for n in sizes)


def _storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> int:
    nbytes = storage.nbytes()
    return _cuda_rounded(nbytes) if device.type == "cuda" else nbytes


class LiveBytesMode(NoDynamoWrap, TorchDispatchMode):
    """Count the live bytes of tensor storage and raise `torch.OutOfMemoryError` past a limit.

    Counts storages made by operations inside the mode and those registered with `track`; each
    storage once, released when it is garbage collected. No module or autograd hooks are installed.
    """

    def __init__(self, limit_bytes: int, *, device: torch.device | None = None) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes
        self.device = device
        self.live = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def _counts(self, device: torch.device) -> bool:
        return self.device is None or _same_device(device, self.device)

    def _add(self, t: torch.Tensor) -> None:
        if not self._counts(t.device) or t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return
        if storage in self._seen:
            return
        nbytes = _storage_bytes(storage, t.device)
        self._seen[storage] = weakref.finalize(storage, self._release, nbytes)
        self.live += nbytes

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, *objects: Any) -> None:
        """Count tensors made before the mode: modules (parameters, buffers, grads), optimizers, tensors."""
        for obj in tree_flatten(list(objects))[0]:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    self._add(p)
                    if p.grad is not None:
                        self._add(p.grad)
                for b in obj.buffers():
                    self._add(b)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            self._add(value)
            elif isinstance(obj, torch.Tensor):
                self._add(obj)
            elif obj is not None:
                raise TypeError(f"cannot track a {type(obj).__name__}; pass modules, optimizers or tensors")
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        before = self.live
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        if self.live > self.limit_bytes:
            live, requested = self.live, self.live - before
            del out  # the operation fails: what it made is released, as with a real OOM
            where = str(self.device) if self.device is not None else "all devices"
            raise torch.OutOfMemoryError(
                f"MemoryBudget exceeded on {where} in {func}: it asked for {requested:,} bytes, "
                f"which would make {live:,} bytes live against a limit of {self.limit_bytes:,} bytes "
                f"(emulated by colab_memopt.MemoryBudget, not a real allocator error)"
            )
        self.peak = max(self.peak, self.live)
        return out
