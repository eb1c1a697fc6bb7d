"""The tiled MLP (tiling.py) and the checkpoints split between device and host (notebook 17)."""

from __future__ import annotations

import pytest
import torch

import colab_memopt as cm
from colab_memopt import planner, prediction
from colab_memopt.techniques.checkpointing import checkpoint_offloader
from colab_memopt.techniques.tiling import apply_tiled_mlp, find_mlps, remove_tiled_mlp
from test_planner import _plan_and_measure  # plan and measure one recipe through the same step (tests/ is on sys.path)

CPU_TARGET = {"name": "cpu-test", "device_bytes": 2**30, "host_bytes": 64 * 2**30, "cuda": False}
SCALE = 2.0**16  # the fp16 loss scale of a T4 step


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


FACTORIES = {"reference": lambda: cm.build_model("tiny"), "llama": _tiny_llama, "qwen2": _tiny_qwen2}
MODES = {"full": {}, "lora": {"lora_rank": 4}, "qlora": {"quantization": "nf4", "lora_rank": 4}}
# (autocast dtype or None, loss scale, rtol, atol): the tiles' matmuls have other row blocks, the sums another order
PRECISIONS = {"fp32": (None, 1.0, 1e-4, 1e-6), "bf16": (torch.bfloat16, 1.0, 2e-2, 1e-3),
              "fp16": (torch.float16, SCALE, 2e-2, 1e-3)}


def _grads(family, fields, ids, precision, *, tile=None, checkpointing="none"):
    dtype, scale, _, _ = PRECISIONS[precision]
    if family != "reference" and fields.get("lora_rank"):
        fields = {**fields, "lora_targets": ("gate_proj", "up_proj", "down_proj", "q_proj")}
    if family == "reference" and fields.get("lora_rank"):
        fields = {**fields, "lora_targets": ("up", "down", "qkv")}
    torch.manual_seed(0)  # the same LoRA initialisation for both
    recipe = cm.Recipe.from_dict({**fields, "mlp_tile_tokens": tile, "checkpointing": checkpointing})
    model, _ = recipe.build(FACTORIES[family]())
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(ids, labels=ids).loss
    (loss.float() * scale).backward()
    grads = {n: p.grad.float() / scale for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads, model


# every mode and precision on the Llama; the reference model without bf16 (slow on this CPU); one Qwen2 row
GRID = ([("llama", m, p) for m in MODES for p in PRECISIONS] + [("reference", m, p) for m in MODES for p in ("fp32", "fp16")]
        + [("qwen2", "lora", "bf16")])


@pytest.mark.parametrize(("family", "mode", "precision"), GRID)
def test_tiled_mlp_gradients_equal_the_untiled_step(family, mode, precision):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    loss, grads, _ = _grads(family, MODES[mode], ids, precision)
    tiled_loss, tiled_grads, model = _grads(family, MODES[mode], ids, precision, tile=24, checkpointing="full")
    assert all(m.__dict__.get("_cm_mlp_tile_tokens") == 24 for m in find_mlps(model))
    _, _, rtol, atol = PRECISIONS[precision]
    torch.testing.assert_close(tiled_loss, loss, rtol=rtol, atol=atol)
    assert grads.keys() == tiled_grads.keys() and grads
    if mode != "full":  # the adapters inside the MLP train
        assert any(("up" in n or "down" in n) and "lora" in n for n in grads)
    for name, grad in grads.items():
        assert torch.isfinite(tiled_grads[name]).all(), name
        torch.testing.assert_close(tiled_grads[name], grad, rtol=rtol, atol=atol * max(1.0, grad.abs().max().item()),
                                   msg=name)


def test_tiled_mlp_is_refused_by_name_and_removed_cleanly():
    with pytest.raises(ValueError, match="recipe.mlp_tile_tokens must be None or an integer >= 1.*got 0"):
        cm.Recipe(mlp_tile_tokens=0)
    with pytest.raises(ValueError, match="recipe.offload_keep_blocks=2 splits the checkpoints"):
        cm.Recipe(offload_keep_blocks=2)
    model = cm.build_model("tiny")
    for block in model.blocks:
        del block.mlp
        block.ffw = torch.nn.Identity()
    with pytest.raises(ValueError, match="block Block has no MLP submodule named one of"):
        cm.Recipe(mlp_tile_tokens=8).build(model)
    model = apply_tiled_mlp(cm.build_model("tiny"), 8)
    x = torch.randn(2, 20, model.blocks[0].mlp.up.in_features)
    with torch.no_grad():
        tiled = model.blocks[0].mlp(x)
    remove_tiled_mlp(model)
    assert "forward" not in model.blocks[0].mlp.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model.blocks[0].mlp(x), tiled)




