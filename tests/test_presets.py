import pytest

from colab_memopt.training.presets import MODES, PRESETS, RENAMED, mixed_precision, mode_fields, preset_fields, preset_names
from colab_memopt.training.recipe import Recipe


def test_every_preset_builds_a_valid_recipe_per_mode():
    for name in preset_names():
        for mode in MODES:
            r = Recipe.preset(name, mode=mode)
            assert r.precision == "fp16-autocast"  # the T4 default: no native bf16 on sm_75
            assert r.checkpointing != "none"
            assert (r.lora_rank > 0) == (mode != "full")
            assert (r.quantization == "nf4") == (mode == "qlora")


def test_preset_names_say_what_they_checkpoint():
    assert [Recipe.preset(n).checkpoint_interval for n in ("ckpt-every-8", "ckpt-every-4", "ckpt-every-2-paged")] == [8, 4, 2]
    assert Recipe.preset("selective-ckpt").checkpointing == "selective"
    assert Recipe.preset("ckpt-every-2-paged").optimizer == "paged_adamw8bit"
    assert preset_names() == ["selective-ckpt", "ckpt-every-8", "ckpt-every-4", "ckpt-every-2-paged"]
    for name, p in PRESETS.items():
        r = Recipe.preset(name)
        interval = f"ckpt-every-{r.checkpoint_interval}" if r.checkpointing == "every_n" else f"{r.checkpointing}-ckpt"
        assert name.startswith(interval) and name.endswith("-paged") == r.optimizer.startswith("paged"), name


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_old_preset_names_still_work_for_one_release_and_name_the_new_one(old, new):
    with pytest.warns(FutureWarning, match=f"preset '{old}' is now called '{new}'"):
        assert Recipe.preset(old, mode="lora", accumulation_steps=2) == Recipe.preset(new, mode="lora", accumulation_steps=2)
    assert old not in preset_names()


def test_target_picks_the_autocast_dtype():
    assert mixed_precision("t4") == "fp16-autocast"
    assert Recipe.preset("ckpt-every-8", target="a100-80gb").precision == "bf16-autocast"


def test_overrides_apply_last_and_are_validated():
    r = Recipe.preset("ckpt-every-8", accumulation_steps=4, checkpoint_interval=3)
    assert r.accumulation_steps == 4 and r.checkpoint_interval == 3 and r.optimizer == "adamw8bit"
    with pytest.raises(ValueError, match="accumulation_steps"):
        Recipe.preset("ckpt-every-8", accumulation_steps=0)
    with pytest.raises(ValueError, match="unknown recipe field"):
        Recipe.preset("ckpt-every-8", no_such_field=1)


def test_unknown_preset_and_mode_name_the_choices():
    with pytest.raises(ValueError, match="selective-ckpt.*ckpt-every-8.*ckpt-every-4.*ckpt-every-2-paged"):
        Recipe.preset("turbo")
    with pytest.raises(ValueError, match="full.*lora.*qlora"):
        preset_fields("ckpt-every-8", mode="prefix")


def test_lora_targets_follow_the_architecture_family(tmp_path):
    import transformers

    assert mode_fields("lora", "llama-3.2-1b")["lora_targets"][0] == "q_proj"
    assert "lora_targets" not in mode_fields("lora")  # the reference model keeps its defaults
    transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=512).to_json_file(tmp_path / "config.json")
    with pytest.raises(ValueError, match="no LoRA targets known .*family 'bloom'"):
        mode_fields("lora", str(tmp_path / "config.json"))


def test_gpt2s_lora_adapts_every_conv1d_of_its_blocks_and_trains():
    """GPT-2's layers are Conv1D (c_attn, c_proj, c_fc): its family's targets put an adapter on each of the four per
    block (attention's c_proj and the MLP's), and a step trains them alone."""
    import warnings

    import torch
    import transformers

    from colab_memopt.techniques.quantization import add_lora

    fields = mode_fields("lora", "gpt2")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # peft's "fan_in_fan_out is set to False but the target module is Conv1D"
        model = add_lora(transformers.GPT2LMHeadModel(config), 4, targets=fields["lora_targets"])
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A" in name}
    assert adapted == {f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)


def test_probe_rows_79_80_an_unknown_target_or_model_is_named():
    # was: accepted, fp16 autocast (target) and the reference model's LoRA targets (model)
    with pytest.raises(ValueError, match="unknown target 'nope'"):
        Recipe.preset("ckpt-every-8", target="nope")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        Recipe.preset("ckpt-every-8", model="nope", mode="lora")


def test_preset_target_names_are_the_planners():
    from colab_memopt.planning.targets import TARGETS
    from colab_memopt.training.presets import TARGET_NAMES

    assert sorted(TARGET_NAMES) == sorted(TARGETS)
