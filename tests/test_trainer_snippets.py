"""Every technique notebook ends its lesson with "Use it in your own training", and its code runs.

The section holds the transformers / TRL / peft / bitsandbytes settings that switch the notebook's technique
on, as fenced ```python blocks in its markdown (shown, not executed by the notebook: they load real models),
and one code cell tagged `use-in-your-training` with the `cm.Recipe` equivalent and a `cm.plan` line (executed
by the notebook run). Here every fenced block runs with the pinned transformers / TRL / peft / bitsandbytes, so
a snippet cannot name a setting that does not exist; `from_pretrained` loads a tiny local checkpoint of the same
family in place of the hub model (no network), with every keyword the snippet gives; and a `Trainer` (TRL's
`SFTTrainer` for an `SFTConfig`) is built with each arguments object, so settings its constructor refuses fail too.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import nbformat
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import colab_memopt as cm  # noqa: E402
from colab_memopt import architectures  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# 18 and later apply the techniques together to a user's own model (they are not one technique each)
FIRST_CAPSTONE = 18
TECHNIQUE_NOTEBOOKS = [p for p in NOTEBOOKS if int(p.name[:2]) < FIRST_CAPSTONE]
HEADING = "## Use it in your own training"
TAG = "use-in-your-training"
FENCE = re.compile(r"```python\n(.*?)```", re.S)
# Deprecations the snippets accept on purpose. The old checkpointing names are the only ones the transformers
# 4.x preinstalled on Colab knows (5.x accepts them until v6); peft's prepare_model_for_kbit_training calls the
# old method itself.
ALLOWED_DEPRECATIONS = re.compile(
    r"`(gradient_checkpointing|gradient_checkpointing_kwargs|gradient_checkpointing_enable|is_gradient_checkpointing)`"
    r" is deprecated and will be removed in v6")
# Hub ids the snippets may load: the sources of the package's named architectures
KNOWN_MODEL_IDS = {a.source.removesuffix(" config.json") for a in architectures.ARCHITECTURES.values()}


def _section(path: Path) -> tuple[list[str], list[nbformat.NotebookNode], list[str]]:
    """Return (the section's markdown sources, its code cells, every '## ' heading in the notebook in order)."""
    nb = nbformat.read(path, as_version=4)
    headings = [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    start = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith(HEADING)), None)
    if start is None:
        return [], [], headings
    end = next((i for i in range(start + 1, len(nb.cells))
                if nb.cells[i].cell_type == "markdown" and nb.cells[i].source.startswith("## ")), len(nb.cells))
    cells = nb.cells[start:end]
    return [c.source for c in cells if c.cell_type == "markdown"], [c for c in cells if c.cell_type == "code"], headings


def _snippets(path: Path) -> list[str]:
    markdown, _, _ = _section(path)
    return [block for source in markdown for block in FENCE.findall(source)]


def test_the_notebooks_are_found():
    numbers = sorted(int(p.name[:2]) for p in TECHNIQUE_NOTEBOOKS)
    assert numbers == list(range(FIRST_CAPSTONE)), numbers


