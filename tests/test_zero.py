import os
import sys

import pytest

import colab_memopt as cm
from colab_memopt import estimate, zero


def test_formulas_match_the_zero_paper_and_the_7b_example():
    # Rajbhandari et al. 2020: 2 + 2 + K/N, 2 + (2 + K)/N, (2 + 2 + K)/N bytes per parameter
    for stage, per_param in ((0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)):
        assert zero.zero_state_bytes(1, stage, 8)["total"] == pytest.approx(per_param)
    gb = [zero.zero_state_bytes(7e9, s, 8, optimizer_bytes=4)["total"] / 1e9 for s in range(4)]
    assert gb == pytest.approx([56, 31.5, 19.25, 7])
    assert zero.zero_state_bytes(100, 3, 2, weight_bytes=4, persistent_params=10)["parameters"] == 4 * (50 + 10)
    assert zero.zero_reduction_x(3, 64) == pytest.approx(16 / (16 / 64))


def test_formula_rejects_bad_input():
    with pytest.raises(ValueError, match="stage"):
        zero.zero_state_bytes(1, 4, 2)
    with pytest.raises(ValueError, match="world_size"):
        zero.zero_state_bytes(1, 1, 0)


@pytest.mark.parametrize("stage,off_opt,off_param", [(0, False, False), (1, False, False), (2, False, False), (3, False, False),
                                                     (1, True, False), (2, True, False), (3, True, False), (3, True, True)])
def test_config_for_every_stage_and_offload_is_accepted_by_deepspeed(stage, off_opt, off_param):
    recipe = cm.Recipe(zero_stage=stage, offload_optimizer=off_opt, offload_param=off_param)
    config = zero.deepspeed_config(recipe, micro_batch_size=2, grad_accum_steps=4, precision="bf16")
    z = config["zero_optimization"]
    assert z["stage"] == stage
    assert ("offload_optimizer" in z) == off_opt and ("offload_param" in z) == off_param
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 4
    assert config["bf16"] == {"enabled": True}


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="precision"):
        zero.deepspeed_config(cm.Recipe(zero_stage=1), precision="fp8")
    with pytest.raises(ValueError, match="micro_batch_size"):
        zero.deepspeed_config(cm.Recipe(zero_stage=1), micro_batch_size=0)
    with pytest.raises(ValueError, match="DeepSpeed rejects"):
        zero.validate_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 7}})


def test_recipe_zero_fields_are_validated():
    with pytest.raises(ValueError, match="zero_stage"):
        cm.Recipe(zero_stage=4)
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage"):
        cm.Recipe(offload_optimizer=True)
    with pytest.raises(ValueError, match="offload_param needs zero_stage=3"):
        cm.Recipe(zero_stage=2, offload_param=True)
    with pytest.raises(ValueError, match="optimizer='adamw'"):
        cm.Recipe(zero_stage=2, optimizer="sgd")
    assert cm.Recipe(zero_stage=2).uses_deepspeed and not cm.Recipe().uses_deepspeed


def test_offload_host_bytes_follow_deepspeed_estimator():
    ds = estimate.zero_offload_bytes(10**9, zero_stage=2, offload_optimizer=True)
    assert ds["host_bytes"] == 24 * 10**9 and ds["device_bytes"] == 2 * 10**9
    assert estimate.zero_offload_bytes(10**9, zero_stage=0, offload_optimizer=False)["host_bytes"] == 0


def test_plan_reports_host_ram_for_offload_recipes():
    p = cm.plan(lambda: cm.build_model("small"), 1, seq_len=32,
                recipe=cm.Recipe(zero_stage=2, offload_optimizer=True), find_max_batch=False)
    assert p.method == "analytic" and any("not traced" in w for w in p.warnings)
    line = [c for c in p.host_costs if c.name == "offloaded states"]
    assert line and line[0].bytes == 24 * cm.get_config("small").n_params
    assert p.by_category["optimizer_state"] == 0


