import pytest
import torch

import colab_memopt as cm
from colab_memopt.train import train_step


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
    from colab_memopt.checkpointing import apply_checkpointing, remove_checkpointing

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
