import pytest
import torch

import colab_memopt as cm
from colab_memopt.training.train import train_step


def test_default_recipe_builds_adamw():
    model, opt = cm.Recipe().build(cm.build_model("tiny"))
    assert type(opt).__name__ == "AdamW"


def test_recipe_sets_attention_on_the_reference_model():
    model, _ = cm.Recipe(attention="naive").build(cm.build_model("tiny"))
    assert all(block.attn.attention == "naive" for block in model.blocks)


def test_recipe_rejects_bad_values_and_unknown_fields():
    with pytest.raises(ValueError, match="recipe.optimizer must be one of .* got 'adam9'"):
        cm.Recipe(optimizer="adam9")
    with pytest.raises(ValueError, match="recipe.lr must be > 0, got -1"):
        cm.Recipe(lr=-1)
    with pytest.raises(ValueError, match=r"unknown recipe field\(s\) \['colour'\]"):
        cm.Recipe.from_dict({"colour": "red"})
    assert cm.Recipe.from_dict({"optimizer": "sgd"}).with_(lr=0.1).to_dict()["lr"] == 0.1


def test_recipe_quantization_lora_compression_fields():
    import pytest as _pytest

    from colab_memopt import Recipe, build_model

    with _pytest.raises(ValueError, match="recipe.quantization must be"):
        Recipe(quantization="int3")
    with _pytest.raises(ValueError, match="lora_rank >= 1"):
        Recipe(quantization="nf4")
    with _pytest.raises(ValueError, match="recipe.lora_rank must be"):
        Recipe(lora_rank=-1)
    with _pytest.raises(ValueError, match="recipe.activation_compression"):
        Recipe(activation_compression="zip")
    with _pytest.raises(ValueError, match="base peft supports"):
        Recipe(quantization="int8_channel", lora_rank=4)
    model, opt = Recipe(quantization="nf4", lora_rank=4).build(build_model("tiny"))
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    model, opt = Recipe(activation_compression="int8_tensor", optimizer="adam_mini").build(build_model("tiny"))
    assert type(opt).__name__ == "AdamMini"
    r = Recipe(quantization="int8_channel", quantization_phase="forward_only")
    m = build_model("tiny")
    assert r.build(m)[0] is m and r.forward_model(m) is not m
    assert Recipe.from_dict({"lora_rank": 2, "lora_targets": ["qkv"]}).lora_targets == ("qkv",)


def test_compression_survives_the_default_checkpointing_policy(corpus):
    # Recipe.build applies checkpointing (policy 'none') after compression; it must not undo it.
    def activation_peak(recipe):
        model, opt = recipe.build(cm.build_model("tiny"))
        step = cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=64, recipe=recipe)
        return cm.measure_step(step, model=model, optimizer=opt, repeat=1).category_peaks["activations"]

    plain = activation_peak(cm.Recipe())
    assert activation_peak(cm.Recipe(activation_compression="int8_channel")) < 0.8 * plain


def test_checkpointing_removal_restores_the_forward_it_replaced():
    from colab_memopt.techniques.checkpointing import apply_checkpointing, remove_checkpointing

    model = cm.build_model("tiny")
    marker = model.blocks[0].forward
    model.blocks[0].forward = lambda x: marker(x)  # another technique's patch
    patched = model.blocks[0].forward
    apply_checkpointing(model, "full")
    remove_checkpointing(model)
    assert model.blocks[0].forward is patched
    assert "forward" not in model.blocks[1].__dict__


def test_in_backward_optimizers_refuse_fp16_and_accumulation_clearly(corpus):
    # Review D4: GradScaler cannot unscale what was already applied in backward; the step used to crash
    # in GradScaler.step ("No inf checks were recorded"); accumulation silently updated per micro-batch.
    with pytest.raises(ValueError, match=r"adamw_in_backward.*fp16-autocast.*optimizer='adamw'"):
        cm.Recipe(optimizer="adamw_in_backward", precision="fp16-autocast")
    with pytest.raises(ValueError, match=r"accumulation_steps=1.*got accumulation_steps=2"):
        cm.Recipe(optimizer="adamw_in_backward", accumulation_steps=2)
    cm.Recipe(optimizer="adamw_in_backward", precision="bf16-autocast")  # allowed
    model = cm.build_model("tiny")
    opt = cm.make_optimizer("adamw_in_backward", model.parameters())
    x = corpus.batch(2, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="GradScaler"):
        train_step(model, opt, x, precision="fp16-autocast", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("lr", ["0.1", None, True, float("inf"), float("nan")])
def test_probe_rows_74_75_lr_must_be_a_finite_number(lr):
    # was: TypeError "'>' not supported between 'str' and 'int'" ('0.1', None); accepted (True, inf)
    with pytest.raises(ValueError, match=r"recipe.lr must be a finite number > 0, got "):
        cm.Recipe(lr=lr)


def test_lora_base_dtype_keeps_the_frozen_base_in_half_precision_and_the_adapters_in_fp32(corpus):
    import torch

    recipe = cm.Recipe(lora_rank=4, base_dtype="fp16", precision="fp16-autocast")
    model, opt = recipe.build(cm.build_model("tiny"))
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.float16} and trained == {torch.float32}
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=16, recipe=recipe)
    losses = [step(), step()]  # fp16 autocast + GradScaler over fp32 adapter gradients
    assert step.scaler is not None and all(l == l for l in losses)


