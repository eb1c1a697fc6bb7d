import pytest
import torch

import colab_memopt as cm
from colab_memopt import checkpointing as ck


def _grads_and_report(model, corpus, policy, interval=1):
    ck.apply_checkpointing(model, policy, interval)
    opt = cm.make_optimizer("sgd", model.parameters())
    step = cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=32)
    report = cm.measure_step(step, model=model, optimizer=opt, warmup=0, repeat=1)
    model.zero_grad()
    x = corpus.batch(2, 32, generator=torch.Generator().manual_seed(3))
    model(x, labels=x).loss.backward()
    return [p.grad.clone() for p in model.parameters()], report


@pytest.mark.parametrize("policy,interval", [("full", 1), ("every_n", 2), ("segments", 2), ("selective", 1)])
def test_policies_keep_gradients_and_cut_activations(corpus, policy, interval):
    base_grads, base = _grads_and_report(cm.build_model("tiny", n_layer=4), corpus, "none")
    grads, rep = _grads_and_report(cm.build_model("tiny", n_layer=4), corpus, policy, interval)
    for a, b in zip(grads, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert rep.category_peaks["activations"] < base.category_peaks["activations"]
    assert rep.peak_bytes < base.peak_bytes


def test_full_checkpointing_halves_activations_and_is_removable(corpus):
    model = cm.build_model("tiny", n_layer=4)
    _, base = _grads_and_report(model, corpus, "none")
    _, full = _grads_and_report(model, corpus, "full")
    assert full.category_peaks["activations"] <= 0.5 * base.category_peaks["activations"]
    ck.remove_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert set(model.state_dict()) == set(cm.build_model("tiny", n_layer=4).state_dict())


def test_policy_on_a_transformers_model_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for policy in ("none", "full", "selective", "segments"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        assert len(ck.find_blocks(model)) == 4
        ck.apply_checkpointing(model, policy, 2)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(x, labels=x).loss.backward()

        report = cm.measure_step(step, model=model, warmup=0, repeat=1)
        results[policy] = (report, [p.grad.clone() for p in model.parameters()])
    base_report, base_grads = results["none"]
    for policy in ("full", "selective", "segments"):
        report, grads = results[policy]
        assert report.category_peaks["activations"] < base_report.category_peaks["activations"], policy
        for a, b in zip(grads, base_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_checkpointed_block_indices_and_expectations():
    assert ck.checkpointed_blocks(8, "every_n", 4) == [3, 7]
    assert ck.checkpointed_blocks(8, "segments", 4) == [0, 4]
    assert ck.checkpointed_blocks(3, "full") == [0, 1, 2]
    assert ck.checkpointed_blocks(3, "none") == []
    assert ck.expected_activation_bytes(100, 10, 8, "none") == 800
    assert ck.expected_activation_bytes(100, 10, 8, "full") == 8 * 10 + 100
    assert ck.expected_activation_bytes(100, 10, 32, "segments", 8) == 4 * 10 + 8 * 100
    assert ck.expected_activation_bytes(100, 10, 8, "every_n", 2) == 4 * 10 + 4 * 100 + 100


def test_bad_policy_values_and_models():
    with pytest.raises(ValueError, match="policy must be one of .* got 'some'"):
        ck.apply_checkpointing(cm.build_model("tiny"), "some")
    with pytest.raises(ValueError, match="interval must be an integer >= 1, got 0"):
        ck.apply_checkpointing(cm.build_model("tiny"), "every_n", 0)
    with pytest.raises(ValueError, match="no nn.ModuleList of repeated blocks"):
        ck.find_blocks(torch.nn.Linear(2, 2))
    assert isinstance(ck.apply_checkpointing(torch.nn.Linear(2, 2), "none"), torch.nn.Linear)


def test_policies_can_be_switched_on_one_model(corpus):
    model = cm.build_model("tiny", n_layer=4)
    for policy, interval in [("every_n", 2), ("full", 1), ("segments", 2), ("none", 1), ("selective", 1)]:
        ck.apply_checkpointing(model, policy, interval)
        x = corpus.batch(2, 16, generator=torch.Generator().manual_seed(0))
        model(x, labels=x).loss.backward()
    ck.remove_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_probe_row_77_an_interval_past_the_last_block_warns():
    # was: accepted silently; activations identical to no checkpointing
    model = cm.build_model("tiny", n_layer=4)
    with pytest.warns(RuntimeWarning, match="checkpoint_interval 10 exceeds the model's 4 blocks: .*none is checkpointed"):
        ck.apply_checkpointing(model, "every_n", 10)
    assert ck.checkpointed_blocks(4, "every_n", 10) == []
