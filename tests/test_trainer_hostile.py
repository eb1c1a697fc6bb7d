"""plan_trainer / fit_trainer / `plan --training-args` on the inputs of reliability probe 3 (shared/reviews/
reliability-probe-3.md): the plan is of the step the Trainer runs, leaves nothing on the user's model, and refuses
what the Trainer refuses, by the name the user wrote. Each `test_probe3_row_N...` reproduces that row."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import IA3Config, LoHaConfig, LoraConfig, PromptTuningConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Trainer, TrainingArguments  # noqa: E402
from trl import SFTConfig  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt import trainer as tr, trainerfit  # noqa: E402
from colab_memopt.tooling.cli import main  # noqa: E402

CFG = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
TINY_TARGET = {"name": "tiny", "device_bytes": 4 * 2**20, "host_bytes": 2**40, "cuda_context_bytes": 0}


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def hf_trainer(seq: int = 8, optimizer: bool = False, checkpointing: bool = False, peft: bool = False, **args) -> Trainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CFG))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if peft:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    rows = [[i % 1000 + 3 for i in range(seq)]] * 8
    values = {**dict(per_device_train_batch_size=1, max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                     disable_tqdm=True), **args}
    return Trainer(model=model, args=TrainingArguments("/tmp/colab_memopt_test_hostile", **values),
                   train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}),
                   optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None) if optimizer else (None, None))


def sft(**changes) -> SFTConfig:
    values = dict(output_dir="/tmp/colab_memopt_test_hostile", max_length=32, per_device_train_batch_size=2,
                  report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False)
    return SFTConfig(**{**values, **changes})


def measured_peak(trainer: Trainer) -> int:
    profiler = cm.MemoryProfiler(device="cpu", capacity_bytes=cm.T4_USABLE_BYTES)
    trainer.add_callback(profiler.callback())
    trainer.train()
    return profiler.samples[-1].peak_bytes


# -- the step the Trainer runs -------------------------------------------------------------------------
def test_probe3_row_104_a_users_own_optimizer_is_planned_not_optim():
    plan = tr.plan_trainer(hf_trainer(optimizer=True), target="cpu", seq_len=8)
    measured = measured_peak(hf_trainer(optimizer=True))
    assert abs(plan.peak_bytes - measured) <= 0.01 * measured, (plan.peak_bytes, measured)  # was +100 % (AdamW)
    assert plan.recipe["optimizer"] == "sgd" and plan.optimizer_impl.startswith("your SGD")
    assert any("optimizers=(SGD" in w and "adamw_torch_fused" in w for w in plan.warnings)
    tiny = {**TINY_TARGET, "device_bytes": 2 * 2**20}
    assert not any("optim" in c for c in trainerfit._candidates(hf_trainer().args, tr._target(tiny), hf_trainer(optimizer=True)))
    assert any("optim" in c for c in trainerfit._candidates(hf_trainer().args, tr._target(tiny), hf_trainer()))


def test_probe3_row_108_checkpointing_the_user_enabled_on_the_model_is_planned_on():
    """The Trainer never turns a model's own checkpointing off: planned as with gradient_checkpointing=True."""
    sized = dict(seq=256, optimizer=True, per_device_train_batch_size=4)  # activations over the optimizer's bytes
    kept = tr.plan_trainer(hf_trainer(**sized, checkpointing=True), target="cpu", seq_len=256)
    asked = tr.plan_trainer(hf_trainer(**sized, gradient_checkpointing=True,
                                       gradient_checkpointing_kwargs={"use_reentrant": False}), target="cpu", seq_len=256)
    off = tr.plan_trainer(hf_trainer(**sized), target="cpu", seq_len=256)
    assert kept.peak_bytes == asked.peak_bytes < off.peak_bytes
    assert kept.recipe["checkpointing"] == "full" and any("checkpointing on" in w for w in kept.warnings)
    trainer = hf_trainer(checkpointing=True)  # fit_trainer does not offer what the model already has
    assert not any("gradient_checkpointing" in c for c in trainerfit._candidates(trainer.args, tr._target("t4"), trainer))