@pytest.mark.parametrize("fields, says", [
    ({"base_dtype": "fp8", "lora_rank": 4}, r"recipe.base_dtype must be None \(fp32\) or one of \('fp16', 'bf16'\), got 'fp8'"),
    ({"base_dtype": "fp16"}, "set lora_rank >= 1"),
    ({"base_dtype": "fp16", "lora_rank": 4}, "set precision='fp16-autocast', got 'fp32'"),
    ({"base_dtype": "bf16", "lora_rank": 4, "precision": "fp16-autocast"}, "set precision='bf16-autocast'"),
])
def test_lora_base_dtype_is_validated(fields, says):
    with pytest.raises(ValueError, match=says):
        cm.Recipe.from_dict(fields)


def test_update_rounding_is_built_and_refused_for_fp32_weights():
    from colab_memopt.training.recipe import Recipe
    from colab_memopt.techniques.rounding import UpdateRounding

    with pytest.raises(ValueError, match="update_rounding='kahan' rounds updates into 16-bit weights"):
        Recipe(update_rounding="kahan")
    with pytest.raises(ValueError, match="update_rounding must be one of"):
        Recipe(precision="bf16", update_rounding="nearest")
    with pytest.raises(ValueError, match="cannot train under precision='fp16'"):
        Recipe(precision="fp16", optimizer="adamw_in_backward")
    assert Recipe(precision="fp16").rounding_mode == "kahan"
    assert Recipe(precision="bf16").rounding_mode is None  # bf16 steps its weights as before the field
    model, opt = Recipe(precision="fp16", update_rounding="stochastic").build(cm.build_model("tiny"))
    assert isinstance(opt, UpdateRounding) and opt.mode == "stochastic"
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    _, plain = Recipe(precision="bf16").build(cm.build_model("tiny"))
    assert isinstance(plain, torch.optim.AdamW)


# -- one table says which backend applies each field; build applies what plan counts ----------

def _blocks_patched(model):
    return ["forward" in b.__dict__ for b in model.blocks]


def _first_block_forward_args(model):
    fwd = model.blocks[0].forward
    return getattr(fwd, "args", ())


