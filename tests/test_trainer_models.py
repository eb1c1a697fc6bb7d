"""plan_trainer on the Trainers users really have, against the step peak the Trainer reaches on the CPU
(MemoryProfiler's callback): a model loaded in bf16 (the CPU's half type: the same bytes as fp16 on a T4), a QLoRA
SFTTrainer holding a real bitsandbytes 4-bit or 8-bit model, a plain Trainer over a PyTorch Dataset, a model that
lives on another device; and the dtype a plan from settings loads the base in."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("trl")
pytest.importorskip("bitsandbytes")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    Trainer,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt import trainer as tr, trainertrace  # noqa: E402
from colab_memopt.planning.hfconfig import save_example_chat_model  # noqa: E402

SEQ = 64


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny llama saved in bf16 (config.json says dtype bfloat16), with its tokenizer."""
    root = tmp_path_factory.mktemp("models")
    fp32 = save_example_chat_model("llama", root / "fp32")
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    AutoTokenizer.from_pretrained(fp32).save_pretrained(root / "bf16")
    return str(root / "bf16")


def lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def train_args(**changes) -> TrainingArguments:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer_models", per_device_train_batch_size=2, max_steps=2,
                  logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False)
    return TrainingArguments(**{**values, **changes})


def sft_args(**changes) -> SFTConfig:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer_models", per_device_train_batch_size=2, max_length=SEQ,
                  max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                  bf16=False)
    return SFTConfig(**{**values, **changes})


def quiet(build):
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build()
    finally:
        logging.disable(logging.NOTSET)


def measured_peak(trainer) -> int:
    """Return the second step's peak (the first also makes the optimizer state), as tests/test_trainer.py does."""
    profiler = cm.MemoryProfiler(device="cpu", capacity_bytes=cm.T4_USABLE_BYTES)
    trainer.add_callback(profiler.callback())
    quiet(trainer.train)
    return profiler.samples[-1].peak_bytes


def qlora_trainer(folder: str, bnb: BitsAndBytesConfig, *, prepare: bool = False) -> SFTTrainer:
    model = quiet(lambda: AutoModelForCausalLM.from_pretrained(folder, quantization_config=bnb, device_map="cpu"))
    if prepare:  # (its own checkpointing left off: the Trainer turns on the one SFTConfig names, see the report)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    text = Dataset.from_dict({"text": ["hello world " * 20] * 8})  # every row longer than max_length: full rows
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return quiet(lambda: SFTTrainer(model=model, args=sft_args(), processing_class=tokenizer, train_dataset=text,
                                    peft_config=lora()))


NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.mark.parametrize(("bnb", "prepare"), [(NF4, False), (NF4, True), (dict(load_in_8bit=True), False)],
                         ids=["nf4", "nf4-prepared", "int8"])
def test_a_qlora_sft_trainer_holding_a_real_bitsandbytes_model_is_planned_within_one_percent(bf16_folder, bnb, prepare):
    trainer = qlora_trainer(bf16_folder, BitsAndBytesConfig(**bnb), prepare=prepare)
    layer = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    kept = ("state", "quant_state", "compute_dtype", "compute_type_is_set")
    weight, state = layer.weight, (dict(vars(layer.weight)), {k: getattr(layer, k, None) for k in kept})
    inner = dict(vars(layer.state)) if hasattr(layer, "state") else None
    guard = cm.MemoryGuardCallback(target="t4")  # plans the real Trainer at on_train_begin, before step 1
    trainer.add_callback(guard)
    plan = tr.plan_trainer(trainer, target="cpu")
    # the real weights and bitsandbytes' states are untouched: the same objects, the same attributes
    assert layer.weight is weight and (dict(vars(layer.weight)), {k: getattr(layer, k, None) for k in kept}) == state
    assert inner is None or vars(layer.state) == inner
    measured = measured_peak(trainer)
    assert abs(plan.peak_bytes - measured) <= 0.01 * measured, (plan.peak_bytes, measured)
    assert guard.plan is not None and trainer.state.global_step == 2


