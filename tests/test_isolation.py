"""Planning never touches the run: the user's Trainer, its GradScaler, the RNGs and the process's modes are as they
were after every planning entry point, and a guarded fp16 run trains exactly as an unguarded one.

accelerate attaches a GradScaler for fp16=True on CUDA only; these tests attach the CPU one, as on CUDA
(../shared/reviews/cuda-readiness-2.md, R1: a plan left a fake scale in the real scaler and the T4 run trained nothing).
"""

from __future__ import annotations

import logging
import random

import numpy
import pytest
import torch

pytest.importorskip("trl")

from peft import LoraConfig  # noqa: E402
from test_guard import sft, train  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402
from trl import SFTConfig  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt.core.isolation import neutral_process_state, throwaway_scaler, trainer_kept  # noqa: E402
from colab_memopt.techniques.architectures import small_config  # noqa: E402

# The settings planned below: a small Llama in bf16 (as the built-in names load), 4 layers (the modes are what is
# tested; a 30-layer model only made each plan take 20 s)
LLAMA = small_config("llama", num_hidden_layers=4, dtype="bfloat16")


def _scaled_sft(**changes):
    t = sft(quantized_flag=True, fp16=True, **changes)
    t.accelerator.scaler = torch.amp.GradScaler("cpu")  # what accelerate builds for fp16=True on CUDA
    cm.guard.upcast_trainable(t.model)  # TRL's bf16 adapters to fp32, as the guard and fp16's GradScaler need
    return t


class _Losses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def _trainable(t):
    return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}


def _moved(before, t):
    return sum(not torch.equal(before[n].float(), p.float()) for n, p in t.model.named_parameters() if p.requires_grad)


def _run(t):
    losses = _Losses()
    t.add_callback(losses)
    before = _trainable(t)
    train(t)
    return _moved(before, t), len(before), losses.losses