# field -> (the recipe fields that set it, a check that the built (model, optimizer, recipe) shows its effect)
FIELD_SAMPLES = {
    "optimizer": ({"optimizer": "sgd"}, lambda m, o, r: type(o).__name__ == "SGD"),
    "lr": ({"lr": 0.0125}, lambda m, o, r: all(g["lr"] == 0.0125 for g in o.param_groups)),
    "attention": ({"attention": "naive"}, lambda m, o, r: all(b.attn.attention == "naive" for b in m.blocks)),
    "optimizer_rank": ({"optimizer": "apollo", "optimizer_rank": 4},
                       lambda m, o, r: any(g.get("rank") == 4 for g in o.param_groups)),
    "quantization": ({"quantization": "nf4", "lora_rank": 4},
                     lambda m, o, r: any(type(x).__name__ == "Linear4bit" for x in m.modules())),
    "quantization_phase": ({"quantization": "int8_channel", "quantization_phase": "forward_only"},
                           lambda m, o, r: r.forward_model(m) is not m),
    "lora_rank": ({"lora_rank": 4}, lambda m, o, r: any("lora_A" in n for n, _ in m.named_parameters())),
    "lora_targets": ({"lora_rank": 4, "lora_targets": ("qkv",)},
                     lambda m, o, r: {n.split(".lora_A")[0].split(".")[-1] for n, _ in m.named_parameters() if "lora_A" in n} == {"qkv"}),
    "base_dtype": ({"lora_rank": 4, "base_dtype": "fp16", "precision": "fp16-autocast"},
                   lambda m, o, r: any(p.dtype == torch.float16 and not p.requires_grad for p in m.parameters())),
    "activation_compression": ({"activation_compression": "int8_tensor"},
                               lambda m, o, r: all("int8_tensor" in _first_block_forward_args(m) for _ in [0])),
    "compression_checkpointing": ({"compression_checkpointing": True},
                                  lambda m, o, r: True in _first_block_forward_args(m)),
    "phase_offload": ({"phase_offload": "cpu"}, lambda m, o, r: _step(m, o, r).__name__ == "phased_step"),
    "precision": ({"precision": "bf16"}, lambda m, o, r: all(p.dtype == torch.bfloat16 for p in m.parameters())),
    "eval_precision": ({"eval_precision": "bf16-autocast"}, lambda m, o, r: r.forward_precision() == "bf16-autocast"),
    "update_rounding": ({"precision": "bf16", "update_rounding": "stochastic"},
                        lambda m, o, r: type(o).__name__ == "UpdateRounding" and o.mode == "stochastic"),
    "checkpointing": ({"checkpointing": "full"}, lambda m, o, r: all(_blocks_patched(m))),
    "checkpoint_interval": ({"checkpointing": "every_n", "checkpoint_interval": 2},
                            lambda m, o, r: _blocks_patched(m)[:2] == [False, True]),
    "accumulation_steps": ({"accumulation_steps": 2}, lambda m, o, r: len(_step(m, o, r).micro_batch_sizes) == 2),
    "attention_window": ({"attention_window": 8}, lambda m, o, r: all(b.attn.window == 8 for b in m.blocks)),
    "layer_offload_active": ({"layer_offload_active": 1}, lambda m, o, r: o.streamer.max_active_layers == 1),
    "layer_offload_prefetch": ({"layer_offload_active": 1, "layer_offload_prefetch": 2},
                               lambda m, o, r: o.streamer.prefetch_distance == 2),
    "optimizer_state_offload": ({"optimizer_state_offload": "cpu"}, None),  # applied by no step: refused everywhere
    "zero_stage": ({"zero_stage": 2}, None),  # select the DeepSpeed backend: checked through `zero.initialize` below
    "offload_optimizer": ({"zero_stage": 2, "offload_optimizer": True}, None),
    "offload_param": ({"zero_stage": 3, "offload_param": True}, None),
    "loss_chunk_tokens": ({"loss_chunk_tokens": 8}, lambda m, o, r: m.loss_chunk_tokens == 8),
    "mlp_tile_tokens": ({"mlp_tile_tokens": 8},
                        lambda m, o, r: all(getattr(mlp, cm.tiling._TILE, None) == 8 for mlp in cm.tiling.find_mlps(m))),
    "norm_tile_tokens": ({"norm_tile_tokens": 8},
                         lambda m, o, r: all(cm.tiling._NORM_ORIGINAL in n.__dict__ for n in cm.tiling.find_rmsnorms(m))),
    "weight_dtype": ({"weight_dtype": "int8", "optimizer": "lomo", "precision": "bf16"},
                     lambda m, o, r: any(type(x).__name__ == "Int8Linear" for x in m.modules())),
    "offload_keep_blocks": ({"checkpointing": "offload", "offload_keep_blocks": 1},
                            lambda m, o, r: all(_blocks_patched(m)) and cm.checkpointing.checkpoint_offloader(m) is not None),
}
SELECTORS = {"zero_stage", "offload_optimizer", "offload_param"}


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


# fields that apply to a transformers model only (the reference model has LayerNorm): built and planned on a tiny Llama
FIELD_MODELS = {"norm_tile_tokens": _tiny_llama}


def _step(model, opt, recipe):
    return cm.make_train_step(model, opt, cm.load_corpus(), batch_size=2, seq_len=16, recipe=recipe)