def test_two_ranks_match_the_formulas():
    job = zero.ZeroJob(model_size="tiny", steps=2, stages=(1, 3), bucket_elements=200000, param_persistence_threshold=1000)
    result = zero.run_zero(job, world_size=2, timeout_s=240)
    n = result.n_params
    for rank in range(2):
        b1 = result.bytes_of("zero1", rank)
        assert b1["parameters"] == 4 * n and b1["optimizer_state"] == pytest.approx(12 * n / 2, rel=0.02)
        b3 = result.bytes_of("zero3", rank)
        want = zero.zero_state_bytes(n, 3, 2, weight_bytes=4, grad_bytes=4, optimizer_bytes=12, persistent_params=b3["persistent_params"])
        for cat in ("parameters", "gradients", "optimizer_state"):
            assert b3[cat] == pytest.approx(want[cat], rel=0.02)


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
    ({"timeout_s": -1}, "timeout_s must be > 0, got -1"),
])
def test_run_zero_names_bad_arguments_before_launching(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zero.run_zero(zero.ZeroJob(model_size="tiny", stages=(0,)), **kwargs)
    with pytest.raises(ValueError, match=r"ZeRO stages must be in \(0, 1, 2, 3\), got \[4\]"):
        zero.run_zero(zero.ZeroJob(model_size="tiny", stages=(4,)))


@pytest.mark.parametrize("stage,opt,param,ranks", [(1, False, False, 1), (2, True, False, 1), (2, False, False, 2),
                                                   (3, False, False, 2), (3, True, False, 1), (3, True, True, 2)])
def test_zero_estimate_without_deepspeed_matches_deepspeeds_own(monkeypatch, stage, opt, param, ranks):
    # Colab has no DeepSpeed (review A1): the estimate must not need it, and must say what DeepSpeed says.
    pytest.importorskip("deepspeed")
    kwargs = dict(zero_stage=stage, offload_optimizer=opt, offload_param=param, largest_layer_params=7 * 10**6,
                  world_size=ranks)
    with_ds = estimate.zero_offload_bytes(123_456_789, **kwargs)
    for name in ("deepspeed", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    assert estimate.zero_offload_bytes(123_456_789, **kwargs) == with_ds


def test_zero_settings_stand_in_for_a_recipe_and_share_its_checks():
    """zero works on its own (no Recipe needed): ZeroSettings gives the same config, with the same refusals."""
    for stage, off_opt, off_param in [(1, False, False), (2, True, False), (3, True, True)]:
        settings = zero.ZeroSettings(zero_stage=stage, offload_optimizer=off_opt, offload_param=off_param)
        recipe = cm.Recipe(zero_stage=stage, offload_optimizer=off_opt, offload_param=off_param)
        assert zero.deepspeed_config(settings, micro_batch_size=2) == zero.deepspeed_config(recipe, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"^offload_param needs zero_stage=3"):
        zero.ZeroSettings(zero_stage=2, offload_param=True)
    with pytest.raises(ValueError, match=r"^recipe.offload_param needs zero_stage=3"):
        cm.Recipe(zero_stage=2, offload_param=True)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got True"):
        zero.ZeroSettings(zero_stage=True)
    with pytest.raises(ValueError, match="lr must be > 0"):
        zero.ZeroSettings(lr=0)


# -- the engine Recipe.build makes applies the recipe, and measure_step measures it ----------------

_ENGINE_SCRIPT = r"""
import json, torch, colab_memopt as cm
from colab_memopt import zero
out = {}
for stage in (2, 3):
    recipe = cm.Recipe(zero_stage=stage, lr=0.0125, loss_chunk_tokens=8)
    engine, opt = recipe.build(cm.build_model("tiny", seed=0))
    step = cm.make_train_step(engine, opt, cm.load_corpus(), batch_size=2, seq_len=16, recipe=recipe)
    report = cm.measure_step(step, model=engine, optimizer=opt, repeat=1)
    x = next(cm.load_corpus().batches(2, 16))
    engine.backward(engine(x, labels=x).loss)
    held = zero.rank_state_bytes(engine)
    engine.step()
    out[stage] = {"stage": engine.zero_optimization_stage(), "chunk": engine.module.loss_chunk_tokens,
                  "lr": [g["lr"] for g in opt.param_groups], "measured": report.by_category, "peak": report.peak_bytes,
                  "held": held}
print("RESULT" + json.dumps(out))
"""


def test_zero_engine_applies_the_recipe_and_measure_step_reads_its_buffers():
    # In a fresh process: DeepSpeed starts a process group (one rank, gloo) that must not leak into other tests.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.split("RESULT", 1)[1])
    for stage, got in out.items():
        assert got["stage"] == int(stage) and got["chunk"] == 8 and set(got["lr"]) == {0.0125}
        # the tracker sees what DeepSpeed holds: the fp32 master partition and AdamW's m and v, the flat weights
        assert got["measured"]["optimizer_state"] == got["held"]["optimizer_state"]
        assert abs(got["held"]["optimizer_state"] - 12 * 120_576) <= 16  # (and the step counter)
        assert got["measured"]["parameters"] == got["held"]["parameters"] == 4 * 120_576
        assert got["peak"] >= 4 * zero.DEFAULT_BUCKET_ELEMENTS  # the reduce bucket, whatever the model's size


_SHM_SCRIPT = r"""
import sys
from colab_memopt.techniques import lomo, zero
lomo._ensure_process_group()  # a process group started before DeepSpeed's (LOMO's fp16 loss scaler starts one)
zero.init_distributed()
print("RESULT", sys.modules["deepspeed.comm.torch"].build_shm_op())
"""


def test_deepspeeds_cpu_only_comm_op_is_not_built_where_a_process_group_came_first():
    """DeepSpeed compiles a shared-memory all-reduce op for its CPU accelerator (30-50 s on 2 cores; a CUDA machine has
    no such op) when its comm starts. init_distributed skipped it only where it started the group itself: after LOMO's
    group, DeepSpeed's comm started later (at its engine, or at TrainingArguments(deepspeed=...)) and compiled it. In
    a fresh process: the process group must not leak into other tests."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # without the rank variables an earlier test's init_distributed left here (its group holds MASTER_PORT)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SHM_SCRIPT], capture_output=True, text=True, env=env, cwd=root,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("RESULT", 1)[1].split() == ["None"], run.stdout[-500:]


def test_a_lock_left_by_a_cut_short_op_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A cpu_adam build killed part-way (a restarted runtime) leaves `lock` in its build folder, and torch's loader
    waits on it without a limit: notebook 10 hung on one here. A leftover is removed, naming it; a build in progress
    (a young lock) is left alone; no lock, nothing done."""
    import os
    import time
    import warnings

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert zero.build_directory("cpu_adam") == tmp_path / "cpu_adam"
    assert zero.clear_stale_build_lock("cpu_adam") is None  # no folder, no lock: nothing created either
    assert not (tmp_path / "cpu_adam").exists()
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zero.clear_stale_build_lock("cpu_adam") is None and lock.exists()  # a build in progress
    old = time.time() - zero.STALE_BUILD_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match=r"removed .*cpu_adam/lock: a build of DeepSpeed's cpu_adam was cut short 16 min"):
        assert zero.clear_stale_build_lock("cpu_adam") == lock
    assert not lock.exists()


def test_the_default_build_folder_is_torchs(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    import torch.utils.cpp_extension as cpp

    expected = cpp._get_build_directory("cm_probe_op", False)  # torch's own (it creates the folder: removed after)
    try:
        assert str(zero.build_directory("cm_probe_op")) == expected
    finally:
        os.rmdir(expected)
