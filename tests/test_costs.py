import json

import pytest

from colab_memopt.planning.costs import (
    ADDS_WORK, TECHNIQUES, TechniqueCosts, expected_slowdown, load_technique_costs, measure_technique_costs, techniques_used,
)
from colab_memopt.training.recipe import Recipe


def _costs(**ratios):
    return TechniqueCosts(ratios=ratios, device="test device", model="tiny", batch=1, seq_len=8)


def test_slowdown_multiplies_the_measured_ratios_of_the_techniques_used():
    costs = _costs(**{"fp16-autocast": 1.5, "checkpoint-every-4": 1.2, "adamw8bit": 1.1})
    s = expected_slowdown(Recipe.preset("ckpt-every-4"), costs)
    assert s.ratio == pytest.approx(1.5 * 1.2 * 1.1)
    assert s.parts == {"fp16-autocast": 1.5, "checkpoint-every-4": 1.2, "adamw8bit": 1.1}
    assert s.unmeasured == [] and s.device == "test device"
    assert expected_slowdown(Recipe(), costs).ratio == 1.0


def test_a_technique_that_only_adds_work_is_never_counted_faster():
    costs = _costs(**{"checkpoint-every-2": 0.76, "fp16-autocast": 0.5, "lora": 0.9})
    s = expected_slowdown(Recipe(checkpointing="every_n", checkpoint_interval=2, precision="fp16-autocast"), costs)
    assert s.parts == {"fp16-autocast": 0.5, "checkpoint-every-2": 1.0} and s.ratio == 0.5  # tensor cores may be faster
    assert s.floored == ["checkpoint-every-2"] and s.n_techniques == 2
    assert expected_slowdown(Recipe(lora_rank=16), costs).ratio == 0.9 and not expected_slowdown(Recipe(lora_rank=16), costs).floored


def test_adds_work_names_measured_techniques():
    assert ADDS_WORK <= set(TECHNIQUES), ADDS_WORK - set(TECHNIQUES)
    assert not ADDS_WORK & {"fp16-autocast", "bf16-autocast", "lora", "qlora"}  # these can really be faster


def test_unmeasured_techniques_are_named_not_hidden():
    s = expected_slowdown(Recipe(optimizer="lion", checkpointing="full"), _costs())
    assert s.ratio == 1.0
    assert "checkpoint-full" in s.unmeasured and "optimizer='lion'" in s.unmeasured


def test_qlora_is_one_technique_not_lora_plus_qlora():
    used, uncovered = techniques_used(Recipe(lora_rank=16, quantization="nf4"))
    assert used == ["qlora"] and uncovered == []
    assert techniques_used(Recipe(lora_rank=4))[0] == ["lora"]


def test_measure_times_techniques_against_the_plain_step(tmp_path):
    costs = measure_technique_costs(model_size="tiny", batch=2, seq_len=16, rounds=1, device="cpu",
                                    techniques=["checkpoint-full", "accumulation-2"], n_layer=2)
    assert set(costs.ratios) == {"checkpoint-full", "accumulation-2"}
    assert all(r > 0 for r in costs.ratios.values()) and costs.device.startswith("cpu")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(costs.to_dict()))
    assert load_technique_costs(path).ratios == costs.ratios


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="unknown technique"):
        measure_technique_costs(techniques=["warp-drive"])
    with pytest.raises(ValueError, match="rounds"):
        measure_technique_costs(rounds=0)
    with pytest.raises(FileNotFoundError, match="technique_costs.py"):
        load_technique_costs("/nonexistent/costs.json")


def test_every_technique_is_a_valid_recipe():
    for fields in TECHNIQUES.values():
        Recipe().with_(**fields)


def test_committed_costs_name_their_device():
    costs = load_technique_costs()
    assert costs.device and costs.ratios and set(costs.ratios) <= set(TECHNIQUES)


def test_each_device_class_has_its_table_and_each_gpu_row_cites_its_source():
    from colab_memopt.planning.costs import DEVICE_CLASSES, PRIORS, costs_for_class, device_class
    from colab_memopt.planning.targets import get_target

    assert device_class(get_target("t4")) == "t4" and device_class(get_target("a100-80gb")) == "ampere+"
    assert device_class(get_target({"device_bytes": 1, "host_bytes": 1, "cuda": False})) == "cpu"
    for cls in DEVICE_CLASSES:
        table = costs_for_class(cls)
        assert table.device_class == cls
        for technique in table.ratios:
            assert technique in TECHNIQUES
            source = table.row_source(technique)
            assert source.startswith("measured on ") or (source.startswith("prior: ") and len(source) > 40), source
    assert set(costs_for_class("cpu").kinds.values()) == {"measured"} and set(PRIORS["t4"]) >= {"fp16-autocast", "checkpoint-full", "adamw8bit", "lora"}
    # tensor cores: fp16 is faster than fp32 on a T4 and bf16 is not (emulated); on Ampere both are
    t4, ampere = costs_for_class("t4").ratios, costs_for_class("ampere+").ratios
    assert t4["fp16-autocast"] < 1 < t4["bf16-autocast"] and ampere["bf16-autocast"] < 1


def test_a_measured_gpu_table_replaces_the_priors_it_measured_and_a_cpu_one_is_refused(tmp_path):
    from colab_memopt.planning.costs import costs_for_class, costs_for_target
    from colab_memopt.planning.targets import get_target

    measured = _costs(**{"fp16-autocast": 0.41})
    measured.device, measured.device_class = "cuda: NVIDIA H100 emulating t4", "t4"
    path = tmp_path / "technique_costs_t4.json"
    path.write_text(json.dumps(measured.to_dict()))
    table = costs_for_class("t4", path)
    assert table.ratios["fp16-autocast"] == 0.41 and table.kind("fp16-autocast") == "measured"
    assert table.row_source("fp16-autocast") == "measured on cuda: NVIDIA H100 emulating t4; priors for " + str(
        sorted(t for t in table.ratios if t != "fp16-autocast"))
    assert table.kind("checkpoint-full") == "prior" and "Chen et al. 2016" in table.row_source("checkpoint-full")
    with pytest.raises(ValueError, match="device class 't4' .*, not 'ampere\\+'"):
        costs_for_class("ampere+", path)
    with pytest.raises(ValueError, match="never stand for another"):
        costs_for_target(get_target("t4"), load_technique_costs())  # the CPU's measured table


def test_committed_cpu_costs_say_their_class():
    assert load_technique_costs().device_class == "cpu"
