import pytest
import torch

import colab_memopt as cm
from colab_memopt import accumulation as acc


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("sizes", [[4, 4], [3, 3, 2], [5, 2, 1], [1] * 8])
def test_accumulated_gradients_equal_the_large_batch(corpus, sizes):
    model = cm.build_model("tiny")
    x = corpus.batch(8, 32, generator=torch.Generator().manual_seed(1))
    full = _grads(model, lambda: model(x, labels=x).loss.backward())
    parts = list(x.split(sizes))
    accumulated = _grads(model, lambda: acc.accumulate_gradients(model, parts))
    assert acc.grad_rel_diff(accumulated, full) < 1e-5


def test_dividing_by_steps_is_wrong_for_an_uneven_split(corpus):
    model = cm.build_model("tiny")
    x = corpus.batch(8, 32, generator=torch.Generator().manual_seed(1))
    full = _grads(model, lambda: model(x, labels=x).loss.backward())

    def naive():
        for part in x.split([5, 2, 1]):
            (model(part, labels=part).loss / 3).backward()

    assert acc.grad_rel_diff(_grads(model, naive), full) > 1e-3


def test_micro_batches_and_step_attributes(corpus):
    assert acc.micro_batch_sizes(10, 4) == [3, 3, 2, 2]
    assert [t.size(0) for t in acc.split_micro_batches(torch.zeros(7, 3), 3)] == [3, 2, 2]
    model, opt = cm.Recipe(accumulation_steps=4).build(cm.build_model("tiny"))
    step = cm.make_train_step(model, opt, corpus, batch_size=8, seq_len=32, recipe=cm.Recipe(accumulation_steps=4))
    assert step.effective_batch == 8 and step.micro_batch_sizes == [2, 2, 2, 2]
    assert step() > 0


def test_accumulation_lowers_the_peak(corpus):
    peaks = {}
    for k in (1, 4):
        recipe = cm.Recipe(accumulation_steps=k)
        model, opt = recipe.build(cm.build_model("tiny"))
        step = cm.make_train_step(model, opt, corpus, batch_size=8, seq_len=64, recipe=recipe)
        peaks[k] = cm.measure_step(step, model=model, optimizer=opt, repeat=1).peak_bytes
    assert peaks[4] < peaks[1]


def test_lr_rules_and_bad_values():
    assert acc.scaled_lr(0.1, 32, 128, "linear") == pytest.approx(0.4)
    assert acc.scaled_lr(0.1, 32, 128, "sqrt") == pytest.approx(0.2)
    assert acc.scaled_lr(0.1, 32, 128, "none") == 0.1
    with pytest.raises(ValueError, match="rule must be one of"):
        acc.scaled_lr(0.1, 1, 2, "cubic")
    with pytest.raises(ValueError, match=r"accumulation_steps \(9\) must not exceed the effective batch_size \(8\)"):
        acc.micro_batch_sizes(8, 9)
    with pytest.raises(ValueError, match="recipe.accumulation_steps must be an integer >= 1, got 0"):
        cm.Recipe(accumulation_steps=0)
    with pytest.raises(ValueError, match="micro_batches must hold at least one batch"):
        acc.accumulate_gradients(torch.nn.Linear(1, 1), [])
