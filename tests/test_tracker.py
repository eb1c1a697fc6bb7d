"""Pins on the private MemTracker API the adapter relies on: an upgrade that changes it fails here."""

import os

import torch
from torch import nn

from colab_memopt.core.tracker import CATEGORIES, LiveBytesMode, TensorTracker


def test_private_names_we_use_exist():
    from torch.distributed._tools import mem_tracker

    assert {m.name for m in mem_tracker._MemRefType} == {"PARAM", "BUFFER", "GRAD", "ACT", "TEMP", "OPT", "OTH"}
    assert mem_tracker._TOTAL_KEY == "Total"
    for attr in ("_update_peak_stats", "_pre_fw_hook", "track_external", "get_tracker_snapshot", "memory_tracking"):
        assert hasattr(mem_tracker.MemTracker(), attr), attr
    tracker = mem_tracker.MemTracker()
    assert tracker._in_opt is False
    assert tracker._mod_tracker.is_bw is False
    assert mem_tracker._ModState.PRE_FW.value == "Pre-Forward"
    assert mem_tracker._ModState.POST_FW.value == "Post-Forward"


def test_linear_step_categories_exact():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    opt = torch.optim.AdamW(layer.parameters())
    x = torch.randn(16, 64)
    tracker = TensorTracker(device=torch.device("cpu"))
    tracker.track_external(layer, opt, x)
    with tracker:
        layer(x).square().sum().backward()
        opt.step()
        resident = tracker.current_categories()
    n = 64 * 32 + 32
    assert set(resident) == set(CATEGORIES)
    assert resident["parameters"] == 4 * n
    assert resident["gradients"] == 4 * n
    assert resident["optimizer_state"] == 8 * n + 4 * 2  # m, v, and a float32 step per tensor
    assert resident["other"] == x.numel() * 4
    assert tracker.phase_peaks["forward"] > 0 and tracker.phase_peaks["backward"] > 0
    assert tracker.phase_peaks["optimizer"] >= resident["optimizer_state"]
    assert tracker.peak_bytes == sum(tracker.peak_categories.values())


def test_two_forwards_in_one_step_are_allowed():
    # MemTracker alone raises NotImplementedError on a second root forward (gradient accumulation).
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    tracker = TensorTracker()
    tracker.track_external(model)
    with tracker:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
    assert tracker.current_categories()["gradients"] == 4 * sum(p.numel() for p in model.parameters())


def test_live_bytes_mode_counts_and_releases():
    mode = LiveBytesMode(limit_bytes=10**9)
    with mode:
        a = torch.zeros(1000)  # 4000 bytes
        assert mode.live == 4000
        b = a.view(10, 100)  # a view: same storage, counted once
        assert mode.live == 4000
        del a, b
    assert mode.live == 0
    assert mode.peak == 4000


def test_frozen_parameters_are_tracked_without_hooks():
    # MemTracker alone raises "cannot register a hook on a tensor that doesn't require gradient".
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tracker = TensorTracker()
    tracker.track_external(model, opt)
    with tracker:
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
        resident = tracker.current_categories()
    assert resident["parameters"] == 4 * (32 * 32 + 32 + 32 * 4 + 4)
    assert resident["gradients"] == 4 * (32 * 4 + 4)  # frozen weights get no gradient
    assert resident["optimizer_state"] == 8 * (32 * 4 + 4) + 4 * 2


def test_autocast_weight_copies_are_temporaries_not_activations():
    """Autocast keeps a 16-bit copy of each weight for backward: a copy of a parameter, filed as a temporary."""
    lin = torch.nn.Linear(256, 256, bias=False)
    x = torch.randn(4, 256, requires_grad=True)  # an inner layer's input: its backward needs the weight copy
    tracker = TensorTracker()
    tracker.track_external(lin)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        cats = tracker.current_categories()
        del y
    weight_copy = 256 * 256 * 2  # bytes of the bf16 weight
    assert cats["temporaries"] >= weight_copy
    assert cats["activations"] < weight_copy  # only the (4, 256) output and the input's bf16 copy


def test_the_storage_walks_note_is_hidden_while_tracking_and_only_then():
    """torch's MemTracker warns "Expected a tensor or a traceable wrapper-subclass of tensor" for an object its storage
    walk skips (notebooks showed it); nothing a learner can act on: hidden while the tracker runs, and only then."""
    import warnings

    from torch.distributed._tools.common_utils import get_untyped_storages

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with TensorTracker():
            assert get_untyped_storages(object()) == set()
        TensorTracker().track_as("other", torch.ones(2))
        inside = [str(w.message) for w in seen]
        get_untyped_storages(object())  # outside the tracker: torch's own note, as before
    assert inside == []
    assert any("Expected a tensor" in str(w.message) for w in seen)


