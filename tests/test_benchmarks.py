"""benchmarks/planner_accuracy.py: which configurations it runs and how it judges them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location("planner_accuracy", Path(__file__).resolve().parent.parent / "benchmarks" / "planner_accuracy.py")
pa = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pa)


def test_grids_include_foreach_rows_and_only_valid_batches():
    cpu = torch.device("cpu")
    rows = pa._configs("all", cpu)
    impls = {r[4] for r in rows}
    assert impls == {"single-tensor", "foreach"}
    assert all(b >= f.get("accumulation_steps", 1) for _, b, _, f, _ in rows)
    cuda = pa._configs("cuda", cpu)
    assert {r[4] for r in cuda} == {"foreach"} and ("smollm2-135m", 1, 512, {}, "foreach") in cuda
    # no reference size whose every step is far below 64 MiB; QLoRA's dequantization is checked on CUDA
    assert not {r[0] for r in cuda} & {"tiny", "small"}
    assert any(r[3].get("quantization") == "nf4" for r in cuda)


def test_cuda_rows_compare_like_with_like():
    # the foreign-corrected measurement against Plan.step_peak_bytes: both without the fixed workspaces
    import inspect

    src = inspect.getsource(pa.main)
    assert "predicted.step_peak_bytes if cuda" in src and "measured = report.peak_bytes" in src
    assert "predicted.step_peak_bytes < CUDA_SMALL_BYTES" in src  # rows of 64 MiB and more


def test_the_grid_plans_and_builds_on_the_cpu_on_a_gpu_machine():
    # cuda-run-1 #2: _factory(size) passed device=None, which build_model reads as 'auto' (CUDA on a GPU machine):
    # the plan moved a meta model to CUDA and the crash stopped the grid at its first row
    from unittest import mock

    import bitsandbytes  # noqa: F401 - imported before the mock, as on a GPU machine

    from colab_memopt import planner

    with mock.patch("torch.cuda.is_available", return_value=True):
        assert {p.device.type for p in pa._factory("tiny")().parameters()} == {"cpu"}
        p = planner.plan(pa._factory("tiny"), 1, seq_len=32, target="t4", find_max_batch=False, method="trace")
    assert p.method == "trace" and p.peak_bytes > 0


def test_a_run_labelled_emulating_t4_emulates_it_in_its_own_process():
    # cuda-run-1 #2: gpucheck labels the grid "<gpu> emulating t4"; the grid must then run the T4's code paths
    from unittest import mock

    import pytest

    cuda = torch.device("cuda")
    with mock.patch.object(pa.cm, "pick_device", return_value=cuda), \
            mock.patch.object(pa.env, "apply_emulation", return_value="t4") as emulate, \
            mock.patch.object(pa.env, "device_label", return_value="NVIDIA H100 80GB HBM3 emulating t4"):
        device, name = pa._device("NVIDIA H100 80GB HBM3 emulating t4")
    emulate.assert_called_once_with(cuda, "t4")
    assert device == cuda and name == "cuda (NVIDIA H100 80GB HBM3 emulating t4)"
    with mock.patch.object(pa.env, "apply_emulation", return_value=None) as emulate:
        assert pa._device("") == (torch.device("cpu"), f"cpu ({pa.platform.machine()})")
    emulate.assert_called_once_with(torch.device("cpu"), None)  # unlabelled: CM_EMULATE decides
    with pytest.raises(SystemExit, match="says emulating t4, but cpu cannot emulate it"):
        pa._device("cpu emulating t4")


def test_pass_rule_is_one_percent_on_cpu_and_five_percent_on_cuda():
    MiB = 2**20
    assert pa._passes({"rel_error_pct": 0.9, "measured_bytes": MiB, "abs_error_bytes": 0}, cuda=False)
    assert not pa._passes({"rel_error_pct": 1.1, "measured_bytes": MiB, "abs_error_bytes": 0}, cuda=False)
    big = 100 * MiB
    assert pa._passes({"rel_error_pct": -4.9, "measured_bytes": big, "abs_error_bytes": -4.9 * MiB}, cuda=True)
    assert not pa._passes({"rel_error_pct": 5.1, "measured_bytes": big, "abs_error_bytes": 5.1 * MiB}, cuda=True)



def test_optimizer_quality_keeps_the_default_ranks_share_of_the_capacity_width():
    spec = importlib.util.spec_from_file_location("optimizer_quality", Path(__file__).resolve().parent.parent / "benchmarks" / "optimizer_quality.py")
    oq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oq)
    assert oq.rank_for("galore_adamw8bit_in_backward", 128) == 8  # 128 of 2048 -> 8 of 128
    assert oq.rank_for("apollo", 128) == 16 and oq.rank_for("apollo", 2048) == 256
    assert oq.rank_for("apollo_mini", 128) is None and oq.rank_for("adamw", 128) is None
    assert oq.BASELINE in oq.OPTIMIZERS_COMPARED


def test_bf16_rows_are_left_out_of_a_t4_emulation_and_say_why():
    """cuda-readiness-2, R2: a T4 plans bf16 attention as math (no bf16 kernel before sm_80), while the emulating H100
    runs its own bf16 memory-efficient kernel: those rows measure no T4. They are left out, counted, with the reason."""
    from unittest import mock

    cuda = torch.device("cuda", 0)
    bf16_rows = [r for r in pa._configs("cuda", torch.device("cpu")) if str(r[3].get("precision", "")).startswith("bf16")]
    assert len(bf16_rows) == 5
    with mock.patch.object(pa.env, "emulated_gpu", return_value="t4"):
        assert all(pa.emulates_t4_without_bf16(cuda, r[3]) for r in bf16_rows)
        assert not pa.emulates_t4_without_bf16(cuda, {"precision": "fp16-autocast"})
        assert not pa.emulates_t4_without_bf16(torch.device("cpu"), {"precision": "bf16-autocast"})
    with mock.patch.object(pa.env, "emulated_gpu", return_value=None):  # CM_EMULATE=none: the GPU as it is
        assert not any(pa.emulates_t4_without_bf16(cuda, r[3]) for r in bf16_rows)
    assert "no bf16" in pa.BF16_UNDER_EMULATION


def test_an_8b_qlora_sft_trainer_is_planned_to_fit_a_t4_at_40960_tokens_within_colab_host_ram():
    """Issue 45's goal, from benchmarks/trainer_long_context.py's rows: Llama-3.1-8B's shape in 4 bits, LoRA on all
    linear layers, TRL's SFTTrainer with fp16 and `cm.LongContext` (settings a Trainer user writes), planned by trace
    for the 2026 T4, device and host RAM both counted."""
    import json

    from colab_memopt.planning.targets import DEFAULT_HEADROOM, get_target

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "trainer_long_context.json"
    table = json.loads(path.read_text())
    t4 = get_target("t4")
    assert table["target"] == "t4"
    fitting = [r for r in table["rows"] if r["fits"]]
    assert max(r["seq_len"] for r in fitting) >= 40960, [(r["seq_len"], r["fits"]) for r in table["rows"]]
    for r in fitting:
        assert r["fits_device"] and r["fits_host"]
        assert r["device_need_bytes"] <= r["device_limit_bytes"] == int(t4.device_bytes * (1 - DEFAULT_HEADROOM))
        assert r["host_need_bytes"] <= r["host_limit_bytes"] < 12.7e9
        assert r["host_costs"]["offloaded checkpoints"] > 0  # the layer inputs in host RAM are counted