def test_probe3_row_113_a_what_if_leaves_no_hook_flag_or_state_behind():
    trainer = hf_trainer(seq=32, peft=True)
    model = trainer.model
    before = [(m, dict(m.__dict__), {k: len(v) for k, v in m.__dict__.items() if "hook" in k and isinstance(v, dict)})
              for m in model.modules()]
    emb = model.get_input_embeddings()
    what_if = tr.plan_trainer(trainer, target="cpu", seq_len=32, gradient_checkpointing=True)
    plain = tr.plan_trainer(trainer, target="cpu", seq_len=32)
    assert len(emb._forward_hooks) == 0 and not model.is_gradient_checkpointing  # peft's input-grads hook was left
    for module, attrs, hooks in before:
        assert module.__dict__.keys() == attrs.keys()
        assert {k: len(module.__dict__[k]) for k in hooks} == hooks
    assert what_if.recipe["checkpointing"] == "full" and what_if.peak_bytes < plain.peak_bytes
    assert trainer.accelerator.num_processes == 1  # rebuilding the arguments reset accelerate's state


def test_probe3_rows_50_53_56_59_60_changes_are_refused_as_the_trainer_refuses_them():
    trainer = hf_trainer()
    refused = [
        (dict(fp16=True, bf16=True), "At most one of fp16 and bf16"),
        (dict(per_device_train_batch_size=2.7), "per_device_train_batch_size must be an integer >= 1, got 2.7"),
        (dict(per_device_train_batch_size=0), "per_device_train_batch_size must be an integer >= 1, got 0"),
        (dict(per_device_train_batch_size=-2), "per_device_train_batch_size must be an integer >= 1, got -2"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be an integer >= 1"),
        (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs="use_reentrant=False"),
         "gradient_checkpointing_kwargs must be a dict"),
        (dict(deepspeed={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}), "deepspeed=.*DeepSpeed"),
        (dict(fsdp="full_shard offload"), "fsdp='full_shard offload'.*FSDP"),
        (dict(seq_len=2.5), "seq_len must be an integer >= 1, got 2.5"),
    ]
    for changes, match in refused:
        with pytest.raises(ValueError, match=match):
            tr.plan_trainer(trainer, target="cpu", **{"seq_len": 8, **changes})
    with pytest.raises(ValueError, match="per_device_train_batch_size must be an integer >= 1, got 0"):
        tr.plan_trainer(sft(), model=LlamaConfig(**CFG), per_device_train_batch_size=0)  # not TRL's IndexError


def test_probe3_rows_59_60_a_built_trainers_deepspeed_and_fsdp_are_named():
    from types import SimpleNamespace

    args = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}, fsdp=["full_shard", "offload"])
    lines = tr._unplanned_parallelism(args)
    assert lines[0].startswith("deepspeed={'zero_optimization': {'stage': 2}}: not modeled")
    assert lines[1].startswith("fsdp='full_shard offload': not modeled")
    assert tr._unplanned_parallelism(SimpleNamespace(deepspeed=None, fsdp=[])) == []


def test_probe3_rows_19_20_168_the_planners_own_trainer_takes_what_the_users_run_has():
    from accelerate.state import AcceleratorState

    before = dict(AcceleratorState._shared_state)
    plain = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), target="cpu")
    assert AcceleratorState._shared_state == before  # the planner's own Trainer's accelerator state is not left behind
    for changes in (dict(eval_strategy="steps", eval_steps=10), dict(assistant_only_loss=True)):
        assert tr.plan_trainer(sft(**changes), model=LlamaConfig(**CFG), target="cpu").peak_bytes == plain.peak_bytes


def test_probe3_rows_11_12_packing_is_planned_as_its_full_rows():
    plain = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), target="cpu")
    packed = tr.plan_trainer(sft(packing=True), model=LlamaConfig(**CFG), target="cpu")
    assert packed.peak_bytes == plain.peak_bytes
    # said once: the settings' note and each trace's (two depths of the stack) said it three times, two ways
    assert [w for w in packed.warnings if "packing=True" in w] == [
        "packing=True: planned as full rows of max_length (the same tokens); the packed row's attention is not traced"]


