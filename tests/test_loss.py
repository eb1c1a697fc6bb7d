"""The chunked cross-entropy: same value and gradients as the plain loss, less memory, clear errors."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import colab_memopt as cm
from torch._subclasses.fake_tensor import FakeTensorMode

from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS, causal_lm_loss, chunked_cross_entropy, make_loss_step
from colab_memopt.core.measure import measure_step
from colab_memopt.techniques.models import build_model
from colab_memopt.core.tracker import TensorTracker

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "chunked_loss.json"


def _inputs(n=37, h=16, v=50, *, bias=True, dtype=torch.float32, ignored_every=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(v, generator=gen).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignored_every:
        labels[::ignored_every] = -100
    return hidden, weight, b, labels


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 8, 36, 37, 1000])  # 8: 37 is not a multiple; 37 and 1000: chunk >= N
@pytest.mark.parametrize("bias", [True, False])
def test_value_and_gradients_match_plain_cross_entropy(reduction, chunk, bias):
    hidden, weight, b, labels = _inputs(bias=bias)
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels, reduction=reduction)
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk, reduction=reduction)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a grad_output other than 1: backward must scale by it
    for got, want in zip(_grads(out * 2.5, (hidden, weight, b)), _grads(ref * 2.5, (hidden, weight, b))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 8, 1000])  # the weight's gradient by vocabulary blocks of 1350, 172, 1 rows
@pytest.mark.parametrize("bias", [True, False])
def test_weight_gradient_by_vocabulary_blocks_matches_plain(chunk, bias):
    # a weight in any dtype but fp32 (fp16, bf16; fp64 here, to compare closely) gets its gradient by
    # vocabulary blocks over all tokens, rounded once; labels at the blocks' edges and ignored ones included
    hidden, weight, b, labels = _inputs(bias=bias, dtype=torch.float64)
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels)
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=chunk)
    for got, want in zip(_grads(out * 3.0, (hidden, weight, b)), _grads(ref * 3.0, (hidden, weight, b))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_ignored_labels_get_no_gradient_and_do_not_count():
    hidden, weight, b, labels = _inputs(ignored_every=2)
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=5)
    (grad_hidden,) = torch.autograd.grad(out, [hidden])
    assert torch.all(grad_hidden[labels == -100] == 0)
    kept = labels != -100
    ref = F.cross_entropy(F.linear(hidden[kept], weight, b), labels[kept])
    torch.testing.assert_close(out, ref)


def test_all_labels_ignored_matches_plain():
    hidden, weight, b, labels = _inputs(ignored_every=0)
    labels[:] = -100
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels)
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    assert torch.isnan(ref) and torch.isnan(out)  # 0 / 0, as F.cross_entropy gives
    for got, want in zip(_grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))):
        torch.testing.assert_close(got, want)  # zeros, not nan


def test_other_ignore_index():
    hidden, weight, b, labels = _inputs(ignored_every=0)
    labels[::3] = 7
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels, ignore_index=7)
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8, ignore_index=7)
    torch.testing.assert_close(out, ref)


def test_frozen_head_gets_no_gradient():
    hidden, weight, _, labels = _inputs(bias=False)
    weight.requires_grad_(False)
    out = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    out.backward()
    ref_hidden = hidden.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(ref_hidden, weight), labels).backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_hidden.grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_give_half_gradients_close_to_plain(dtype):
    hidden, weight, b, labels = _inputs(dtype=dtype)
    ref = F.cross_entropy(F.linear(hidden, weight, b).float(), labels)  # transformers upcasts the logits
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    got, want = _grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-3)


def test_autocast_matches_plain_under_autocast():
    hidden, weight, b, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(hidden, weight, b).float(), labels)
        out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    torch.testing.assert_close(out, ref)  # the same bf16 logits, upcast
    got, want = _grads(out, (hidden, weight, b)), _grads(ref, (hidden, weight, b))
    for g, w in zip(got, want):
        assert g.dtype == torch.float32  # the inputs' dtype
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_causal_lm_loss_shifts_like_the_plain_model_loss(chunk):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 20, (2, 9), generator=gen)
    labels[1, 4] = -100
    logits = hidden @ weight.T
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 20), labels[:, 1:].reshape(-1))
    out = causal_lm_loss(hidden, weight, labels, chunk_tokens=chunk)
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (hidden, weight)), _grads(ref, (hidden, weight))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"chunk_tokens": 0}, "chunk_tokens must be an integer >= 1.*got 0"),
        ({"chunk_tokens": -4}, "chunk_tokens must be an integer >= 1.*got -4"),
        ({"chunk_tokens": True}, "chunk_tokens must be an integer >= 1.*got True"),
        ({"chunk_tokens": 2.0}, "chunk_tokens must be an integer >= 1.*got 2.0"),
        ({"reduction": "none"}, r"reduction must be one of \('mean', 'sum'\), got 'none'"),
        ({"ignore_index": True}, "ignore_index must be an integer, got True"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    hidden, weight, _, labels = _inputs(bias=False)
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(hidden, weight, labels, **kwargs)


def test_bad_shapes_and_dtypes_are_named():
    hidden, weight, b, labels = _inputs()
    with pytest.raises(ValueError, match=r"weight must have shape \(vocab, 16\).*got \(50, 15\)"):
        chunked_cross_entropy(hidden, weight[:, :15], labels)
    with pytest.raises(ValueError, match=r"labels must have shape \(37,\).*got \(36,\)"):
        chunked_cross_entropy(hidden, weight, labels[:36])
    with pytest.raises(ValueError, match=r"hidden must have shape \(tokens, hidden\), got \(37,\)"):
        chunked_cross_entropy(hidden[:, 0], weight, labels)
    with pytest.raises(ValueError, match=r"bias must be None or a tensor of shape \(50,\), got \(49,\)"):
        chunked_cross_entropy(hidden, weight, labels, bias=b[:49])
    with pytest.raises(ValueError, match="labels must be integer class indices, got dtype torch.float32"):
        chunked_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match=r"labels must be in \[0, 50\) or ignore_index \(-100\), got 50"):
        chunked_cross_entropy(hidden, weight, torch.where(labels == -100, 50, labels))
    with pytest.raises(ValueError, match="same dtype outside autocast, got torch.float32 and torch.float16"):
        chunked_cross_entropy(hidden, weight.half(), labels)
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 9\) to match hidden \(2, 9, 16\), got \(2, 8\)"):
        causal_lm_loss(torch.randn(2, 9, 16), weight, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"hidden must have shape \(batch, seq, hidden\), got \(37, 16\)"):
        causal_lm_loss(hidden, weight, labels)
    with pytest.raises(ValueError, match="chunk_tokens must be an integer >= 1.*got 0"):
        make_loss_step(hidden, weight, labels, chunk_tokens=0)


def test_no_grad_computes_the_loss_only():
    hidden, weight, b, labels = _inputs()
    ref = F.cross_entropy(F.linear(hidden, weight, b), labels)
    with torch.no_grad():
        out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    torch.testing.assert_close(out, ref.detach())
    assert not out.requires_grad
    with FakeTensorMode():  # nothing of size (N, H) or (V, H) is made: at most one chunk's logits
        h, w = torch.randn(1000, 64, requires_grad=True), torch.randn(5000, 64, requires_grad=True)
        y = torch.randint(0, 5000, (1000,))
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(h, w, y)
        before = tracker.live_bytes()
        with tracker, torch.no_grad():
            chunked_cross_entropy(h, w, y, chunk_tokens=10)
    assert tracker.peak_bytes - before < 2 * 10 * 5000 * 4 + 1000 * 16


def test_backward_twice_with_retain_graph_accumulates():
    # backward computes the gradients from the inputs (nothing is scaled in place): it can run again
    hidden, weight, b, labels = _inputs()
    out = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_tokens=8)
    out.backward(retain_graph=True)
    once = [t.grad.clone() for t in (hidden, weight, b)]
    out.backward()
    for t, g in zip((hidden, weight, b), once):
        torch.testing.assert_close(t.grad, 2 * g)


# -- fp16 and bf16 under a loss scale: as exact as the plain loss ---------------------------------

_BENCH_SPEC = importlib.util.spec_from_file_location("chunked_loss_bench", RESULTS.parent.parent / "chunked_loss.py")
chunked_bench = importlib.util.module_from_spec(_BENCH_SPEC)
_BENCH_SPEC.loader.exec_module(chunked_bench)


@pytest.mark.parametrize("dtype,mode", [(torch.float16, "autocast"), (torch.float16, "pure"), (torch.bfloat16, "pure")])
def test_16bit_gradients_under_a_loss_scale_are_as_exact_as_the_plain_loss(dtype, mode):
    # 512 tokens x vocabulary 8192: softmax / N is about 2.4e-7, below fp16's normal range unless the
    # loss scale is applied first (gradients computed in forward and cast unscaled were 26x the plain
    # loss's error at 2^10, and inf at 2^16 in pure fp16); hidden 16 keeps the CPU's fp16 matmuls short
    rows = chunked_bench.gradient_errors(512, 8192, 16, dtype=dtype, mode=mode, scales=(2.0**10, 2.0**16), chunk_tokens=64)
    for row in rows:
        for method in ("plain", "chunked"):
            assert all(math.isfinite(e) for e in row[method].values()), (row, method)
        assert row["ratio"] <= 2.0, row


# -- memory ---------------------------------------------------------------------------------------

def _trace_transient(tokens, vocab, hidden, chunk, *, frozen_head=False):
    """Return (peak - inputs, peak - live after backward) of one loss step, traced on fake tensors."""
    with FakeTensorMode():
        h = torch.randn(tokens, hidden, requires_grad=True)
        w = torch.randn(vocab, hidden, requires_grad=not frozen_head)
        y = torch.randint(0, vocab, (tokens,))
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(h, w, y)
        before = tracker.live_bytes()
        with tracker:
            make_loss_step(h, w, y, chunk_tokens=chunk)()
            after = tracker.live_bytes()
    return tracker.peak_bytes - before, tracker.peak_bytes - after


@pytest.mark.parametrize("chunk", [None, 16, 64, 500])
def test_trace_equals_measurement_to_the_byte(chunk):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=gen, requires_grad=True)
    w = torch.randn(700, 32, generator=gen, requires_grad=True)
    y = torch.randint(0, 700, (300,), generator=gen)
    report = measure_step(make_loss_step(h, w, y, chunk_tokens=chunk), track=[h, w, y], device="cpu", repeat=1)
    inputs = sum(t.untyped_storage().nbytes() for t in (h, w, y))
    assert report.peak_bytes - inputs == _trace_transient(300, 700, 32, chunk)[0]


@pytest.mark.parametrize(("dtype", "frozen_head"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32 head (by chunks)", "bf16 head (by vocabulary blocks)", "frozen head"])
def test_a_trace_of_the_first_rounds_only_peaks_where_every_round_measured_does(dtype, frozen_head):
    """The planner traces the chunked loss's first two rounds (`first_rounds_traced`): every later round allocates
    what they do. Its peak is the measured step's, which runs all 19 (300 tokens by 16), for each of backward's loops."""
    from colab_memopt.techniques.loss import first_rounds_traced

    def step_of(h, w, y):
        return make_loss_step(h, w, y, chunk_tokens=16)

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(300, 32, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(700, 32, generator=gen).to(dtype).requires_grad_(not frozen_head)
    y = torch.randint(0, 700, (300,), generator=gen)
    measured = measure_step(step_of(h, w, y), track=[h, w, y], device="cpu", repeat=1).peak_bytes
    every = chunked_cross_entropy(h, w, y, chunk_tokens=16)
    with first_rounds_traced():  # real tensors: every round, the same loss as without it
        assert torch.equal(chunked_cross_entropy(h, w, y, chunk_tokens=16), every)
    mms = []
    with FakeTensorMode():
        fh = torch.empty(300, 32, dtype=dtype, requires_grad=True)
        fw = torch.empty(700, 32, dtype=dtype, requires_grad=not frozen_head)
        fy = torch.randint(0, 700, (300,))
        step = step_of(fh, fw, fy)
        step()  # warm-up, as measure_step does
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(fh, fw, fy)
        from torch.utils._python_dispatch import TorchDispatchMode

        with tracker, first_rounds_traced():
            class Count(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
                        mms.append(func)
                    return func(*args, **(kwargs or {}))

            with Count():
                step()
    assert tracker.peak_bytes == measured
    assert 0 < len(mms) <= 10  # two rounds of each loop, not 19


def test_chunk_memory_grows_with_the_chunk_not_the_tokens():
    # transient = what the loss holds beyond its inputs and their gradients: the chunk's fp32 logits
    v = 1000
    small = _trace_transient(256, v, 16, 32)[1]
    more_tokens = _trace_transient(1024, v, 16, 32)[1]
    bigger_chunk = _trace_transient(256, v, 16, 128)[1]
    # 4x the tokens, same chunk: only per-token bookkeeping grows (labels 8, mask 1, row weight 4 and the
    # logsumexp kept for backward 4: 17 bytes per token, against the 4 * V bytes of the plain loss's logits)
    assert small <= more_tokens <= small + (1024 - 256) * 17
    assert small >= 32 * v * 4  # at least the chunk's fp32 logits
    assert bigger_chunk >= 4 * 32 * v * 4 > small
    plain = _trace_transient(256, v, 16, None)[1]
    assert plain >= 2 * 256 * v * 4  # the plain loss holds at least the logits and their gradient


def test_llama3_head_at_16k_tokens_within_five_percent_of_plain():
    # vocabulary 128,256, hidden 2048 (Llama-3.2-1B), 16,384 tokens: about 24 GiB for the plain loss
    plain = _trace_transient(16384, 128256, 2048, None)[1]
    chunked = _trace_transient(16384, 128256, 2048, DEFAULT_CHUNK_TOKENS)[1]
    assert plain >= 2 * 16384 * 128256 * 4
    assert chunked <= 0.05 * plain, f"chunked {chunked:,} bytes against plain {plain:,}"


def test_default_chunk_is_among_the_fastest_measured():
    # the benchmark's results were recorded with this default, timed among the fastest chunks (its pick
    # rule says 5%; 10% here so that a rerun on a busy machine does not fail the suite)
    data = json.loads(RESULTS.read_text())
    assert data["default_chunk_tokens"] == DEFAULT_CHUNK_TOKENS
    rows = {r["chunk_tokens"]: r["step_seconds"] for r in data["chunk_sweep"]["rows"] if r["chunk_tokens"]}
    assert DEFAULT_CHUNK_TOKENS in rows
    assert rows[DEFAULT_CHUNK_TOKENS] <= 1.10 * min(rows.values())
    assert data["trace_equals_real"] is True
    assert data["target_met"] is True


# -- the reference model --------------------------------------------------------------------------

def test_model_chunked_loss_matches_plain_and_skips_logits():
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    plain = build_model("tiny")
    chunked = build_model("tiny")
    chunked.loss_chunk_tokens = 7
    out_plain = plain(ids, labels=ids)
    out_chunked = chunked(ids, labels=ids)
    assert out_chunked.logits is None
    torch.testing.assert_close(out_chunked.loss, out_plain.loss)
    out_plain.loss.backward()
    out_chunked.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert chunked(ids).logits.shape == (3, 20, 256)  # without labels the logits are returned


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "64"])
def test_model_bad_loss_chunk_tokens_is_named(bad):
    model = build_model("tiny")
    model.loss_chunk_tokens = bad
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=f"loss_chunk_tokens must be None or an integer >= 1.*got {bad!r}"):
        model(ids, labels=ids)


@pytest.mark.parametrize("chunk", [None, 16])
def test_model_step_traced_on_fake_tensors_equals_measurement(chunk):
    # what the planner will do once a Recipe field sets loss_chunk_tokens
    def step_of(model, ids):
        def step():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
        return step

    model = build_model("tiny")
    model.loss_chunk_tokens = chunk
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    measured = measure_step(step_of(model, ids), model=model, track=[ids], device="cpu", repeat=1).peak_bytes
    with FakeTensorMode():
        fake_model = build_model("tiny")
        fake_model.loss_chunk_tokens = chunk
        fake_ids = torch.randint(0, 256, (4, 64))
        step = step_of(fake_model, fake_ids)
        step()  # warm-up, as measure_step does
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(fake_model, fake_ids)
        with tracker:
            step()
    assert tracker.peak_bytes == measured


def test_model_chunked_loss_refuses_a_replaced_head():
    model = build_model("tiny")
    model.loss_chunk_tokens = 16
    model.lm_head = torch.nn.Sequential(model.lm_head)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_chunk_tokens needs lm_head to be an nn.Linear, got Sequential"):
        model(ids, labels=ids)


# -- Recipe(loss_chunk_tokens=...): the training step's loss by chunks, reference model and transformers --

def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def _step_grads(factory, recipe, ids):
    import colab_memopt as cm

    torch.manual_seed(0)  # the same LoRA initialisation for both
    model, _ = recipe.build(factory())
    out = model(ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fields", [{}, {"lora_rank": 4}, {"quantization": "nf4", "lora_rank": 4}],
                         ids=["full", "lora", "qlora"])
@pytest.mark.parametrize("family", ["reference", "llama", "llama-tied"])
def test_recipe_chunked_step_has_the_plain_steps_loss_and_gradients(family, fields):
    import colab_memopt as cm

    factory = {"reference": lambda: build_model("tiny"), "llama": _tiny_llama,
               "llama-tied": lambda: _tiny_llama(tie_word_embeddings=True)}[family]
    if family != "reference" and fields.get("lora_rank"):
        fields = {**fields, "lora_targets": ("q_proj", "v_proj")}
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    recipe = cm.Recipe.from_dict(fields)
    plain, plain_grads = _step_grads(factory, recipe, ids)
    chunked, chunked_grads = _step_grads(factory, recipe.with_(loss_chunk_tokens=16), ids)
    assert chunked.logits is None and plain.logits is not None  # the head never ran on all tokens
    torch.testing.assert_close(chunked.loss, plain.loss)
    assert plain_grads.keys() == chunked_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_recipe_chunked_loss_through_the_training_step_and_without_labels(corpus):
    import colab_memopt as cm

    recipe = cm.Recipe(loss_chunk_tokens=32, precision="bf16-autocast", accumulation_steps=2)
    losses = []
    for rec in (recipe.with_(loss_chunk_tokens=None), recipe):
        torch.manual_seed(0)
        model, opt = rec.build(_tiny_llama())
        losses.append(cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=48, recipe=rec)())
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)  # bf16 autocast: the head's matmul rounds differently
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert model(ids).logits.shape == (1, 8, 256)  # without labels: the model's own forward, with logits
    cm.loss.apply_chunked_loss(model, None)
    assert model(ids, labels=ids).logits is not None  # removed: the plain forward again


def test_recipe_loss_chunk_tokens_is_validated_and_refused_where_it_cannot_apply():
    import colab_memopt as cm

    for bad in (0, -3, True, 2.5, "128"):
        with pytest.raises(ValueError, match=f"recipe.loss_chunk_tokens must be None or an integer >= 1.*got {bad!r}"):
            cm.Recipe(loss_chunk_tokens=bad)
    with pytest.raises(ValueError, match=r"output layer to be a plain torch.nn.Linear, but lora_targets .* would wrap it "
                                         r"\(lm_head\) in a LoRA layer: leave lm_head out of lora_targets"):
        cm.Recipe(loss_chunk_tokens=8, lora_rank=2, lora_targets=("q_proj", "lm_head")).build(_tiny_llama())
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        cm.Recipe(loss_chunk_tokens=8).build(gemma)
    with pytest.raises(ValueError, match="needs the reference model or a transformers causal LM.*got Sequential"):
        cm.Recipe(loss_chunk_tokens=8).check_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_chunked_loss_reaches_through_a_peft_model_wrapper():
    from peft import LoraConfig, get_peft_model

    from colab_memopt.techniques.loss import apply_chunked_loss

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    config = LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    plain = get_peft_model(_tiny_llama(), config)
    torch.manual_seed(0)
    chunked = apply_chunked_loss(get_peft_model(_tiny_llama(), config), 8)
    out_plain, out_chunked = plain(input_ids=ids, labels=ids), chunked(input_ids=ids, labels=ids)
    assert out_chunked.logits is None
    torch.testing.assert_close(out_chunked.loss, out_plain.loss)


# -- the chunked loss only where it computes the model's own objective, decided by running the model --

def _small(family, **kw):
    import transformers

    from colab_memopt.techniques.architectures import small_config

    return transformers.AutoModelForCausalLM.from_config(small_config(family, **kw))


@pytest.mark.parametrize("family, kw, says", [
    ("falcon_h1", {"lm_head_multiplier": 0.5}, "mul on the logits"),  # probe rows 90, 192
    ("recurrent_gemma", {"logits_soft_cap": 1.0}, "tanh on the logits"),  # probe rows 91, 193
])
def test_chunked_loss_is_refused_where_the_model_transforms_its_logits(family, kw, says):
    from colab_memopt import loss as chunked

    model = _small(family, **kw)
    with pytest.raises(ValueError, match=f"{type(model).__name__} does more: {says}.*leave loss_chunk_tokens=None"):
        cm.Recipe(loss_chunk_tokens=8).build(model)
    if family == "falcon_h1":
        return  # (its Mamba layers run a slow reference kernel on the CPU: the meta path is checked on RecurrentGemma)
    chunked._OBJECTIVE_CACHE.clear()  # the planner's meta copy decides the same, by a small real twin of its config
    with torch.device("meta"):
        meta = _small(family, **kw)
    with pytest.raises(ValueError, match=says):
        cm.Recipe(loss_chunk_tokens=8).check_model(meta)


def test_chunked_loss_is_refused_on_masked_and_encoder_decoder_models():
    import transformers

    bert = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="BertForMaskedLM does more: linear on the hidden states before the head"):
        cm.Recipe(loss_chunk_tokens=8).build(bert)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=100, d_model=32, d_ff=64, num_layers=2,
                                                                       num_heads=2, d_kv=16))
    with pytest.raises(ValueError, match="needs the reference model or a transformers causal LM.*T5ForConditionalGeneration"):
        cm.Recipe(loss_chunk_tokens=8).build(t5)


def test_chunked_loss_refuses_another_objective_seen_only_in_the_loss():
    # Plain logits, but a loss that is not next-token cross-entropy (no shift): caught by comparing the losses.
    model = _tiny_llama()
    cls = type(model)

    class Unshifted(cls):
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = cls.forward(self, input_ids=input_ids, **kwargs)
            logits = out.logits
            out.loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
            return out

    model.__class__ = Unshifted
    with pytest.raises(ValueError, match="own loss differs on 8 tokens .* another objective"):
        cm.Recipe(loss_chunk_tokens=8).build(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # fp16 weights: the check's tolerance holds
def test_chunked_loss_is_accepted_on_plain_causal_lms_and_on_their_meta_copies(dtype):
    from colab_memopt import loss as chunked

    chunked._OBJECTIVE_CACHE.clear()  # checked again at this dtype
    model = _small("llama").to(dtype)
    ids = torch.randint(3, 500, (2, 16))
    with torch.no_grad():
        want = model(ids, labels=ids).loss.float()
        cm.Recipe(loss_chunk_tokens=8).build(model)
        got = model(ids, labels=ids).loss
    assert float(got) == pytest.approx(float(want), rel=1e-3 if dtype == torch.float32 else 2e-2)
    chunked._OBJECTIVE_CACHE.clear()
    with torch.device("meta"):
        meta = _small("llama")
    cm.Recipe(loss_chunk_tokens=8).check_model(meta)  # the meta forward runs: no twin needed


def test_plan_refuses_a_lora_head_with_the_chunked_loss_as_build_does():
    recipe = {"loss_chunk_tokens": 8, "lora_rank": 4, "lora_targets": ("qkv", "lm_head")}  # probe rows 120, 190
    says = r"plain torch.nn.Linear, but lora_targets \('qkv', 'lm_head'\) would wrap it \(lm_head\) in a LoRA layer"
    with pytest.raises(ValueError, match=says):
        cm.plan("tiny", 2, seq_len=16, recipe=recipe, method="analytic")
    with pytest.raises(ValueError, match=says):
        cm.Recipe(**recipe).build(cm.build_model("tiny"))
