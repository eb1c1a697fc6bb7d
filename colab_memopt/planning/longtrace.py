"""What a plan traces for the long-context settings a Trainer user can write, on a machine without a GPU.

- TRL's `activation_offloading=True`: TRL builds `trl.models.activation_offloading.OffloadActivations` while it
  builds the Trainer, and that asks `torch.accelerator.current_accelerator()`, which is None on a machine without
  a GPU (`AttributeError: 'NoneType' object has no attribute 'type'`). The planner builds its Trainer without it
  and traces the step under `TracedActivationOffload`, which does on the planner's fake CPU tensors what TRL's
  hooks do on CUDA (TRL 1.16, streams on, pinned memory, its defaults): every tensor autograd saves of at least
  1,024 bytes that is not a parameter goes to host RAM; the last 5 stay on the device until their copy is done
  (the forward stash); a storage saved again while still stashed stays on the device until backward; nothing
  saved inside the LM head is moved; in backward each one comes back to the device and is freed after the next
  autograd node has run. Its host RAM is the pinned copies, each rounded as torch's caching host allocator
  rounds it (`offload.pinned_bytes`).
- `cm.long_context(...)`: installed into the planner's model (`install_long_context`), its offloaded layer inputs
  counted in host RAM (`offloaded_inputs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from colab_memopt.planning.prediction import Cost
from colab_memopt.techniques.offload import pinned_bytes

# TRL 1.16's defaults (get_act_offloading_ctx_manager): min_offload_size, max_fwd_stash_size
MIN_OFFLOAD_BYTES = 1024
FWD_STASH = 5
TRL_OFFLOAD_SOURCE = ("traced: TRL's activation offloading as it runs on CUDA (trl/models/activation_offloading.py: "
                      "saved tensors >= 1 KiB moved to pinned host memory, 5 kept in its forward stash)")


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


class TracedActivationOffload(saved_tensors_hooks):
    """TRL's `OffloadActivations` (streams, pinned memory) as CUDA runs it, on the planner's fake CPU tensors.

    No host copy is allocated (only its bytes are counted), so the trace shows what the GPU holds; `peak_host_bytes` is the most pinned host RAM the copies held at once.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params: set[Any] = set()
        self.tracker: dict[int, tuple[Any, int]] = {}  # id -> (the device tensor, or the host copy's bytes; bytes)
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.stored: dict[Any, int] = {}  # storage -> id while its device tensor is stashed
        self.tensor_id = 0
        self.node: Any = None
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.callback_queued = False
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> TracedActivationOffload:
        self.params = {_storage_key(p) for p in self.model.parameters()}
        self.tracker.clear()
        self.fwd_stash.clear()
        self.bwd_stash.clear()
        self.stored.clear()
        self.node, self.callback_queued = None, False
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self.fwd_stash.clear()
        self.bwd_stash.clear()
        super().__exit__(*args)

    def _pack(self, t: torch.Tensor) -> int:
        self.tensor_id += 1
        tid = self.tensor_id
        nbytes = t.numel() * t.element_size()
        key = _storage_key(t)
        if key in self.stored or nbytes < MIN_OFFLOAD_BYTES or isinstance(t, nn.Parameter) or key in self.params:
            self.tracker[tid] = (t, 0)  # kept on the device until backward
            if key in self.stored:
                self.stored[key] = tid
            return tid
        if 0 not in t.stride() and (not t.is_contiguous() or t.storage_offset() != 0):
            t = t.clone(memory_format=torch.contiguous_format)  # TRL clones such views on the device first
        for old in [i for i in self.fwd_stash if i <= tid - FWD_STASH]:
            stashed = self.fwd_stash.pop(old)
            self.stored.pop(_storage_key(stashed), None)
        copy_bytes = t.untyped_storage().nbytes() if 0 in t.stride() else nbytes
        held = pinned_bytes(copy_bytes)
        self.host_bytes += held
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        self.tracker[tid] = ((t.shape, t.stride(), t.dtype, copy_bytes), held)
        self.fwd_stash[tid] = t
        self.stored[key] = tid
        return tid

    def _unpack(self, tid: int) -> torch.Tensor:
        value, held = self.tracker.pop(tid)
        if not held:
            return value
        shape, stride, dtype, copy_bytes = value
        self.host_bytes -= held
        if not self.callback_queued:  # at the end of backward TRL drops what its backward stash still holds
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.fwd_stash.clear()  # in backward now: TRL drops its forward stash
        self.stored.clear()
        # the copy back, on the device (counted by the tracker)
        out = torch.empty_strided(shape, stride, dtype=dtype) if 0 not in stride else torch.empty(
            copy_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype).as_strided(shape, stride)
        node = torch._C._current_autograd_node()
        if node is not None:
            previous = list(self.bwd_stash) if node is not self.node else []
            self.node = node
            self.bwd_stash[tid] = out

            def drop(outputs: Any, inputs: Any, _ids: list[int] = previous) -> Any:
                for i in _ids:
                    self.bwd_stash.pop(i, None)
                return outputs

            node.register_hook(drop)
        return out

    def _end_of_backward(self) -> None:
        self.bwd_stash.clear()
        self.callback_queued = False


