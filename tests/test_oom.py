import pytest
import torch

import colab_memopt as cm
from colab_memopt.planning.oom import classify, diagnose, parse_oom_message

CUDA_MSG = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which "
            "1.10 GiB is free. Of the allocated memory 11.20 GiB is allocated by PyTorch, and 300.00 MiB is "
            "reserved by PyTorch but unallocated.")


def test_parse_cuda_and_budget_messages():
    info = parse_oom_message(CUDA_MSG)
    assert info["requested_bytes"] == 2 * 2**30 and info["capacity_bytes"] == int(14.74 * 2**30)
    assert info["reserved_unallocated_bytes"] == 300 * 2**20
    with pytest.raises(torch.OutOfMemoryError) as err:
        with cm.MemoryBudget(1000):
            torch.ones(1000)
    info = parse_oom_message(str(err.value))
    assert info["requested_bytes"] == 4000 and info["capacity_bytes"] == 1000


@pytest.mark.parametrize(
    "kwargs, situation",
    [(dict(step=0), "step 0"), (dict(step=7), "after N steps"), (dict(step=7, during="eval"), "during evaluation"),
     (dict(step=0, seq_len=2048), "long sequences"), (dict(step=9, oom_steps=[3]), "intermittent")],
)
def test_situations(kwargs, situation):
    diag = diagnose(CUDA_MSG, cm.Recipe(), **kwargs)
    assert diag.situation == situation and len(diag.suggestions) >= 3


def test_fragmentation_in_the_message_makes_it_intermittent():
    assert classify(step=5, during="train", seq_len=None, oom_steps=[], reserved_unallocated_bytes=3 * 2**30,
                    capacity_bytes=14 * 2**30) == "intermittent"


def test_step0_suggestions_are_ordered_and_predicted():
    diag = diagnose(CUDA_MSG, cm.Recipe(attention="naive"), config=cm.get_config("gpt2-small"), batch_size=16,
                    seq_len=512, step=0)
    actions = [s.action for s in diag.suggestions]
    assert "attention" in actions[0] and "micro-batch" in actions[-2] and "offload" in actions[-1]
    peaks = [s.predicted_peak_bytes for s in diag.suggestions]
    assert all(p is not None for p in peaks) and peaks == sorted(peaks, reverse=True)  # cumulative savings
    assert diag.suggestions[-1].fits is True and diag.suggestions[0].predicted_by.startswith("paper")
    # SDPA already on: not suggested again.
    diag2 = diagnose(CUDA_MSG, cm.Recipe(), config=cm.get_config("gpt2-small"), batch_size=16, seq_len=512, step=0)
    assert not any("attention" in s.action for s in diag2.suggestions)


def test_planner_is_used_when_the_recipe_has_the_field():
    calls = []

    def plan(recipe):
        calls.append(recipe)
        return type("Plan", (), {"peak_bytes": 123})()

    diag = diagnose(CUDA_MSG, cm.Recipe(attention="naive"), plan, config=cm.get_config("small"), batch_size=4,
                    seq_len=64, step=0)
    assert diag.suggestions[0].predicted_peak_bytes == 123 and diag.suggestions[0].predicted_by == "planner"
    assert calls[0].attention == "sdpa"
    assert diag.suggestions[1].predicted_by.startswith("paper")  # no mixed_precision field yet


def test_bad_input():
    with pytest.raises(ValueError, match="during must be 'train' or 'eval'"):
        diagnose(CUDA_MSG, during="test")
    with pytest.raises(ValueError, match="empty message"):
        diagnose("")
