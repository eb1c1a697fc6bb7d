"""One T4, one answer (newcomer-review-4 finding 7): every tool plans against the same total, CUDA context, usable
device memory and host RAM, and prints the same usable figure for the same run."""

from __future__ import annotations

import pytest

import colab_memopt as cm
from colab_memopt.core import env
from colab_memopt.planning.targets import DEFAULT_HEADROOM, TARGETS

T4 = TARGETS["t4"]
USABLE = T4.usable_bytes()
HOST_USABLE = T4.host_usable_bytes()


def test_the_t4_is_the_2026_card_with_its_measured_context_and_one_margin():
    assert T4.device_bytes == env.T4_TOTAL_BYTES == 14_912 * 2**20
    assert T4.cuda_context_bytes == env.T4_CUDA_CONTEXT_BYTES and "133-147 MiB" in T4.context_source
    assert USABLE == cm.T4_USABLE_BYTES and cm.format_bytes(USABLE) == "13.83 GiB"
    assert HOST_USABLE == cm.COLAB_HOST_USABLE_BYTES and cm.format_bytes(HOST_USABLE) == "11.24 GiB"


def test_every_tool_holds_the_same_run_to_the_same_usable_memory():
    from peft import LoraConfig
    from transformers import TrainingArguments

    from colab_memopt.planning import capacity, doctor, recommender
    from colab_memopt.planning.guard import MemoryGuardCallback
    from colab_memopt.techniques.architectures import resolve_model

    recipe = cm.Recipe(precision="fp16-autocast", lora_rank=8, lora_targets=("q_proj",), base_dtype="fp16",
                       checkpointing="full")
    limits = {
        "plan": cm.plan("smollm2-135m", 1, seq_len=64, recipe=recipe, target="t4", method="analytic",
                        find_max_batch=False),
        "recommend": recommender.recommend("smollm2-135m", 1, seq_len=64, target="t4", method="analytic").plan,
        "doctor": doctor.check_fit(resolve_model("smollm2-135m"), recipe, 1, 64, T4, "analytic")[1],
        "plan_trainer": cm.plan_trainer(TrainingArguments("/tmp/cm_one_t4", per_device_train_batch_size=1, use_cpu=True,
                                                          report_to=[], fp16=False),
                                        model="smollm2-135m", lora=LoraConfig(r=8, target_modules=["q_proj"]),
                                        target="t4", seq_len=64),
    }
    assert {name: (p.device_limit_bytes, p.host_limit_bytes) for name, p in limits.items()} == {
        name: (USABLE, HOST_USABLE) for name in limits}
    fit = capacity.best_fit("smollm2-135m", mode="lora", seq_len=64)
    assert fit is not None and fit.limit_bytes == USABLE
    assert MemoryGuardCallback(target="t4").headroom == DEFAULT_HEADROOM
    # what the command line prints: the same usable figure
    text = str(limits["plan"])
    assert f"of {cm.format_bytes(USABLE)} usable" in text and f"of {cm.format_bytes(HOST_USABLE)} usable" in text


@pytest.mark.parametrize("verb", ["plan", "recommend"])
def test_the_command_line_prints_the_same_usable_t4(verb, capsys):
    from colab_memopt.tooling.cli import main

    argv = [verb, "--model", "smollm2-135m", "--batch", "1", "--seq", "64", "--target", "t4", "--method", "analytic"]
    main(argv)
    out = capsys.readouterr().out
    assert f"{cm.format_bytes(USABLE)} usable" in out, out
    for stale in ("14.00 GiB", "13.27 GiB", "14.74 GiB"):
        assert stale not in out