@pytest.mark.parametrize("path", TECHNIQUE_NOTEBOOKS, ids=lambda p: p.stem)
def test_the_section_ends_the_lesson(path):
    markdown, code, headings = _section(path)
    assert markdown, f"{path.name} has no '{HEADING}' section"
    assert headings.count(HEADING) == 1, headings
    at = headings.index(HEADING)
    assert any(h.startswith("## When not to use it") for h in headings[:at]), f"{path.name}: the section comes after 'When not to use it'"
    assert not any(h.startswith("## Claims") for h in headings[:at]), f"{path.name}: the section comes before the claims"
    assert _snippets(path), f"{path.name}: the section has no ```python block with the stack's settings"
    tagged = [c for c in code if TAG in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: the section needs one code cell tagged {TAG!r}"
    assert "cm.Recipe(" in tagged[0].source and "cm.plan(" in tagged[0].source, tagged[0].source


@pytest.mark.parametrize("path", TECHNIQUE_NOTEBOOKS, ids=lambda p: p.stem)
def test_the_plan_cell_names_a_valid_recipe_and_a_known_model(path, monkeypatch):
    """The tagged cell's recipes validate and its model is one the package knows offline (the notebook run plans it)."""
    _, code, _ = _section(path)
    cell = next(c for c in code if TAG in c.metadata.get("tags", []))
    calls = []
    monkeypatch.setattr(cm, "plan", lambda model, batch, **kw: calls.append((model, batch, kw)) or "")
    exec(compile(cell.source, f"{path.name}:{TAG}", "exec"), {"cm": cm})
    assert calls
    for model, batch, kw in calls:
        assert model in architectures.model_names(), model
        assert isinstance(kw["recipe"], cm.Recipe) and kw["target"] == "t4"
        assert kw.get("find_max_batch") is False, "one trace per plan keeps the notebook fast"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer Llama with random weights and a word-level tokenizer, saved as a checkpoint folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny_llama")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                                      pad_token_id=1, eos_token_id=2, bos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "</s>"] + [f"w{i}" for i in range(20)])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                                         eos_token="</s>").save_pretrained(folder)
    return str(folder)


def _build_trainers(namespace: dict, checkpoint: str, name: str) -> None:
    """Build a `Trainer` (or TRL's `SFTTrainer`) with every arguments object a snippet made.

    The trainer applies what its constructor applies (checkpointing and its kwargs, the model's placement) on
    the snippet's model, else on the tiny checkpoint. Left out: a DeepSpeed config (its engine needs a process
    group and compiled ops; notebook 10 runs them for real) and, without an accelerator, TRL's
    `activation_offloading` (its context asks `torch.accelerator` for the device type at construction).
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    models = [v for v in namespace.values() if isinstance(v, PreTrainedModel) or hasattr(v, "peft_config")]
    for args in [v for v in namespace.values() if isinstance(v, TrainingArguments)]:
        if args.deepspeed:
            continue
        if getattr(args, "activation_offloading", False) and torch.accelerator.current_accelerator() is None:
            continue  # TRL's offloading context reads the accelerator's type at construction: a GPU run builds it
        model = models[0] if models else AutoModelForCausalLM.from_pretrained(checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        if isinstance(args, SFTConfig):
            data = Dataset.from_list([{"text": "w1 w2 w3 w4"}] * 4)
            trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        else:
            data = Dataset.from_list([{"input_ids": [3, 4, 5, 6], "labels": [3, 4, 5, 6]}] * 4)
            trainer = Trainer(model=model, args=args, train_dataset=data)
        _check_fp16_trainable(trainer, name)


def _check_fp16_trainable(trainer, name: str) -> None:
    """Under fp16=True the trainer's trainable weights are fp32 (the GradScaler cannot unscale bf16 or fp16 ones on a
    GPU: TRL's bf16 cast of a 4-bit model's LoRA weights, trl#4901), unless MemoryGuardCallback casts them."""
    from colab_memopt.planning.guard import MemoryGuardCallback, half_trainable

    if not trainer.args.fp16 or any(isinstance(c, MemoryGuardCallback) for c in trainer.callback_handler.callbacks):
        return
    half = half_trainable(trainer.model)
    assert not half, (f"{name}: fp16=True with {len(half)} trainable bf16/fp16 tensors ({next(iter(half))}): the first "
                      "step fails on a T4; add MemoryGuardCallback or cast them to float32")


def _check_t4_settings(namespace: dict, code: str, name: str, *, trl_checkpointing_default: bool = False) -> None:
    """The objects a snippet built are right for a T4: no bf16, fp16 compute, SDPA, non-reentrant checkpointing.

    `trl_checkpointing_default`: an SFTConfig's checkpointing without use_reentrant is TRL's default, non-reentrant
    (TRL sets use_reentrant=False on transformers 4, transformers 5 defaults to it)."""
    from transformers import BitsAndBytesConfig, PreTrainedModel, TrainingArguments
    from trl import SFTConfig

    lines = [line.split("#")[0] for line in code.splitlines()]  # comments may name what not to do
    for bad in ("bf16=True", "bfloat16", "flash_attention_2"):
        assert not any(bad in line for line in lines), f"{name}: {bad} in a T4 snippet"
    for value in namespace.values():
        if isinstance(value, TrainingArguments):  # SFTConfig too
            assert not value.bf16 and not value.bf16_full_eval, f"{name}: bf16 on (a T4 has no bf16)"
            # transformers 5.2x names it activation_checkpointing; 5.17 (and Colab's 4.x) gradient_checkpointing
            on = getattr(value, "activation_checkpointing", None)
            on = value.gradient_checkpointing if on is None else on
            if on:
                kwargs = getattr(value, "activation_checkpointing_kwargs", None)
                kwargs = (value.gradient_checkpointing_kwargs if kwargs is None else kwargs) or {}
                if trl_checkpointing_default and isinstance(value, SFTConfig) and "use_reentrant" not in kwargs:
                    continue
                assert kwargs.get("use_reentrant") is False, f"{name}: checkpointing without use_reentrant=False"
        if isinstance(value, BitsAndBytesConfig) and value.load_in_4bit:
            assert value.bnb_4bit_compute_dtype == torch.float16, f"{name}: 4-bit compute dtype must be fp16 on a T4"
        if isinstance(value, PreTrainedModel):
            assert value.config._attn_implementation in ("sdpa", "eager"), value.config._attn_implementation


@pytest.mark.parametrize("path", TECHNIQUE_NOTEBOOKS, ids=lambda p: p.stem)
def test_the_snippets_run_with_the_pinned_stack(path, tiny_checkpoint, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    loaded = []
    original = AutoModelForCausalLM.from_pretrained

    def from_pretrained(cls, model_id, *args, **kwargs):
        if model_id != tiny_checkpoint:  # a snippet's, not _build_trainers' own
            loaded.append(model_id)
        return original(tiny_checkpoint, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.chdir(tmp_path)  # output_dir="out" lands here
    environ = dict(os.environ)
    for i, code in enumerate(_snippets(path)):
        name = f"{path.name} snippet {i}"
        namespace: dict = {"__name__": "__snippet__"}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                exec(compile(code, name, "exec"), namespace)
        finally:
            os.environ.clear()
            os.environ.update(environ)
        deprecated = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))
                      and "deprecat" in str(w.message).lower() and not ALLOWED_DEPRECATIONS.search(str(w.message))]
        assert not deprecated, f"{name} uses a deprecated setting: {deprecated}"
        _check_t4_settings(namespace, code, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the trainers' own notices (fp16 on a CPU, ...); errors still raise
            try:
                _build_trainers(namespace, tiny_checkpoint, name)
            finally:
                os.environ.clear()
                os.environ.update(environ)
    assert set(loaded) <= KNOWN_MODEL_IDS, f"{path.name} loads a model the package does not know: {set(loaded) - KNOWN_MODEL_IDS}"


def test_the_t4_check_catches_trls_bf16_adapters_under_fp16(tiny_checkpoint):
    """The fp16 check is not vacuous: TRL's SFTTrainer on a 4-bit model (TRL reads is_loaded_in_4bit) makes the LoRA
    weights bf16; under fp16=True that is refused, and MemoryGuardCallback in the callbacks lets it pass."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    def trainer(callbacks):
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        model.is_loaded_in_4bit = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SFTTrainer(model=model, args=SFTConfig(output_dir="out", fp16=True, use_cpu=True, report_to=[]),
                              train_dataset=Dataset.from_list([{"text": "w1 w2 w3 w4"}] * 4),
                              processing_class=AutoTokenizer.from_pretrained(tiny_checkpoint), callbacks=callbacks,
                              peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))

    with pytest.raises(AssertionError, match="fp16=True with 4 trainable bf16/fp16 tensors"):
        _check_fp16_trainable(trainer(None), "bad")
    _check_fp16_trainable(trainer([cm.MemoryGuardCallback(target="t4")]), "guarded")


def test_the_t4_check_catches_bf16_and_reentrant_checkpointing():
    """The settings check is not vacuous: bf16 and reentrant checkpointing are refused."""
    from transformers import TrainingArguments

    with pytest.raises(AssertionError, match="bf16"):
        _check_t4_settings({}, "args = TrainingArguments(bf16=True)", "bad")
    args = TrainingArguments(output_dir="out", gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(AssertionError, match="use_reentrant"):
        _check_t4_settings({"args": args}, "", "bad")


CAPSTONE_NOTEBOOKS = [p for p in NOTEBOOKS if int(p.name[:2]) >= FIRST_CAPSTONE]


@pytest.mark.parametrize("path", CAPSTONE_NOTEBOOKS, ids=lambda p: p.stem)
def test_the_capstone_trainer_snippets_are_t4_runs_with_the_guard(path, tiny_checkpoint, tmp_path, monkeypatch):
    """Notebooks 18 and 19 show a whole SFTTrainer script: fp16=True (a T4 has no bf16), no bf16 anywhere, and
    MemoryGuardCallback in the trainer's callbacks (it casts TRL's bf16 QLoRA weights to fp32 before the first step).
    The hub model and the fit are stood in for (no network); the snippet's SFTConfig and callbacks then build and
    train a real SFTTrainer on a tiny local checkpoint."""
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real_sft = trl.SFTTrainer
    built: list[dict] = []

    class RecordedSFTTrainer:
        def __init__(self, model=None, args=None, callbacks=None, **kwargs):
            built.append({"model": model, "args": args, "callbacks": list(callbacks or [])})

        def train(self):
            pass

    fits: list[tuple] = []
    loads: list[tuple] = []

    class Fit:  # fit_trainer's result as the snippet uses it: its changes as lines, and the fitted settings
        def __init__(self, args, kw):
            self.kw = kw

        def snippet(self):
            return ""

        def apply(self, args):
            from types import SimpleNamespace

            return SimpleNamespace(args=args, lora=self.kw.get("lora"), bnb=self.kw.get("bnb"),
                                   model_init_kwargs=dict(args.model_init_kwargs or {}),
                                   dtype=(args.model_init_kwargs or {}).get("dtype"))

    def load(model_id, **kwargs):  # a hub model loaded by the snippet: recorded, and stood in for by its id
        loads.append((model_id, kwargs))
        return model_id

    real_from_pretrained = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(trl, "SFTTrainer", RecordedSFTTrainer)
    monkeypatch.setattr(cm, "fit_trainer", lambda args, **kw: fits.append((args, kw)) or Fit(args, kw))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.chdir(tmp_path)
    snippets = [s for s in _snippets(path) if "SFTTrainer(" in s]
    assert snippets, f"{path.name}: no SFTTrainer snippet in its '{HEADING}' section"
    for i, code in enumerate(snippets):
        name = f"{path.name} snippet {i}"
        namespace: dict = {"__name__": "__snippet__", "dataset": Dataset.from_list([{"text": "w1 w2 w3 w4"}] * 4)}
        exec(compile(code, name, "exec"), namespace)
        assert built and fits, f"{name}: no fit_trainer call or no SFTTrainer"
        for run in built:
            assert _named_architecture(run["model"]), run["model"]  # a model the package knows offline
            assert run["args"].fp16, f"{name}: a T4 run is fp16=True"
            assert any(isinstance(c, cm.MemoryGuardCallback) for c in run["callbacks"]), f"{name}: no MemoryGuardCallback"
            args = run["args"]
            args.max_steps, args.use_cpu, args.report_to, args.output_dir = 1, True, [], str(tmp_path / "out")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = real_sft(model=real_from_pretrained(tiny_checkpoint), args=args,
                                   train_dataset=namespace["dataset"], processing_class=AutoTokenizer.from_pretrained(
                                       tiny_checkpoint), callbacks=[cm.MemoryGuardCallback(target="t4", verbose=False)])
                trainer.train()
            assert trainer.state.global_step == 1
        for model_id, kwargs in loads:  # a model the snippet loads itself: QLoRA's 4-bit base computes in fp16
            quantization = kwargs.get("quantization_config")
            assert quantization is None or (quantization.load_in_4bit and
                                            quantization.bnb_4bit_compute_dtype == torch.float16), f"{name}: {kwargs}"
        _check_t4_settings(namespace, code, name, trl_checkpointing_default=True)
        built.clear()
        fits.clear()
        loads.clear()


# Republished copies of a model under another id, with its config.json (Unsloth's copies carry no licence gate).
_COPIES = {"unsloth/Meta-Llama-3.1-8B": "meta-llama/Llama-3.1-8B"}


def _named_architecture(model_id: str) -> str:
    """Return our architecture built from the same config.json as a hub id (an -Instruct model shares its base's)."""
    base = model_id.removesuffix("-Instruct")
    base = _COPIES.get(base, base)
    return next(a.name for a in architectures.ARCHITECTURES.values() if a.source == f"{base} config.json")


def test_notebook_19_runs_the_8b_path_on_a_t4_at_its_colab_defaults():
    """CI plans what Colab plans: notebook 19's draft and fit cells (QLoRA of its Colab model, Llama-3.1-8B, at 2,048
    tokens), at the parameters cell's values (Colab's), planned for its Colab target. The draft does not fit (its assert
    holds there; TRL turns gradient checkpointing on by default: a draft that did not turn it off fitted a T4, and the
    notebook's assert stopped Run all on Colab); the fitted settings do; the 4-bit load the notebook runs fits the T4
    and Colab's host RAM, as does the merge, shard by shard, and the 4-bit reload of the merged model."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig
    from trl import SFTConfig

    path = ROOT / "notebooks" / "19_your_trainer_on_a_free_t4.ipynb"
    nb = nbformat.read(path, as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    draft_cell = next(c for c in nb.cells if c.cell_type == "code" and "draft_plan = cm.plan_trainer(" in c.source)
    namespace: dict = {}
    exec(params.source, namespace)
    assert namespace["target"] == "t4"
    import tempfile
    import time

    namespace.update(tempfile=tempfile, time=time, warnings=warnings, torch=torch, SFTConfig=SFTConfig, LoraConfig=LoraConfig,
                     BitsAndBytesConfig=BitsAndBytesConfig, cm=cm, dev=torch.device("cuda"),
                     model_id=_named_architecture(namespace["model_id"]))
    # The draft cell's plan is fit_trainer's first (the same call): the fit cell plans it, the draft cell's result is
    # read from the fit (an 8B plan less in this test).
    namespace["cm"] = type("NoPlan", (), {"plan_trainer": staticmethod(lambda *a, **k: None),
                                          "quiet": staticmethod(cm.quiet), "format_bytes": staticmethod(cm.format_bytes)})
    draft_source = draft_cell.source.replace('use_cpu=dev.type == "cpu"', "use_cpu=True")  # no GPU here
    exec(draft_source.split("print(draft_plan)")[0], namespace)
    namespace["cm"] = cm
    assert namespace["model_id"] == "llama-3.1-8b"  # the 8B the users came for
    fit_cell = next(c for c in nb.cells if c.cell_type == "code" and "fit = cm.fit_trainer(" in c.source)
    assert "fit_trainer(draft, model=model_id, lora=peft_config, bnb=bnb_config, target=target)" in fit_cell.source
    assert "plan_trainer(draft, model=model_id, lora=peft_config, bnb=bnb_config, target=target)" in draft_cell.source
    exec(fit_cell.source, namespace)
    fit, fitted = namespace["fit"], namespace["fitted"]
    draft_plan = fit.before
    assert not draft_plan.fits, f"the first draft fits {draft_plan.target.name}: {draft_plan.device_need_bytes:,} bytes"
    assert not namespace["draft"].gradient_checkpointing
    assert namespace["bnb_config"].load_in_4bit and namespace["bnb_config"].bnb_4bit_compute_dtype == torch.float16
    assert namespace["max_length"] >= 2048 and draft_plan.seq_len == namespace["max_length"]
    assert fit.fits and fit.after.fits_host, str(fit)
    load = cm.loading.quantized_load_bytes("llama-3.1-8b", device="cuda", dtype=fitted.model_init_kwargs.get("dtype"),
                                           double_quant=fitted.bnb.bnb_4bit_use_double_quant)
    t4 = cm.planner.get_target("t4")
    assert load.device_bytes <= t4.device_bytes - t4.cuda_context_bytes, str(load)  # the load and the reload
    assert load.host_anon_bytes <= cm.COLAB_HOST_USABLE_BYTES, str(load)
    merge = cm.merge_cost("llama-3.1-8b", torch.float16, r=namespace["lora_r"]).shard_by_shard
    assert merge.host_bytes <= cm.COLAB_HOST_USABLE_BYTES, merge


def test_the_checkpointing_flag_the_notebooks_teach_runs_on_the_installed_transformers(tmp_path):
    """`gradient_checkpointing=True` (TrainingArguments / SFTConfig) and `model.gradient_checkpointing_enable(...)`:
    transformers 4.x knows only these names; 5.x takes them as the older names of activation_checkpointing."""
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5: the older names, kept until v6
        args = transformers.TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True,
                                              gradient_checkpointing_kwargs={"use_reentrant": False})
        model = transformers.LlamaForCausalLM(config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert args.gradient_checkpointing and getattr(args, "activation_checkpointing", True)
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert model.is_gradient_checkpointing


def test_the_default_optimizer_is_picked_by_the_torch_version_as_notebooks_00_and_06_say():
    from packaging.version import Version

    default = transformers.TrainingArguments.__dataclass_fields__["optim"].default
    fused = Version(torch.__version__.split("+")[0]) >= Version("2.8")
    assert str(getattr(default, "value", default)) == ("adamw_torch_fused" if fused else "adamw_torch")


def test_the_reentrant_note_follows_the_installed_transformers():
    """No plan states a default the installed library does not have (newcomer-review-4 finding 5): read from what the
    installed transformers hands torch's checkpoint, as a Trainer enables it."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    from colab_memopt.planning.hfconfig import checkpoint_use_reentrant, trainer_recipe

    def note(args):
        return [n for n in trainer_recipe(args, None, None)[1] if "use_reentrant" in n]

    default = TrainingArguments("/tmp/cm_reentrant", gradient_checkpointing=True, use_cpu=True, report_to=[])
    reentrant, source = checkpoint_use_reentrant(None)
    assert note(default) == ([] if not reentrant else note(default))
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 0):
        assert (reentrant, source) == (False, f"transformers {transformers.__version__}'s default")
        assert note(default) == [] and note(SFTConfig("/tmp/cm_reentrant", use_cpu=True, report_to=[])) == []
    given = TrainingArguments("/tmp/cm_reentrant", gradient_checkpointing=True, use_cpu=True, report_to=[],
                              gradient_checkpointing_kwargs={"use_reentrant": True})
    assert len(note(given)) == 1 and "as you set it" in note(given)[0] and "{'use_reentrant': False}" in note(given)[0]
    # kwargs without use_reentrant reach torch's checkpoint as they are: its default is True
    other = TrainingArguments("/tmp/cm_reentrant", gradient_checkpointing=True, use_cpu=True, report_to=[],
                              gradient_checkpointing_kwargs={"preserve_rng_state": False})
    assert checkpoint_use_reentrant({"preserve_rng_state": False})[0] is True and len(note(other)) == 1
    assert all(len(line) <= 100 for line in note(given) + note(other))