@pytest.mark.parametrize("fields", [
    {"mlp_tile_tokens": 32},
    {"mlp_tile_tokens": 32, "checkpointing": "full", "precision": "bf16-autocast"},
    {"mlp_tile_tokens": 32, "checkpointing": "offload", "offload_keep_blocks": 2, "loss_chunk_tokens": 24},
], ids=["tiled", "tiled+full+bf16", "tiled+split+chunked"])
def test_plan_of_a_tiled_mlp_equals_the_measurement(corpus, fields):
    recipe = cm.Recipe.from_dict(fields)
    plan, measured, _ = _plan_and_measure(lambda: cm.build_model("tiny", n_layer=4), 4, 64, recipe, corpus)
    assert plan.peak_bytes == measured.peak_bytes and plan.by_category == measured.by_category


def test_tiled_mlp_lowers_the_checkpointed_step_on_a_llama(corpus):
    """The MLP's intermediates (3.5 x hidden wide here) set the recomputed block's peak; tiles cut it."""
    full, full_measured, _ = _plan_and_measure(_tiny_llama, 1, 128, cm.Recipe(checkpointing="full", loss_chunk_tokens=16),
                                               corpus)
    tiled, tiled_measured, _ = _plan_and_measure(
        _tiny_llama, 1, 128, cm.Recipe(checkpointing="full", loss_chunk_tokens=16, mlp_tile_tokens=16), corpus)
    assert full.peak_bytes == full_measured.peak_bytes and tiled.peak_bytes == tiled_measured.peak_bytes
    assert tiled.by_category["activations"] < full.by_category["activations"]