def test_probe3_rows_3_4_reference_gpts_are_refused_by_name():
    for args in (sft(), TrainingArguments("/tmp/colab_memopt_test_hostile", report_to=[], use_cpu=True)):
        with pytest.raises(ValueError, match="model='tiny' is one of this project's reference GPTs"):
            tr.plan_trainer(args, model="tiny", seq_len=32)


def test_probe3_row_52_a_learned_position_table_shorter_than_the_sequence_is_refused():
    gpt2 = GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_size=128)
    args = TrainingArguments("/tmp/colab_memopt_test_hostile", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="seq_len=256 .*64 positions"):
        tr.plan_trainer(args, model=gpt2, seq_len=256)
    assert tr.plan_trainer(args, model=gpt2, seq_len=64, target="cpu").seq_len == 64


@pytest.mark.parametrize(("peft", "named"), [
    (IA3Config(task_type="CAUSAL_LM", target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "IA3"),
    (LoHaConfig(r=4, target_modules=["q_proj"]), "LOHA"),
    (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), "PROMPT_TUNING"),
])
def test_probe3_rows_82_85_peft_configs_other_than_lora_are_planned_and_named(peft, named):
    plan = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), lora=peft, target="cpu")
    assert not plan.recipe["lora_rank"] and any(f"peft {named}" in w for w in plan.warnings)


def test_probe3_rows_68_77_174_175_lora_as_a_dict_and_what_the_recipe_cannot_say():
    as_dict = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), lora={"r": 4, "target_modules": ["q_proj"]}, target="cpu")
    as_config = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), lora=LoraConfig(r=4, target_modules=["q_proj"]),
                                target="cpu")
    assert as_dict.peak_bytes == as_config.peak_bytes and as_dict.recipe["lora_rank"] == 4
    dora = tr.plan_trainer(sft(), model=LlamaConfig(**CFG), target="cpu",
                           lora=LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, layers_to_transform=[0]))
    assert any("use_dora=True" in w for w in dora.warnings)
    assert any("layers_to_transform=[0]" in w for w in dora.warnings)


def test_probe3_rows_118_119_fit_trainer_is_bounded_and_says_when_it_stops():
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=f"max_plans must be an integer >= 1, got {bad}"):
            trainerfit.fit_trainer(sft(), model=LlamaConfig(**CFG), max_plans=bad)
    fit = trainerfit.fit_trainer(sft(), model=LlamaConfig(**CFG), target=TINY_TARGET, max_plans=1)
    assert not fit.fits and len(fit.tried) == 1
    assert fit.notes[0].startswith("stopped after max_plans=1 plans") and "stopped after" in str(fit)


# -- plan --training-args ------------------------------------------------------------------------------
@pytest.fixture()
def model_dir(tmp_path):
    LlamaConfig(**CFG).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def plan_file(tmp_path, model_dir, text: str, *extra: str) -> tuple[int, dict]:
    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\n" + text)
    code = main(["plan", "--model", str(model_dir), "--training-args", str(path), "--no-max-batch", "--json", *extra])
    return code, path


def _out(capsys) -> dict:
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return json.loads(out)


def test_probe3_row_153_yaml_numbers_written_as_strings_are_read_as_trl_reads_them(tmp_path, model_dir, capsys):
    code, _ = plan_file(tmp_path, model_dir, "max_length: 32\nlearning_rate: 2e-4\nper_device_train_batch_size: '2'\n")
    out = _out(capsys)
    assert code == 0 and out["recipe"]["lr"] == 2e-4 and out["batch"] == 2, out


