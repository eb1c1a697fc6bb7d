import pytest

from colab_memopt.presets import MODES, PRESETS, mixed_precision, mode_fields, preset_fields, preset_names
from colab_memopt.recipe import Recipe


def test_every_preset_builds_a_valid_recipe_per_mode():
    for name in preset_names():
        for mode in MODES:
            r = Recipe.preset(name, mode=mode)
            assert r.precision == "fp16-autocast"  # the T4 default: no native bf16 on sm_75
            assert r.checkpointing != "none"
            assert (r.lora_rank > 0) == (mode != "full")
            assert (r.quantization == "nf4") == (mode == "qlora")


def test_presets_follow_the_documents_checkpoint_intervals():
    assert [Recipe.preset(n).checkpoint_interval for n in ("balanced", "aggressive", "maximum")] == [8, 4, 2]
    assert Recipe.preset("conservative").checkpointing == "selective"
    assert set(PRESETS) == {"conservative", "balanced", "aggressive", "maximum"}


def test_target_picks_the_autocast_dtype():
    assert mixed_precision("t4") == "fp16-autocast"
    assert Recipe.preset("balanced", target="a100-80gb").precision == "bf16-autocast"


def test_overrides_apply_last_and_are_validated():
    r = Recipe.preset("balanced", accumulation_steps=4, checkpoint_interval=3)
    assert r.accumulation_steps == 4 and r.checkpoint_interval == 3 and r.optimizer == "adamw8bit"
    with pytest.raises(ValueError, match="accumulation_steps"):
        Recipe.preset("balanced", accumulation_steps=0)
    with pytest.raises(ValueError, match="unknown recipe field"):
        Recipe.preset("balanced", no_such_field=1)


def test_unknown_preset_and_mode_name_the_choices():
    with pytest.raises(ValueError, match="conservative.*balanced.*aggressive.*maximum"):
        Recipe.preset("turbo")
    with pytest.raises(ValueError, match="full.*lora.*qlora"):
        preset_fields("balanced", mode="prefix")


def test_lora_targets_follow_the_architecture_family():
    assert mode_fields("lora", "llama-3.2-1b")["lora_targets"][0] == "q_proj"
    assert "lora_targets" not in mode_fields("lora")  # the reference model keeps its defaults
    with pytest.raises(ValueError, match="no LoRA targets"):
        mode_fields("lora", "gpt2")


def test_probe_rows_79_80_an_unknown_target_or_model_is_named():
    # was: accepted, fp16 autocast (target) and the reference model's LoRA targets (model)
    with pytest.raises(ValueError, match="unknown target 'nope'"):
        Recipe.preset("balanced", target="nope")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        Recipe.preset("balanced", model="nope", mode="lora")


def test_preset_target_names_are_the_planners():
    from colab_memopt.planner import TARGETS
    from colab_memopt.presets import TARGET_NAMES

    assert sorted(TARGET_NAMES) == sorted(TARGETS)
