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


def _need(text: str) -> str:
    import re

    found = re.search(r"need ([\d.]+ [KMG]iB) of ([\d.]+ [KMG]iB) usable", text)
    assert found, text
    return found.group(0)


def test_doctor_plans_a_trainer_run_as_plan_trainer_and_a_recipe_as_plan(capsys, tmp_path):
    """issue 43.4 / 45.5: for one run, the doctor's device need is plan_trainer's (Trainer settings) or plan's
    (a Recipe), figure for figure, in Python and on the command line."""
    from peft import LoraConfig
    from trl import SFTConfig

    from colab_memopt.planning.doctor import doctor
    from colab_memopt.techniques.architectures import small_config
    from colab_memopt.tooling.cli import main

    # a small Llama saved as a model folder (the route of a model id): the figures, not the model's size, are tested
    small_config("llama", num_hidden_layers=4, dtype="bfloat16").save_pretrained(tmp_path / "llama")
    model = str(tmp_path / "llama")

    args = SFTConfig("/tmp/cm_one_t4_doctor", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_length=64, use_cpu=True, report_to=[], fp16=False)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    planned = cm.plan_trainer(args, model=model, lora=lora, target="t4")
    checked = doctor(model, recipe=args, lora=lora, target="t4")
    assert (checked.plan.device_need_bytes, checked.plan.device_limit_bytes, checked.plan.batch, checked.plan.seq_len) \
        == (planned.device_need_bytes, planned.device_limit_bytes, 4, 64)
    assert "does-not-fit" in checked.checked and _need(str(checked)) == _need(str(planned))
    with pytest.raises(ValueError, match="batch=2: with a Trainer or TrainingArguments the batch is theirs"):
        doctor(model, recipe=args, lora=lora, target="t4", batch=2)

    recipe = cm.Recipe(precision="fp16-autocast", lora_rank=8, base_dtype="fp16", checkpointing="full")
    argv = ["--model", model, "--batch", "2", "--seq", "64", "--target", "t4", "--recipe",
            "precision=fp16-autocast", "lora_rank=8", "base_dtype=fp16", "checkpointing=full"]
    main(["plan", *argv, "--no-max-batch"])
    plan_out = capsys.readouterr().out
    main(["doctor", *argv])
    doctor_out = capsys.readouterr().out
    planned = cm.plan(model, 2, seq_len=64, recipe=recipe, target="t4", find_max_batch=False)
    checked = doctor(model, recipe=recipe, target="t4", batch=2, seq_len=64)
    assert checked.plan.device_need_bytes == planned.device_need_bytes
    assert _need(doctor_out) == _need(plan_out) == _need(str(planned)) == _need(str(checked))


def test_doctor_of_a_trainer_is_plan_trainer_of_it():
    pytest.importorskip("trl")
    from test_guard import sft

    from colab_memopt.planning.doctor import doctor

    trainer = sft(fp16=True)  # fp16 autocast with its GradScaler (loss scale 2**16), as on a T4
    checked = doctor(trainer, target="t4", probe=False)
    planned = cm.plan_trainer(trainer, target="t4")
    assert checked.plan.device_need_bytes == planned.device_need_bytes and checked.plan.method == "trace"
    assert checked.plan.recipe["precision"] == planned.recipe["precision"] == "fp16-autocast"
