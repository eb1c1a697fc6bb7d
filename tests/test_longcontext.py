"""Long context through the user's own SFTTrainer: `cm.long_context` installs the package's techniques into the
Trainer's model (the plain run's loss, fp32 and fp16 with loss scale 2^16), `plan_trainer` counts them, and TRL's
`activation_offloading=True` is planned on a machine without a GPU as CUDA runs it."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt.planning.longtrace import TracedActivationOffload  # noqa: E402
from colab_memopt.techniques.checkpointing import checkpoint_offloader  # noqa: E402
from colab_memopt.core.tracker import TensorTracker  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SEQ = 64
TILE = 16  # tokens per MLP / RMSNorm tile: 4 tiles per sequence


def char_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({**{chr(i): i for i in range(32, 127)}, "<pad>": 0, "<eos>": 1, "<unk>": 2},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def peft_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(LlamaConfig(**DIMS)).to(dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                            task_type="CAUSAL_LM"))
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters matter from the first step
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
            if p.requires_grad:
                p.data = p.data.float()
    return model


def sft(model: torch.nn.Module, **changes) -> SFTTrainer:
    values = dict(output_dir="/tmp/colab_memopt_test_longcontext", per_device_train_batch_size=2, max_length=SEQ,
                  max_steps=3, logging_steps=1, optim="sgd", learning_rate=0.05, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, gradient_checkpointing=False, seed=0)
    values.update(changes)
    text = "the quick brown fox jumps over the lazy dog and keeps running far away "
    data = Dataset.from_dict({"text": [text * 2] * 8})
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SFTTrainer(model=model, args=SFTConfig(**values), train_dataset=data, processing_class=char_tokenizer())
    finally:
        logging.disable(logging.NOTSET)


def run(trainer: SFTTrainer, *, scale: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train; return the logged losses and the trained adapters."""
    if scale is not None:  # accelerate builds the GradScaler on CUDA only: the one fp16=True uses there
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("interval", [1, 2])
def test_long_context_in_an_sft_trainer_gives_the_plain_runs_loss(interval):
    plain_model = peft_model()
    long_model = copy.deepcopy(plain_model)
    plain_losses, plain_weights = run(sft(plain_model))
    trainer = sft(long_model)
    installed = cm.long_context(trainer, checkpoint_interval=interval, mlp_tile_tokens=TILE, norm_tile_tokens=TILE)
    assert cm.installed_long_context(trainer) == installed
    long_losses, long_weights = run(trainer)
    offloader = checkpoint_offloader(long_model.get_base_model())
    assert offloader is not None and offloader.stats.to_host > 0  # the layer inputs really went to the host
    assert len(plain_losses) == len(long_losses) == 3
    torch.testing.assert_close(torch.tensor(long_losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6)
    for name, w in plain_weights.items():
        torch.testing.assert_close(long_weights[name], w, rtol=1e-3, atol=1e-4)  # after 3 steps at lr 0.05
    assert plain_weights and any(not torch.equal(w, peft_model().state_dict().get(n, w)) for n, w in plain_weights.items())


def test_long_context_in_fp16_with_loss_scale_2_16_gives_the_plain_runs_loss():
    """A 16-bit frozen base with fp32 adapters, fp16=True and a GradScaler at 2^16, as on a T4."""
    plain_model = peft_model(torch.float16)
    long_model = copy.deepcopy(plain_model)
    plain_losses, plain_weights = run(sft(plain_model, fp16=True), scale=2.0**16)
    trainer = sft(long_model, fp16=True)
    cm.long_context(trainer, mlp_tile_tokens=TILE, norm_tile_tokens=TILE)
    long_losses, long_weights = run(trainer, scale=2.0**16)
    assert trainer.accelerator.scaler.get_scale() == 2.0**16  # no step skipped for an overflow
    torch.testing.assert_close(torch.tensor(long_losses), torch.tensor(plain_losses), rtol=2e-3, atol=1e-4)
    for name, w in plain_weights.items():
        torch.testing.assert_close(long_weights[name], w, rtol=2e-3, atol=1e-4)


def test_long_context_refuses_the_trainers_own_checkpointing_and_bad_settings():
    with pytest.raises(ValueError, match="gradient_checkpointing=False"):
        cm.long_context(sft(peft_model(), gradient_checkpointing=True))
    with pytest.raises(ValueError, match="checkpoint_interval must be an integer >= 1, got 0"):
        cm.LongContext(checkpoint_interval=0)
    with pytest.raises(ValueError, match="mlp_tile_tokens must be None or an integer >= 1"):
        cm.LongContext(mlp_tile_tokens=-4)
    with pytest.raises(ValueError, match="keep_blocks=2 needs checkpoint_interval=1"):
        cm.LongContext(checkpoint_interval=2, keep_blocks=2)
    with pytest.raises(TypeError, match="long_context takes a transformers Trainer"):
        cm.long_context("llama-3.1-8b")


def test_plan_trainer_counts_what_long_context_installed_and_leaves_it_as_it_was():
    plain = cm.plan_trainer(sft(peft_model(), max_length=256), target="t4")
    trainer = sft(peft_model(), max_length=256)
    cm.long_context(trainer, mlp_tile_tokens=64, norm_tile_tokens=64)
    offloader = checkpoint_offloader(trainer.model.get_base_model())
    before = (dict(vars(offloader.stats)), offloader.peak_host_bytes)
    planned = cm.plan_trainer(trainer, target="t4")
    assert (dict(vars(offloader.stats)), offloader.peak_host_bytes) == before  # the user's counts untouched
    host = {c.name: c.bytes for c in planned.host_costs}
    # one fp32 (2 x 256 x 32) input per layer, each a pinned copy of a power of two bytes
    assert host["offloaded checkpoints"] == DIMS["num_hidden_layers"] * 2 * 256 * 32 * 4
    assert planned.by_category["activations"] < plain.by_category["activations"]
    assert any(w.startswith("cm.long_context: every layer's input in host RAM") for w in planned.warnings)
    # the same settings planned before a Trainer exists give the same trace
    args = SFTConfig(output_dir="/tmp/colab_memopt_test_longcontext", per_device_train_batch_size=2, max_length=256,
                     optim="adamw_torch", report_to=[], use_cpu=True, gradient_checkpointing=False)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    by_args = cm.plan_trainer(args, model=LlamaConfig(**DIMS), lora=lora, dtype=torch.float32, target="t4",
                              long_context=cm.LongContext(mlp_tile_tokens=64, norm_tile_tokens=64))
    assert {c.name: c.bytes for c in by_args.host_costs}["offloaded checkpoints"] == host["offloaded checkpoints"]
    with pytest.raises(ValueError, match="set gradient_checkpointing=False"):
        cm.plan_trainer(SFTConfig(output_dir="/tmp/colab_memopt_test_longcontext", use_cpu=True, report_to=[],
                                  gradient_checkpointing=True), model=LlamaConfig(**DIMS), lora=lora,
                        target="t4", long_context=cm.LongContext())


def test_trl_activation_offloading_is_planned_without_a_gpu():
    """TRL builds CUDA hooks for activation_offloading=True while it builds the Trainer; without a GPU that raised
    AttributeError inside TRL. The plan traces the offloading as CUDA runs it and counts its host RAM."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    common = dict(output_dir="/tmp/colab_memopt_test_longcontext", per_device_train_batch_size=2, max_length=256,
                  report_to=[], use_cpu=True)
    args = SFTConfig(**common, activation_offloading=True, gradient_checkpointing=False)
    kept = args.to_dict()
    offloaded = cm.plan_trainer(args, model=LlamaConfig(**DIMS), lora=lora, target="t4")
    assert args.to_dict() == kept and args.activation_offloading  # the user's settings as they were
    plain = cm.plan_trainer(SFTConfig(**common, gradient_checkpointing=False), model=LlamaConfig(**DIMS), lora=lora,
                            target="t4")
    host = {c.name: c.bytes for c in offloaded.host_costs}
    assert host["offloaded activations"] > 0 and "offloaded activations" not in {c.name for c in plain.host_costs}
    assert offloaded.by_category["activations"] < plain.by_category["activations"]
    # with TRL's default checkpointing too (the setting the issue names)
    both = cm.plan_trainer(SFTConfig(**common, activation_offloading=True, gradient_checkpointing=True),
                           model=LlamaConfig(**DIMS), lora=lora, target="t4")
    assert both.device_need_bytes > 0
    on_cpu = cm.plan_trainer(args, model=LlamaConfig(**DIMS), lora=lora, target="cpu")
    assert any("activation_offloading=True on the CPU" in w for w in on_cpu.warnings)


def _chain(emulate: bool) -> tuple[int, int]:
    """Eight `h = (h @ w) * 2` steps on fake 32 x 32 fp32 tensors: each matmul saves its 4 KiB input (and its weight,
    a parameter). Return (the live bytes after forward, the emulation's peak host bytes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        holder = torch.nn.Module()
        holder.w = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(32, 32)) for _ in range(8)])
        x = torch.empty(32, 32, requires_grad=True)
        emulated = TracedActivationOffload(holder)
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(holder, x)
        with tracker:
            with emulated if emulate else contextlib.nullcontext():
                h = x
                for w in holder.w:
                    h = (h @ w) * 2.0
                small = (h[:2, :2] * h[:2, :2]).sum()  # 16-byte saved tensors: under 1 KiB, kept
                live = tracker.live_bytes()  # TRL's context spans forward and backward (its training_step)
                small.backward()
    assert emulated.host_bytes == 0  # everything came back in backward
    return live, emulated.peak_host_bytes


