import pytest
import torch

import colab_memopt as cm
from colab_memopt.techniques.models import GPTConfig


@pytest.mark.parametrize("size", sorted(cm.MODEL_SIZES))
def test_parameter_formula_matches_the_model(size):
    model = cm.build_model(size, device="meta")
    assert cm.count_parameters(model) == cm.get_config(size).n_params


def test_named_sizes_span_tiny_to_one_billion():
    assert cm.MODEL_SIZES["tiny"].n_params < 200_000
    assert 120e6 < cm.MODEL_SIZES["gpt2-small"].n_params < 130e6  # GPT-2 small: 124M
    assert 1.0e9 < cm.MODEL_SIZES["1b"].n_params < 1.5e9


def test_forward_returns_loss_and_logits_like_transformers():
    model = cm.build_model("tiny")
    x = torch.randint(0, 256, (3, 20))
    out = model(x, labels=x)
    assert out.logits.shape == (3, 20, 256)
    assert out.loss.ndim == 0 and 5.0 < out.loss.item() < 6.0  # about ln(256) = 5.55 at init
    assert model(x).loss is None


def test_sdpa_and_naive_attention_agree():
    x = torch.randint(0, 256, (2, 33))
    a = cm.build_model("tiny", attention="sdpa", seed=3)(x).logits
    b = cm.build_model("tiny", attention="naive", seed=3)(x).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_seeded_weights_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a, b = cm.build_model("tiny", seed=7), cm.build_model("tiny", seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert not torch.equal(next(cm.build_model("tiny", seed=8).parameters()), next(a.parameters()))


def test_weights_are_tied():
    model = cm.build_model("tiny")
    assert model.lm_head.weight is model.wte.weight


def test_overrides_and_bad_sizes():
    assert cm.get_config("tiny", seq_len=128).seq_len == 128
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        cm.build_model("huge")
    with pytest.raises(ValueError, match="n_layer must be an integer >= 1, got 0"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=10, n_head=3)
    with pytest.raises(ValueError, match="attention must be one of"):
        GPTConfig(attention="flash")


def test_too_long_or_badly_shaped_input():
    model = cm.build_model("tiny")
    with pytest.raises(ValueError, match="exceeds the model's seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \(batch, seq\)"):
        model(torch.zeros(65, dtype=torch.long))


def test_training_reduces_loss_on_real_text(corpus):
    model = cm.build_model("tiny")
    opt = cm.make_optimizer("adamw", model.parameters(), lr=3e-3)
    log = cm.train(model, opt, corpus, steps=30, batch_size=8, seq_len=64)
    assert sum(log.train_loss[-5:]) / 5 < log.train_loss[0] - 1.0
    assert log.val_loss < log.train_loss[0]


def test_unknown_optimizer_and_bad_lr():
    params = cm.build_model("tiny").parameters()
    with pytest.raises(ValueError, match="unknown optimizer 'adam8'"):
        cm.make_optimizer("adam8", params)
    with pytest.raises(ValueError, match="lr must be > 0, got 0"):
        cm.make_optimizer("sgd", params, lr=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        cm.train(cm.build_model("tiny"), cm.make_optimizer("sgd", cm.build_model("tiny").parameters()), None, steps=0, batch_size=1, seq_len=8)


@pytest.mark.parametrize("kwargs, error, says", [
    ({"n_layer": True}, ValueError, "n_layer must be an integer >= 1, got True"),  # row 85: a 1-block model
    ({"dtype": "float16"}, TypeError, "dtype must be a torch.dtype"),  # row 86: Invalid device string
    ({"seed": "x"}, ValueError, "seed must be an integer, got 'x'"),  # row 87: invalid literal for int()
    ({"seq_len": 10**9}, ValueError, r"64,000,116,480 parameters: .* more than the .* of host RAM available"),  # row 88
    ({"vocab_size": 10**10}, ValueError, r"parameters: .* more than the .* of host RAM available"),  # row 88
])
def test_probe_rows_85_to_88_bad_build_arguments_are_named_before_allocating(kwargs, error, says):
    with pytest.raises(error, match=says):
        cm.build_model("tiny", **kwargs)


def test_a_huge_config_still_builds_on_meta_for_planning():
    assert cm.build_model("tiny", device="meta", seq_len=10**9).config.seq_len == 10**9


def test_building_for_cuda_under_meta_or_fake_tensors_moves_nothing():
    # cuda-run-1 #2/#3: the planner builds a factory's model on meta or fake tensors; on a GPU machine
    # build_model(device="cuda") then moved it ("Cannot copy out of meta tensor"; here: "not compiled with CUDA")
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with mock.patch("torch.cuda.is_available", return_value=True):
        with torch.device("meta"):
            meta = cm.build_model("tiny", device="cuda", dtype=torch.float16)
        with FakeTensorMode():
            fake = cm.build_model("tiny", device="cuda")
    assert {(p.device.type, p.dtype) for p in meta.parameters()} == {("meta", torch.float16)}
    assert all(isinstance(p, FakeTensor) and p.device.type == "cpu" for p in fake.parameters())


def test_probe_row_92_evaluate_with_no_batches_is_named():
    # was: ZeroDivisionError (also notebook 02 with eval_batches=0, row 155)
    model = cm.build_model("tiny")
    with pytest.raises(ValueError, match="batches must be an integer >= 1 .*got 0"):
        cm.evaluate(model, cm.load_corpus(), batch_size=2, seq_len=32, batches=0)