@pytest.mark.parametrize(("text", "named"), [
    ("max_length: 32\nper_device_train_batch_size: eight\n", "per_device_train_batch_size: 'eight' is not an integer"),
    ("max_length: 32\nper_device_train_batch_size: 2.5\n", "per_device_train_batch_size must be an integer >= 1, got 2.5"),
    ("max_length: 32\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: use_reentrant=False\n",
     "gradient_checkpointing_kwargs must be a dict"),
    ("max_length: 32\ndeepspeed:\n  zero_optimization:\n    stage: 3\n", "deepspeed: the plan does not model DeepSpeed"),
    ("max_length: [32\n\tbf16: true\n", "is not valid YAML"),
    ("per_device_train_batch_size: 2\n", "the file sets no max_length: give --seq"),
])
def test_probe3_rows_154_155_157_161_169_170_bad_files_are_one_line_errors(tmp_path, model_dir, capsys, text, named):
    code, _ = plan_file(tmp_path, model_dir, text)
    error = _out(capsys)["error"]
    assert code == 2 and named in error and "\n" not in error, error


def test_probe3_row_150_a_huge_list_of_unknown_keys_is_capped(tmp_path, model_dir, capsys):
    code, _ = plan_file(tmp_path, model_dir, "".join(f"key_{i:05d}: 1\n" for i in range(5000)))
    error = _out(capsys)["error"]
    assert code == 2 and "'key_00000'" in error and "and 4992 more" in error and len(error) < 300, error


def test_probe3_row_191_method_analytic_is_refused_with_training_args(tmp_path, model_dir, capsys):
    code, _ = plan_file(tmp_path, model_dir, "max_length: 32\n", "--method", "analytic")
    assert code == 2 and "--method analytic" in _out(capsys)["error"]


