import pytest

import colab_memopt as cm
from colab_memopt.training.train import run_steps


def test_run_steps_returns_every_loss_and_prints_the_mean_since_the_last_line():
    losses = iter([4.0, 2.0, 3.0, 1.0, 5.0])
    lines = []
    out = run_steps(lambda: next(losses), 5, log_every=2, print_fn=lines.append)
    assert out == [4.0, 2.0, 3.0, 1.0, 5.0]
    assert [line.split("(")[0].strip() for line in lines] == ["step 2/5  loss 3.000", "step 4/5  loss 2.000",
                                                             "step 5/5  loss 5.000"]
    assert all(line.endswith(" s)") for line in lines)
    quiet = []
    assert run_steps(lambda: 1.0, 3, log_every=0, print_fn=quiet.append) == [1.0] * 3 and quiet == []


def test_run_steps_stops_at_a_non_finite_loss():
    losses = iter([1.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="the loss at step 2 is nan"):
        run_steps(lambda: next(losses), 3, print_fn=lambda s: None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=0), "steps must be an integer >= 1, got 0"),
    (dict(steps=2, log_every=-1), "log_every must be an integer >= 0"),
    (dict(steps=True), "steps must be an integer"),
])
def test_run_steps_names_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_steps(lambda: 1.0, **kwargs)


def test_run_steps_trains_in_fp16_autocast_under_a_loss_scale():
    """The T4's precision: fp16 autocast with a GradScaler (initial scale 2^16) through the same step."""
    model = cm.build_model("tiny", seed=0)
    recipe = cm.Recipe(precision="fp16-autocast", lr=3e-3)
    model, optimizer = recipe.build(model)
    corpus = cm.load_corpus(16384)
    step = cm.make_train_step(model, optimizer, corpus, batch_size=4, seq_len=32, recipe=recipe)
    losses = run_steps(step, 12, log_every=0)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