def test_in_op_bytes_counts_what_cuda_softmax_kernels_hold_inside_themselves():
    """The figures of the emulated T4's math attention (benchmarks/results/cuda/): 16 MiB inside softmax's backward
    (`grad * output`), 4,203,008 B inside `_safe_softmax` (mask, rows, scalar); nothing inside a contiguous log-softmax
    backward; a strided input adds its contiguous copy."""
    from colab_memopt.core.tracker import in_op_bytes

    aten = torch.ops.aten
    scores = torch.empty(4, 4, 512, 512, device="meta")
    assert in_op_bytes(aten._softmax_backward_data.default, (scores, scores, -1, torch.float32)) == 16 * 2**20
    assert in_op_bytes(aten._safe_softmax.default, (scores, -1)) == 4_203_008
    half = torch.empty(4, 4, 512, 512, device="meta", dtype=torch.float16)  # fp16: grad * output in fp16, half the bytes
    assert in_op_bytes(aten._softmax_backward_data.default, (half, half, -1, torch.float16)) == 8 * 2**20
    assert in_op_bytes(aten._softmax_backward_data.default, (scores, half, -1, torch.float16)) == 16 * 2**20  # fp32 grad
    logits = torch.empty(2048, 512, device="meta")
    assert in_op_bytes(aten._log_softmax_backward_data.default, (logits, logits, 1, torch.float32)) == 0
    strided = torch.empty(512, 2048, device="meta").t()
    assert in_op_bytes(aten._log_softmax_backward_data.default, (strided, logits, 1, torch.float32)) == 4 * 2**20
    assert in_op_bytes(aten._softmax.default, (strided, 1, False)) == 4 * 2**20
    assert in_op_bytes(aten.mm.default, (logits, logits.t())) == 0


def test_the_tracker_counts_in_op_buffers_only_when_asked():
    aten_calls = []

    def step(tracker):
        x = torch.randn(8, 64, requires_grad=True)
        with tracker:
            torch.softmax(x, -1).sum().backward()
        aten_calls.append(tracker.in_op_calls)
        return tracker.peak_bytes

    plain = step(TensorTracker())
    counted = step(TensorTracker(in_op_buffers=True))
    assert aten_calls == [0, 1]  # softmax's backward: grad * output, 8 x 64 fp32
    assert counted - plain == 8 * 64 * 4


def test_the_trace_modes_dispatch_without_torchs_dynamo_wrapper():
    """torch 2.13 wraps each dispatch mode's __torch_dispatch__ in torch._disable_dynamo (two more Python frames per
    operation and mode, 10-18% of a plan's time): the tracker, the live-bytes mode, the Trainer trace's scalar mode and
    the planning fake-tensor mode opt out and run the methods as written, and the planning mode is a FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from colab_memopt.core.tracker import LiveBytesMode, TensorTracker, fake_tensor_mode, unwrapped_dispatch
    from colab_memopt.planning.trainertrace import _ScalarMode

    def dynamo_wrapped(method: object) -> bool:  # torch._disable_dynamo's `inner`, defined in torch/_compile.py
        return method.__code__.co_filename.endswith(os.path.join("torch", "_compile.py"))

    from torch.utils._python_dispatch import TorchDispatchMode

    wraps = getattr(TorchDispatchMode, "_should_skip_dynamo", lambda: False)()  # torch >= 2.13
    assert dynamo_wrapped(MemTracker.__torch_dispatch__) == wraps  # what the opt-out is for
    for cls in (TensorTracker, LiveBytesMode, _ScalarMode, type(fake_tensor_mode())):
        assert not dynamo_wrapped(cls.__torch_dispatch__), cls
    mode = fake_tensor_mode()
    assert isinstance(mode, FakeTensorMode)
    assert type(mode).__torch_dispatch__ is unwrapped_dispatch(FakeTensorMode)
    assert unwrapped_dispatch(MemTracker) is getattr(MemTracker.__torch_dispatch__, "__wrapped__", MemTracker.__torch_dispatch__)
    with mode:  # a plain fake step under it, counted by the tracker
        x = torch.empty(256, 256, requires_grad=True)
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(x)
        with tracker:
            (x * 2).sum().backward()
    assert tracker.peak_bytes >= 2 * 256 * 256 * 4


def test_the_lean_dispatch_keeps_memtrackers_books(monkeypatch):
    """TensorTracker runs MemTracker's per-operation bookkeeping itself, with less Python (`_dispatch_tracked`): on a
    real and on a fake step with checkpointing, both ways give the same peaks, categories and timeline. A torch
    whose MemTracker keeps other books fails here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import colab_memopt.core.tracker as tr

    lean_dispatch = TensorTracker._dispatch_tracked
    memtrackers = tr.unwrapped_dispatch(tr.MemTracker)

    def books(lean: bool, fake: bool) -> tuple:
        monkeypatch.setattr(TensorTracker, "_dispatch_tracked", lean_dispatch if lean else memtrackers)
        torch.manual_seed(0)
        with FakeTensorMode() if fake else torch.device("cpu"):
            model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            x = torch.randn(32, 64)
            opt = torch.optim.AdamW(model.parameters())
            tracker = TensorTracker(device=torch.device("cpu"), units={id(model[0]): 0, id(model[2]): 1})
            tracker.track_external(model, opt, x)
            with tracker:
                y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
                y.square().mean().backward()
                opt.step()
                opt.zero_grad()
        timeline = [(ph, unit, str(func), cats) for ph, unit, func, cats in tracker.timeline]
        return (tracker.peak_bytes, tracker.peak_categories, tracker.phase_peaks, tracker.category_peaks, timeline)

    for fake in (False, True):
        lean, theirs = books(True, fake), books(False, fake)
        assert lean == theirs and lean[0] > 0, fake


