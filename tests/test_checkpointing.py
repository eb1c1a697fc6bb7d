import pytest
import torch

import colab_memopt as cm
from colab_memopt import checkpointing as ck


def _grads_and_report(model, corpus, policy, interval=1):
    ck.apply_checkpointing(model, policy, interval)
    opt = cm.make_optimizer("sgd", model.parameters())
    step = cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=32)
    report = cm.measure_step(step, model=model, optimizer=opt, warmup=0, repeat=1)
    model.zero_grad()
    x = corpus.batch(2, 32, generator=torch.Generator().manual_seed(3))
    model(x, labels=x).loss.backward()
    return [p.grad.clone() for p in model.parameters()], report


@pytest.mark.parametrize("policy,interval", [("full", 1), ("every_n", 2), ("segments", 2), ("selective", 1)])
def test_policies_keep_gradients_and_cut_activations(corpus, policy, interval):
    base_grads, base = _grads_and_report(cm.build_model("tiny", n_layer=4), corpus, "none")
    grads, rep = _grads_and_report(cm.build_model("tiny", n_layer=4), corpus, policy, interval)
    for a, b in zip(grads, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert rep.category_peaks["activations"] < base.category_peaks["activations"]
    assert rep.peak_bytes < base.peak_bytes


def test_full_checkpointing_halves_activations_and_is_removable(corpus):
    model = cm.build_model("tiny", n_layer=4)
    _, base = _grads_and_report(model, corpus, "none")
    _, full = _grads_and_report(model, corpus, "full")
    assert full.category_peaks["activations"] <= 0.5 * base.category_peaks["activations"]
    ck.remove_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert set(model.state_dict()) == set(cm.build_model("tiny", n_layer=4).state_dict())


def test_policy_on_a_transformers_model_from_a_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for policy in ("none", "full", "selective", "segments"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        assert len(ck.find_blocks(model)) == 4
        ck.apply_checkpointing(model, policy, 2)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(x, labels=x).loss.backward()

        report = cm.measure_step(step, model=model, warmup=0, repeat=1)
        results[policy] = (report, [p.grad.clone() for p in model.parameters()])
    base_report, base_grads = results["none"]
    for policy in ("full", "selective", "segments"):
        report, grads = results[policy]
        assert report.category_peaks["activations"] < base_report.category_peaks["activations"], policy
        for a, b in zip(grads, base_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_checkpointed_block_indices_and_expectations():
    assert ck.checkpointed_blocks(8, "every_n", 4) == [3, 7]
    assert ck.checkpointed_blocks(8, "segments", 4) == [0, 4]
    assert ck.checkpointed_blocks(3, "full") == [0, 1, 2]
    assert ck.checkpointed_blocks(3, "none") == []
    assert ck.expected_activation_bytes(100, 10, 8, "none") == 800
    assert ck.expected_activation_bytes(100, 10, 8, "full") == 8 * 10 + 100
    assert ck.expected_activation_bytes(100, 10, 32, "segments", 8) == 4 * 10 + 8 * 100
    assert ck.expected_activation_bytes(100, 10, 8, "every_n", 2) == 4 * 10 + 4 * 100 + 100


def test_bad_policy_values_and_models():
    with pytest.raises(ValueError, match="policy must be one of .* got 'some'"):
        ck.apply_checkpointing(cm.build_model("tiny"), "some")
    with pytest.raises(ValueError, match="interval must be an integer >= 1, got 0"):
        ck.apply_checkpointing(cm.build_model("tiny"), "every_n", 0)
    with pytest.raises(ValueError, match="no nn.ModuleList of repeated blocks"):
        ck.find_blocks(torch.nn.Linear(2, 2))
    assert isinstance(ck.apply_checkpointing(torch.nn.Linear(2, 2), "none"), torch.nn.Linear)


def test_policies_can_be_switched_on_one_model(corpus):
    model = cm.build_model("tiny", n_layer=4)
    for policy, interval in [("every_n", 2), ("full", 1), ("segments", 2), ("none", 1), ("selective", 1)]:
        ck.apply_checkpointing(model, policy, interval)
        x = corpus.batch(2, 16, generator=torch.Generator().manual_seed(0))
        model(x, labels=x).loss.backward()
    ck.remove_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_probe_row_77_an_interval_past_the_last_block_warns():
    # was: accepted silently; activations identical to no checkpointing
    model = cm.build_model("tiny", n_layer=4)
    with pytest.warns(RuntimeWarning, match="checkpoint_interval 10 exceeds the model's 4 blocks: .*none is checkpointed"):
        ck.apply_checkpointing(model, "every_n", 10)
    assert ck.checkpointed_blocks(4, "every_n", 10) == []


# -- 'offload': the checkpointed blocks' inputs in host memory ------------------------------------

def _offload_vs_full(build, batch_fn, n_blocks, input_bytes):
    """Return {policy: (report, grads, offloader)} for 'full' and 'offload' on the same model and batches."""
    out = {}
    for policy in ("full", "offload"):
        torch.manual_seed(0)
        model = build()
        ck.apply_checkpointing(model, policy)
        x = batch_fn()

        def step(model=model, x=x):
            model.zero_grad(set_to_none=True)
            model(x, labels=x).loss.backward()

        report = cm.measure_step(step, model=model, warmup=1, repeat=1, track=[x])
        out[policy] = (report, [p.grad.clone() for p in model.parameters()], ck.checkpoint_offloader(model))
    full, offload = out["full"], out["offload"]
    assert full[2] is None
    for a, b in zip(offload[1], full[1]):
        assert torch.equal(a, b)  # the same operations on the same values: bit-exact
    off = offload[2]
    # One input per block crossed to the host and back in each of the three steps (warm-up, measured,
    # and the untracked first run), and none is left there once backward freed the graph.
    assert off.peak_host_bytes == n_blocks * input_bytes
    # on CUDA the copies are pinned: torch's caching host allocator rounds each allocation up to a power of two,
    # and the offloader stores each input in power-of-two pieces, so the rounding adds nothing
    assert off.peak_pinned_host_bytes == n_blocks * sum(
        cm.offload.pinned_bytes(n * 4) for n in cm.offload.power_of_two_pieces(input_bytes // 4)) == n_blocks * input_bytes
    assert off.host_bytes == 0
    assert off.stats.bytes_to_host == off.stats.bytes_to_device == off.stats.to_host * input_bytes
    assert off.stats.to_host == off.stats.to_device and off.stats.to_host % n_blocks == 0
    # The device drop against 'full': all n inputs at best; at worst n - 2, since backward holds the input
    # being recomputed and the one loaded ahead (at most two at any moment). Nothing else moves.
    drop = full[0].category_peaks["activations"] - offload[0].category_peaks["activations"]
    assert (n_blocks - 2) * input_bytes <= drop <= n_blocks * input_bytes, (drop, input_bytes)
    return full[0], offload[0], off, drop


def test_offload_is_exact_and_frees_the_block_inputs_on_the_reference_model(corpus):
    n, B, T, h = 6, 4, 64, 64
    x = corpus.batch(B, T, generator=torch.Generator().manual_seed(3))
    full, offload, off, drop = _offload_vs_full(lambda: cm.build_model("tiny", n_layer=n), lambda: x, n, B * T * h * 4)
    assert offload.peak_bytes <= full.peak_bytes


def _llama_case(transformers, n: int, B: int, T: int, h: int):
    """A small Llama config (n blocks, hidden h, grouped-query heads) and a batch of B x T tokens for it."""
    cfg = transformers.LlamaConfig(hidden_size=h, intermediate_size=128, num_hidden_layers=n, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=T)
    return cfg, torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))


def test_offload_is_exact_and_frees_the_block_inputs_on_a_transformers_llama():
    transformers = pytest.importorskip("transformers")
    n, B, T, h = 6, 2, 64, 64
    cfg, x = _llama_case(transformers, n, B, T, h)
    _offload_vs_full(lambda: transformers.LlamaForCausalLM(cfg), lambda: x, n, B * T * h * 4)


def test_offload_by_segments_halves_the_host_copies_and_keeps_gradients():
    """checkpointing='offload' with interval 2 (two-level): one host copy per 2 blocks, the same gradients."""
    transformers = pytest.importorskip("transformers")
    n, B, T, h = 6, 2, 64, 64
    cfg, x = _llama_case(transformers, n, B, T, h)
    out = {}
    for interval in (1, 2):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        ck.apply_checkpointing(model, "offload", interval)
        model(x, labels=x).loss.backward()
        off = ck.checkpoint_offloader(model)
        out[interval] = ([p.grad.clone() for p in model.parameters()], off.peak_host_bytes, off.stats.to_host)
    for a, b in zip(out[2][0], out[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same operations on the same values
    input_bytes = B * T * h * 4
    assert out[1][1] == n * input_bytes and out[2][1] == n // 2 * input_bytes
    assert out[2][2] == n // 2
    with pytest.raises(ValueError, match="keep_blocks=1 splits one checkpoint per block"):
        ck.apply_checkpointing(transformers.LlamaForCausalLM(cfg), "offload", 2, keep_blocks=1)


def test_offload_is_removable_and_switches_back(corpus):
    model = cm.build_model("tiny", n_layer=2)
    ck.apply_checkpointing(model, "offload")
    assert isinstance(ck.checkpoint_offloader(model), ck.CheckpointOffloader)
    ck.apply_checkpointing(model, "full")
    assert ck.checkpoint_offloader(model) is None
    ck.apply_checkpointing(model, "offload")
    ck.remove_checkpointing(model)
    assert ck.checkpoint_offloader(model) is None and all("forward" not in b.__dict__ for b in model.blocks)
    with torch.no_grad():  # evaluation: nothing saved, nothing offloaded
        ck.apply_checkpointing(model, "offload")
        x = corpus.batch(1, 8, generator=torch.Generator().manual_seed(0))
        model(x, labels=x)
    assert ck.checkpoint_offloader(model).stats.to_host == 0
    assert ck.expected_activation_bytes(100, 10, 8, "offload") == 2 * 10 + 100


def test_offload_needs_the_hidden_states_first():
    class Block(torch.nn.Module):
        def forward(self, scale, hidden):
            return hidden * scale

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    model = ck.apply_checkpointing(Model(), "offload")
    with pytest.raises(ValueError, match="hidden states as its first argument, got float"):
        model.blocks[0](2.0, torch.ones(2, requires_grad=True))


def test_offload_moves_far_fewer_bytes_than_save_on_cpu(corpus):
    """Host traffic per step, counted: ours (block inputs only) against `save_on_cpu` around the whole step.

    save_on_cpu's pack hook is wrapped to count what it receives; on the CPU its copy is `tensor.cpu()`,
    which returns the tensor itself, so it moves nothing here: only its bytes are compared.
    """
    n, B, T = 6, 4, 64
    x = corpus.batch(B, T, generator=torch.Generator().manual_seed(0))
    model = cm.build_model("tiny", n_layer=n)
    ctx = torch.autograd.graph.save_on_cpu()
    counted = []
    pack = ctx.pack_hook
    ctx.pack_hook = lambda t: (counted.append(t.numel() * t.element_size()), pack(t))[1]
    with ctx:
        loss = model(x, labels=x).loss
    loss.backward()
    save_on_cpu_bytes = sum(counted)
    ck.apply_checkpointing(model, "offload")
    model(x, labels=x).loss.backward()
    ours = ck.checkpoint_offloader(model).stats.bytes_to_host
    assert ours == n * B * T * model.config.d_model * 4
    # Measured on the 2-core CPU (tiny, 6 blocks, 4 x 64 tokens): 393,216 bytes against 8,639,460 (157
    # saved tensors), 22x: save_on_cpu offloads whatever autograd saves, every block's activations.
    assert save_on_cpu_bytes > 10 * ours, (save_on_cpu_bytes, ours)


# -- every stack of blocks is checkpointed (an encoder-decoder's encoder and decoder) -----------

def _tiny_t5():
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=3, num_decoder_layers=2, num_heads=2,
                                d_kv=16, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)  # use_cache on
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


# fp16: T5's fp16 gradients overflow under a loss scale of 2^16 with or without checkpointing (inf in 51,568 of
# them, measured); 2^8 is a scale a dynamic loss scaler backs off to, where they are finite
@pytest.mark.parametrize("policy, dtype", [("full", torch.float32), ("every_n", torch.float32), ("selective", torch.float32),
                                           ("offload", torch.float32), ("full", torch.float16), ("offload", torch.float16)])
def test_every_stack_of_an_encoder_decoder_is_checkpointed(policy, dtype):
    import copy

    from colab_memopt.techniques.checkpointing import apply_checkpointing, checkpoint_offloader, find_block_stacks

    reference = _tiny_t5().to(dtype)
    stacks = find_block_stacks(reference)
    assert [len(s) for s in stacks] == [3, 2] and stacks[0] is reference.encoder.block and stacks[1] is reference.decoder.block
    x, y = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 7))
    scale = 2.0**8 if dtype == torch.float16 else 1.0

    def grads(model):
        loss = model(input_ids=x, labels=y).loss
        (loss * scale).backward()
        return loss.item(), [p.grad.float() / scale for p in model.parameters()]

    want_loss, want = grads(copy.deepcopy(reference))
    # (interval 2 for 'every_n'; 'offload' with an interval > 1 is two-level, which T5's blocks refuse: see below)
    model = apply_checkpointing(copy.deepcopy(reference), policy, 2 if policy == "every_n" else 1)
    patched = ["forward" in b.__dict__ for s in find_block_stacks(model) for b in s]
    assert patched == ([False, True, False, False, True] if policy == "every_n" else [True] * 5)
    got_loss, got = grads(model)
    assert got_loss == pytest.approx(want_loss, rel=1e-5 if dtype == torch.float32 else 1e-3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert all(torch.isfinite(g).all() for g in want)
    assert all(torch.allclose(a, b, rtol=tol, atol=tol) for a, b in zip(want, got))
    if policy == "offload":  # one offloader for both stacks: every block's input went to the host
        assert checkpoint_offloader(model).stats.to_host == 5
        two_level = apply_checkpointing(copy.deepcopy(reference), policy, 2)
        with pytest.raises(ValueError, match="T5Block hands 3 values on to the next block: use checkpoint_interval=1"):
            grads(two_level)


def test_segments_refuse_blocks_that_hand_on_more_than_their_hidden_states():
    from colab_memopt.techniques.checkpointing import apply_checkpointing

    model = apply_checkpointing(_tiny_t5(), "segments", 2)
    x = torch.randint(0, 64, (2, 12))
    with pytest.raises(ValueError, match="'segments' .* T5Block hands 3 values on to the next block.*use checkpointing 'full'"):
        model(input_ids=x, labels=x).loss.backward()


# -- reliability probe 4 ---------------------------------------------------------------------------------------------

def test_probe4_offload_with_an_interval_of_all_blocks_warns_as_every_n_does():
    """checkpointing='offload' with checkpoint_interval >= the blocks made one segment (no second level) silently."""
    transformers = pytest.importorskip("transformers")
    for interval in (4, 64):
        cfg, _ = _llama_case(transformers, 4, 1, 16, 64)
        with pytest.warns(RuntimeWarning, match=rf"checkpoint_interval {interval} covers all of the model's 4 blocks: "
                                                r"'offload' makes one segment .*use an interval < 4"):
            cm.Recipe(checkpointing="offload", checkpoint_interval=interval).build(transformers.LlamaForCausalLM(cfg))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an interval that makes two segments: no word
        cm.Recipe(checkpointing="offload", checkpoint_interval=2).build(transformers.LlamaForCausalLM(cfg))


def test_probe4_a_one_block_llama_is_checkpointed_and_offloaded_exactly():
    """'full' and 'offload' on a one-block Llama said "has no nn.ModuleList of repeated blocks"; it has one, of one
    block (its _no_split_modules class)."""
    transformers = pytest.importorskip("transformers")
    B, T, h = 2, 64, 64
    cfg, x = _llama_case(transformers, 1, B, T, h)
    assert ck.find_blocks(transformers.LlamaForCausalLM(cfg)) is not None
    _offload_vs_full(lambda: transformers.LlamaForCausalLM(cfg), lambda: x, 1, B * T * h * 4)
    reports = {}
    for policy in ("none", "full"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        ck.apply_checkpointing(model, policy)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(x, labels=x).loss.backward()

        reports[policy] = (cm.measure_step(step, model=model, warmup=1, repeat=1, track=[x]),
                           [p.grad.clone() for p in model.parameters()])
    for a, b in zip(reports["full"][1], reports["none"][1]):
        torch.testing.assert_close(a, b)
    assert reports["full"][0].category_peaks["activations"] < reports["none"][0].category_peaks["activations"]
    with pytest.raises(ValueError, match="has no nn.ModuleList of repeated blocks"):  # a lone leaf list is not a stack
        ck.find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])))


@pytest.mark.parametrize("policy, interval", [("offload", 64), ("every_n", 64)])
def test_a_plan_says_a_checkpoint_interval_too_large_for_the_model_among_its_warnings(policy, interval):
    """Probe 4 recheck: an interval covering every block (offload: no second level; every_n: nothing checkpointed)
    was said on stderr only, by the build inside the plan's trace; the plan's warnings had nothing."""
    import warnings

    import colab_memopt as cm

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = cm.plan("tiny", 2, seq_len=32, recipe={"checkpointing": policy, "checkpoint_interval": interval},
                       target="t4", find_max_batch=False)
    said = [w for w in plan.warnings if w.startswith(f"checkpoint_interval {interval} ")]
    assert len(said) == 1 and ("no second level" if policy == "offload" else "none is checkpointed") in said[0]
    assert not [w for w in caught if "checkpoint_interval" in str(w.message)]  # said once, in the plan
    fine = cm.plan("tiny", 2, seq_len=32, recipe={"checkpointing": policy, "checkpoint_interval": 1}, target="t4",
                   find_max_batch=False)
    assert not [w for w in fine.warnings if w.startswith("checkpoint_interval")]