def test_the_offload_emulation_keeps_five_saved_tensors_and_moves_the_rest():
    """TRL moves every saved tensor of 1 KiB or more to the host and keeps it on the device while it is among the
    last five saved (its ids count every saved tensor, the weights too): the matmul inputs x, h1 ... h7 get ids
    1, 3, ..., 15, so after the last one h5, h6 and h7 are still stashed, x is held by the caller, and h1 ... h4
    are freed."""
    live_plain, _ = _chain(False)
    live_offloaded, host = _chain(True)
    assert host == 8 * 4096  # eight 4 KiB inputs, each already a power of two (pinned rounding adds nothing)
    assert live_plain - live_offloaded == 4 * 4096  # h1 ... h4 freed on the device


def test_a_plan_gives_sdpa_the_causal_mask_the_run_gives_it(monkeypatch):
    """transformers passes SDPA no mask (is_causal) when no token of the batch is padded, reading the mask's values;
    on the planner's fake tensors it could not read them and built a (B, 1, T, T) mask, with SDPA's 16-bit copy for
    the memory-efficient kernel: 5.0 GB the run never makes in an 8B QLoRA plan at 40,960 tokens."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    masks: list[object] = []

    def recorded(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003
        masks.append(None if attention_mask is None else tuple(attention_mask.shape))
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recorded)
    trainer = sft(peft_model())  # full rows: every text is longer than max_length
    run(trainer)
    assert masks and set(masks) == {None}, masks[:4]  # the run: no padding, no mask
    masks.clear()
    with torch.no_grad():  # a padded batch does get one: the recorder sees masks
        ids = torch.ones(2, SEQ, dtype=torch.long)
        trainer.model(input_ids=ids, attention_mask=torch.cat([torch.ones(2, SEQ - 8), torch.zeros(2, 8)], 1).long())
    assert masks and all(m == (2, 1, SEQ, SEQ) for m in masks), masks[:4]
    masks.clear()
    plan = cm.plan_trainer(trainer, target="cpu")
    assert masks and set(masks) == {None}, masks[:4]  # the plan: as the run
    assert plan.fits


def test_a_batch_of_several_rows_says_what_padding_adds_where_it_matters():
    """The plan's rows are full (no mask); padded rows of other lengths get transformers' (B, 1, T, T) bool mask and
    SDPA's 16-bit copy of it: said with its bytes where that is 1% of the step or more, never for one row or packing."""
    config = LlamaConfig(**{**DIMS, "max_position_embeddings": 2048})

    def padded(**changes):
        values = dict(output_dir="/tmp/colab_memopt_test_longcontext", max_length=2048, use_cpu=True, report_to=[])
        p = cm.plan_trainer(SFTConfig(**{**values, **changes}), model=config, target="t4", find_max_batch=False)
        return [w for w in p.warnings if "padded rows" in w]

    assert padded(per_device_train_batch_size=2) == [
        "per_device_train_batch_size=2 with padded rows: +24.00 MiB for the attention mask (planned: full rows)"]
    assert padded(per_device_train_batch_size=1) == []
    assert padded(per_device_train_batch_size=2, packing=True) == []
