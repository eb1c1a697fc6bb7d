import json
import warnings

import pytest

from colab_memopt.__main__ import main
from colab_memopt.costs import TECHNIQUES, TechniqueCosts
from colab_memopt.models import build_model
from colab_memopt.recommender import CANDIDATE_AXES, NoRecipeFits, candidate_recipes, recommend

# Made-up ratios for the logic tests (the committed, measured ones are used by the CLI test).
COSTS = TechniqueCosts(ratios={k: 1.0 + 0.1 * i for i, k in enumerate(TECHNIQUES)}, device="test", model="tiny", batch=1, seq_len=8)


def _small():
    return build_model("small", device="cpu")


def test_candidates_cover_the_axes_and_accumulation_divides_the_batch():
    cands = candidate_recipes(4)
    n_axes = 1
    for options in CANDIDATE_AXES.values():
        n_axes *= len(options)
    assert len(cands) == n_axes * 3  # accumulation 1, 2, 4
    assert {c.accumulation_steps for c in candidate_recipes(3)} == {1}
    assert all(c.precision in ("fp32", "fp16-autocast") for c in cands)
    assert all(c.lora_rank == 16 and c.quantization == "nf4" for c in candidate_recipes(1, mode="qlora"))


def test_a_roomy_target_gets_the_cheapest_recipe_and_a_traced_plan():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = recommend(_small, 2, seq_len=32, target="a100-80gb", mode="full", costs=COSTS)
    assert r.chosen.slowdown.ratio == 1.0 and r.recipe.optimizer == "adamw" and r.recipe.checkpointing == "none"
    assert r.plan.fits and r.plan.method == "trace" and r.costs_device == "test"
    d = r.to_dict()
    assert d["expected_slowdown"] == 1.0 and d["predicted_peak_bytes"] > 0 and d["slowdown_measured_on"] == "test"


def test_fastest_takes_the_plain_recipe_over_noise_that_says_checkpointing_is_faster():
    noisy = TechniqueCosts(ratios={**COSTS.ratios, "checkpoint-every-2": 0.76, "checkpoint-selective": 0.99},
                           device="test", model="tiny", batch=1, seq_len=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = recommend(_small, 2, seq_len=32, target="a100-80gb", mode="full", costs=noisy)
    assert r.recipe.checkpointing == "none" and r.chosen.slowdown.ratio == 1.0 and r.chosen.slowdown.n_techniques == 0
    assert any("counted as x1.00" in line and "checkpoint-every-2" in line for line in r.reasoning)


def test_a_tight_target_forces_a_leaner_recipe_that_still_fits():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roomy = recommend(_small, 8, seq_len=64, target="t4", mode="full", costs=COSTS)
        budget = int(roomy.plan.peak_bytes * 0.8)
        tight = recommend(_small, 8, seq_len=64, mode="full", costs=COSTS,
                          target={"name": "tiny-gpu", "device_bytes": budget, "host_bytes": 2**36, "cuda_context_bytes": 0, "cuda": False})
    assert tight.chosen.slowdown.ratio > 1.0
    assert tight.plan.device_need_bytes <= tight.plan.device_limit_bytes
    failed = [c for c in tight.candidates if not c.fits]
    assert failed and all(c.short_bytes > 0 for c in failed)
    assert any("screen" in line for line in tight.reasoning)


def test_auto_mode_moves_to_lora_then_qlora_and_says_why():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = recommend("llama-3.1-8b", 1, seq_len=512, target="t4", costs=COSTS, method="analytic")
    assert r.mode == "qlora" and r.recipe.quantization == "nf4" and r.recipe.lora_targets[0] == "q_proj"
    assert r.reasoning[0].startswith("mode full passed over") and r.reasoning[1].startswith("mode lora passed over")


def test_no_fit_says_what_would_be_needed():
    with pytest.raises(NoRecipeFits, match=r"needs .* of device memory .* would need a device with at least") as info:
        recommend("llama-3.1-8b", 1, seq_len=512, mode="full", costs=COSTS,
                  target={"name": "small-gpu", "device_bytes": 2**32, "host_bytes": 2**34})
    assert info.value.candidates and all(not c.fits for c in info.value.candidates)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="objective"):
        recommend("gpt2", 1, seq_len=64, objective="cheapest", costs=COSTS)
    with pytest.raises(ValueError, match="unknown model"):
        recommend("gpt-9", 1, costs=COSTS)
    with pytest.raises(ValueError, match="mode"):
        recommend("smollm2-135m", 1, seq_len=64, mode="prefix", costs=COSTS)
    with pytest.raises(ValueError, match="batch"):
        recommend("smollm2-135m", 0, seq_len=64, costs=COSTS)