def test_a_qlora_plan_from_settings_is_the_plan_of_the_trainer_it_builds(bf16_folder):
    """plan_trainer(SFTConfig, model=, lora=, bnb=, dtype=) before loading: the non-quantized modules in the load
    dtype (bf16 here, as from_pretrained loads them), the 4-bit layers computing in bnb_4bit_compute_dtype."""
    trainer = qlora_trainer(bf16_folder, BitsAndBytesConfig(**NF4))
    from_trainer = tr.plan_trainer(trainer, target="cpu")
    before = tr.plan_trainer(sft_args(), model=bf16_folder, lora=lora(), bnb=NF4, dtype=torch.bfloat16, target="cpu")
    assert before.peak_bytes == pytest.approx(from_trainer.peak_bytes, rel=0.001)
    assert before.by_category["parameters"] == from_trainer.by_category["parameters"]
    # bitsandbytes' absmax as loaded (BitsAndBytesConfig's default: one fp32 per 64 weights, not double-quantized)
    scales = [[c.bytes for c in p.device_costs if c.name == "quantization scales"] for p in (before, from_trainer)]
    assert scales[0] == scales[1] and scales[0][0] > 0
    # SFTTrainer given the folder itself loads it in fp32 (TRL's rule): the embeddings, norms and head in fp32
    as_id = tr.plan_trainer(sft_args(), model=bf16_folder, lora=lora(), bnb=NF4, target="cpu")
    assert as_id.by_category["parameters"] > before.by_category["parameters"]


def test_lora_on_a_bf16_base_is_planned_as_loaded_before_loading_and_from_the_trainer(bf16_folder):
    """A plain Trainer over a model loaded with from_pretrained (transformers 5: the config's dtype, bf16 here),
    over a datasets.Dataset and over a PyTorch Dataset yielding input_ids and labels."""

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.ones(SEQ, dtype=torch.long), "labels": torch.ones(SEQ, dtype=torch.long)}

    rows = {"input_ids": [[1] * SEQ] * 8, "labels": [[1] * SEQ] * 8}
    autocast = dict(bf16=True, gradient_checkpointing=True)  # the CPU's 16-bit autocast, as fp16=True on a T4
    for data, changes in ((Dataset.from_dict(rows), {}), (Rows(), {}), (Dataset.from_dict(rows), autocast)):
        before = tr.plan_trainer(train_args(**changes), model=bf16_folder, lora=lora(), target="cpu", seq_len=SEQ)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_folder), lora())
        trainer = quiet(lambda: Trainer(model=model, args=train_args(**changes), train_dataset=data))
        planned = tr.plan_trainer(trainer, target="cpu", seq_len=SEQ).peak_bytes
        measured = measured_peak(trainer)
        assert abs(planned - measured) <= 0.01 * measured, (type(data).__name__, changes, planned, measured)
        assert before.peak_bytes == pytest.approx(planned, rel=0.001)
    params = sum(p.numel() for p in model.parameters())
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert before.by_category["parameters"] == 2 * (params - adapters) + 4 * adapters  # bf16 base, fp32 adapters
    assert before.recipe["base_dtype"] == "bf16"  # LoRA's bf16 frozen base under bf16 autocast: a Recipe says it
    plain = tr.plan_trainer(train_args(), model=bf16_folder, lora=lora(), target="cpu", seq_len=SEQ)
    assert plain.recipe["base_dtype"] is None
    assert any(w.startswith("the model loaded in bfloat16: planned as loaded") for w in plain.notes)


