"""CPU offloading (notebook 09): stream layers from host memory, move named tensors and optimizer state out and back.

- `LayerStreamer`: the blocks' weights live in host memory (pinned on CUDA); only the active blocks
  have device copies during forward and backward, the next ones prefetched (on a side stream on
  CUDA); gradients go back to the host copies, where `StreamingOptimizer` steps them.
- `OffloadManager`: named tensors moved to the host and back, with transfer statistics.
- `OptimizerStateOffloader`: the optimizer state moved off the device for phases without a backward
  pass (evaluation, generation) and restored ahead of the next step.

On the CPU, device and host are the same RAM. The streamer still keeps separate device copies (their
storage freed when a block is evicted) and does its host-side work out of sight of the tensor
tracker, so the tracker shows what a GPU would hold: the split is emulated there.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from colab_memopt.core.env import pick_device

STRATEGIES = ("keep", "cpu", "pinned_cpu", "int8", "drop")
INT8_BLOCK = 256  # values per absmax block of the int8 code


@contextlib.contextmanager
def host_side(emulated: bool) -> Iterator[None]:
    """Run host-side work unseen by tensor trackers when the host is emulated (device and host are the CPU).

    Suspends the active dispatch modes (the tracker's) and PyTorch's global optimizer-step hooks
    (MemTracker registers the stepped optimizer's state through them). A no-op on CUDA, where the
    tracker counts only the GPU anyway.
    """
    if not emulated:
        yield
        return
    from torch.optim import optimizer as optim_mod
    from torch.utils._python_dispatch import _disable_current_modes

    pre, post = dict(optim_mod._global_optimizer_pre_hooks), dict(optim_mod._global_optimizer_post_hooks)
    optim_mod._global_optimizer_pre_hooks.clear()
    optim_mod._global_optimizer_post_hooks.clear()
    try:
        with _disable_current_modes():
            yield
    finally:
        optim_mod._global_optimizer_pre_hooks.update(pre)
        optim_mod._global_optimizer_post_hooks.update(post)


def pinned_bytes(nbytes: int) -> int:
    """Return the host bytes torch's caching host allocator takes for a pinned tensor of `nbytes` bytes.

    It rounds every pinned allocation up to the next power of two and keeps freed blocks cached for
    reuse (PyTorch `ATen/core/CachingHostAllocator.h`, `PowerOf2Ceil(size)` below
    `pinned_max_round_threshold`, whose default is SIZE_MAX: `c10/core/AllocatorConfig.h`). So an 18 MiB
    pinned copy holds 32 MiB of host RAM.

    Example:
        >>> pinned_bytes(18 * 2**20) == 32 * 2**20
        True
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def held_host_bytes(t: torch.Tensor) -> int:
    """Return the host bytes `t` holds: its bytes, rounded as the caching host allocator rounds them if pinned."""
    nbytes = t.numel() * t.element_size()
    try:
        pinned = t.device.type == "cpu" and t.is_pinned()
    except (RuntimeError, NotImplementedError):  # a fake or meta tensor (the planner's trace): not pinned
        pinned = False
    return pinned_bytes(nbytes) if pinned else nbytes


def power_of_two_pieces(numel: int) -> list[int]:
    """Return `numel` split into counts of elements that are powers of two, largest first (its binary digits).

    With an element size that is a power of two (every torch dtype), each piece's bytes are a power of two,
    which the pinned allocator takes without rounding (`pinned_bytes`).
    """
    return [1 << i for i in range(numel.bit_length() - 1, -1, -1) if numel >> i & 1]


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t.detach())
    return out


# -- the offload manager --------------------------------------------------------------------------

@dataclass
class TransferStats:
    """Transfers each way, their bytes and mean time.

    Blocking copies are timed by the wall clock. Asynchronous copies on CUDA (non_blocking, side
    streams) are timed with CUDA events around them (`record_async`), since the wall clock would only
    see the launch; their time is added by `settle`, which waits for them and which
    `OffloadManager.get_statistics`, `LayerStreamer.stats` and the mean properties call.
    """

    to_host: int = 0
    to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    seconds_to_host: float = 0.0
    seconds_to_device: float = 0.0
    _pending: list = field(default_factory=list, repr=False, compare=False)

    def start_async(self, stream: Any = None) -> Any:
        """Return a CUDA event recorded on `stream` (default: the current one) before an asynchronous copy."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def record_async(self, start: Any, direction: str, stream: Any = None) -> None:
        """Close an asynchronous copy begun at `start` ('to_device' or 'to_host'); timed when settled."""
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._pending.append((start, end, direction))

    def settle(self) -> TransferStats:
        """Wait for the asynchronous copies recorded so far and add their GPU-timed seconds; return self."""
        for start, end, direction in self._pending:
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if direction == "to_device":
                self.seconds_to_device += seconds
            else:
                self.seconds_to_host += seconds
        self._pending.clear()
        return self

    @property
    def mean_seconds_to_host(self) -> float:
        self.settle()
        return self.seconds_to_host / self.to_host if self.to_host else 0.0

    @property
    def mean_seconds_to_device(self) -> float:
        self.settle()
        return self.seconds_to_device / self.to_device if self.to_device else 0.0


class OffloadManager:
    """Keep named tensors in host memory and bring them back on demand, counting every transfer.

    Example:
        >>> manager = OffloadManager()
        >>> manager.offload("U", U)                # host copy (pinned on CUDA); drop your device reference
        >>> U = manager.load("U", device)          # a fresh device copy
        >>> manager.get_statistics().to_host, manager.get_statistics().bytes_to_device
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._host: dict[str, torch.Tensor] = {}
        self.stats = TransferStats()

    def offload(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` to host memory under `name` (a separate copy, also when it is already on the CPU)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"offload needs a tensor, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"offload takes dense (strided) tensors, got {name!r} with layout {tensor.layout}; "
                             "call .to_dense() first")
        if tensor.device.type == "meta":
            raise ValueError(f"{name!r} is a meta tensor: it has a shape but no values to offload")
        start = time.perf_counter()
        self._host[name] = _host_copy(tensor, self.pin_memory and tensor.device.type == "cuda")
        self.stats.seconds_to_host += time.perf_counter() - start
        self.stats.to_host += 1
        self.stats.bytes_to_host += tensor.numel() * tensor.element_size()

    def load(self, name: str, device: str | torch.device, *, non_blocking: bool = False) -> torch.Tensor:
        """Return a device copy of the tensor offloaded under `name` (it stays on the host too)."""
        if name not in self._host:
            raise KeyError(f"no tensor offloaded under {name!r}; offloaded: {sorted(self._host)}")
        host = self._host[name]
        device = pick_device(device)  # names a bad device, or CUDA asked for without a GPU
        start = time.perf_counter()
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        if non_blocking and out.device.type == "cuda":  # time the copy itself, not its launch
            event = self.stats.start_async()
            out.copy_(host, non_blocking=True)
            self.stats.record_async(event, "to_device")
        else:
            out.copy_(host, non_blocking=non_blocking)
            self.stats.seconds_to_device += time.perf_counter() - start
        self.stats.to_device += 1
        self.stats.bytes_to_device += host.numel() * host.element_size()
        return out

    def remove(self, name: str) -> None:
        """Forget the host copy under `name`."""
        self._host.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._host

    def names(self) -> list[str]:
        return list(self._host)

    @property
    def host_bytes(self) -> int:
        """Return the bytes held in host memory (pinned copies rounded up to a power of two, as torch allocates them)."""
        return sum(held_host_bytes(t) for t in self._host.values())

    def get_statistics(self) -> TransferStats:
        """Return the transfer statistics so far (waiting for asynchronous copies to time them)."""
        return self.stats.settle()


# -- optimizer-state offload ----------------------------------------------------------------------

def int8_compress(t: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (int8 codes, fp32 absmax per block of `block` values): 1 byte per value + 4 per block."""
    flat = t.detach().reshape(-1).float()
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30)
    codes = torch.round(blocks / scale[:, None] * 127).to(torch.int8)
    return codes, scale


def int8_decompress(codes: torch.Tensor, scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return the tensor `int8_compress` coded, shaped and typed like `like`."""
    values = (codes.float() / 127 * scale[:, None]).reshape(-1)[: like.numel()]
    return values.view(like.shape).to(like.dtype)


class OptimizerStateOffloader:
    """Move an optimizer's state off the device between steps and bring it back before the next one.

    Strategies: 'keep' (nothing moves), 'cpu', 'pinned_cpu' (host copies; pinned ones transfer
    asynchronously on CUDA), 'int8' (compressed in place to 1 byte per value plus a 4-byte scale per
    256 values: lossy), 'drop' (deleted; the optimizer re-initialises it at its next step). 'keep',
    'cpu' and 'pinned_cpu' return the state bit-exact.

    Example:
        >>> off = OptimizerStateOffloader(opt, "cpu")
        >>> off.offload(); evaluate(...); off.restore(); train_step(...)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: str = "cpu") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.optimizer = optimizer
        self.strategy = strategy
        self.manager = OffloadManager(pin_memory=strategy == "pinned_cpu")
        self._compressed: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._moved: list[tuple[Any, str, torch.device]] = []
        self._side_stream: Any = None
        self._on_side_stream: list[torch.Tensor] = []
        self.offloaded = False

    def _big_tensors(self) -> Iterator[tuple[Any, str, torch.Tensor]]:
        for p, state in self.optimizer.state.items():
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    yield p, k, v

    def offload(self) -> None:
        """Move the state off the device according to the strategy."""
        if self.offloaded or self.strategy == "keep":
            self.offloaded = self.strategy != "keep"
            return
        if self.strategy == "drop":
            self.optimizer.state.clear()
        for i, (p, k, v) in enumerate(list(self._big_tensors())):
            if self.strategy in ("cpu", "pinned_cpu"):
                self.manager.offload(f"{i}:{k}", v)
                self._moved.append((p, k, v.device))
            else:  # int8: codes and scales replace the fp32 values on the device
                codes, scale = int8_compress(v)
                self._compressed[(i, k)] = (codes, scale, torch.empty(v.shape, dtype=v.dtype, device="meta"))
                self._moved.append((p, k, v.device))
            del self.optimizer.state[p][k]
        self.offloaded = True

    def restore(self, *, non_blocking: bool = False) -> None:
        """Bring the state back (with `non_blocking` on a side stream on CUDA: call `wait` before the step)."""
        if not self.offloaded:
            return
        stream_ctx: Any = contextlib.nullcontext()
        if non_blocking and torch.cuda.is_available() and any(d.type == "cuda" for _, _, d in self._moved):
            self._side_stream = self._side_stream or torch.cuda.Stream()
            stream_ctx = torch.cuda.stream(self._side_stream)
        with stream_ctx:
            for i, (p, k, device) in enumerate(self._moved):
                if self.strategy in ("cpu", "pinned_cpu"):
                    name = f"{i}:{k}"
                    self.optimizer.state[p][k] = self.manager.load(name, device, non_blocking=non_blocking)
                    self.manager.remove(name)
                else:
                    codes, scale, like = self._compressed.pop((i, k))
                    self.optimizer.state[p][k] = int8_decompress(codes, scale, like).to(device)
                if not isinstance(stream_ctx, contextlib.nullcontext):
                    self._on_side_stream.append(self.optimizer.state[p][k])
        self._moved.clear()
        self.offloaded = False

    def wait(self) -> None:
        """Make the current stream wait for a non-blocking restore (no-op on the CPU)."""
        if self._side_stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self._side_stream)
            # Made on the side stream, used on this one: tell the allocator, so that freeing them cannot hand
            # their blocks to the side stream while this stream still reads them (review D2).
            for t in self._on_side_stream:
                t.record_stream(current)
            self._on_side_stream.clear()

    @contextlib.contextmanager
    def offloaded_during(self) -> Iterator[None]:
        """Offload for the block (an evaluation, a generation), restore after it."""
        self.offload()
        try:
            yield
        finally:
            self.restore()

    def device_state_bytes(self) -> int:
        """Return the bytes of state (or int8 codes) left on the device."""
        live = sum(v.numel() * v.element_size() for _, _, v in self._big_tensors())
        codes = sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s, _ in self._compressed.values())
        return live + codes


# -- layer streaming ------------------------------------------------------------------------------

def check_streamable(model: nn.Module) -> None:
    """Raise ValueError when `model` has no `.blocks` to stream (pass blocks=[...] to `LayerStreamer` then)."""
    if not hasattr(model, "blocks"):
        raise ValueError(f"{type(model).__name__} has no .blocks: pass blocks=[...] to stream")


STREAMED_MESSAGE = ("this weight belongs to a block that streams from host memory (layer_offload_active): "
                    "its storage is empty between uses. Read weights through model.state_dict(), or end "
                    "streaming first with opt.streamer.materialize() (opt: the optimizer the build returned)")

# What may be asked of an evicted parameter: its metadata, its storage (which the streamer resizes), its
# gradient and hooks. Anything else would read the empty storage (a segfault in C++): it raises instead.
_METADATA_CALLS = frozenset({
    "__get__", "__set__", "__delete__", "__hash__", "__len__", "size", "dim", "ndimension", "numel", "nelement",
    "stride", "storage_offset", "element_size", "is_contiguous", "is_floating_point", "is_complex", "is_pinned",
    "untyped_storage", "data_ptr", "get_device", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "_is_view", "is_shared", "_typed_storage", "_version",
    "detach",  # a view, no read (module.state_dict detaches each parameter before its hook swaps in the host copy)
})


def _empty(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _guarded(func: Any, args: Any, kwargs: Any) -> Any:
    """Run `func` unless it would read a streamed tensor's empty storage (then raise, naming materialize())."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    with torch._C.DisableTorchFunctionSubclass():
        if name not in _METADATA_CALLS:
            leaves = [*args, *kwargs.values()]
            leaves += [x for a in leaves if isinstance(a, (list, tuple)) for x in a]
            if any(isinstance(a, (StreamedParameter, _StreamedView)) and _empty(a) for a in leaves):
                raise RuntimeError(STREAMED_MESSAGE)
        out = func(*args, **kwargs)
    if name == "detach" or func == torch.Tensor.data.__get__:  # an alias of the same storage: guarded too
        out = out.as_subclass(_StreamedView)
    return out


class _StreamedView(torch.Tensor):
    """`p.detach()` or `p.data` of a streamed parameter: the same storage, the same guard."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guarded(func, args, kwargs)


class StreamedParameter(nn.Parameter):
    """A streamed block's parameter: between uses its storage is empty, and reading it raises (naming
    `streamer.materialize()`) instead of reading freed memory. Loaded, it behaves as an nn.Parameter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guarded(func, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise RuntimeError("copy.deepcopy: " + STREAMED_MESSAGE)

    def __reduce_ex__(self, proto: Any) -> Any:
        raise RuntimeError("pickling (torch.save of the module): " + STREAMED_MESSAGE)


def _refuse_pickling(protocol: Any) -> Any:
    raise RuntimeError("torch.save(model) and copy.deepcopy(model) would take the streamed blocks' hooks and empty "
                       "weights along: save the weights with torch.save(model.state_dict(), path) (the trained host "
                       "copies), or end streaming first with opt.streamer.materialize() (opt: the optimizer the build "
                       "returned)")


def _refuse_apply(fn: Any, recurse: bool = True) -> Any:
    raise RuntimeError("model.to / .half / .float / .cuda move or cast every weight: " + STREAMED_MESSAGE)


def streamer_of(model: nn.Module) -> LayerStreamer | None:
    """Return the open `LayerStreamer` that streams `model`'s blocks, or None."""
    return next((s for m in model.modules() if (s := getattr(m, "_layer_streamer", None)) is not None
                 and not s.closed), None)


class LayerStreamer:
    """Stream a model's blocks between host and device memory during forward and backward.

    Every block's parameters keep a host copy (pinned on CUDA) that the optimizer updates; the
    parameters on the device are freed (their storage resized to 0) while the block is not active.
    A forward pre-hook loads a block before it runs and prefetches the next `prefetch_distance`
    blocks; at most `max_active_layers` used blocks stay loaded (least recently used evicted first);
    in backward the blocks load again in reverse order and each gradient is sent to the host copy as
    soon as it is complete. Outputs and gradients equal the non-offloaded model's: the same
    operations run on the same values.

    Device memory for the blocks' weights: about (max_active_layers + prefetch_distance) blocks.

    Args:
        model: a module with a `blocks` ModuleList (the reference model), or pass `blocks`.
        max_active_layers: used blocks kept loaded (>= 1); >= the number of blocks keeps all.
        prefetch_distance: blocks loaded ahead of the running one (>= 0).

    Example:
        >>> streamer = LayerStreamer(model, max_active_layers=2, prefetch_distance=1)
        >>> opt = streamer.optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        >>> train_step(model, opt, batch)
    """

    def __init__(self, model: nn.Module, max_active_layers: int, prefetch_distance: int = 1, *,
                 blocks: Iterable[nn.Module] | None = None) -> None:
        if isinstance(max_active_layers, bool) or not isinstance(max_active_layers, int) or max_active_layers < 1:
            raise ValueError(f"max_active_layers must be an integer >= 1, got {max_active_layers!r}")
        if isinstance(prefetch_distance, bool) or not isinstance(prefetch_distance, int) or prefetch_distance < 0:
            raise ValueError(f"prefetch_distance must be an integer >= 0, got {prefetch_distance!r}")
        if blocks is None:
            check_streamable(model)
            blocks = model.blocks
        self.model = model
        self.blocks = list(blocks)
        self.max_active_layers = max_active_layers
        self.prefetch_distance = prefetch_distance
        self.device = next(model.parameters()).device
        self.emulated = self.device.type == "cpu"
        pin = self.device.type == "cuda"
        if streamer_of(model) is not None:
            raise ValueError(f"{type(model).__name__}'s blocks already stream from host memory: stream a fresh model, "
                             "or end streaming first with opt.streamer.materialize()")
        self._params = [[p for p in b.parameters()] for b in self.blocks]
        self.host: dict[nn.Parameter, nn.Parameter] = {}
        with torch.no_grad():
            for ps in self._params:
                for p in ps:
                    self.host[p] = nn.Parameter(_host_copy(p, pin), requires_grad=p.requires_grad)
        self._loaded: OrderedDict[int, None] = OrderedDict()  # LRU of loaded blocks
        self._events: dict[int, Any] = {}
        self._pending_grads: dict[int, int] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._stats = TransferStats()
        self._handles: list[Any] = []
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._make_pre_forward(i)))
            self._handles.append(block.register_forward_hook(self._make_post_forward(i)))
            self._handles.append(block.register_full_backward_pre_hook(self._make_pre_backward(i)))
            for p in self._params[i]:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(i)))
            # The evicted parameters have no storage; the trained values are the host copies, so the
            # state dict reads those, and loading a state dict writes them (no 0-byte tensor is ever read or saved)
            for module in block.modules():  # each module's own: a submodule's state_dict() reads the host copies too
                if any(p in self.host for p in module.parameters(recurse=False)):
                    self._handles.append(module._register_state_dict_hook(self._make_state_dict_hook(module)))
            self._handles.append(block._register_load_state_dict_pre_hook(self._make_load_pre_hook(i), with_module=True))
            self._handles.append(block.register_load_state_dict_post_hook(self._make_load_post_hook(i)))
        self.closed = False
        model._layer_streamer = self  # (a plain attribute: `streamer_of` finds it, a second streamer refuses)
        model.__reduce_ex__ = _refuse_pickling  # torch.save(model): pickle looks it up on the instance first
        for module in (model, *self.blocks):  # model.to / .half / .cuda: refused before any module is converted
            module._apply = _refuse_apply
        for ps in self._params:  # reading an evicted one raises, naming materialize(), instead of faulting
            for p in ps:
                p.__class__ = StreamedParameter
        for i in range(len(self.blocks)):
            self._evict(i)

    @property
    def stats(self) -> TransferStats:
        """Return the transfer statistics so far (waiting for the side stream's copies to time them)."""
        return self._stats.settle()

    # -- moving blocks ---------------------------------------------------------------------
    def _load(self, i: int) -> None:
        if i in self._loaded or not 0 <= i < len(self.blocks):
            return
        start = time.perf_counter()
        ctx: Any = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            event = self._stats.start_async(self._stream) if self._stream is not None else None
            for p in self._params[i]:
                host = self.host[p]
                p.untyped_storage().resize_(host.numel() * host.element_size())
                p.data.copy_(host.data, non_blocking=self._stream is not None)
                self._stats.bytes_to_device += host.numel() * host.element_size()
            if self._stream is not None:  # timed on the GPU by events: the wall clock sees only the launch
                self._stats.record_async(event, "to_device", self._stream)
                self._events[i] = torch.cuda.Event()
                self._events[i].record(self._stream)
        self._stats.to_device += 1
        if self._stream is None:
            self._stats.seconds_to_device += time.perf_counter() - start
        self._loaded[i] = None

    def _ready(self, i: int) -> None:
        self._load(i)
        self._loaded.move_to_end(i)
        event = self._events.pop(i, None)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for p in self._params[i]:
                p.data.record_stream(current)

    def _evict(self, i: int) -> None:
        for p in self._params[i]:
            p.untyped_storage().resize_(0)
        self._loaded.pop(i, None)
        self._events.pop(i, None)

    def _trim(self, current: int | None, ahead: Iterable[int] = ()) -> None:
        """Evict least recently used blocks until at most max_active_layers are loaded besides the prefetched ones."""
        ahead = set(ahead)
        candidates = [j for j in self._loaded if j not in ahead and j != current]
        while len([j for j in self._loaded if j not in ahead]) > self.max_active_layers and candidates:
            self._evict(candidates.pop(0))

    def _ahead(self, i: int, direction: int) -> list[int]:
        return [j for j in range(i + direction, i + direction * (1 + self.prefetch_distance), direction) if 0 <= j < len(self.blocks)]

    # -- hooks ------------------------------------------------------------------------------
    def _make_pre_forward(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._ready(i)
            ahead = self._ahead(i, +1)
            for j in ahead:
                self._load(j)
            self._trim(i, ahead)
        return hook

    def _make_post_forward(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._pending_grads[i] = sum(p.requires_grad for p in self._params[i]) if torch.is_grad_enabled() else 0
            self._trim(None, self._ahead(i, +1))
        return hook

    def _make_pre_backward(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, grad_output: Any) -> None:
            self._ready(i)
            ahead = self._ahead(i, -1)
            for j in ahead:
                self._load(j)
            self._trim(i, ahead)
        return hook

    def _make_grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            host = self.host[p]
            start = time.perf_counter()
            with host_side(self.emulated), torch.no_grad():
                if host.grad is None:
                    host.grad = _host_copy(p.grad, self._stream is not None)
                else:
                    host.grad.add_(p.grad.to(host.device))
            self._stats.to_host += 1
            self._stats.bytes_to_host += p.grad.numel() * p.grad.element_size()
            self._stats.seconds_to_host += time.perf_counter() - start
            p.grad = None
            self._pending_grads[i] = self._pending_grads.get(i, 1) - 1
            if self._pending_grads[i] <= 0:
                self._trim(None, self._ahead(i, -1))
        return hook

    # -- reading, saving and loading the weights ------------------------------------------
    def _named(self, i: int) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.blocks[i].named_parameters(remove_duplicate=False) if p in self.host]

    def _make_state_dict_hook(self, owner: nn.Module) -> Callable[..., None]:
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            for name, p in owner.named_parameters(recurse=False):
                if p in self.host and prefix + name in state_dict:
                    state_dict[prefix + name] = self.host[p].detach()  # (on CUDA: the pinned host copy)
        return hook

    def _make_load_pre_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, *args: Any) -> None:
            self._load(i)  # storage to copy the loaded values into; the post hook hands them to the host copies
        return hook

    def _make_load_post_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, incompatible_keys: Any) -> None:
            with torch.no_grad():
                for _, p in self._named(i):
                    self.host[p].data.copy_(p.data)
            self._evict(i)
        return hook

    def materialize(self) -> nn.Module:
        """End streaming: copy the trained host weights into every block, remove the hooks; return the model.

        After it the model is an ordinary module again (all its weights on its device, readable, savable, trainable
        with an ordinary optimizer); the streaming optimizer refuses to step. While streaming, read and save the
        weights through `model.state_dict()` (it returns the host copies) and load them with `load_state_dict`;
        the blocks' parameters themselves have no storage between uses (reading one raises, naming this method;
        so do `copy.deepcopy` of the model and building a recipe on it again).

        Example:
            >>> model, opt = Recipe(layer_offload_active=1).build(model); train(...)
            >>> opt.streamer.materialize(); torch.save(model.state_dict(), "model.pt")
        """
        if self.closed:
            return self.model
        with torch.no_grad():
            for i in range(len(self.blocks)):
                self._load(i)
                for p in self._params[i]:
                    p.data.copy_(self.host[p].data)  # also blocks still loaded from before the last step
                    if self.host[p].grad is not None and p.requires_grad:
                        p.grad = self.host[p].grad.to(p.device)
        if self._stream is not None:
            self._stream.synchronize()
        self._events.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for ps in self._params:
            for p in ps:
                p.__class__ = nn.Parameter
        for module in (self.model, *self.blocks):
            module.__dict__.pop("_apply", None)
        self.model.__dict__.pop("__reduce_ex__", None)
        self.closed = True
        if getattr(self.model, "_layer_streamer", None) is self:
            del self.model._layer_streamer
        return self.model

    # -- the optimizer side -----------------------------------------------------------------
    def refresh(self) -> None:
        """Copy the host weights into the blocks still loaded (after the optimizer changed them)."""
        for i in list(self._loaded):
            self._evict(i)

    def host_parameters(self) -> list[nn.Parameter]:
        """Return the host copies of the streamed parameters (what the host optimizer steps)."""
        return list(self.host.values())

    def device_parameters(self) -> list[nn.Parameter]:
        """Return the parameters that stay on the device (embeddings, final norm, head)."""
        streamed = set(self.host)
        seen, out = set(), []
        for p in self.model.parameters():
            if p not in streamed and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def host_bytes(self) -> int:
        """Return the host bytes of the streamed weights and their gradients (pinned ones rounded up to a power of
        two, as torch's caching host allocator allocates them)."""
        return sum(held_host_bytes(h) + (held_host_bytes(h.grad) if h.grad is not None else 0) for h in self.host.values())

    def optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> StreamingOptimizer:
        """Return an optimizer over the device parameters and the host copies, from `factory(params)`."""
        return StreamingOptimizer(self, factory)

    def remove(self) -> None:
        """Load every block back, copy the host weights in, and remove the hooks (`materialize`)."""
        self.materialize()


def _scaled_step(optimizer: torch.optim.Optimizer, grad_scale: float) -> None:
    if grad_scale == 1.0:
        optimizer.step()
    elif getattr(optimizer, "takes_grad_scale", False):
        optimizer.step(grad_scale=grad_scale)
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        optimizer.step()


class StreamingOptimizer:
    """Two optimizers behind one `step`: one for the device parameters, one stepping the host copies on the host.

    `device_optimizer` is what a GPU holds state for (pass it to `measure_step`); the host one's state
    lives in host memory, as in ZeRO-Offload.
    """

    def __init__(self, streamer: LayerStreamer, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.streamer = streamer
        self.device_optimizer = factory(streamer.device_parameters())
        with host_side(streamer.emulated):
            self.host_optimizer = factory(streamer.host_parameters())

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.device_optimizer.param_groups + self.host_optimizer.param_groups

    @property
    def state(self) -> dict[Any, Any]:
        return {**self.device_optimizer.state, **self.host_optimizer.state}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.device_optimizer.zero_grad(set_to_none=set_to_none)
        with host_side(self.streamer.emulated):
            self.host_optimizer.zero_grad(set_to_none=set_to_none)

    takes_grad_scale = True  # `rounding.DynamicLossScaler` hands it the inverse loss scale (pure fp16)

    def step(self, *, grad_scale: float = 1.0) -> None:
        """Step both optimizers; `grad_scale` (pure fp16's inverse loss scale) reaches an `UpdateRounding` as its
        own argument (unscaled in fp32) and multiplies any other optimizer's gradients first."""
        if self.streamer.closed:
            raise RuntimeError("the layer streamer was materialized (streaming ended): step the model with an "
                               "ordinary optimizer, e.g. make_optimizer(name, model.parameters())")
        _scaled_step(self.device_optimizer, grad_scale)
        if self.streamer._stream is not None:
            # The host optimizer updates the pinned host weights in place: no copy from them may still be
            # in flight on the prefetch stream (review D3; the blocking gradient copies happen to drain it).
            self.streamer._stream.synchronize()
        with host_side(self.streamer.emulated):
            _scaled_step(self.host_optimizer, grad_scale)
        self.streamer.refresh()

    def host_state_bytes(self) -> int:
        """Return the bytes of the host optimizer's state."""
        return sum(v.numel() * v.element_size() for s in self.host_optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor))
