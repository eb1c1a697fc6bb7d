import pytest
import torch

import colab_memopt as cm
from colab_memopt.planning.monitor import (
    NOT_APPLICABLE,
    PROFILES,
    MemoryMonitor,
    MemoryProfiler,
    MemorySample,
    Thresholds,
    find_leak,
    find_spikes,
    read_csv,
)


def _samples(allocated, peaks=None, phase="train"):
    peaks = peaks or allocated
    return [MemorySample(i, phase, a, p) for i, (a, p) in enumerate(zip(allocated, peaks))]


def test_profiles_are_the_sources():
    assert PROFILES["aggressive"] == Thresholds(0.92, 0.94, 0.96, 0.98)
    assert PROFILES["balanced"] == Thresholds(0.90, 0.92, 0.95, 0.97)
    assert PROFILES["conservative"] == Thresholds(0.85, 0.88, 0.92, 0.95)


@pytest.mark.parametrize("values", [(0.9, 0.9, 0.95, 0.97), (0.95, 0.92, 0.9, 0.97), (0.9, 0.92, 0.95, 1.2)])
def test_thresholds_must_rise(values):
    with pytest.raises(ValueError, match="thresholds must rise"):
        Thresholds(*values)


@pytest.mark.parametrize(
    "profile, used, status",
    [("balanced", 0.50, "normal"), ("balanced", 0.919, "normal"), ("balanced", 0.92, "warning"),
     ("balanced", 0.95, "critical"), ("balanced", 0.97, "emergency"), ("conservative", 0.90, "warning"),
     ("conservative", 0.93, "critical"), ("aggressive", 0.95, "warning")],
)
def test_status_thresholds(profile, used, status):
    mon = MemoryMonitor(1000, profile=profile, device="cpu")
    assert mon.check(8, used_bytes=int(used * 1000)).status == status


def test_check_recommends_concrete_batches():
    # 200 fixed bytes + 10 bytes per sample; capacity 1000.
    mon = MemoryMonitor(1000, fixed_bytes=200, device="cpu")
    low = mon.check(20, used_bytes=400)  # 40% used: the 90% target allows (900-200)/10 = 70
    assert low.status == "normal" and low.suggested_batch_size == 20 and "up to 70" in low.recommendations[0]
    crit = mon.check(75, used_bytes=950)  # critical: go to the target's 70 and accumulate 2
    assert crit.status == "critical" and crit.suggested_batch_size == 70 and "accumulate 2" in crit.recommendations[0]
    emerg = mon.check(78, used_bytes=980)
    assert emerg.status == "emergency" and emerg.suggested_batch_size == 39 and len(emerg.recommendations) == 2


def test_monitor_rejects_bad_input():
    with pytest.raises(ValueError, match="profile must be one of"):
        MemoryMonitor(1000, profile="yolo", device="cpu")
    with pytest.raises(ValueError, match="capacity_bytes is required on the CPU"):
        MemoryMonitor(device="cpu")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        MemoryMonitor(1000, device="cpu").check(0, used_bytes=10)
    with pytest.raises(ValueError, match="pass used_bytes"):
        MemoryMonitor(1000, device="cpu").check(4)


def test_breakdown_on_cpu_says_not_applicable():
    b = MemoryMonitor(1000, device="cpu").breakdown()
    assert b["reserved_bytes"] == NOT_APPLICABLE and b["fragmentation_ratio"] == NOT_APPLICABLE


def test_activation_estimate_follows_korthikanti():
    est = MemoryMonitor.estimate_activation_memory(12, 256, 512, 14, 8, use_flash_attention=False)
    assert est["per_layer_bytes"] == 256 * 12 * 512 * (34 + 5 * 8 * 256 // 512)
    assert est["total_bytes"] == 14 * est["per_layer_bytes"] and est["savings_bytes"] == 0
    ck = MemoryMonitor.estimate_activation_memory(12, 256, 512, 14, 8, use_gradient_checkpointing=True)
    assert ck["effective_bytes"] == 14 * 256 * 12 * 512 * 2 + ck["per_layer_bytes"]
    assert ck["savings_bytes"] == ck["total_bytes"] - ck["effective_bytes"] > 0


def test_optimizations_reads_recipe_fields():
    opts = MemoryMonitor.optimizations(cm.Recipe(attention="naive", optimizer="sgd"))
    assert opts["attention"]["enabled"] is False and opts["optimizer"]["enabled"] is True
    assert "mixed_precision" not in opts  # not a field of this recipe
    # checkpointing is a policy name: 'none' is off, any policy is on; precision fp32 is off
    assert opts["checkpointing"]["enabled"] is False and opts["precision"]["enabled"] is False
    on = MemoryMonitor.optimizations(cm.Recipe(checkpointing="selective", precision="fp16-autocast"))
    assert on["checkpointing"]["enabled"] and on["precision"]["enabled"] and not on["offload_optimizer"]["enabled"]


def test_spikes_found_with_step_delta_phase():
    samples = _samples([10] * 6, [100, 100, 160, 100, 100, 150])
    samples[5].phase = "eval"
    spikes = find_spikes(samples, threshold_bytes=40)
    assert [(s.step, s.delta_bytes, s.phase) for s in spikes] == [(2, 60, "train"), (5, 50, "eval")]
    assert find_spikes(samples, threshold_bytes=60) == []


def test_leak_is_a_steady_climb_not_a_one_time_rise():
    flat = [100, 180, 180, 180, 180, 180, 180, 180]  # optimizer state made by the first step
    assert find_leak(_samples(flat)) is None
    leak = [100, 180, 180, 180, 190, 200, 210, 220, 230]  # grows from step 4
    assert find_leak(_samples(leak), window=4) == 4
    assert find_leak(_samples(leak), window=6) is None
    with pytest.raises(ValueError, match="window"):
        find_leak(_samples(leak), window=1)


def test_csv_round_trip(tmp_path):
    samples = _samples([1, 2, 3], [4, 5, 6])
    samples[1].reserved_bytes = 8
    prof = MemoryProfiler(capacity_bytes=100, device="cpu")
    prof.samples = samples
    text = prof.to_csv(tmp_path / "m.csv")
    assert read_csv(tmp_path / "m.csv") == samples == read_csv(text)
    with pytest.raises(ValueError, match="CSV columns"):
        read_csv("a,b\n1,2\n")


def test_profiler_on_a_training_loop_detects_a_leak():
    model = cm.build_model("tiny")
    opt = cm.make_optimizer("adamw", model.parameters())
    step = cm.make_train_step(model, opt, cm.load_corpus(), batch_size=2, seq_len=16)
    kept = []
    with MemoryProfiler(model, opt, capacity_bytes=64 * 2**20, device="cpu") as prof:
        for i in range(9):
            prof.begin_step()
            step()
            if i >= 3:
                kept.append(torch.ones(1000))  # the leak: a tensor kept across steps
            prof.sample(i)
    report = prof.report()
    assert report.leak_step == 3
    assert report.peak_bytes >= report.final_bytes > report.initial_bytes
    assert report.by_phase["train"].steps == 9 and report.reserved_peak_bytes is None
    assert 0 < report.utilization < 1
    with pytest.raises(RuntimeError, match="active profiler"):
        prof.sample(10)


def test_profiler_needs_capacity_on_cpu():
    with pytest.raises(ValueError, match="capacity_bytes is required"):
        MemoryProfiler(device="cpu")