def test_the_load_dtype_of_a_plan_from_settings(bf16_folder):
    def params(args, **kwargs):
        return tr.plan_trainer(args, model=bf16_folder, lora=lora(), target="cpu", seq_len=16, **kwargs).by_category[
            "parameters"]

    bf16 = params(train_args())  # from_pretrained with no dtype: the config's (bfloat16)
    assert params(train_args(), dtype="bfloat16") == params(train_args(), dtype="auto") == bf16
    assert params(train_args(), dtype=torch.float16) == bf16
    fp32 = params(train_args(), dtype=torch.float32)
    assert fp32 > 1.9 * bf16
    assert params(sft_args()) == fp32  # SFTTrainer(model=<id>) loads fp32 unless model_init_kwargs names a dtype
    assert params(sft_args(model_init_kwargs={"dtype": "bfloat16"})) == bf16
    assert params(sft_args(model_init_kwargs={"dtype": "auto"})) == bf16
    assert params(sft_args(model_init_kwargs={"dtype": "float32"}), dtype="bfloat16") == bf16  # what you load wins
    with pytest.raises(ValueError, match=r"dtype must be 'auto', 'float32', 'float16' or 'bfloat16'.*got 'int8'"):
        params(train_args(), dtype="int8")
    with pytest.raises(ValueError, match=r"model_init_kwargs\['dtype'\] must be .*got 'bf17'"):
        params(sft_args(model_init_kwargs={"dtype": "bf17"}))


def test_bitsandbytes_settings_are_read_as_the_trainer_reads_them(bf16_folder):
    # a dict is a BitsAndBytesConfig's fields, as the CLI reads them
    as_dict = tr.plan_trainer(sft_args(), model=bf16_folder, lora=lora(), bnb=NF4, target="cpu")
    as_config = tr.plan_trainer(sft_args(), model=bf16_folder, lora=lora(), bnb=BitsAndBytesConfig(**NF4), target="cpu")
    assert as_dict.recipe["quantization"] == "nf4" and as_dict.peak_bytes == as_config.peak_bytes
    with pytest.raises(ValueError, match="unknown BitsAndBytesConfig field"):
        tr.plan_trainer(sft_args(), model=bf16_folder, lora=lora(), bnb={"load_in_4bits": True}, target="cpu")
    # the Trainer refuses to fine-tune a quantized model without adapters: so does its plan
    with pytest.raises(ValueError, match=r"BitsAndBytesConfig\(load_in_4bit=True\) without LoRA.*purely quantized"):
        tr.plan_trainer(sft_args(), model=bf16_folder, bnb=NF4, target="cpu")
    # the planner's model is marked quantized as from_pretrained marks it (what the Trainer's own checks read)
    built = trainertrace._fake_trainer(sft_args(), bf16_folder, lora(), BitsAndBytesConfig(**NF4), SEQ, trainertrace._new_mode()).model
    assert built.is_quantized and built.is_loaded_in_4bit and built.hf_quantizer.is_trainable
    # a Trainer holds its model: bnb= and dtype= are refused as model= and lora= are
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_folder), lora())
    trainer = quiet(lambda: Trainer(model=model, args=train_args(), train_dataset=Dataset.from_dict(
        {"input_ids": [[1] * SEQ] * 2, "labels": [[1] * SEQ] * 2})))
    for given in (dict(bnb=BitsAndBytesConfig(**NF4)), dict(dtype=torch.float16), dict(model=bf16_folder, lora=lora())):
        with pytest.raises(ValueError, match=f"a Trainer already holds its model.*leave {'= and '.join(given)}= out"):
            tr.plan_trainer(trainer, target="cpu", seq_len=SEQ, **given)