def test_every_field_has_a_backend_row_and_a_sample():
    # A new Recipe field must say which backends apply it (recipe.FIELD_BACKENDS) and how this test sees it.
    from dataclasses import fields

    from colab_memopt.training.recipe import BACKENDS, FIELD_BACKENDS

    names = {f.name for f in fields(cm.Recipe)}
    assert set(FIELD_BACKENDS) == names, f"rows missing: {sorted(names - set(FIELD_BACKENDS))}, stale: {sorted(set(FIELD_BACKENDS) - names)}"
    assert set(FIELD_SAMPLES) == names, f"samples missing: {sorted(names - set(FIELD_SAMPLES))}"
    assert all(set(row) <= set(BACKENDS) for row in FIELD_BACKENDS.values())


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
@pytest.mark.parametrize("name", sorted(FIELD_SAMPLES))
def test_build_applies_every_field_plan_counts_or_both_refuse_it(name, backend, monkeypatch):
    from colab_memopt import zero
    from colab_memopt.training.recipe import FIELD_BACKENDS

    values, applied = FIELD_SAMPLES[name]
    if backend == "deepspeed" and not values.keys() & SELECTORS:
        values = {"zero_stage": 1, **values}
    if backend == "torch" and values.keys() & SELECTORS:
        pytest.skip(f"{name} selects the DeepSpeed backend")  # its torch pairing does not exist
    if backend not in FIELD_BACKENDS[name]:
        # refused, naming a field the backend skips (this one, or one it needs, such as precision for update_rounding)
        # (DeepSpeed also refuses every optimizer but AdamW, naming zero_stage and optimizer)
        skipped = "|".join(k for k in values if backend not in FIELD_BACKENDS[k] or (backend, k) == ("deepspeed", "optimizer"))
        with pytest.raises(ValueError, match=rf"recipe\..*\b({skipped})\b"):
            cm.Recipe(**values)
        with pytest.raises(ValueError, match=rf"recipe\..*\b({skipped})\b"):  # plan refuses what build would skip
            cm.plan("tiny", 2, seq_len=16, recipe=values, method="analytic", find_max_batch=False)
        return
    if backend == "deepspeed" and name == "optimizer":  # DeepSpeed runs AdamW only: any other name is refused
        with pytest.raises(ValueError, match=r"recipe\.zero_stage / offload run DeepSpeed with AdamW: set optimizer='adamw'"):
            cm.Recipe(**values)
        return
    recipe = cm.Recipe(**values)
    build = FIELD_MODELS.get(name, lambda: cm.build_model("tiny"))
    plan = cm.plan(FIELD_MODELS.get(name, "tiny"), 2, seq_len=16, recipe=values, method="analytic", find_max_batch=False)
    assert plan.recipe[name] == values[name]
    if backend == "deepspeed":  # the engine itself: tests/test_zero.py::test_zero_engine_applies_the_recipe_and_measure_step_reads_its_buffers
        seen = {}
        monkeypatch.setattr(zero, "initialize", lambda model, rec: seen.update(model=model, recipe=rec) or (model, None))
        recipe.build(build())
        assert seen["recipe"] is recipe
        config = zero.deepspeed_config(recipe)["zero_optimization"]
        checks = {"zero_stage": config["stage"] == recipe.zero_stage,
                  "offload_optimizer": "offload_optimizer" in config, "offload_param": "offload_param" in config,
                  "loss_chunk_tokens": getattr(seen["model"], "loss_chunk_tokens", None) == 8,
                  "lr": recipe.lr == 0.0125, "eval_precision": recipe.forward_precision() == "bf16-autocast",
                  "mlp_tile_tokens": all(getattr(mlp, cm.tiling._TILE, None) == 8 for mlp in cm.tiling.find_mlps(seen["model"])),
                  "norm_tile_tokens": name == "norm_tile_tokens" and FIELD_SAMPLES[name][1](seen["model"], None, recipe)}
        assert checks[name], name
        return
    model, opt = recipe.build(build())
    assert applied(model, opt, recipe), f"Recipe.build did not apply {name}={values[name]!r}"


def test_str_names_only_the_changed_fields_and_repr_keeps_them_all():
    recipe = cm.Recipe(precision="fp16", optimizer="lomo")
    assert str(recipe) == "Recipe(optimizer='lomo', precision='fp16')"
    assert recipe.changed() == {"optimizer": "lomo", "precision": "fp16"}
    assert str(cm.Recipe()) == "Recipe()" and cm.Recipe().changed() == {}
    assert f"{recipe}" == str(recipe)  # printing and f-strings give the short form
    full = repr(recipe)  # every field, as the dataclass writes it
    assert full.startswith("Recipe(") and all(f"{name}=" in full for name in cm.Recipe().to_dict())
    assert eval(str(recipe), {"Recipe": cm.Recipe}) == recipe  # the short form still builds the same recipe


def test_probe3_row_221_offload_keep_blocks_beyond_the_blocks_is_refused_before_build_and_by_plan():
    recipe = {"checkpointing": "offload", "offload_keep_blocks": 99}
    says = r"recipe\.offload_keep_blocks=99 exceeds the model's 2 blocks: use 0 to 2"
    model = cm.build_model("tiny")
    with pytest.raises(ValueError, match=says):
        cm.Recipe(**recipe).check_model(model)
    assert not any("forward" in b.__dict__ for b in model.blocks)  # refused before anything changed
    with pytest.raises(ValueError, match=says):  # plan refuses it too (it fell back to the analytic estimate)
        cm.plan("tiny", 2, seq_len=16, recipe=recipe, find_max_batch=False)
    cm.Recipe(checkpointing="offload", offload_keep_blocks=2).check_model(model)  # all blocks kept: allowed


