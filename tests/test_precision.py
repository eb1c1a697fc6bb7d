import pytest
import torch

import colab_memopt as cm
from colab_memopt import precision as P


def _report(corpus, prec):
    model, opt = cm.Recipe(precision=prec).build(cm.build_model("tiny", n_layer=1))
    step = cm.make_train_step(model, opt, corpus, batch_size=8, seq_len=64, recipe=cm.Recipe(precision=prec))
    return cm.measure_step(step, model=model, optimizer=opt, warmup=1, repeat=1), model, step


def test_autocast_shrinks_activations_and_bf16_halves_weights(corpus):
    fp32, _, _ = _report(corpus, "fp32")
    auto, model_auto, _ = _report(corpus, "bf16-autocast")
    pure, model_pure, _ = _report(corpus, "bf16")
    assert auto.category_peaks["activations"] < fp32.category_peaks["activations"]
    assert auto.category_peaks["parameters"] == fp32.category_peaks["parameters"]  # fp32 master weights stay
    assert pure.category_peaks["parameters"] * 2 == fp32.category_peaks["parameters"]
    assert next(model_pure.parameters()).dtype == torch.bfloat16
    assert next(model_auto.parameters()).dtype == torch.float32


def test_fp16_autocast_uses_a_grad_scaler(corpus):
    assert P.make_grad_scaler("bf16-autocast", "cpu") is None
    scaler = P.make_grad_scaler("fp16-autocast", "cpu")
    assert isinstance(scaler, torch.amp.GradScaler)
    if not P.fp16_supported("cpu"):
        pytest.skip("this CPU build has no fp16 autocast kernels")
    _, _, step = _report(corpus, "fp16-autocast")
    assert step.scaler is not None and step.scaler.get_scale() > 1  # the loss was scaled


def test_contexts_and_dtypes():
    with P.autocast_context("bf16-autocast", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with P.autocast_context("fp32", "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert P.weight_dtype("bf16") == torch.bfloat16 and P.weight_dtype("fp16-autocast") == torch.float32
    assert P.compute_dtype("fp16-autocast") == torch.float16


def test_eval_precision_per_phase(corpus):
    recipe = cm.Recipe(precision="fp32", eval_precision="bf16-autocast")
    assert recipe.forward_precision() == "bf16-autocast"
    assert cm.Recipe(precision="bf16").forward_precision() == "fp32"
    model = cm.build_model("tiny", n_layer=1)
    full = cm.evaluate(model, corpus, batch_size=2, seq_len=16, batches=1)
    low = cm.evaluate(model, corpus, batch_size=2, seq_len=16, batches=1, precision="bf16-autocast")
    assert abs(full - low) / full < 0.02 and full != low
    step = cm.make_eval_step(model, corpus, batch_size=2, seq_len=16, recipe=recipe)
    assert step() == pytest.approx(low, rel=0.05)


def test_bad_precision_values():
    with pytest.raises(ValueError, match="precision must be one of .* got 'fp8'"):
        P.autocast_context("fp8", "cpu")
    with pytest.raises(ValueError, match="recipe.precision must be one of .* got 'half'"):
        cm.Recipe(precision="half")
    with pytest.raises(ValueError, match="recipe.eval_precision must be one of .* got 'bf16'"):
        cm.Recipe(eval_precision="bf16")