def _head(model: nn.Module) -> nn.Module | None:
    """Return the module TRL keeps out of offloading (`get_act_offloading_ctx_manager`'s output-head search)."""
    unwrapped = getattr(model, "module", model)
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    for name in ("output", "lm_head"):
        head = getattr(unwrapped, name, None)
        if isinstance(head, nn.Module):
            return head
    return None


class _NoOffload(saved_tensors_hooks):
    def __init__(self) -> None:
        super().__init__(lambda t: t, lambda t: t)


@contextlib.contextmanager
def trl_activation_offloading(trainer: Any, args: Any, *, cuda: bool, notes: list[str]) -> Iterator[
        TracedActivationOffload | None]:
    """Trace the step with TRL's activation offloading as the target runs it, for the duration; yield the emulation
    (None where the settings do not ask for it, or on a CPU target, where TRL moves nothing)."""
    if not getattr(args, "activation_offloading", False) or not hasattr(trainer, "maybe_activation_offload_context"):
        yield None
        return
    if not cuda:
        notes.append("activation_offloading=True on the CPU: TRL moves nothing there (and cannot build its Trainer "
                     "on a machine without a GPU); planned without it")
        saved = trainer.maybe_activation_offload_context
        trainer.maybe_activation_offload_context = contextlib.nullcontext()
        try:
            yield None
        finally:
            trainer.maybe_activation_offload_context = saved
        return
    emulated = TracedActivationOffload(trainer.model)
    handles = []
    head = _head(trainer.model)
    if head is not None:
        noop = _NoOffload()
        handles = [head.register_forward_pre_hook(lambda *a: noop.__enter__()),
                   head.register_forward_hook(lambda *a: noop.__exit__(None, None, None), always_call=True)]
    saved = trainer.maybe_activation_offload_context
    trainer.maybe_activation_offload_context = emulated
    try:
        yield emulated
    finally:
        trainer.maybe_activation_offload_context = saved
        for h in handles:
            h.remove()


def activation_offload_cost(emulated: TracedActivationOffload | None) -> list[Cost]:
    """Return the host-RAM line of TRL's offloaded activations (none where nothing was offloaded)."""
    if emulated is None or not emulated.peak_host_bytes:
        return []
    return [Cost("offloaded activations", emulated.peak_host_bytes, TRL_OFFLOAD_SOURCE)]


@contextlib.contextmanager
def offloaded_inputs(model: nn.Module, *, cuda: bool) -> Iterator[list[Cost]]:
    """Yield a list that, after the block, holds the host-RAM line of the layer inputs `cm.long_context` offloaded
    in the trace; the offloader's own figures are put back as they were (the user's model keeps its counts)."""
    from colab_memopt.techniques.checkpointing import checkpoint_offloader

    costs: list[Cost] = []
    offloader = checkpoint_offloader(getattr(model, "get_base_model", lambda: model)())
    if offloader is None:
        yield costs
        return
    saved = dict(vars(offloader))
    saved_stats = vars(offloader.stats).copy()
    offloader.peak_host_bytes = offloader.peak_pinned_host_bytes = 0
    try:
        yield costs
        peak = offloader.peak_pinned_host_bytes if cuda else offloader.peak_host_bytes
        if peak:
            costs.append(Cost("offloaded checkpoints", peak, "traced: the layer inputs cm.long_context keeps in host "
                              "RAM" + (" (pinned copies, as torch's caching host allocator takes them)" if cuda else "")))
    finally:
        vars(offloader).clear()
        vars(offloader).update(saved)
        vars(offloader.stats).clear()
        vars(offloader.stats).update(saved_stats)
