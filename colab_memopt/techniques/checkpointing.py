"""Activation checkpointing: keep fewer activations in forward, recompute them in backward.

Works on any model with a stack of repeated blocks (an `nn.ModuleList` of modules of one class):
the reference model's `blocks`, a transformers model's `model.layers` or `transformer.h`. A policy
patches the chosen blocks' `forward` in place, so parameter names and the state dict do not change,
and `remove_checkpointing` restores them. Policies (notebook 03):

- 'none': keep every activation.
- 'full': checkpoint every block: keep only each block's input, recompute the block in backward.
- 'every_n': checkpoint every `interval`-th block (checkpoint ratio 1/interval); the others keep
  their activations.
- 'segments': the literature's `checkpoint_interval`: keep the input of every `interval`-th block
  and recompute the `interval` blocks of a segment together in backward. Blocks must take the hidden
  states first and return them (or a tuple that starts with them), with the same other arguments.
- 'selective': checkpoint every block, but save the outputs of matmuls and attention kernels
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) and recompute only the cheap
  pointwise ops (LayerNorm, GELU, adds).
- 'offload': checkpoint every block as 'full' does, and keep each block's input (one tokens x hidden
  tensor) in host memory instead of on the device: `CheckpointOffloader`, read its figures with
  `checkpoint_offloader(model)` after a step. With `interval` k > 1, one input per segment of k blocks
  goes to the host (1/k of the host RAM), and backward recomputes the segment with each of its blocks
  checkpointed on the device (two-level checkpointing: k - 1 more block inputs on the device, one more
  forward per block).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from colab_memopt.techniques.offload import TransferStats, held_host_bytes, host_side, pinned_bytes, power_of_two_pieces

POLICIES = ("none", "full", "every_n", "segments", "selective", "offload")

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing saves: the expensive ones (FLOPs grow with h^2 or s^2).
SAVE_OPS: tuple[Any, ...] = tuple(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
        getattr(_aten, "_scaled_dot_product_efficient_attention", None),
        getattr(_aten, "_scaled_dot_product_flash_attention", None),
        getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    )
    if op is not None
)
_SAVE_OPS = set(SAVE_OPS)
_SAVE_OPS |= {getattr(op, "default") for op in SAVE_OPS if hasattr(op, "default")}
_ORIGINAL = "_cm_original_forward"
_OFFLOADER = "_cm_checkpoint_offloader"


def check_policy(policy: str, interval: int = 1) -> None:
    """Raise ValueError unless `policy` is one of POLICIES and `interval` an integer >= 1."""
    if policy not in POLICIES:
        raise ValueError(f"checkpointing policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"checkpoint interval must be an integer >= 1, got {interval!r}")


def _block_names(model: nn.Module) -> set[str]:
    """The block classes a transformers model names itself (`_no_split_modules`: its decoder layers)."""
    names = getattr(model, "_no_split_modules", None) or ()
    return {n for n in names if isinstance(n, str)}


def _is_stack(module: nn.Module, block_names: set[str]) -> bool:
    """Whether `module` is a stack of repeated blocks: a ModuleList of two or more modules of one class, or of the
    blocks the model names itself (a one-block transformers model has a stack of one)."""
    if not isinstance(module, nn.ModuleList) or not len(module) or len({type(m) for m in module}) != 1:
        return False
    return len(module) >= 2 or type(module[0]).__name__ in block_names


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """Return the model's stack of repeated blocks: the longest ModuleList of modules of one class.

    A transformers model's stack of one block (its `_no_split_modules` class) counts too. Raises
    ValueError when the model has no such ModuleList.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    names = _block_names(model)
    best: nn.ModuleList | None = None
    for module in model.modules():
        if _is_stack(module, names) and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to checkpoint (two or more "
                         "modules of one class, or a transformers model's decoder layers)")
    return best