def test_the_trace_modes_answer_a_fake_tensors_device_as_the_fake_mode_does(monkeypatch):
    """`tensor.device` of a fake tensor, asked about twice per operation, is answered by the tracker and the scalar mode
    themselves (`fake_device`) instead of passing through to the fake mode: the same answer as torch's own handler
    (the tensor's device outside a kernel, meta inside), no answer for anything else, and a traced step's books the
    same either way."""
    from torch._subclasses import fake_tensor as ft

    import colab_memopt.core.tracker as tr
    from colab_memopt.planning import trainertrace

    device_query = torch.ops.prim.device.default
    mode = tr.fake_tensor_mode()
    with mode:
        t = torch.empty(4, 4)
    assert tr.fake_device(device_query, (t,)) == ft._device_handler((t,)) == torch.device("cpu")
    mode.in_kernel_invocation = True
    try:
        assert tr.fake_device(device_query, (t,)) == ft._device_handler((t,)) == torch.device("meta")
    finally:
        mode.in_kernel_invocation = False
    assert tr.fake_device(device_query, (torch.empty(2),)) is None  # a real tensor: the question goes on down
    assert tr.fake_device(torch.ops.aten.add.Tensor, (t, t)) is None

    asked, tr_fake_device = [], tr.fake_device

    def books(answer_here: bool) -> tuple:
        monkeypatch.setattr(tr, "fake_device", (lambda f, a: asked.append(f) or tr_fake_device(f, a)) if answer_here
                            else (lambda f, a: None))
        monkeypatch.setattr(trainertrace, "fake_device", tr.fake_device)
        with tr.fake_tensor_mode():
            model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            x = torch.randn(32, 64)
            tracker = TensorTracker(device=torch.device("cpu"), module_stats=False, units={id(model[0]): 0, id(model[2]): 1})
            tracker.track_external(model, x)
            with tracker, trainertrace._ScalarMode():
                y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
                loss = y.square().mean()
                assert loss.item() == 1.0
                loss.backward()
        return tracker.peak_bytes, tracker.peak_categories, tracker.phase_peaks, [str(e[2]) for e in tracker.timeline]

    assert books(True) == books(False)
    assert device_query in asked  # the step asked, and the modes answered


def _lora_like_step(tracker_cls):
    """A step as LoRA with checkpointing runs it: a frozen embedding whose output a forward hook makes a leaf that needs
    a gradient (peft's `enable_input_require_grads`), a block checkpointed without reentrance, a trainable adapter.
    Return whether the embedding's output is still alive after the step (and a collection)."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    emb.weight.requires_grad_(False)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base, self.adapter = nn.Linear(8, 8), nn.Linear(8, 8)
            self.base.requires_grad_(False)

        def forward(self, x):
            return self.base(x) + self.adapter(x)

    block = Block()
    emb.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    outputs = []
    emb.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    tracker = tracker_cls()
    with tracker:
        checkpoint(block, emb(torch.tensor([[1, 2, 3]])), use_reentrant=False).sum().backward()
    gc.collect()
    return outputs[0]() is not None, tracker


def test_the_tracker_lets_each_steps_graph_go():
    """torch's ModTracker hooks every module's inputs and the hook holds their autograd nodes: a cycle through C++ that
    kept the step's graph, and the embedding output LoRA with checkpointing makes a leaf, alive for good (one hidden
    state per step, two in a plan that traced two micro-batches). The tracker's module hooks let them go."""
    from torch.distributed._tools.mod_tracker import ModTracker

    kept, _ = _lora_like_step(ModTracker)
    assert kept  # torch's own module tracker: the cycle this guards against (if torch fixes it, this line says so)
    kept, tracker = _lora_like_step(TensorTracker)
    assert not kept
    assert tracker._mod_tracker.parents == {"Global"}  # every module left forward and backward


def test_the_all_gradients_hook_calls_as_torchs_does():
    """`_all_grads_hook` against torch's `register_multi_grad_hook` (its docstring's example): called once per
    backward, after every gradient that backward computes, with None for those it does not."""
    from torch.autograd.graph import register_multi_grad_hook

    from colab_memopt.core.tracker import _all_grads_hook

    def run(register):
        a = torch.rand(2, 3, requires_grad=True)
        b = torch.rand(2, 3, requires_grad=True)
        c, d = a * b, a * b
        calls = []
        register((a, b, c, d), lambda grads: calls.append([g is not None for g in grads]))
        c.sum().backward(retain_graph=True)
        c.sum().backward(inputs=(a,), retain_graph=True)
        return calls

    torch_calls = run(register_multi_grad_hook)
    assert torch_calls == [[True, True, True, False], [True, False, True, False]]
    assert run(_all_grads_hook) == torch_calls