def _fingerprint(t):
    """Everything of a Trainer a later train() reads, as comparable values."""
    tensors = {f"param:{n}": (p.detach().clone(), p.dtype, p.device, p.requires_grad, type(p).__name__, p.grad is None)
               for n, p in t.model.named_parameters()}
    tensors.update({f"buffer:{n}": (b.detach().clone(), b.dtype, type(b).__name__) for n, b in t.model.named_buffers()})
    scaler = t.accelerator.scaler
    scaler_state = {k: (type(v).__name__, v) for k, v in vars(scaler).items()} if scaler is not None else None
    opt = t.optimizer.state_dict() if t.optimizer is not None else None
    args = {k: repr(v) for k, v in vars(t.args).items()}
    return dict(
        tensors=tensors, scaler=scaler_state, scaler_id=id(scaler), optimizer=repr(opt),
        scheduler=repr(t.lr_scheduler.state_dict()) if t.lr_scheduler is not None else None,
        args=args, state=repr(vars(t.state)), control=repr(vars(t.control)),
        callbacks=[id(c) for c in t.callback_handler.callbacks],
        training=t.model.training, modules=[sorted(vars(m)) for m in t.model.modules()],
        hooks=[(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in t.model.modules()],
        rng=(torch.get_rng_state().clone(), random.getstate(), repr(numpy.random.get_state())),
        dataset=t.train_dataset[:], dtype=torch.get_default_dtype(), grad=torch.is_grad_enabled(),
    )


def _same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key == "tensors":
            assert x.keys() == y.keys()
            for name in x:
                assert torch.equal(x[name][0], y[name][0]) and x[name][1:] == y[name][1:], name
        elif key == "rng":
            assert torch.equal(x[0], y[0]) and x[1:] == y[1:], "an RNG state changed"
        elif key == "scaler" and x is not None:
            assert x.keys() == y.keys()
            for name in x:
                assert x[name][0] == y[name][0], f"GradScaler.{name} became a {y[name][0]}"
                if isinstance(x[name][1], torch.Tensor):
                    assert torch.equal(x[name][1], y[name][1]), f"GradScaler.{name} changed"
                else:
                    assert x[name][1] == y[name][1], f"GradScaler.{name} changed"
        else:
            assert x == y, f"{key} changed"


@pytest.mark.parametrize("entry", ["plan_trainer", "fit_trainer", "plan_trainer_changes", "doctor"])
def test_planning_a_real_trainer_leaves_every_part_of_it_as_it_was(entry):
    t = _scaled_sft()
    torch.manual_seed(123)
    random.seed(5)
    numpy.random.seed(7)
    before = _fingerprint(t)
    small = dict(name="small", device_bytes=2**20, host_bytes=2**34, cuda=True, compute_capability=(7, 5))
    if entry == "plan_trainer":
        cm.plan_trainer(t, target="t4")
    elif entry == "plan_trainer_changes":
        cm.plan_trainer(t, target="t4", per_device_train_batch_size=1, gradient_accumulation_steps=2)
    elif entry == "fit_trainer":
        cm.fit_trainer(t, target=small, max_plans=2)
    else:
        cm.doctor(t, target="t4")
    _same(before, _fingerprint(t))


@pytest.mark.parametrize("entry", ["plan_trainer", "fit_trainer", "guard"])
def test_a_planned_or_guarded_fp16_run_trains_as_the_unplanned_one(entry):
    """The review's R1 reproduction: 8 of 8 adapters move, with the unplanned run's losses, at loss scale 2^16."""
    logging.disable(logging.WARNING)
    plain = _scaled_sft()
    torch.manual_seed(0)
    moved, total, losses = _run(plain)
    assert moved == total == 8 and len(losses) == 2
    assert plain.accelerator.scaler.get_scale() == 2.0**16  # no overflow at this size: the scaled path really ran

    planned = _scaled_sft()
    if entry == "plan_trainer":
        cm.plan_trainer(planned, target="t4")
    elif entry == "fit_trainer":
        cm.fit_trainer(planned, target="t4", max_plans=2)
    else:
        planned.add_callback(cm.MemoryGuardCallback(target="t4", verbose=False))
    torch.manual_seed(0)
    moved2, total2, losses2 = _run(planned)
    assert type(planned.accelerator.scaler._scale) is torch.Tensor, type(planned.accelerator.scaler._scale)
    assert (moved2, total2) == (8, 8)
    assert losses2 == losses


def test_trainer_kept_puts_back_what_a_traced_step_changes():
    t = _scaled_sft()
    real = t.accelerator.scaler
    state, control, args = t.state, t.control, t.args
    with trainer_kept(t):
        assert t.accelerator.scaler is not real and t.accelerator.scaler.get_scale() == real._init_scale
        t.accelerator.scaler.scale(torch.ones(()))
        t.state.global_step = 99
        t.control.should_training_stop = True
        t.args.per_device_train_batch_size = 64
        t.args.new_field = 1
        t.callback_handler.callbacks.append(object())
        t.optimizer = "replaced"
        torch.rand(3)
    assert t.accelerator.scaler is real and real._scale is None
    assert t.state is state and state.global_step == 0 and t.control is control and not control.should_training_stop
    assert t.args is args and args.per_device_train_batch_size == 2 and not hasattr(args, "new_field")
    assert t.optimizer is None and not any(type(c) is object for c in t.callback_handler.callbacks)


def test_throwaway_scaler_has_the_settings_and_none_of_the_state():
    real = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    real.scale(torch.ones(()))
    copy = throwaway_scaler(real)
    assert copy._init_scale == 1024.0 and copy._growth_interval == 7 and copy._scale is None
    assert throwaway_scaler(None) is None


# -- the process's modes (cuda-readiness-2 section 4) ---------------------------------------------------------
_STATES = {
    "default dtype bf16": lambda: _default_dtype(torch.bfloat16),
    "default dtype float64": lambda: _default_dtype(torch.float64),
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "cpu bf16 autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "default device meta": lambda: _default_device("meta"),
}


class _default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


class _default_device:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.set_default_device(self.device)

    def __exit__(self, *exc):
        torch.set_default_device(None)


@pytest.fixture(scope="module")
def unplanned():
    plan = cm.plan("small", 4, seq_len=128, target="t4", find_max_batch=False, method="trace")
    args = SFTConfig("/tmp/cm_isolation", per_device_train_batch_size=2, max_length=64, use_cpu=True, bf16=False,
                     fp16=True, report_to=[])
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer_plan = cm.plan_trainer(args, model=LLAMA, lora=lora, target="t4")
    return plan.peak_bytes, trainer_plan.step_peak_bytes, args, lora


@pytest.mark.parametrize("state", sorted(_STATES))
def test_a_plan_depends_only_on_its_arguments_not_on_the_process_modes(state, unplanned):
    bytes_plan, bytes_trainer, args, lora = unplanned
    with _STATES[state]():
        got = cm.plan("small", 4, seq_len=128, target="t4", find_max_batch=False, method="trace").peak_bytes
        got_trainer = cm.plan_trainer(args, model=LLAMA, lora=lora, target="t4").step_peak_bytes
        still = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    assert got == bytes_plan
    assert got_trainer == bytes_trainer
    assert still == {"default dtype bf16": (torch.bfloat16, True, False),
                     "default dtype float64": (torch.float64, True, False),
                     "no_grad": (torch.float32, False, False),
                     "inference_mode": (torch.float32, False, True)}.get(state, (torch.float32, True, False))


def test_a_plan_under_the_callers_autocast_keeps_no_cast_weights_between_forward_and_recompute():
    recipe = cm.Recipe(precision="bf16-autocast", checkpointing="offload", loss_chunk_tokens=24)
    kwargs = dict(seq_len=64, recipe=recipe, target="cpu_like", find_max_batch=False, method="trace")
    kwargs["target"] = dict(name="cpu_like", device_bytes=2**34, host_bytes=2**34, cuda=False, cuda_context_bytes=0)
    alone = cm.plan(lambda: cm.build_model("tiny"), 4, **kwargs).peak_bytes
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cm.plan(lambda: cm.build_model("tiny"), 4, **kwargs).peak_bytes
        assert torch.is_autocast_enabled("cpu")
    assert inside == alone


def test_a_plan_reads_no_workspace_setting_from_this_machine(monkeypatch):
    base = cm.plan("small", 2, seq_len=64, target="t4", find_max_batch=False, method="trace").device_need_bytes
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "1")
    assert cm.plan("small", 2, seq_len=64, target="t4", find_max_batch=False, method="trace").device_need_bytes == base