def test_an_sft_file_without_fp16_or_bf16_plans_on_a_machine_without_a_gpu(tmp_path, model_dir, capsys):
    """SFTConfig's bf16 default is True, which TrainingArguments refuses without a GPU unless use_cpu is set."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _ = plan_file(tmp_path, model_dir, "max_length: 32\nuse_peft: true\nlora_r: '4'\n")
    out = _out(capsys)
    assert code == 0 and out["recipe"]["precision"] == "bf16-autocast" and out["recipe"]["lora_rank"] == 4, out


# -- reliability probe 4 (shared/reviews/reliability-probe-4.md) ----------------------------------------
@pytest.mark.parametrize(("suffix", "text", "named"), [
    (".yaml", "max_length: 32\nper_device_train_batch_size: 2\nper_device_train_batch_size: 64\n",
     "gives 'per_device_train_batch_size' twice (line 4) (2, then 64): keep the one you mean"),
    (".json", '{"max_length": 32, "per_device_train_batch_size": 2, "per_device_train_batch_size": 64}',
     "gives 'per_device_train_batch_size' twice (2, then 64): keep the one you mean"),
    (".yaml", "max_length: 32\nmodel_init_kwargs:\n  dtype: float16\n  dtype: bfloat16\n", "gives 'dtype' twice"),
])
def test_probe4_a_key_given_twice_is_refused_not_read_as_the_last(tmp_path, model_dir, capsys, suffix, text, named):
    # YAML and JSON keep the last of two equal keys silently: the probe's file was planned at 64 without a word
    path = tmp_path / f"args{suffix}"
    path.write_text(text if suffix == ".json" else f"output_dir: {tmp_path / 'out'}\n" + text)
    code = main(["plan", "--model", str(model_dir), "--training-args", str(path), "--no-max-batch", "--json"])
    error = _out(capsys)["error"]
    assert code == 2 and named in error and "\n" not in error, error


def test_probe4_a_yaml_merge_key_may_be_overridden(tmp_path):
    from colab_memopt.planning.hfconfig import read_mapping

    path = tmp_path / "a.yaml"
    path.write_text("base: &b\n  max_length: 32\n  per_device_train_batch_size: 2\nargs:\n  <<: *b\n  max_length: 64\n")
    assert read_mapping(path)["args"] == {"max_length": 64, "per_device_train_batch_size": 2}


def test_probe4_packing_plans_its_largest_batch_in_fp16():
    # `plan --training-args` with packing: true, fp16: true exited 3: the largest-batch search traced the packed row
    # itself, whose sequence starts come from nonzero(), a size the fake tensors do not know
    # (GuardOnDataDependentSymNode); it is traced as the plan is, as full rows of max_length
    need = cm.plan_trainer(sft(fp16=True, max_length=64), model=LlamaConfig(**CFG), target=TINY_TARGET).device_need_bytes
    small = {**TINY_TARGET, "device_bytes": int(1.5 * need)}  # room for a few more rows than the batch of 2
    plans = {packing: cm.plan_trainer(sft(packing=packing, fp16=True, max_length=64), model=LlamaConfig(**CFG),
                                      target=small, find_max_batch=True) for packing in (True, False)}
    assert plans[True].max_batch == plans[False].max_batch > 2, {k: p.max_batch for k, p in plans.items()}
    assert plans[True].peak_bytes == plans[False].peak_bytes  # the same full rows


def test_probe4_a_regex_target_modules_gives_the_modules_peft_matched():
    # plan.recipe["lora_targets"] was the reference GPT's defaults ('qkv', 'proj', 'up', 'down'), which a Llama lacks
    plan = cm.plan_trainer(sft(), model=LlamaConfig(**CFG), target="cpu",
                           lora=LoraConfig(r=4, target_modules=r".*\.(q|v)_proj", task_type="CAUSAL_LM"))
    assert tuple(plan.recipe["lora_targets"]) == ("q_proj", "v_proj"), plan.recipe
    # the regex is still named, in the plan's notes (how it was planned: explain())
    assert any("target_modules=" in w and "(q|v)_proj" in w for w in plan.notes) and "(q|v)_proj" in plan.explain()
    listed = cm.plan_trainer(sft(), model=LlamaConfig(**CFG), target="cpu",
                             lora=LoraConfig(r=4, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM"))
    assert tuple(listed.recipe["lora_targets"]) == ("q_proj", "v_proj") and listed.peak_bytes == plan.peak_bytes


def test_probe4_an_impossible_model_init_dtype_is_refused_whatever_the_model():
    # round 3 refused model_init_kwargs={'dtype': 'float8'} by name; probe 4 found it accepted with model=<a config>
    # (TRL reads the field only for a model id, but the value is wrong for any model)
    for model in (LlamaConfig(**CFG), "llama"):
        with pytest.raises(ValueError, match=r"model_init_kwargs\['dtype'\] must be 'auto', 'float32', 'float16' or "
                                             r"'bfloat16' .*got 'float8'"):
            cm.plan_trainer(sft(model_init_kwargs={"dtype": "float8"}), model=model, target="cpu")
    with pytest.raises(ValueError, match=r"model_init_kwargs must be a dict such as \{'dtype': 'float16'\}, got 'fp16'"):
        cm.plan_trainer(sft(model_init_kwargs="fp16"), model=LlamaConfig(**CFG), target="cpu")


class _BrokenRows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise KeyError("text")


def test_probe4_a_dataset_whose_rows_raise_is_named_not_a_missing_loss():
    # the plan failed with transformers' "The model did not return a loss ... only the following keys: logits"
    trainer = hf_trainer()
    trainer.train_dataset = _BrokenRows()
    with pytest.raises(ValueError, match=r"cannot read a row of the train dataset: its first row raised KeyError: "
                                         r"'text'"):
        cm.plan_trainer(trainer, target="cpu", seq_len=8)
    trainer.train_dataset = Dataset.from_dict({"input_ids": [], "labels": []})  # no rows: still planned, as before
    assert cm.plan_trainer(trainer, target="cpu", seq_len=8).peak_bytes > 0


def test_a_built_model_given_as_model_is_refused_with_what_to_give():
    """Recheck of probe 4: plan_trainer(args, model=<a built model>) called the model as a zero-argument builder and
    raised transformers' "You must specify exactly one of input_ids or inputs_embeds"."""
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    import colab_memopt as cm

    built = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    args = TrainingArguments("/tmp/colab_memopt_test_built", per_device_train_batch_size=2, use_cpu=True, report_to=[])
    for call in (cm.plan_trainer, cm.fit_trainer):
        with pytest.raises(TypeError, match=r"model= got a LlamaForCausalLM already built: .*model.config.*"
                                            r"cm.plan_trainer\(trainer\)"):
            call(args, model=built, target="t4", seq_len=32)
    assert cm.plan_trainer(args, model=built.config, target="t4", seq_len=32).batch == 2  # its config is planned
