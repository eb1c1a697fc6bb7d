"""A Trainer plan costs the same whatever the counts: gradient_accumulation_steps and the largest-batch search.

Issue 44 item 5 (reliability probe 4): gradient_accumulation_steps=100,000 gave no answer in 120 s, because the trace
built one collated batch per accumulation step. Two are built and one is traced; the others' token ids are counted.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
from transformers import LlamaConfig  # noqa: E402
from trl import SFTConfig  # noqa: E402

import colab_memopt as cm  # noqa: E402
from colab_memopt.planning import trainer as tr, trainertrace  # noqa: E402

DIMS = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def sft_args(**changes) -> SFTConfig:
    values = dict(output_dir="/tmp/colab_memopt_test_trainer_speed", per_device_train_batch_size=2, max_length=48,
                  report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False)
    values.update(changes)
    return SFTConfig(**values)


def _figures(p):
    return p.peak_bytes, p.by_category, p.by_phase, p.by_phase_category


@pytest.fixture
def built(monkeypatch):
    """Count the collated batches the trace builds."""
    calls = []
    original = trainertrace._synthetic_batch

    def counted(trainer, batch, seq_len):
        calls.append(batch)
        return original(trainer, batch, seq_len)

    monkeypatch.setattr(trainertrace, "_synthetic_batch", counted)
    return calls


def test_many_accumulation_steps_build_two_batches_and_count_the_rest(built):
    p = cm.plan_trainer(sft_args(gradient_accumulation_steps=100_000), model=LlamaConfig(**DIMS), target="t4")
    assert len(built) == 2  # was 100,000: minutes
    one = cm.plan_trainer(sft_args(gradient_accumulation_steps=1), model=LlamaConfig(**DIMS), target="t4")
    two = cm.plan_trainer(sft_args(gradient_accumulation_steps=2), model=LlamaConfig(**DIMS), target="t4")
    per_batch = two.by_category["other"] - one.by_category["other"]  # one micro-batch's token ids (rounded)
    assert per_batch > 0
    assert p.by_category["other"] == two.by_category["other"] + 99_998 * per_batch
    assert p.peak_bytes == two.peak_bytes + 99_998 * per_batch


@pytest.mark.parametrize("fp16", [False, True])
def test_the_counted_batches_give_the_figures_of_every_batch_built(monkeypatch, fp16):
    """The fast path against the full one (every micro-batch built and held), on a T4 (rounded, fp16 autocast)."""
    args = sft_args(gradient_accumulation_steps=5, fp16=fp16)
    fast = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    monkeypatch.setattr(trainertrace, "_BUILT_BATCHES", 10**9)
    full = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    assert _figures(fast) == _figures(full)


@pytest.mark.parametrize("case", ["full fp16, checkpointing", "LoRA, checkpointing", "QLoRA, bf16"])
def test_one_traced_micro_batch_gives_the_figures_of_two(monkeypatch, case):
    """With gradient accumulation the trace runs one micro-batch, the gradients made before it, where it ran two:
    the same figures, phase by phase and category by category, at half the tracing."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = {
        "full fp16, checkpointing": dict(args=sft_args(gradient_accumulation_steps=3, fp16=True, gradient_checkpointing=True)),
        "LoRA, checkpointing": dict(args=sft_args(gradient_accumulation_steps=3, fp16=True, gradient_checkpointing=True),
                                    lora=lora),
        "QLoRA, bf16": dict(args=sft_args(gradient_accumulation_steps=2, bf16=True), lora=lora,
                            bnb=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)),
    }[case]
    args = kwargs.pop("args")
    traced = []
    original = trainertrace.TensorTracker

    class Counting(original):  # how many training steps each trace runs
        def _pre_fw_hook(self, module, inputs):
            if type(module).__name__ == "LlamaForCausalLM" and not self._mod_tracker.is_bw:
                traced[-1] += 1
            super()._pre_fw_hook(module, inputs)

        def __enter__(self):
            traced.append(0)
            return super().__enter__()

    monkeypatch.setattr(trainertrace, "TensorTracker", Counting)
    one = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4", **kwargs)
    assert set(traced) == {1}
    traced.clear()
    monkeypatch.setattr(trainertrace, "_TRACED_MICRO_BATCHES", 2)
    two = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4", **kwargs)
    assert set(traced) == {2}
    assert _figures(one) == _figures(two)


def test_the_largest_batch_search_bisects_where_the_linear_guess_is_over(monkeypatch):
    """Where the guess from two traces is over the answer, the search bisects: it stepped down one batch at a time,
    one trace per batch (a guess 20 batches over took 20 traces)."""
    from colab_memopt.planning.targets import Target

    args = sft_args(per_device_train_batch_size=2, max_length=64)
    roomy = Target("roomy", 10**12, 10**12, cuda_context_bytes=0, compute_capability=(7, 5))
    p2 = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target=roomy, headroom=0.0)
    p3 = cm.plan_trainer(sft_args(per_device_train_batch_size=3, max_length=64), model=LlamaConfig(**DIMS), target=roomy,
                         headroom=0.0)
    per_sample = p3.peak_bytes - p2.peak_bytes
    assert per_sample > 0
    small = Target("small", p2.device_need_bytes + int(6.5 * per_sample), 10**12, cuda_context_bytes=0,
                   compute_capability=(7, 5))
    truth = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target=small, headroom=0.0, find_max_batch=True).max_batch
    assert 4 <= truth <= 12
    real = trainertrace._trace_step
    traced: list[int] = []

    def under_at_three(trainer, changed, b, seq_len, **kw):  # batch 3's trace says a sample costs a quarter of it
        trace, n = real(trainer, changed, b, seq_len, **kw)
        traced.append(b)
        if b == 3:
            trace.peak_bytes = p2.peak_bytes + per_sample // 4
        return trace, n

    monkeypatch.setattr(tr, "_trace_step", under_at_three)
    again = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target=small, headroom=0.0, find_max_batch=True)
    searched = traced[1:]  # the plan's own trace first
    assert again.max_batch == truth
    assert len(searched) == len(set(searched)) and len(searched) <= 8, searched