def test_settings_plans_keep_the_rngs_although_a_trainer_seeds_the_process(unplanned):
    _, _, args, lora = unplanned
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    random.seed(1)
    python_before = random.getstate()
    cm.plan_trainer(args, model=LLAMA, lora=lora, target="t4")
    assert torch.equal(torch.rand(4), expected)
    assert random.getstate() == python_before


def test_neutral_process_state_restores_what_the_caller_set():
    with _default_dtype(torch.float64), torch.no_grad():
        with neutral_process_state():
            assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
            assert not torch.is_autocast_enabled("cpu")
        assert torch.get_default_dtype() == torch.float64 and not torch.is_grad_enabled()


def test_settings_plan_leaves_the_arguments_as_given(unplanned):
    _, _, args, lora = unplanned
    before = {k: repr(v) for k, v in vars(args).items()}
    lora_before = repr(lora)
    cm.plan_trainer(args, model=LLAMA, lora=lora, target="t4", per_device_train_batch_size=1)
    assert {k: repr(v) for k, v in vars(args).items()} == before and repr(lora) == lora_before
    assert isinstance(args, TrainingArguments)


def test_an_all_linear_lora_is_left_as_given_and_the_next_plan_puts_adapters_on_every_layer():
    """peft turns `target_modules="all-linear"` into the names of the model it wraps. A plan handed the caller's
    LoraConfig to peft: afterwards it named only the planned model's layers (`model.layers.0.self_attn.q_proj`, ...),
    so a deeper model planned next (fit_trainer's next candidate, the stack count's second copy) and the user's own
    SFTTrainer got adapters on those layers only: a plan with fewer adapter bytes, a run that trains fewer layers."""
    import copy

    args = SFTConfig("/tmp/cm_isolation_all_linear", per_device_train_batch_size=1, max_length=32, use_cpu=True,
                     bf16=False, report_to=[])
    lora = LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")
    fresh = cm.plan_trainer(args, model=LLAMA, lora=copy.deepcopy(lora), target="t4")
    cm.plan_trainer(args, model=small_config("llama", num_hidden_layers=2, dtype="bfloat16"), lora=lora, target="t4")
    assert lora.target_modules == "all-linear"
    again = cm.plan_trainer(args, model=LLAMA, lora=lora, target="t4")
    assert again.by_category == fresh.by_category and again.step_peak_bytes == fresh.step_peak_bytes