@pytest.mark.parametrize("tokens", [200, 256], ids=["short last tile", "tiles alike"])
@pytest.mark.parametrize(("autocast", "lora"), [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16 autocast", "LoRA, bf16 autocast"])
def test_a_tiled_mlp_traced_by_four_of_its_tiles_peaks_where_every_tile_measured_does(tokens, autocast, lora):
    """The planner's trace runs a tiled MLP's first two and last two tiles (`tiling.traced_tiles`; the others hold
    their output and input gradient, `_HeldTile`); the step measured runs all 8 (7 of 32 and one of 8, or 8 of 32):
    forward peaks in one of the last two tiles, backward in one of the first two (in fp32 the second: the first
    moves the parameters' summed gradients out of autograd's buffer as it goes)."""
    from colab_memopt.core.measure import measure_step

    def step_of(mlp, x):
        def step():
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = mlp(x)
            out.float().square().sum().backward()
        return step

    def tiled_mlp():
        model = _tiny_llama()
        if lora:  # the adapters' gradients summed over the tiles, the base frozen
            model = cm.Recipe(lora_rank=4, lora_targets=("gate_proj", "up_proj", "down_proj")).build(model)[0]
        mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
        mlp.forward = cm.tiling.tiled(mlp.forward, 32)
        return mlp

    def fake_step():
        mlp, x = tiled_mlp(), torch.empty(1, tokens, 64, requires_grad=True)
        return step_of(mlp, x), (mlp, x)

    mlp, x = tiled_mlp(), torch.randn(1, tokens, 64, requires_grad=True)
    measured = measure_step(step_of(mlp, x), model=mlp, track=[x], device="cpu", repeat=1).peak_bytes
    assert _traced_by_first_rounds(fake_step) == measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_norm_traced_by_its_first_tiles_peaks_where_every_tile_measured_does(dtype):
    """The planner's trace runs a tiled RMSNorm's first two tiles of the seven here (`loss.first_rounds_traced`: the
    rest allocate what they do, into buffers made before the loop); the step measured runs all seven, the last short."""
    from colab_memopt.core.measure import measure_step
    from colab_memopt.techniques.tiling import tiled_rms_norm

    def step_of(x, w):
        def step():
            x.grad = w.grad = None
            tiled_rms_norm(x, w, 1e-6, 40).float().sum().backward()
        return step

    def fake_step():
        x = torch.empty(2, 128, 64, dtype=dtype, requires_grad=True)
        w = torch.empty(64, dtype=dtype, requires_grad=True)
        return step_of(x, w), (x, w)

    x = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()  # 256 tokens
    w = torch.ones(64, dtype=dtype, requires_grad=True)
    measured = measure_step(step_of(x, w), track=[x, w], device="cpu", repeat=1).peak_bytes
    assert _traced_by_first_rounds(fake_step) == measured


def _traced_by_first_rounds(build):
    """Return the peak of the step `build()` makes on fake tensors (with the tensors it tracks), traced as the planner
    traces it (`loss.first_rounds_traced`) after a warm-up step, as `measure_step` measures."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from colab_memopt.core.tracker import TensorTracker
    from colab_memopt.planning.faketrace import _fake_safe_module_to
    from colab_memopt.techniques.loss import first_rounds_traced

    with FakeTensorMode(), _fake_safe_module_to():  # (peft moves its adapters as the planner's trace lets it)
        step, tracked = build()
        step()  # warm-up
        tracker = TensorTracker(device=torch.device("cpu"))
        tracker.track_external(*tracked)
        with tracker, first_rounds_traced():
            step()
    return tracker.peak_bytes


def test_split_checkpoints_keep_the_last_blocks_on_the_device(corpus):
    factory = lambda: cm.build_model("tiny", n_layer=4)  # noqa: E731
    for keep in (0, 1, 3):
        recipe = cm.Recipe(checkpointing="offload", offload_keep_blocks=keep)
        plan, measured, model = _plan_and_measure(factory, 4, 64, recipe, corpus)
        assert plan.peak_bytes == measured.peak_bytes
        host = {c.name: c.bytes for c in plan.host_costs}["offloaded checkpoints"]
        assert host == checkpoint_offloader(model).peak_host_bytes == (4 - keep) * 4 * 64 * 64 * 4
    with pytest.raises(ValueError, match="keep_blocks=5 exceeds the model's 4 blocks"):
        cm.Recipe(checkpointing="offload", offload_keep_blocks=5).build(factory())


# -- the split chosen for a target, the longest sequence per mode, the CLI, loss_chunk_tokens='auto' ------------

def _fake_plan(device_need, device_limit, host_need, host_limit, offloaded, keep=0):
    from types import SimpleNamespace

    return SimpleNamespace(recipe={"checkpointing": "offload", "offload_keep_blocks": keep}, device_need_bytes=device_need,
                           device_limit_bytes=device_limit, host_need_bytes=host_need, host_limit_bytes=host_limit,
                           host_costs=[prediction.Cost("offloaded checkpoints", offloaded, "")])


def test_offload_split_keeps_the_middle_of_what_both_memories_allow():
    # 10 blocks of 100 bytes offloaded; the host is 250 over (3 blocks must come back), the device has 720 free (7 fit)
    assert planner.offload_split(_fake_plan(1000, 1720, 1250, 1000, 1000), 10) == 5
    assert planner.offload_split(_fake_plan(1000, 1720, 900, 1000, 1000), 10) == 3  # host fits: spare split in two
    assert planner.offload_split(_fake_plan(1000, 1250, 1450, 1000, 1000), 10) is None  # 5 must come back, 2 fit
    assert planner.offload_split(_fake_plan(1100, 1000, 900, 1000, 1000), 10) is None  # the device alone is over
    assert planner.offload_split(_fake_plan(1000, 1720, 1250, 1000, 1000, keep=2), 10) is None  # already split


def test_longest_sequence_splits_the_checkpoints_when_the_host_is_short():
    """A CPU target whose host holds only part of the checkpoints: the split reaches further than offloading all."""
    recipe = cm.Recipe(checkpointing="offload", loss_chunk_tokens=16)
    at = planner.plan("tiny", 1, seq_len=64, recipe=recipe, target={**CPU_TARGET, "device_bytes": 2**40}, find_max_batch=False)
    offloaded = {c.name: c.bytes for c in at.host_costs}["offloaded checkpoints"]
    base = at.host_need_bytes - offloaded
    # the host holds half the checkpoints of 64 tokens: all of them offloaded fit up to 32 tokens
    target = {"name": "small-host", "device_bytes": 2**40, "host_bytes": int((base + offloaded // 2) / 0.95) + 1,
              "cuda": False}
    kw = dict(target=target, step_tokens=16, host_base_bytes=base, max_plans=6, guess_tokens=32)
    plain = cm.capacity.longest_sequence("tiny", recipe, **kw)
    split = cm.capacity.longest_sequence("tiny", recipe, split_checkpoints=True, **kw)
    # past what the host holds, one host copy per 2 blocks (two-level offload), or a split of one copy per block
    assert split.max_seq_len > plain.max_seq_len
    assert split.offload_keep_blocks or split.recipe.get("checkpoint_interval", 1) > 1
    assert plain.limited_by == "host RAM" and plain.breakdown["host_over_bytes"] > 0


def test_context_command_answers_per_mode(capsys):
    from colab_memopt.tooling.cli import main

    assert main(["context", "--model", "tiny", "--mode", "full", "--step", "32", "--max-plans", "3", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    full = out["results"]["full"]
    assert full["max_seq_len"] >= 32 and full["recipe"]["mlp_tile_tokens"] == cm.capacity.LONG_CONTEXT_TILE_TOKENS
    assert full["limited_by"] == "the sequence cap"
    assert main(["context", "--model", "tiny", "--mode", "everything"]) == 2


def test_auto_loss_chunk_is_chosen_from_the_memory_left():
    from colab_memopt.techniques.loss import DEFAULT_CHUNK_TOKENS, auto_chunk_tokens

    assert auto_chunk_tokens(0, 128256, 4096, 49152) == DEFAULT_CHUNK_TOKENS
    # 529,288 bytes per chunk token at Llama-3's vocabulary (one fp32 logits row, traced)
    assert auto_chunk_tokens(2 * 2**30, 128256, 4096, 49152) == 4096
    assert auto_chunk_tokens(300 * 2**20, 128256, 4096, 49152) == 512
    assert auto_chunk_tokens(2**40, 256, 64, 100) == 128
    p = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=64, recipe=cm.Recipe(loss_chunk_tokens="auto"),
                     target=CPU_TARGET, find_max_batch=False)
    assert p.recipe["loss_chunk_tokens"] == 128 and "loss_chunk_tokens='auto': 128 tokens" in p.warnings[-1]
    with pytest.raises(ValueError, match="loss_chunk_tokens='auto' is chosen for a target by the planner"):
        cm.Recipe(loss_chunk_tokens="auto").build(cm.build_model("tiny"))
    with pytest.raises(ValueError, match="must be None or an integer >= 1 .tokens per chunk., or 'auto', got 'big'"):
        cm.Recipe(loss_chunk_tokens="big")


def test_tiled_norm_keeps_the_gradients_and_saves_only_its_16_bit_input_and_a_scale_per_token():
    """transformers' RMSNorm saves an fp32 copy of a 16-bit input; the tiled norm its input and one fp32 scale."""
    from colab_memopt.techniques.tiling import apply_tiled_norm, find_rmsnorms, remove_tiled_norm

    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    plain, tiled = _tiny_llama(), _tiny_llama()
    apply_tiled_norm(tiled, 40)  # tiles of 40 of the 96 tokens: a short last tile too
    for model in (plain, tiled):
        model(x, labels=x).loss.backward()
    for a, b in zip(plain.parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    norm = find_rmsnorms(plain)[0]
    h = torch.randn(2, 48, 64, dtype=torch.bfloat16, requires_grad=True)  # (B, T, hidden), 16-bit
    saved = {}
    for name, run in (("plain", lambda: norm(h)), ("tiled", lambda: cm.tiling.tiled_rms_norm(h, norm.weight, 1e-6, 40))):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append((t.data_ptr(), t.numel() * t.element_size())) or t,
                                                      lambda t: t):
            run()
        saved[name] = sum(n for ptr, n in dict(sizes).items() if ptr != h.data_ptr())  # bytes beyond the input
    assert saved["tiled"] == 2 * 48 * 4 + norm.weight.numel() * 4  # one fp32 scale per token, and the weight
    assert saved["plain"] >= 2 * h.numel() * h.element_size()  # an fp32 copy of the input
    remove_tiled_norm(tiled)
    assert not any(cm.tiling._NORM_ORIGINAL in m.__dict__ or "forward" in m.__dict__ for m in find_rmsnorms(tiled))
    with pytest.raises(ValueError, match="norm_tile_tokens: GPT has no Llama-style RMSNorm"):
        apply_tiled_norm(cm.build_model("tiny"), 8)
    with pytest.raises(ValueError, match="recipe.norm_tile_tokens must be None or an integer >= 1 .* got 0"):
        cm.Recipe(norm_tile_tokens=0)