def test_probe3_rows_403_409_recipe_settings_names_every_field_it_cannot_say():
    from colab_memopt.planning.hfconfig import checkpointing_names, recipe_settings

    # weight_dtype, mlp_tile_tokens and optimizer_rank were dropped with an empty not_expressible
    cases = {
        cm.Recipe(weight_dtype="int8", optimizer="lomo", precision="fp16"): "weight_dtype='int8'",
        cm.Recipe(mlp_tile_tokens=256): "mlp_tile_tokens=256",
        cm.Recipe(optimizer="galore_adamw8bit", optimizer_rank=64): "optimizer_rank=64",
        cm.Recipe(checkpointing="segments", checkpoint_interval=2): "checkpointing='segments', checkpoint_interval=2",
        cm.Recipe(eval_precision="bf16-autocast"): "eval_precision='bf16-autocast'",
        cm.Recipe(layer_offload_active=1, layer_offload_prefetch=2): "layer_offload_prefetch=2",
    }
    for recipe, says in cases.items():
        out = recipe_settings(recipe, 8, 512)
        assert any(line.startswith(says) for line in out["not_expressible"]), (recipe, out["not_expressible"])
    # every field: set away from its default, it is said (in the settings) or named (in not_expressible)
    for name, (values, _) in FIELD_SAMPLES.items():
        if name == "optimizer_state_offload":  # refused by every recipe (no step applies it)
            continue
        recipe = cm.Recipe(**values)
        out = recipe_settings(recipe, 8, 64)
        named = " ".join(out["not_expressible"])
        for field_name in recipe.changed():
            back_field = field_name in ("optimizer", "lr", "precision", "base_dtype", "checkpointing", "lora_rank",
                                        "lora_targets", "quantization", "accumulation_steps")
            kwargs = out["training_args"].get(checkpointing_names()[1]) or {}
            back_field |= field_name == "checkpoint_interval" and kwargs.get("every_n_layers") == recipe.checkpoint_interval
            phase = field_name == "quantization_phase" and f"({recipe.quantization_phase})" in named
            assert back_field or phase or f"{field_name}=" in named, (field_name, out)


def test_probe3_row_409_recipe_settings_keeps_an_effective_batch_the_recipe_splits_unevenly():
    from colab_memopt.planning.hfconfig import recipe_settings

    # Round 3 and 4: 2 x 2 = 4 sequences for a batch of 3. The Trainer's micro-batches are equal: 3 of 1 keeps the
    # batch exactly, and each micro-batch is no larger than the recipe's largest (2), where its plan's peak is.
    out = recipe_settings(cm.Recipe(accumulation_steps=2), 3, 64)
    args = out["training_args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 3)
    assert out["not_expressible"] == ["accumulation_steps=2 at batch 3: gradient_accumulation_steps=3 of 1 keeps the "
                                      "batch of 3 (the Trainer's micro-batches are equal; the recipe's largest was 2, "
                                      "so each step holds no more)"]
    for recipe, batch in ((cm.Recipe(accumulation_steps=2), 4), (cm.Recipe(accumulation_steps=3), 12)):
        out = recipe_settings(recipe, batch, 64)
        args = out["training_args"]
        assert out["not_expressible"] == [] and args["gradient_accumulation_steps"] == recipe.accumulation_steps
    for batch in range(1, 40):  # every split keeps the batch, never a micro-batch above the recipe's largest
        for steps in (1, 2, 3, 4, 7):
            args = recipe_settings(cm.Recipe(accumulation_steps=steps), batch, 64)["training_args"]
            micro, acc = args["per_device_train_batch_size"], args["gradient_accumulation_steps"]
            assert micro * acc == batch and micro <= -(-batch // steps), (batch, steps, micro, acc)
    with pytest.raises(ValueError, match="batch must be an integer >= 1, got 0"):
        recipe_settings(cm.Recipe(), 0, 64)


def test_probe4_repeated_kv_attention_refuses_a_window_it_would_drop():
    """Recipe(attention='sdpa_repeated_kv', attention_window=16) built on a Llama: accepted, the window dropped."""
    import transformers

    from colab_memopt.techniques.architectures import small_config

    model = transformers.AutoModelForCausalLM.from_config(small_config("llama"))
    with pytest.raises(ValueError, match=r"recipe.attention_window=16 applies to the reference model only: "
                                         r"attention='sdpa_repeated_kv' keeps the model's own causal attention"):
        cm.Recipe(attention="sdpa_repeated_kv", attention_window=16).build(model)