def test_an_absurd_per_device_batch_is_refused_with_the_limit_before_anything_is_built(monkeypatch):
    """per_device_train_batch_size=100,000 gave no answer in 120 s (reliability probe 4): the trace built the rows."""
    def never(*args, **kwargs):
        raise AssertionError("the planner built a Trainer for a batch no step can run")

    monkeypatch.setattr(tr, "_fake_trainer", never)
    wide = LlamaConfig(**{**DIMS, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "max_position_embeddings": 2048})
    limit = cm.planner.get_target("t4").device_bytes
    most = limit // (4 * 1024 * 4096)  # two hidden states of 2 bytes a value
    with pytest.raises(ValueError, match=rf"per_device_train_batch_size=100,000 at max_length=1,024: the embedding's "
                                         rf"output and the first block's normalized copy of it alone .* "
                                         rf"per_device_train_batch_size={most:,} at most at this length"):
        cm.plan_trainer(sft_args(per_device_train_batch_size=100_000, max_length=1024), model=wide, target="t4")
    monkeypatch.undo()
    at_most = cm.plan_trainer(sft_args(per_device_train_batch_size=1, max_length=1024), model=wide, target="t4")
    assert at_most.batch == 1  # a batch under the bound is planned as before


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("fp16", [False, True])
def test_a_large_micro_batch_is_shaped_from_two_small_collations_with_every_figure_kept(monkeypatch, padding_free, fp16):
    """Probe 4 row 15: per_device_train_batch_size=100,000 gave no answer in 120 s (TRL's collator looped over every
    example under the fake mode). Above 8 examples the batch is shaped from collations of 2 and 4; the plan is the
    plan of the batch the collator makes whole, on a T4 (rounded, fp16 autocast), padded or packed in one row."""
    packed = dict(padding_free=True, packing=True, packing_strategy="bfd") if padding_free else {}
    args = sft_args(per_device_train_batch_size=12, fp16=fp16, **packed)
    sizes, collate = [], trainertrace._collate
    monkeypatch.setattr(trainertrace, "_collate", lambda trainer, batch, *a: sizes.append(batch) or collate(trainer, batch, *a))
    shaped = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    assert set(sizes) == {2, 4}  # the collator never made the batch of 12
    monkeypatch.setattr(trainertrace, "_COLLATED_DIRECTLY", 10**9)
    whole = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    assert _figures(shaped) == _figures(whole)



@pytest.mark.parametrize("fp16", [False, True])
def test_trls_fused_lm_head_is_traced_by_its_first_tiles_with_the_figures_of_every_tile(monkeypatch, fp16):
    """Probe 4 row 15 again: per_device_train_batch_size=100,000 x 64 took 110 s (fp32) and 71 s (fp16) here, tracing
    TRL's fused LM head over 1,563 tiles of 4,096 tokens each way; by its first two tiles, 3.1 s and 1.3 s, the same
    peak. 300 x 64 tokens are 5 tiles: the plan by the first two has every figure of the plan by all five."""
    import contextlib

    args = sft_args(per_device_train_batch_size=300, max_length=64, fp16=fp16)
    first = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    monkeypatch.setattr(trainertrace, "_trl_tiles_first_rounds", contextlib.nullcontext)
    every = cm.plan_trainer(args, model=LlamaConfig(**DIMS), target="t4")
    assert first.peak_bytes == every.peak_bytes and first.by_category == every.by_category
    assert first.by_phase["backward"] == every.by_phase["backward"]
    # the forward phase's own peak can differ by a few hundred KB of autocast's cached casts: 0.001% at 100,000 x 64
    assert abs(first.by_phase["forward"] - every.by_phase["forward"]) <= 1e-4 * every.by_phase["forward"]


def test_trls_fused_lm_head_runs_every_tile_on_real_tensors_while_a_trace_is_on():
    """The first-rounds switch is the trace's alone: TRL's head on real tensors, inside it, gives what it gives outside."""
    import torch
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE

    from colab_memopt.techniques.loss import first_rounds_traced
    from trl.trainer.utils import _ChunkedLogProbFunction

    torch.manual_seed(0)
    n = 2 * TOKEN_CHUNK_SIZE + 5  # three token tiles
    hidden, weight = torch.randn(n, 16), torch.randn(40, 16)
    targets = torch.randint(0, 40, (n,))
    outside = _ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 16)[0]
    with first_rounds_traced(), trainertrace._trl_tiles_first_rounds():
        inside = _ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 16)[0]
    assert torch.equal(inside, outside)
    assert torch.isfinite(inside[-5:]).all() and (inside[-5:] != 0).all()  # the last tile was run