def test_planning_leaves_the_config_it_was_given_as_it_was(bf16_folder):
    """transformers' from_config writes the dtype it builds in into the config it is given: the planner builds
    each model from its own copy, so the user's config (and a folder's, read again) keeps saying bfloat16."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(bf16_folder)
    tr.plan_trainer(train_args(), model=config, lora=lora(), target="cpu", seq_len=16)
    assert config.dtype == torch.bfloat16 and getattr(config, "quantization_config", None) is None
    tr.plan_trainer(train_args(), model=config, lora=lora(), bnb=NF4, target="cpu", seq_len=16)
    assert config.dtype == torch.bfloat16 and getattr(config, "quantization_config", None) is None


def test_a_trainer_whose_model_lives_on_cuda_is_planned_on_cpu_fakes(bf16_folder):
    """The model's weights are fake CUDA tensors (what FakeTensorMode makes on a CPU-only torch, standing in for a
    model moved to the GPU): the plan traces CPU fakes of the same shapes and dtypes, as for the model on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_folder), lora())
    data = Dataset.from_dict({"input_ids": [[1] * SEQ] * 2, "labels": [[1] * SEQ] * 2})
    trainer = quiet(lambda: Trainer(model=model, args=train_args(), train_dataset=data))
    on_cpu = tr.plan_trainer(trainer, target="cpu", seq_len=SEQ)
    tables = [(m._parameters, name, p) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    with FakeTensorMode() as cuda_mode:
        on_cuda = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cuda"),
                                       requires_grad=p.requires_grad) for _, _, p in tables}
    assert cuda_mode is not None
    try:
        for table, name, p in tables:
            table[name] = on_cuda[id(p)]
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        planned = tr.plan_trainer(trainer, target="cpu", seq_len=SEQ)
        assert {p.device.type for p in model.parameters()} == {"cuda"}  # the model's own tensors are left as they are
    finally:
        for table, name, p in tables:
            table[name] = p
    assert planned.peak_bytes == on_cpu.peak_bytes and planned.by_category == on_cpu.by_category


def test_cli_plans_the_dtype_given_with_training_args(bf16_folder, tmp_path, capsys):
    import json

    from colab_memopt.tooling.cli import main

    config = tmp_path / "sft.yaml"
    config.write_text(f"model_name_or_path: {bf16_folder}\nmax_length: 16\nper_device_train_batch_size: 1\n"
                      "use_peft: true\nlora_r: 4\nlora_target_modules: [q_proj, v_proj]\nbf16: false\nuse_cpu: true\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    params = {}
    for dtype in (None, "bfloat16"):
        argv = ["plan", "--training-args", str(config), "--no-max-batch", "--json"]
        argv += ["--dtype", dtype] if dtype else []
        assert main(argv) == 0
        params[dtype] = json.loads(capsys.readouterr().out)["by_category"]["parameters"]
    assert params[None] > 1.9 * params["bfloat16"]  # TRL given the folder loads fp32; --dtype: what you load
    assert main(["plan", "--model", bf16_folder, "--batch", "1", "--dtype", "bfloat16", "--json"]) == 2
    assert "--dtype goes with --training-args" in json.loads(capsys.readouterr().out)["error"]


def test_an_fp16_base_on_a_t4_is_planned_as_the_same_bytes_in_bf16(bf16_folder):
    """fp16=True on a T4 is traced as the CPU's bf16 autocast: an fp16-loaded base (and an fp16 4-bit compute
    dtype) is traced as bf16, so nothing is cast that CUDA's fp16 autocast would not cast."""
    rows = Dataset.from_dict({"input_ids": [[1] * SEQ] * 2, "labels": [[1] * SEQ] * 2})

    def planned(dtype, **bnb):
        quantized = dict(quantization_config=BitsAndBytesConfig(**bnb), device_map="cpu") if bnb else {}
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=dtype, **quantized), lora())
        trainer = quiet(lambda: Trainer(model=model, args=train_args(), train_dataset=rows))
        from_trainer = tr.plan_trainer(trainer, target="t4", seq_len=SEQ, fp16=True)
        before = tr.plan_trainer(train_args(fp16=True), model=bf16_folder, lora=lora(), bnb=bnb or None, dtype=dtype,
                                 target="t4", seq_len=SEQ)
        assert before.by_category == from_trainer.by_category, dtype
        # the plan's Recipe says the fp16 frozen base a T4 run keeps under fp16 autocast; bf16 it cannot say there
        assert from_trainer.recipe["base_dtype"] == before.recipe["base_dtype"] == (
            "fp16" if dtype == torch.float16 else None)
        assert (dtype == torch.float16) != any("loaded in bfloat16" in w for w in before.notes)
        return from_trainer.by_category

    assert planned(torch.float16) == planned(torch.bfloat16)
    nf4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    assert planned(torch.float16, **nf4, bnb_4bit_compute_dtype=torch.float16) == planned(
        torch.bfloat16, **nf4, bnb_4bit_compute_dtype=torch.bfloat16)