def find_block_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """Return every stack of repeated blocks in `model`, in module order: each ModuleList of two or more modules
    of one class that have submodules of their own, not inside another such stack (an encoder-decoder such as
    T5 has two: the encoder's and the decoder's; a mixture of experts' expert list sits inside a block).

    The reference model's `blocks` is its only stack. Raises ValueError (`find_blocks`'s message) when there
    is none.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return [blocks]
    stacks: list[tuple[str, nn.ModuleList]] = []
    names = _block_names(model)
    for name, module in model.named_modules():
        if (_is_stack(module, names) and next(module[0].children(), None) is not None
                and not any(name.startswith(f"{outer}.") for outer, _ in stacks)):
            stacks.append((name, module))
    if not stacks:
        find_blocks(model)  # raises, naming the model
        return [find_blocks(model)]  # a stack of leaf modules (never a transformer's blocks)
    return [m for _, m in stacks]


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> Any:
    """Return the contexts that save matmul and attention outputs and recompute everything else."""
    return create_selective_checkpoint_contexts(_selective_policy)


def _checkpointed(forward: Callable[..., Any], *, selective: bool) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        extra = {"context_fn": selective_context_fn} if selective else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


# -- 'offload': the checkpoints in host memory ----------------------------------------------------

class _Offloaded:
    """One block input held in host memory, and its device copy once it is loaded back."""

    __slots__ = ("host", "shape", "index", "target", "device", "event", "__weakref__")

    def __init__(self, host: list[torch.Tensor], shape: torch.Size, index: int, target: torch.device) -> None:
        self.host = host  # flat pieces of power-of-two bytes (`offload.power_of_two_pieces`)
        self.shape = shape
        self.index = index
        self.target = target  # the device it came from and goes back to
        self.device: torch.Tensor | None = None
        self.event: Any = None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _host_bytes(entry: _Offloaded) -> int:
    """Return the host bytes an offloaded input takes as the pinned allocator allocates them."""
    return sum(pinned_bytes(_bytes(piece)) for piece in entry.host)


def _fake_mode_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Return the FakeTensorMode that made `t` (the planner's trace), else a null context."""
    mode = getattr(t, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


class CheckpointOffloader:
    """Keep checkpointed blocks' inputs in host memory between forward and backward.

    PyTorch's own mechanisms do the work: each block runs under `torch.utils.checkpoint.checkpoint`
    (non-reentrant), which saves the block's positional tensor inputs as saved tensors, inside a
    `torch.autograd.graph.saved_tensors_hooks` pair (the checkpoint's own hooks sit above it for
    everything saved inside the block, so these hooks see only the block's inputs). The pack hook
    copies the hidden states (the block's first argument; other inputs stay where they are) to host
    memory, pinned on CUDA, and the device tensor is freed; the unpack hook, called when backward
    recomputes the block, hands back a device copy and starts loading the previous block's input,
    the next one backward needs: on CUDA on a side stream (the compute stream waits on an event only
    when it uses it), so the copy overlaps the block's recomputation and backward.

    On the CPU, device and host are the same RAM: the host copy is still a real copy into a
    separate tensor, made out of sight of the tensor tracker (`offload.host_side`, as the layer
    streamer of notebook 09 does), so a measurement shows what a GPU would hold; the load back is a
    plain, synchronous copy, done at the same moments as on CUDA (one block ahead). Under the
    planner's FakeTensorMode the same code runs on fake tensors, so the trace is exact.

    Device memory of the checkpoints: at most two block inputs at a time (the one being recomputed
    and the one prefetched) instead of one per block; host memory: one per block (`peak_host_bytes`).

    Measured on the 2-core CPU (tests/test_checkpointing.py; tiny reference model, 6 blocks, 4 x 64
    tokens, fp32): the activation peak falls from 1,319,432 bytes under 'full' to 926,216, by the six
    inputs (393,216 bytes, now in host memory); gradients are bit-equal. The step's total peak did not
    move at that size: it falls at the end of backward, where the gradients dominate.

    Compared with what ships elsewhere:
    - `torch.autograd.graph.save_on_cpu` around the whole step (recipe.activation_compression=
      'cpu_offload' without checkpointing) moves every saved tensor to the host: no recomputation,
      but all of a block's saved activations (about 34 s*b*h bytes per layer in 16-bit, Korthikanti
      et al.) cross the bus twice and sit in host RAM, which is Colab's tighter limit (12.7 GB).
      Counted on the same step: 8,639,460 bytes in 157 saved tensors against 393,216 here (22x).
      (On the CPU its copy is `tensor.cpu()`, which returns the tensor itself: it moves nothing there.)
    - transformers (5.x) `model.activation_checkpointing_enable(offload=True)` wraps each layer's
      checkpoint in `save_on_cpu(pin_memory=True)`: the same bytes as here, but both copies run on
      the compute stream when the tensor is needed (no prefetch, so no overlap), with one device
      input fewer at a time than here (nothing is loaded ahead).

    Attributes:
        stats: transfers each way (`offload.TransferStats`: counts, bytes, seconds).
        peak_host_bytes: the most host bytes held at once since creation or `reset_peak` (on CUDA the
            copies are pinned, so each counts as torch's caching host allocator rounds it: the next power
            of two, `offload.pinned_bytes`).
        peak_pinned_host_bytes: the same peak with every copy rounded as a pinned one, wherever it ran:
            what the planner gives a CUDA target from a CPU trace. Freed pinned blocks stay cached by torch
            for the next step, so this much host RAM stays taken between steps too.
    """

    def __init__(self, prefetch: bool = True) -> None:
        self.prefetch = bool(prefetch)
        self.stats = TransferStats()
        self.peak_host_bytes = 0
        self.peak_pinned_host_bytes = 0
        self._entries: list[weakref.ref[_Offloaded]] = []  # this step's offloaded inputs, in forward order
        self._streams: dict[torch.device, Any] = {}

    # -- figures ----------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Return the bytes of block inputs held in host memory now (0 once backward freed the graph)."""
        return sum(held_host_bytes(piece) for e in self._live() for piece in e.host)

    @property
    def pinned_host_bytes(self) -> int:
        """Return the host bytes held now if every copy were pinned (CUDA), as the pinned allocator takes them."""
        return sum(_host_bytes(e) for e in self._live())

    def reset_peak(self) -> None:
        """Start counting `peak_host_bytes` (and `peak_pinned_host_bytes`) again from what is held now."""
        self.peak_host_bytes = self.host_bytes
        self.peak_pinned_host_bytes = self.pinned_host_bytes

    def _live(self) -> list[_Offloaded]:
        return [e for e in (ref() for ref in self._entries) if e is not None]

    # -- the hooks --------------------------------------------------------------------------
    def hooks(self, hidden: torch.Tensor) -> torch.autograd.graph.saved_tensors_hooks:
        """Return the saved-tensor hooks that offload `hidden` (and leave every other saved tensor alone)."""
        # A weak reference: autograd keeps the pack hook as long as the saved tensor, and a strong one
        # would keep the device tensor alive with it.
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, weakref.ref(hidden)), self._unpack)

    def _pack(self, hidden: weakref.ref[torch.Tensor], t: torch.Tensor) -> Any:
        if t is not hidden():
            return t  # another input (a mask, position embeddings shared by all blocks): kept as is
        if not any(ref() is not None for ref in self._entries):
            self._entries.clear()  # the previous step's graph is gone: a new step starts
        start = time.perf_counter()
        pin = t.device.type == "cuda"
        # On the CPU this is the emulated host: a separate copy the tracker does not see.
        with host_side(t.device.type == "cpu"), _fake_mode_of(t):
            # Pieces of power-of-two bytes: the pinned allocator rounds each allocation up to one (offload.pinned_bytes).
            flat, host, start_at = t.detach().reshape(-1), [], 0
            for n in power_of_two_pieces(t.numel()) or [0]:
                piece = torch.empty(n, dtype=t.dtype, device="cpu", pin_memory=pin)
                piece.copy_(flat[start_at:start_at + n], non_blocking=pin)  # ordered before t's memory is reused
                host.append(piece)
                start_at += n
        entry = _Offloaded(host, t.shape, len(self._entries), t.device)
        self._entries.append(weakref.ref(entry))
        self.stats.to_host += 1
        self.stats.bytes_to_host += _bytes(t)
        self.stats.seconds_to_host += time.perf_counter() - start
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.peak_pinned_host_bytes = max(self.peak_pinned_host_bytes, self.pinned_host_bytes)
        return entry

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self._load(packed)
        out, event = packed.device, packed.event
        packed.device, packed.event = None, None  # the recomputation owns it now; freed after it
        if event is not None:
            current = torch.cuda.current_stream(out.device)
            current.wait_event(event)
            out.record_stream(current)  # allocated on the side stream, used on this one
        if self.prefetch and packed.index > 0:
            previous = self._entries[packed.index - 1]()
            if previous is not None:
                self._load(previous)  # the block backward reaches next
        return out

    def _load(self, entry: _Offloaded) -> None:
        """Start copying `entry` back to its device (a no-op when it is already loaded)."""
        if entry.device is not None:
            return
        device = entry.target
        start = time.perf_counter()
        host = entry.host
        if device.type == "cuda":
            if device not in self._streams:  # one side stream per device, created once
                self._streams[device] = torch.cuda.Stream(device)
            stream = self._streams[device]
            stream.wait_stream(torch.cuda.current_stream(device))  # the forward's copy to the host is done
            with torch.cuda.stream(stream):
                entry.device = _joined(host, entry.shape, device, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(stream)
        else:
            # A separate device-side tensor, which the tracker counts, as a GPU would hold it.
            entry.device = _joined(host, entry.shape, device, non_blocking=False)
        self.stats.to_device += 1
        self.stats.bytes_to_device += sum(_bytes(piece) for piece in host)
        self.stats.seconds_to_device += time.perf_counter() - start


def _joined(pieces: list[torch.Tensor], shape: torch.Size, device: torch.device, *, non_blocking: bool) -> torch.Tensor:
    """Return one device tensor of `shape` filled from the host pieces, in order."""
    out = torch.empty(shape, dtype=pieces[0].dtype, device=device)
    flat, start = out.view(-1), 0
    for piece in pieces:
        flat[start:start + piece.numel()].copy_(piece, non_blocking=non_blocking)
        start += piece.numel()
    return out


def _offloaded(forward: Callable[..., Any], offloader: CheckpointOffloader) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if not args and "hidden_states" in kwargs:  # only positional inputs are saved tensors: pass it so
            args = (kwargs.pop("hidden_states"),)
        if not args or not isinstance(args[0], torch.Tensor):
            raise ValueError(
                "checkpointing policy 'offload' needs the block's hidden states as its first argument, got "
                f"{type(args[0]).__name__ if args else 'no positional argument'}"
            )
        with offloader.hooks(args[0]):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def checkpoint_offloader(model: nn.Module) -> CheckpointOffloader | None:
    """Return the `CheckpointOffloader` of a model under policy 'offload' (None under any other policy)."""
    for blocks in find_block_stacks(model):
        offloader = getattr(blocks, _OFFLOADER, None)
        if offloader is not None:
            return offloader
    return None


def _hidden(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _segment_forward(forwards: list[Callable[..., Any]]) -> Callable[..., Any]:
    """Return a forward that runs a segment of blocks under one checkpoint."""

    def run_segment(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out: Any = hidden
        for forward in forwards:
            out = forward(_hidden(out), *args, **kwargs)
        return out

    def run(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return run_segment(hidden, *args, **kwargs)
        return checkpoint(run_segment, hidden, *args, use_reentrant=False, **kwargs)

    return run


def _passthrough(example_out_is_tuple: list[bool]) -> Callable[..., Any]:
    def run(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        # The segment's first block already ran this block; hand its output on unchanged.
        if example_out_is_tuple[0] and not isinstance(hidden, tuple):
            return (hidden,)
        return hidden

    return run


def checkpointed_blocks(n_blocks: int, policy: str, interval: int = 1) -> list[int]:
    """Return the indices of the blocks whose inputs are the stored checkpoints under `policy`."""
    check_policy(policy, interval)
    if policy == "none":
        return []
    if policy in ("full", "selective", "offload"):
        return list(range(n_blocks))
    if policy == "every_n":
        return [i for i in range(n_blocks) if i % interval == interval - 1]
    return list(range(0, n_blocks, interval))  # segments: the first block of each segment


def apply_checkpointing(model: nn.Module, policy: str, interval: int = 1, *, keep_blocks: int = 0) -> nn.Module:
    """Apply a checkpointing policy to the model's repeated blocks, in place; return the model.

    Every stack of blocks gets the policy (`find_block_stacks`: an encoder-decoder's encoder and decoder);
    under 'offload' one `CheckpointOffloader` serves them all.

    Args:
        model: any module with a stack of repeated blocks (see `find_block_stacks`).
        policy: one of POLICIES.
        interval: for 'every_n', checkpoint blocks interval-1, 2*interval-1, ...; for 'segments',
            recompute `interval` consecutive blocks from one stored input.; for 'offload', one host copy per
            `interval` blocks, each block checkpointed again inside its segment.
        keep_blocks: for 'offload', how many blocks (the last ones, which backward reaches first) keep
            their input on the device as 'full' does; the others' inputs go to host memory. The split that
            uses both memories (`planner.offload_split` chooses it for a target).

    Example:
        >>> apply_checkpointing(build_model("small"), "selective")
    """
    check_policy(policy, interval)
    if isinstance(keep_blocks, bool) or not isinstance(keep_blocks, int) or keep_blocks < 0:
        raise ValueError(f"keep_blocks must be an integer >= 0, got {keep_blocks!r}")
    if keep_blocks and policy != "offload":
        raise ValueError(f"keep_blocks={keep_blocks} applies to policy 'offload' only, got policy {policy!r}")
    if keep_blocks and interval > 1:
        raise ValueError(f"keep_blocks={keep_blocks} splits one checkpoint per block between device and host: use "
                         f"interval=1 with it, or keep_blocks=0 with interval={interval}")
    if policy == "none":  # also fine on a model without repeated blocks
        if any(isinstance(m, nn.ModuleList) for m in model.modules()) or hasattr(model, "blocks"):
            with contextlib.suppress(ValueError):
                remove_checkpointing(model)
        return model
    stacks = find_block_stacks(model)  # every stack: an encoder-decoder's encoder and decoder both
    remove_checkpointing(model)
    for module in model.modules():  # the model's config and its stacks' own copies (T5's decoder has one)
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            # A KV cache filled in forward is global state the recomputation would fill again (with
            # different shapes): transformers turns it off for checkpointing too.
            config.use_cache = False
    total = sum(len(blocks) for blocks in stacks)
    if keep_blocks > total:
        raise ValueError(f"keep_blocks={keep_blocks} exceeds the model's {total} blocks")
    offloader = CheckpointOffloader() if policy == "offload" else None  # one for the model: inputs in forward order
    first_kept = total - keep_blocks  # the last blocks in forward order (backward reaches them first) stay on the device
    for blocks in stacks:
        _apply_to_stack(blocks, policy, interval, offloader, first_kept)
        first_kept -= len(blocks)
    return model


# What every `interval_pitfall` text starts with (a plan, which says the pitfall itself, keeps the build's warning quiet).
INTERVAL_PITFALL_PATTERN = r"checkpoint_interval \d+ (exceeds|covers)"


def interval_pitfall(policy: str, interval: int, n_blocks: int) -> str | None:
    """Return what a `checkpoint_interval` too large for a stack of `n_blocks` does under `policy` (None if fine):
    `apply_checkpointing` warns with it, and a plan lists it among its warnings."""
    if policy == "every_n" and interval > n_blocks:
        return (f"checkpoint_interval {interval} exceeds the model's {n_blocks} blocks: 'every_n' checkpoints "
                f"blocks {interval - 1}, {2 * interval - 1}, ..., so none is checkpointed and nothing is saved; "
                f"use an interval <= {n_blocks}")
    if policy == "offload" and 1 < n_blocks <= interval:
        return (f"checkpoint_interval {interval} covers all of the model's {n_blocks} blocks: 'offload' makes "
                f"one segment of them, so the host holds one input and the device every block's input, as "
                f"checkpointing 'full' does, with a third forward of each block (no second level); use an "
                f"interval < {n_blocks}")
    return None


def interval_pitfalls(model: nn.Module, policy: str, interval: int) -> list[str]:
    """Return `interval_pitfall` for each stack of `model`'s blocks the interval is too large for, once each (a model
    without repeated blocks has none: `apply_checkpointing` refuses it)."""
    if policy not in ("every_n", "offload"):
        return []
    try:
        stacks = find_block_stacks(model)
    except ValueError:
        return []
    found = [interval_pitfall(policy, interval, len(blocks)) for blocks in stacks]
    return list(dict.fromkeys(f for f in found if f is not None))


def _apply_to_stack(blocks: nn.ModuleList, policy: str, interval: int, offloader: CheckpointOffloader | None,
                    first_kept: int = 0) -> None:
    """Apply `policy` to one stack of blocks (`apply_checkpointing` calls it for each); under 'offload' the blocks
    from index `first_kept` on keep their inputs on the device."""
    pitfall = interval_pitfall(policy, interval, len(blocks))
    if pitfall is not None:
        warnings.warn(pitfall, RuntimeWarning, stacklevel=3)
    for block in blocks:
        setattr(block, _ORIGINAL, block.forward)
    if policy == "segments":
        is_tuple = [False]
        for start in range(0, len(blocks), interval):
            segment = list(blocks[start : start + interval])
            forwards = [getattr(b, _ORIGINAL) for b in segment]
            _install_segment(segment, _segment_forward(forwards), is_tuple,
                             "checkpointing 'segments' runs a segment's blocks with the first one's arguments, but {block} "
                             "hands {n} values on to the next block (T5 passes its position biases so): use checkpointing "
                             "'full', 'every_n' or 'selective'")
        return
    if policy == "offload" and interval > 1:
        setattr(blocks, _OFFLOADER, offloader)
        _offload_segments(blocks, interval, offloader, first_kept)
        return
    if policy == "offload":
        setattr(blocks, _OFFLOADER, offloader)
        for i, block in enumerate(blocks):
            block.forward = (_offloaded(getattr(block, _ORIGINAL), offloader) if i < first_kept
                             else _checkpointed(getattr(block, _ORIGINAL), selective=False))
        return
    chosen = set(checkpointed_blocks(len(blocks), policy, interval))
    for i, block in enumerate(blocks):
        if i in chosen:
            block.forward = _checkpointed(getattr(block, _ORIGINAL), selective=policy == "selective")


def _offload_segments(blocks: nn.ModuleList, interval: int, offloader: CheckpointOffloader | None,
                      first_kept: int) -> None:
    """'offload' with `interval` > 1: one host copy per segment of `interval` blocks, each block checkpointed inside.

    Backward recomputes a segment from its input (loaded back from the host) with every block in it checkpointed
    again, so the device holds the segment's block inputs (interval - 1 more than 'offload') and one block's
    activations at a time, and the host one input per segment (1/interval of 'offload'). Every block runs its forward
    three times instead of two. Blocks must take the hidden states first and hand on only them ('segments' too).
    """
    is_tuple = [False]
    for start in range(0, len(blocks), interval):
        segment = list(blocks[start : start + interval])
        inner = [_checkpointed(getattr(b, _ORIGINAL), selective=False) for b in segment]

        def run_segment(hidden: torch.Tensor, *args: Any, _inner: list[Callable[..., Any]] = inner, **kwargs: Any) -> Any:
            out: Any = hidden
            for forward in _inner:
                out = forward(_hidden(out), *args, **kwargs)
            return out

        outer = (_offloaded(run_segment, offloader) if offloader is not None and start < first_kept
                 else _checkpointed(run_segment, selective=False))
        _install_segment(segment, outer, is_tuple,
                         "checkpointing 'offload' with checkpoint_interval > 1 runs a segment's blocks with the first "
                         "one's arguments, but {block} hands {n} values on to the next block: use checkpoint_interval=1")


def _install_segment(segment: list[nn.Module], run: Callable[..., Any], is_tuple: list[bool], refusal: str) -> None:
    """Run the whole segment from its first block's forward (`run`); the other blocks pass their input through.

    A block that hands on more than its hidden states (T5's position biases) is refused with `refusal`, formatted
    with the block's class name and the number of values it returns.
    """
    def first_forward(*args: Any, **kwargs: Any) -> Any:
        out = run(*args, **kwargs)
        is_tuple[0] = isinstance(out, tuple)
        if is_tuple[0] and any(isinstance(t, torch.Tensor) for t in out[1:]):
            raise ValueError(refusal.format(block=type(segment[0]).__name__, n=len(out)))
        return out

    segment[0].forward = first_forward
    for block in segment[1:]:
        block.forward = _passthrough(is_tuple)


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo what `apply_checkpointing` installed on the blocks; return the model.

    Only blocks this module patched are touched, and each gets back the forward it had before, so a
    patch installed by another technique first (activation compression) survives.
    """
    for blocks in find_block_stacks(model):
        blocks.__dict__.pop(_OFFLOADER, None)
        for block in blocks:
            original = block.__dict__.pop(_ORIGINAL, None)
            if original is None:
                continue  # not checkpointed here: leave other patches alone
            if getattr(original, "__self__", None) is block and getattr(original, "__func__", None) is type(block).forward:
                block.__dict__.pop("forward", None)  # it was the class's own forward
            else:
                block.forward = original
    return model


def expected_stored_blocks(n_blocks: int, policy: str, interval: int = 1) -> float:
    """Return the analytic activation memory, in blocks' worth, kept for backward under `policy`.

    Units: one block's saved activations = 1. A block's input is `input_fraction` of that (see
    `expected_activation_fraction`). This counts whole blocks that keep everything, plus the
    recomputation window (one block, or one segment) alive during backward.
    """
    check_policy(policy, interval)
    if policy == "none":
        return float(n_blocks)
    if policy in ("full", "selective", "offload"):
        return 1.0
    if policy == "every_n":
        return float(n_blocks - len(checkpointed_blocks(n_blocks, policy, interval))) + 1.0
    return float(min(interval, n_blocks))


def expected_activation_bytes(
    block_bytes: int, input_bytes: int, n_blocks: int, policy: str, interval: int = 1, *, saved_bytes: int = 0
) -> int:
    """Return the analytic peak of block activations under `policy`, in bytes.

    stored = the inputs of the checkpointed blocks (or segments) + the blocks that keep everything
    + one recomputation window (a block, or a segment) alive during backward. For 'selective',
    `saved_bytes` per block (the matmul outputs it keeps) is added for every block.

    Args:
        block_bytes: one block's saved activations without checkpointing (measured or estimated).
        input_bytes: one block's input (B*T*h values).
        saved_bytes: per block, what 'selective' keeps in forward.
    """
    check_policy(policy, interval)
    if policy == "none":
        return n_blocks * block_bytes
    checkpoints = len(checkpointed_blocks(n_blocks, policy, interval))
    if policy == "full":
        return checkpoints * input_bytes + block_bytes
    if policy == "offload":  # on the device: the input being recomputed and the one loaded ahead
        return min(2, n_blocks) * input_bytes + block_bytes
    if policy == "selective":
        return n_blocks * (input_bytes + saved_bytes) + block_bytes
    if policy == "every_n":
        return checkpoints * input_bytes + (n_blocks - checkpoints) * block_bytes + block_bytes
    return checkpoints * input_bytes + min(interval, n_blocks) * block_bytes