def test_cli_prints_the_recipe_its_peak_and_its_slowdown(capsys):
    assert main(["recommend", "--model", "smollm2-135m", "--seq", "128", "--target", "t4", "--method", "analytic", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["optimizer"] and out["predicted_peak_bytes"] > 0 and out["expected_slowdown"] > 0
    assert out["slowdown_measured_on"]


def test_cli_reports_unknown_models_and_impossible_targets(capsys):
    assert main(["recommend", "--model", "gpt-9"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["recommend", "--model", "llama-3.1-8b", "--seq", "512", "--device-bytes", str(2**30),
                 "--host-bytes", str(2**34), "--method", "analytic"]) == 1
    assert "would need a device with at least" in capsys.readouterr().err


def _tiny():
    return build_model("tiny", device="cpu")


def test_probe_row_122_a_factory_past_its_sequence_length_is_refused_as_plan_refuses_it():
    # was: 'fp32 AdamW (baseline)', fits, the reason only in rec.plan.warnings
    from colab_memopt.planner import plan

    with pytest.raises(ValueError) as by_plan:
        plan(_tiny, 1, seq_len=100)
    with pytest.raises(ValueError) as by_recommend:
        recommend(_tiny, 1, seq_len=100, costs=COSTS)
    assert str(by_plan.value) == str(by_recommend.value) == "seq_len 100 exceeds 'GPT''s maximum of 64"
    with pytest.raises(ValueError, match="seq_len 100000 exceeds 'tiny''s maximum of 64"):
        recommend("tiny", 1, seq_len=100000, costs=COSTS)


@pytest.mark.parametrize("headroom", [2, 1, 1.5, -0.5, float("nan"), True, "0.1"])
def test_probe_rows_123_and_49_headroom_is_checked_before_anything(headroom):
    # was: NoRecipeFits with negative sizes (2), ZeroDivisionError (1)
    with pytest.raises(ValueError, match=r"headroom must be in \[0, 1\) .*got"):
        recommend("tiny", 1, seq_len=32, headroom=headroom, costs=COSTS)


def test_plan_warnings_and_the_analytic_fallback_are_in_the_text_and_json():
    # probe row 43's second half: the recommender dropped the plan's warnings
    def untraceable():
        model = _tiny()
        forward = model.forward

        def data_dependent(input_ids, *args, **kwargs):
            if bool((input_ids > 10**9).any()):  # fake tensors cannot decide this: the trace fails
                pass
            return forward(input_ids, *args, **kwargs)

        model.forward = data_dependent
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = recommend(untraceable, 1, seq_len=16, mode="full", costs=COSTS)
    assert rec.plan.method == "analytic" and rec.warnings and "could not trace" in rec.warnings[0]
    assert rec.to_dict()["warnings"] == rec.warnings
    text = str(rec)
    assert f"warning: {rec.warnings[0]}" in text
    assert "fell back from the trace to the analytic estimate: could not trace" in text


@pytest.mark.parametrize("factory, says", [
    (lambda: 5, "model must return a torch.nn.Module, it returned int"),
    (lambda n: _tiny(), "model must be callable with no arguments"),
])
def test_a_factory_that_builds_no_model_is_named(factory, says):
    with pytest.raises(TypeError, match=says):
        recommend(factory, 1, seq_len=16, costs=COSTS)


# -- issue 16: long context (offloaded checkpoints, the chunked loss) and the host-RAM check ---------

def _big_vocab_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))


def _least_need(cands):
    return min(c.analytic_need_bytes for c in cands)


def test_long_context_candidates_come_in_when_no_plain_one_fits():
    from colab_memopt import estimate
    from colab_memopt.planner import shape_model

    long = candidate_recipes(1, long_context=True)
    assert long and all(r.checkpointing == "offload" or r.loss_chunk_tokens for r in long)
    assert not any(r.checkpointing == "offload" or r.loss_chunk_tokens for r in candidate_recipes(1))
    meta = shape_model(_big_vocab_llama)
    plain_least = min(estimate.training_step_bytes(meta, 1, 2048, r).peak_bytes for r in candidate_recipes(1, mode="full"))
    long_least = min(estimate.training_step_bytes(meta, 1, 2048, r).peak_bytes
                     for r in candidate_recipes(1, mode="full", long_context=True))
    assert long_least < plain_least  # 2048 x 32768 fp32 logits: the chunked loss removes most of them
    budget = (plain_least + long_least) // 2
    target = {"name": "between", "device_bytes": int(budget / 0.9), "host_bytes": 2**40, "cuda_context_bytes": 0, "cuda": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = recommend(_big_vocab_llama, 1, seq_len=2048, target=target, mode="full", costs=COSTS, method="analytic")
    assert r.recipe.loss_chunk_tokens or r.recipe.checkpointing == "offload"
    assert r.plan.fits and any("long-context candidates" in line for line in r.reasoning)


def test_offloaded_checkpoints_over_the_host_ram_do_not_fit():
    from dataclasses import replace

    from colab_memopt.costs import expected_slowdown
    from colab_memopt.planner import Target, offloaded_checkpoint_bytes, plan
    from colab_memopt.recommender import Candidate

    offload = [r for r in candidate_recipes(1, long_context=True) if r.checkpointing == "offload"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(_big_vocab_llama, 1, seq_len=2048, recipe=offload, target="t4", method="analytic", find_max_batch=False)
    host = {c.name: c.bytes for c in p.host_costs}["offloaded checkpoints"]
    assert host == offloaded_checkpoint_bytes(_big_vocab_llama(), 1, 2048, offload) == 4 * 2048 * 64 * 4  # fp32 residual
    assert p.fits_host
    short = Target("short-host", p.target.device_bytes, int((p.host_need_bytes - host // 2) / (1 - p.headroom_fraction)))
    assert not replace(p, target=short).fits_host and not replace(p, target=short).fits  # the planner counts host RAM
    # the recommender's screen: a candidate whose offloaded checkpoints exceed the host RAM does not fit
    cand = Candidate("offload", offload, expected_slowdown(offload, COSTS), 1, 10, analytic_host_bytes=host,
                     host_limit_bytes=host - 1)
    assert not cand.fits and replace(cand, host_limit_bytes=host).fits
