import pytest

from colab_memopt import capacity
from colab_memopt.recipe import Recipe


def test_params_and_scaled_models():
    assert capacity.model_params("smollm2-135m") == pytest.approx(134.5e6, rel=0.01)
    one, two = capacity.model_params(capacity.scaled("smollm2-135m", 1)), capacity.model_params(capacity.scaled("smollm2-135m", 2))
    assert two > one
    with pytest.raises(ValueError, match="num_layers"):
        capacity.scaled("smollm2-135m", 0)
    with pytest.raises(ValueError, match="unknown architecture"):
        capacity.scaled("tiny", 2)


def test_leaner_recipes_fit_more():
    full = capacity.fit("llama-3.2-1b", "baseline", Recipe(), mode="full", seq_len=512)
    best = capacity.best_fit("llama-3.2-1b", mode="full", seq_len=512)
    qlora = capacity.best_fit("llama-3.2-1b", mode="qlora", seq_len=512)
    assert full.need_bytes > best.need_bytes > qlora.need_bytes and qlora.fits and not full.fits


def test_capacity_table_rows_and_qlora_8b_at_512():
    rows = capacity.capacity_table(["smollm2-135m", "llama-3.1-8b"], seq_lens=(512,), modes=("full", "qlora"), presets=("maximum",))
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["qlora"]["largest_model"] == "llama-3.1-8b"
    assert by_mode["full"]["largest_model"] == "smollm2-135m" and by_mode["full"]["next_short_bytes"] > 0
    assert by_mode["full"]["next_model"] == "llama-3.1-8b"
    with pytest.raises(ValueError, match="unknown model"):
        capacity.capacity_table(["gpt-9"])


def test_largest_scaled_brackets_the_limit():
    fit, miss = capacity.largest_scaled("llama-3.2-1b", mode="full", seq_len=512, max_layers=32)
    assert fit is not None and fit.fits and miss is not None and not miss.fits
    assert miss.params > fit.params


def test_longest_sequence_is_the_boundary_of_the_planned_fit():
    """issue 16: the longest multiple of step_tokens whose plan fits; the next one up does not."""
    import warnings

    from colab_memopt import Recipe
    from colab_memopt.capacity import longest_sequence
    from colab_memopt.planner import plan

    recipe = Recipe(loss_chunk_tokens=8)
    at_32 = plan("tiny", 1, seq_len=32, recipe=recipe, target={"device_bytes": 2**30, "host_bytes": 2**40, "cuda": False},
                 find_max_batch=False)
    target = {"name": "tight", "device_bytes": int(at_32.peak_bytes / 0.95) + 1, "host_bytes": 2**40, "cuda": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = longest_sequence("tiny", recipe, target=target, step_tokens=8, guess_tokens=8)
        assert res.max_seq_len >= 32 and res.method == "trace" and res.converged
        assert res.max_seq_len == 64 or not plan("tiny", 1, seq_len=res.max_seq_len + 8, recipe=recipe, target=target,
                                                   find_max_batch=False).fits
    assert res.first_miss is not None and res.host_need_bytes > 0 and res.device_need_bytes <= int(target["device_bytes"] * 0.95)
    with pytest.raises(ValueError, match="step_tokens must be an integer >= 1, got 0"):
        longest_sequence("tiny", recipe, step_tokens=0)