def test_a_plan_reads_and_leaves_no_bitsandbytes_optimizer_override():
    """transformers' Trainer registers its embeddings for 32-bit state in bitsandbytes' process-wide GlobalOptimManager
    whenever it builds an 8-bit optimizer; every later 8-bit optimizer reads them by parameter position. A plan left
    them behind (a GaLore 8-bit optimizer built afterwards kept 32-bit state), and read the caller's."""
    bnb = pytest.importorskip("bitsandbytes")
    manager = bnb.optim.GlobalOptimManager.get_instance()
    args = SFTConfig("/tmp/cm_isolation_bnb", per_device_train_batch_size=2, max_length=32, use_cpu=True, bf16=False,
                     report_to=[], optim="adamw_8bit")
    saved = dict(vars(manager))
    try:
        manager.initialize()
        clean = cm.plan_trainer(args, model=LLAMA, target="t4").step_peak_bytes
        assert manager.index2config == {} and manager.module_weight_config_triple == []  # the plan registered none
        stale = {(0, 1): {"optim_bits": 32}}
        manager.index2config.update(stale)
        assert cm.plan_trainer(args, model=LLAMA, target="t4").step_peak_bytes == clean  # and read none
        assert manager.index2config == stale and manager.module_weight_config_triple == []
    finally:
        manager.initialize()
        vars(manager).update(saved)


def test_the_collector_spares_the_callers_objects_during_a_plan_only(monkeypatch):
    """`collector_spared`: inside, what existed before is out of the collector's scans (frozen); after, it is
    collectable again, a cycle the caller dropped during the plan is collected, and objects the caller froze
    itself stay frozen (the block then leaves the collector alone). A planning call inside another asks nothing of
    the collector (its count of frozen objects walks each of them): the outer one froze, and unfreezes at its end."""
    import gc
    import weakref

    from colab_memopt.core import isolation
    from colab_memopt.core.isolation import collector_spared, isolated

    class Cycle:
        pass

    seen = []
    asked = []

    def caller_froze():
        asked.append(1)
        return gc.get_freeze_count() > 0

    monkeypatch.setattr(isolation, "_caller_froze", caller_froze)  # the real question (the session answers it)

    @isolated
    def entry():
        seen.append(gc.get_freeze_count())

    @isolated
    def outer():
        entry()
        entry()
        seen.append(gc.get_freeze_count())

    gc.unfreeze()  # the test session froze what it loaded (conftest.py): start as a user's process does
    try:
        garbage = Cycle()
        garbage.me = garbage
        gone = weakref.ref(garbage)
        with collector_spared():
            assert gc.get_freeze_count() > 0
            del garbage
            gc.collect()
            assert gone() is not None  # frozen: left alone for the duration
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert gone() is None
        entry()
        assert seen[0] > 0 and gc.get_freeze_count() == 0
        seen.clear()
        asked.clear()
        outer()
        assert len(asked) == 1 and len(seen) == 3 and min(seen) > 0 and gc.get_freeze_count() == 0, (asked, seen)
        seen.clear()
        gc.freeze()  # the caller's own
        frozen = gc.get_freeze_count()
        since = [Cycle() for _ in range(1000)]  # what a freeze inside the plan would add
        entry()
        assert seen[0] <= frozen and 0 < gc.get_freeze_count() <= frozen, (frozen, seen, len(since))
    finally:
        gc.freeze()
