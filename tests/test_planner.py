import json
import re
import warnings

import pytest
import torch

import colab_memopt as cm
from colab_memopt import faketrace, planner, quantized, targets, untraced
from colab_memopt.tooling.cli import main as cli
from colab_memopt.techniques.architectures import ARCHITECTURES, model_names
from colab_memopt.techniques.lowstate import LOW_STATE_OPTIMIZERS

CPU_TARGET = {"name": "cpu-test", "device_bytes": 2**30, "host_bytes": 64 * 2**30, "cuda": False}


def _measured(size, batch, seq, recipe, corpus):
    model, opt = recipe.build(cm.build_model(size))
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq, recipe=recipe)
    return cm.measure_step(step, model=model, optimizer=opt, repeat=1)


@pytest.mark.parametrize(
    "size, batch, seq, recipe",
    [("tiny", 4, 32, cm.Recipe()), ("small", 2, 100, cm.Recipe(attention="naive")), ("tiny", 3, 64, cm.Recipe(optimizer="sgd_momentum"))],
)
def test_trace_predicts_the_cpu_measurement(corpus, size, batch, seq, recipe):
    plan = planner.plan(lambda: cm.build_model(size), batch, seq_len=seq, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    measured = _measured(size, batch, seq, recipe, corpus)
    assert plan.method == "trace"
    assert plan.peak_bytes == measured.peak_bytes  # the same step, the same tracker: exact on the CPU
    assert plan.by_category == measured.by_category
    assert plan.by_phase == measured.by_phase


def test_plan_accepts_names_and_cuda_rounding_adds_a_little():
    cpu = planner.plan("tiny", 2, seq_len=32, target=CPU_TARGET, find_max_batch=False)
    # Same implementation on both: only the CUDA allocator's 512-byte rounding differs.
    cuda = planner.plan("tiny", 2, seq_len=32, target="t4", find_max_batch=False, optimizer_impl="single-tensor")
    assert 0 < cuda.peak_bytes - cpu.peak_bytes < 512 * 200
    assert cuda.peak_bytes % 512 == 0
    assert [c.name for c in cuda.device_costs] == ["CUDA context", "cuBLAS workspace", "cuBLAS workspace (autograd thread)",
                                                   "cuBLASLt workspace"] and cpu.device_costs == []


def test_max_batch_is_the_boundary():
    target = dict(CPU_TARGET, device_bytes=40 * 2**20)
    result = planner.plan("tiny", 4, seq_len=64, target=target, headroom=0.0)
    assert result.max_batch >= 4
    fits = planner.plan("tiny", result.max_batch, seq_len=64, target=target, headroom=0.0, find_max_batch=False)
    over = planner.plan("tiny", result.max_batch + 1, seq_len=64, target=target, headroom=0.0, find_max_batch=False)
    assert fits.fits and not over.fits_device


def test_verified_search_finds_boundary_from_any_guess():
    for guess in (1, 37, 40, 41, 90):
        assert planner._verified_max_batch(lambda b: b <= 40, guess) == (40, True)
    assert planner._verified_max_batch(lambda b: False, 5) == (0, True)
    # an upper bound: never tried above it; where it fits, the answer is the bound, not converged
    tried = []
    assert planner._verified_max_batch(lambda b: tried.append(b) or b <= 40, 90, upper=16) == (16, False)
    assert max(tried) == 16
    assert planner._verified_max_batch(lambda b: b <= 10, 90, upper=16) == (10, True)


def test_probe3_row_226_the_max_batch_search_with_a_chunked_loss_or_tiles_answers_in_seconds():
    # loss_chunk_tokens='auto' traced a round per chunk: the unbounded search traced batch 46,529 (1,454 chunks a
    # trace) and answered after 356 s. A trace now runs the chunked loss's first rounds only (the rest allocate what
    # they do): the search finds its boundary. A tiled MLP still traces every tile: its search stops at 32 rounds of
    # tiles and says so.
    import time

    start = time.perf_counter()
    p = planner.plan("tiny", 4, seq_len=32, recipe=dict(loss_chunk_tokens="auto"))
    assert time.perf_counter() - start < 60
    assert p.max_batch > 4 * 128 and not any("largest batch searched" in w for w in p.warnings), p.warnings
    assert planner._search_batch_cap(None, cm.Recipe(loss_chunk_tokens=128), 4, 32) is None
    tiles = cm.Recipe(mlp_tile_tokens=16)
    cap = planner._search_batch_cap(faketrace.shape_model(lambda: cm.build_model("tiny")), tiles, 4, 32)
    p = planner.plan("tiny", 4, seq_len=32, recipe=tiles)
    assert time.perf_counter() - start < 120
    assert cap == 16 and p.max_batch == cap  # 4x batch 4: more than 32 rounds of 16 tokens over its MLPs
    assert any(f"max_batch {cap} is the largest batch searched, and it fits" in w for w in p.warnings)
    assert planner._search_batch_cap(None, cm.Recipe(), 4, 32) is None  # nothing loops per token: no bound


def test_too_big_does_not_fit_and_says_why():
    result = planner.plan("1b", 1, seq_len=512, target="t4")
    assert not result.fits and not result.fits_device and result.max_batch == 0
    assert "DOES NOT FIT (device memory)" in str(result)


def test_lora_model_has_no_frozen_gradients_or_state():
    from peft import LoraConfig, get_peft_model

    def lora():  # a real transformers architecture: Llama's modules, two layers
        return get_peft_model(_tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora_plan = planner.plan(lora, 1, seq_len=64, find_max_batch=False)
        full_plan = planner.plan(_tiny_llama, 1, seq_len=64, find_max_batch=False)
    assert lora_plan.method == "trace", lora_plan.warnings
    adapters = [p for p in lora().parameters() if p.requires_grad]
    n = sum(p.numel() for p in adapters)
    # AdamW's state of the adapters only: two fp32 moments and a step per adapter tensor, each of the three rounded up
    # to the T4 allocator's 512 bytes; the frozen base has none
    assert 8 * n <= lora_plan.by_category["optimizer_state"] <= 8 * n + 3 * 512 * len(adapters)
    assert lora_plan.by_category["optimizer_state"] < 0.05 * full_plan.by_category["optimizer_state"]
    assert lora_plan.peak_bytes < full_plan.peak_bytes


class _DataDependent(torch.nn.Module):
    """A model whose forward branches on a tensor's value: not traceable on fake tensors."""

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, input_ids, labels=None):
        h = self.emb(input_ids)
        if h.sum() > 0:
            h = h * 2
        return type("Out", (), {"loss": h.square().mean()})()


def test_untraceable_model_falls_back_loudly():
    with pytest.warns(UserWarning, match="analytic estimate, not a trace"):
        result = planner.plan(_DataDependent, 2, seq_len=8, find_max_batch=False)
    assert result.method == "analytic" and result.warnings and result.peak_bytes > 0
    with pytest.raises(Exception):
        planner.plan(_DataDependent, 2, seq_len=8, method="trace", find_max_batch=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch": 0}, "batch must be an integer >= 1, got 0"),
        ({"seq_len": 0}, "seq_len must be an integer >= 1, got 0"),
        ({"seq_len": 65}, "seq_len 65 exceeds 'tiny'"),
        ({"target": "v100"}, "unknown target 'v100'"),
        ({"target": {"device_bytes": 1}}, "needs device_bytes and host_bytes"),
        ({"recipe": {"lr": 0}}, "recipe.lr must be > 0"),
        ({"recipe": {"colour": 1}}, "unknown recipe field"),
        ({"headroom": 1.5}, "headroom must be in"),
        ({"method": "guess"}, "method must be"),
    ],
)
def test_bad_input(kwargs, message):
    args = {"batch": 1, "seq_len": 16, **kwargs}
    with pytest.raises(ValueError, match=message):
        planner.plan("tiny", args.pop("batch"), **args)


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        planner.plan("gpt5", 1)


def test_named_architectures_have_published_sizes():
    assert "llama-3.2-1b" in model_names() and "tiny" in model_names()
    with torch.device("meta"):
        n = sum(p.numel() for p in ARCHITECTURES["llama-3.2-1b"].build().parameters())
    assert 1.23e9 < n < 1.24e9  # Llama-3.2-1B: 1.236B with tied embeddings


def test_cli_json_and_exit_codes(capsys):
    assert cli(["plan", "--model", "tiny", "--batch", "2", "--seq", "32", "--target", "t4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("peak_bytes", "by_category", "fits", "target", "max_batch", "method"):
        assert key in out
    assert out["method"] == "trace" and out["fits"] is True and out["target"]["name"] == "t4"
    assert cli(["plan", "--model", "tiny", "--batch", "0"]) == 2
    assert "batch must be" in capsys.readouterr().err
    assert cli(["plan", "--model", "tiny", "--batch", "1", "--recipe", "optimizer=adam9"]) == 2
    assert "recipe.optimizer" in capsys.readouterr().err
    assert cli(["plan", "--model", "tiny", "--batch", "1", "--device-bytes", "100"]) == 2
    assert cli(["plan", "--batch", "1"]) == 2  # argparse's refusal: one line, no usage dump, no SystemExit
    assert "plan needs --model and --batch (or --training-args FILE)" in capsys.readouterr().err


TRACED_RECIPES = [
    {"precision": "bf16-autocast"},
    {"precision": "fp16-autocast"},
    {"precision": "bf16"},
    {"precision": "bf16", "update_rounding": "kahan"},
    {"precision": "bf16", "update_rounding": "stochastic"},
    {"precision": "fp16"},  # traced in fp16 with its loss scaler (a clean step), measured in real fp16
    {"precision": "fp16", "optimizer": "lomo"},  # two backward passes, the first checks for overflow
    {"precision": "fp16", "optimizer": "adalomo"},
    {"precision": "bf16", "optimizer": "lomo"},
    {"precision": "bf16", "optimizer": "adalomo"},
    {"precision": "bf16", "update_rounding": "kahan", "optimizer": "adamw_in_backward"},
    {"checkpointing": "full"},
    {"checkpointing": "selective"},
    {"checkpointing": "offload"},
    {"loss_chunk_tokens": 16},
    {"loss_chunk_tokens": 24, "checkpointing": "offload", "precision": "bf16-autocast"},
    {"loss_chunk_tokens": 16, "precision": "fp16-autocast"},  # the T4's: the GradScaler's scale reaches its backward
    {"accumulation_steps": 2},
    {"attention_window": 16},
    {"attention": "semiseparable"},
    {"optimizer": "lion"},
    {"optimizer": "adam_mini"},
    {"optimizer": "adamw_in_backward"},
    {"lora_rank": 4},
    # LoRA's frozen base in half precision, adapters fp32
    {"lora_rank": 4, "base_dtype": "fp16", "precision": "fp16-autocast"},
    {"lora_rank": 4, "base_dtype": "bf16", "precision": "bf16-autocast"},
    {"quantization": "nf4", "lora_rank": 4, "base_dtype": "fp16", "precision": "fp16-autocast"},  # 4-bit layers compute in fp16
    # bitsandbytes' 8-bit optimizers: their code book is built for real, their update ops have fake kernels.
    {"optimizer": "adamw8bit"},
    {"optimizer": "lion8bit"},
    {"optimizer": "paged_adamw8bit"},
    {"optimizer": "adamw8bit_in_backward"},
    # the optimizers with almost no state, from their packages (lowstate)
    {"optimizer": "galore_adamw8bit"},
    {"optimizer": "galore_adamw8bit_in_backward"},
    {"optimizer": "galore_adamw8bit_in_backward", "optimizer_rank": 8},
    {"optimizer": "apollo"},
    {"optimizer": "apollo", "optimizer_rank": 8},
    {"optimizer": "apollo_mini"},
    {"optimizer": "torchao_adamw8bit"},
    {"optimizer": "torchao_adamw4bit"},
    {"optimizer": "badam"},
]


@pytest.mark.parametrize("fields", TRACED_RECIPES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_plan_honours_each_technique_exactly(corpus, fields):
    recipe = cm.Recipe.from_dict(fields)
    plan = planner.plan(lambda: cm.build_model("tiny"), 4, seq_len=64, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    assert plan.method == "trace", plan.warnings
    measured = _measured("tiny", 4, 64, recipe, corpus)
    assert plan.peak_bytes == measured.peak_bytes
    if recipe.optimizer.removesuffix("_in_backward") in LOW_STATE_OPTIMIZERS:  # each phase, each category
        assert plan.by_category == measured.by_category
        if recipe.optimizer.startswith("apollo"):  # the norm limiter's branch: at most one 0-d tensor above
            assert {k: v for k, v in plan.by_phase.items() if k != "optimizer"} == \
                {k: v for k, v in measured.by_phase.items() if k != "optimizer"}
            assert 0 <= plan.by_phase["optimizer"] - measured.by_phase["optimizer"] <= 4
        else:
            assert plan.by_phase == measured.by_phase


QLORA_RECIPES = [{"quantization": "nf4", "lora_rank": 4}, {"quantization": "fp4", "lora_rank": 4}]


# bitsandbytes' 4-bit weights are traced through a stand-in with their exact storage (quantized.traced_linear4bit).
@pytest.mark.parametrize("fields", QLORA_RECIPES, ids=lambda f: f["quantization"])
def test_qlora_is_traced_exactly_and_the_analytic_estimate_stays_close(corpus, fields):
    recipe = cm.Recipe.from_dict(fields)
    plan = planner.plan(lambda: cm.build_model("tiny"), 4, seq_len=64, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    measured = _measured("tiny", 4, 64, recipe, corpus)
    assert plan.method == "trace", plan.warnings
    assert plan.peak_bytes == measured.peak_bytes and plan.by_category == measured.by_category
    assert abs(plan.analytic_peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.10  # the cross-check


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


def test_qlora_on_a_transformers_family_is_traced_exactly(corpus):
    recipe = cm.Recipe(quantization="nf4", lora_rank=4, lora_targets=("q_proj", "v_proj"))
    plan = planner.plan(_tiny_llama, 2, seq_len=48, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(_tiny_llama())
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=48, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace", plan.warnings
    assert plan.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("scheme", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", [(200, 300), (64, 64), (129, 17)])
def test_the_4bit_stand_in_holds_what_a_real_linear4bit_holds(scheme, shape):
    """Byte for byte: packed weight, nested absmax, offset and both code books, per quant type and shape."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from colab_memopt.techniques.quantization import _bnb_linear, _quant_state_tensors

    out_f, in_f = shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = _bnb_linear(torch.nn.Linear(in_f, out_f), scheme)

    def storage(layer):
        qs = layer.weight.quant_state
        tensors = [layer.weight, layer.bias, qs.code, qs.state2.code, *_quant_state_tensors(layer.weight, layer)]
        return sorted((tuple(t.shape), str(t.dtype)) for t in tensors)

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
    with quantized._fake_safe_bitsandbytes(mode, cm.Recipe(quantization=scheme, lora_rank=1)), mode:
        fake = quantized.traced_linear4bit(torch.nn.Linear(in_f, out_f), scheme)
    assert isinstance(real, bnb.nn.Linear4bit) and isinstance(fake, bnb.nn.Linear4bit)
    assert storage(fake) == storage(real)
    assert fake.weight.quant_state.blocksize == real.weight.quant_state.blocksize == quantized.FOUR_BIT_BLOCKSIZE


# bitsandbytes' 8-bit base (LLM.int8) is traced through quantized.traced_linear8bit. On the CPU, in training,
# bitsandbytes dequantizes each 8-bit weight to the input's dtype in forward and again in backward.
def _real_int8_scale_bytes(model):
    from colab_memopt.techniques.quantization import _quant_state_tensors

    return sum(t.numel() * t.element_size() for m in model.modules() if type(m).__name__ == "Linear8bitLt"
               for t in _quant_state_tensors(m.weight, m))


@pytest.mark.parametrize("build, batch, seq, targets", [
    (lambda: cm.build_model("tiny"), 4, 64, None),
    (_tiny_llama, 2, 48, ("q_proj", "v_proj")),
], ids=["tiny", "llama"])
def test_bnb_int8_lora_is_traced_exactly_on_the_cpu(corpus, build, batch, seq, targets):
    fields = {"quantization": "bnb_int8", "lora_rank": 4, **({"lora_targets": targets} if targets else {})}
    recipe = cm.Recipe.from_dict(fields)
    plan = planner.plan(build, batch, seq_len=seq, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(build())
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace", plan.warnings
    assert plan.peak_bytes == measured.peak_bytes
    assert plan.by_category == measured.by_category and plan.by_phase == measured.by_phase
    # The row scales live beside the weights, outside what the tracker counts: a line of the plan, as in the real model.
    scales = next(c for c in plan.device_costs if c.name == "quantization scales")
    assert scales.bytes == _real_int8_scale_bytes(model) > 0
    assert not any("lower bound" in w for w in plan.warnings)  # the CPU path has no outlier columns


@pytest.mark.parametrize("shape", [(200, 300), (64, 64), (129, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_8bit_stand_in_holds_what_a_real_linear8bitlt_holds(shape, bias):
    """The int8 weight (also state.CB), the fp32 row scales, the bias: dtypes, shapes and bytes, and the layer's settings."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from colab_memopt.techniques.quantization import _bnb_linear

    out_f, in_f = shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = _bnb_linear(torch.nn.Linear(in_f, out_f, bias=bias), "bnb_int8")
        real(torch.randn(3, in_f, requires_grad=True)).sum().backward()  # the first forward moves CB and SCB to the state

    def tensors(layer):
        named = {"weight": layer.weight, "bias": layer.bias, "state.CB": layer.state.CB, "state.SCB": layer.state.SCB}
        return {k: (tuple(t.shape), t.dtype, t.numel() * t.element_size()) for k, t in named.items() if t is not None}

    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True))
    with quantized._fake_safe_bitsandbytes(mode, cm.Recipe(quantization="bnb_int8", lora_rank=1)), mode:
        fake = quantized.traced_linear8bit(torch.nn.Linear(in_f, out_f, bias=bias))
    assert isinstance(real, bnb.nn.Linear8bitLt) and isinstance(fake, bnb.nn.Linear8bitLt)
    assert tensors(fake) == tensors(real)
    assert tensors(real)["weight"] == ((out_f, in_f), torch.int8, out_f * in_f)
    assert tensors(real)["state.SCB"] == ((out_f,), torch.float32, 4 * out_f)
    assert real.weight.CB is None and fake.weight.CB is None and real.weight.SCB is None and fake.weight.SCB is None
    assert real.state.CB.data_ptr() == real.weight.data_ptr()  # the weight is the int8 matrix: counted once
    for key in ("threshold", "has_fp16_weights", "use_pool"):
        assert getattr(fake.state, key) == getattr(real.state, key), key
    assert fake.state.threshold == cm.quantization.INT8_THRESHOLD
    assert not fake.weight.requires_grad and (fake.bias is None or not fake.bias.requires_grad)


def test_bnb_int8_on_a_cuda_target_is_traced_as_llm_int8_and_said_to_be_a_bound():
    from bitsandbytes.autograd import _functions as bnb_autograd
    from torch._library.simple_registry import singleton

    import bitsandbytes as bnb

    ops = ("int8_vectorwise_quant", "int8_double_quant", "int8_mixed_scaled_mm")
    before = [list(singleton.find(f"bitsandbytes::{op}").fake_impl.kernels) for op in ops]
    matmul = bnb.matmul
    calls = []
    original = bnb_autograd.MatMul8bitLt.forward

    def forward(ctx, *args, **kwargs):
        calls.append(args[0].shape)
        return original(ctx, *args, **kwargs)

    bnb_autograd.MatMul8bitLt.forward = staticmethod(forward)
    try:
        plan = planner.plan("tiny", 2, seq_len=32, recipe={"quantization": "bnb_int8", "lora_rank": 4}, target="t4",
                            find_max_batch=False)
    finally:
        bnb_autograd.MatMul8bitLt.forward = staticmethod(original)
    assert plan.method == "trace", plan.warnings
    assert calls  # CUDA's LLM.int8 path, not the CPU's dequantizing one
    assert any("lower bound" in w and "outlier" in w for w in plan.warnings)
    # Everything the trace changed is back: bitsandbytes' fake kernels and its matmul.
    assert [list(singleton.find(f"bitsandbytes::{op}").fake_impl.kernels) for op in ops] == before
    assert bnb.matmul is matmul
    per_column, every_column = quantized.int8_outlier_bytes(cm.quantization.quantize_model(cm.build_model("tiny"), "bnb_int8"),
                                                          64, 4)
    assert 0 < per_column < every_column


def test_accumulation_bounds_the_batch():
    with pytest.raises(ValueError, match="smaller than recipe.accumulation_steps=4"):
        planner.plan("tiny", 2, seq_len=32, recipe={"accumulation_steps": 4})
    result = planner.plan("tiny", 4, seq_len=64, recipe={"accumulation_steps": 4}, target=dict(CPU_TARGET, device_bytes=30 * 2**20), headroom=0)
    assert result.max_batch >= 4
    assert planner._verified_max_batch(lambda b: b <= 3, 9, lower=4) == (0, True)
    assert planner._verified_max_batch(lambda b: b <= 6, 9, lower=4) == (6, True)


@pytest.mark.parametrize("size,batch,seq_len,recipe", [("small", 1, 128, {}), ("tiny", 2, 32, {"optimizer": "adam"}),
                                                         ("tiny", 2, 32, {"optimizer": "adamw_in_backward"})])
def test_foreach_optimizer_trace_equals_a_forced_foreach_measurement(size, batch, seq_len, recipe):
    # Review A5: on CUDA torch runs AdamW's foreach path, whose temporaries the single-tensor CPU path lacks.
    # The same implementation forced on the CPU, traced and measured, agrees to the byte.
    corpus = cm.load_corpus()
    rec = cm.Recipe.from_dict(recipe)
    cpu = {"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40, "cuda": False}
    plans = {impl: planner.plan(lambda: cm.build_model(size), batch, seq_len=seq_len, recipe=rec, target=cpu,
                                find_max_batch=False, optimizer_impl=impl) for impl in ("single-tensor", "foreach")}
    model, opt = rec.build(cm.build_model(size))
    faketrace.set_optimizer_impl(opt, "foreach")
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq_len, recipe=rec)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plans["foreach"].optimizer_impl == "foreach"
    assert plans["foreach"].peak_bytes == measured.peak_bytes
    if recipe.get("optimizer") in (None, "adam"):
        assert plans["foreach"].by_phase["optimizer"] > plans["single-tensor"].by_phase["optimizer"]


def test_cuda_target_traces_foreach_and_plans_the_cublas_workspace():
    p = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target="t4", find_max_batch=False)
    assert p.optimizer_impl == "foreach"
    workspace = next(c for c in p.device_costs if c.name == "cuBLAS workspace")
    assert workspace.bytes == 8_519_680 and workspace.in_allocator and "CublasHandlePool" in workspace.source
    # the autograd thread's own workspace and cuBLASLt's 1 MiB, all inside max_memory_allocated
    assert p.allocator_peak_bytes == p.peak_bytes + 2 * workspace.bytes + 2**20
    assert p.step_peak_bytes == p.peak_bytes  # workspaces are fixed costs, not the step's own
    assert p.to_dict()["optimizer_impl"] == "foreach"
    cpu = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, find_max_batch=False,
                       target={"device_bytes": 2**40, "host_bytes": 2**40, "cuda": False})
    assert cpu.optimizer_impl == "single-tensor" and cpu.device_costs == [] and cpu.allocator_peak_bytes == cpu.peak_bytes
    with pytest.raises(ValueError, match="optimizer_impl must be one of"):
        planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, optimizer_impl="fused")


def test_cublas_workspace_sizes_and_config_parsing():
    assert targets.cublas_workspace_bytes((7, 5), config="")[0] == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert targets.cublas_workspace_bytes((9, 0), config="")[0] == 32 * 2**20
    assert targets.cublas_workspace_bytes((7, 5), config=":4096:8")[0] == 32 * 2**20
    assert targets.cublas_workspace_bytes(None, config=":4096:2:16:8")[0] == 8_519_680
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG must be"):
        targets.cublas_workspace_bytes((7, 5), config="4096x8")
    with pytest.raises(ValueError, match="impl must be"):
        faketrace.set_optimizer_impl(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), "fused")


def test_bf16_on_a_t4_plan_warns_about_emulation_and_math_attention():
    p = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target="t4", find_max_batch=False,
                     recipe=cm.Recipe(precision="bf16-autocast"))
    assert any("no native bf16" in w and "math" in w for w in p.warnings), p.warnings
    a100 = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target="a100-40gb", find_max_batch=False,
                        recipe=cm.Recipe(precision="bf16-autocast"))
    assert not any("no native bf16" in w for w in a100.warnings)


def test_a_target_can_name_the_optimizer_implementation_its_device_runs():
    t = {"device_bytes": 2**40, "host_bytes": 2**40, "cuda": False, "optimizer_impl": "foreach"}
    assert planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target=t, find_max_batch=False).optimizer_impl == "foreach"
    with pytest.raises(ValueError, match="target optimizer_impl must be one of"):
        planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target=dict(t, optimizer_impl="fused"))


def test_probe_row_63_a_recipe_that_is_a_string_is_refused_as_such():
    # was: unknown recipe field(s) ['a', 'd', 'm', 'w']
    with pytest.raises(TypeError, match="recipe must be a Recipe or a dict of its fields, got str 'adamw'"):
        planner.plan("tiny", 1, seq_len=16, recipe="adamw")


@pytest.mark.parametrize("target, says", [
    ({"device_bytes": "16GB", "host_bytes": 1}, "target device_bytes must be an integer number of bytes, got '16GB'"),  # row 65
    ({"device_bytes": 2**30, "host_bytes": True}, "target host_bytes must be an integer number of bytes, got True"),
    ({"device_bytes": 2**30, "host_bytes": 2**30, "cuda_context_bytes": -1}, "cuda_context_bytes must be >= 0"),
])
def test_probe_row_65_target_sizes_must_be_integers(target, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        planner.plan("tiny", 1, seq_len=16, target=target)


@pytest.mark.parametrize("factory, says", [
    (lambda: 5, "model_factory must return a torch.nn.Module, it returned int"),  # row 66
    (lambda n: None, "model_factory must be callable with no arguments"),  # row 67
    (5, "model_factory must be a model name or a zero-argument function"),
])
def test_probe_rows_66_67_a_bad_factory_is_named(factory, says):
    with pytest.raises(TypeError, match=says):
        planner.plan(factory, 1, seq_len=16)


def test_probe_row_69_a_factory_past_its_sequence_length_is_refused():
    # was: fits=True by the analytic fallback, the reason only in warnings
    with pytest.raises(ValueError, match="seq_len 100 exceeds 'GPT''s maximum of 64"):
        planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=100)


@pytest.mark.parametrize("fields", [
    {"attention_window": 64},                                   # reference model only
    {"activation_compression": "int8_channel"},                 # needs a `blocks` list
    {"lora_rank": 4, "lora_targets": ("nope",)},                # no module of that name
    {"layer_offload_active": 1},                                # streams `.blocks`
])
def test_plan_refuses_what_build_refuses_with_the_same_message(fields):
    """A plan only for what can run: build's refusal comes out of plan, word for word, before any estimate."""
    from colab_memopt import architectures

    recipe = cm.Recipe(**fields)
    with pytest.raises(ValueError) as built:
        recipe.build(architectures.model_factory("smollm2-135m")())
    for method in ("auto", "analytic"):
        with pytest.raises(ValueError) as planned:
            planner.plan("smollm2-135m", 1, seq_len=32, recipe=recipe, method=method, find_max_batch=False)
        assert str(planned.value) == str(built.value)


def test_plan_and_build_accept_the_same_recipe_on_the_reference_model():
    recipe = cm.Recipe(attention_window=16, activation_compression="int8_channel", lora_rank=2)
    recipe.check_model(cm.build_model("tiny"))
    assert planner.plan("tiny", 1, seq_len=32, recipe=recipe, find_max_batch=False).peak_bytes > 0


def _plan_and_measure(factory, batch, seq, recipe, corpus):
    plan = planner.plan(factory, batch, seq_len=seq, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(factory())
    step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=seq, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace", plan.warnings
    return plan, measured, model


@pytest.mark.parametrize(("batch", "steps", "precision"), [(16, 8, "fp32"), (10, 4, "fp32"), (9, 4, "fp32"),
                                                         (10, 4, "fp16-autocast")])
def test_accumulation_traces_two_micro_batches_and_matches_the_whole_step(batch, steps, precision, corpus):
    """The planner traces the first two micro-batches and the optimizer step (the later ones repeat the second's
    peak) with the whole batch's token ids alive: the plan equals the measured step of all `steps` micro-batches,
    even and uneven splits, to the byte and by category."""
    recipe = cm.Recipe(accumulation_steps=steps, precision=precision)  # fp16: the GradScaler's path, as on a T4
    plan, measured, _ = _plan_and_measure(lambda: cm.build_model("tiny"), batch, 32, recipe, corpus)
    assert plan.peak_bytes == measured.peak_bytes and plan.by_category == measured.by_category


def test_offloaded_checkpoints_are_traced_exactly_with_their_host_bytes(corpus):
    """The host copies are made on fake tensors too; the plan counts them in host RAM."""
    recipe = cm.Recipe(checkpointing="offload")
    plan, measured, model = _plan_and_measure(lambda: cm.build_model("tiny", n_layer=4), 4, 64, recipe, corpus)
    assert plan.peak_bytes == measured.peak_bytes and plan.by_category == measured.by_category
    host = {c.name: c.bytes for c in plan.host_costs}["offloaded checkpoints"]
    assert host == cm.checkpointing.checkpoint_offloader(model).peak_host_bytes == 4 * 4 * 64 * 64 * 4


def test_offloaded_checkpoints_on_a_transformers_llama_trace_as_full_checkpointing_does(corpus):
    """'offload' must add no gap of its own to 'full', and its host bytes are exact. (On the Llama the trace of
    'full' was 47,616 bytes above the CPU measurement when 'offload' was added: transformers built a packed-
    sequence mask on fake tensors; the planner's fix (`_fake_safe_transformers`) made both exact.)"""
    full_plan, full_measured, _ = _plan_and_measure(_tiny_llama, 2, 48, cm.Recipe(checkpointing="full"), corpus)
    plan, measured, model = _plan_and_measure(_tiny_llama, 2, 48, cm.Recipe(checkpointing="offload"), corpus)
    assert plan.peak_bytes - measured.peak_bytes == full_plan.peak_bytes - full_measured.peak_bytes
    assert full_plan.peak_bytes == full_measured.peak_bytes
    host = {c.name: c.bytes for c in plan.host_costs}["offloaded checkpoints"]
    assert host == cm.checkpointing.checkpoint_offloader(model).peak_host_bytes == 2 * 2 * 48 * 64 * 4


def test_a_half_precision_lora_base_is_refused_in_bf16_on_a_t4_and_halves_the_frozen_weights():
    recipe = cm.Recipe(lora_rank=4, base_dtype="bf16", precision="bf16-autocast")
    with pytest.raises(ValueError, match=r"base_dtype='bf16' on target 't4' \(sm_75\), which has no native bf16"):
        planner.plan("tiny", 1, seq_len=32, recipe=recipe, target="t4", find_max_batch=False)
    fp32 = planner.plan("tiny", 1, seq_len=32, recipe=cm.Recipe(lora_rank=4, precision="fp16-autocast"), target=CPU_TARGET,
                        find_max_batch=False)
    half = planner.plan("tiny", 1, seq_len=32, recipe=recipe.with_(base_dtype="fp16", precision="fp16-autocast"),
                        target=CPU_TARGET, find_max_batch=False)
    frozen = sum(p.numel() for p in cm.build_model("tiny").parameters())
    # the frozen base goes from 4 to 2 bytes per value; the adapters (trainable) stay fp32
    assert fp32.by_category["parameters"] - half.by_category["parameters"] == 2 * frozen


def test_a_named_models_trace_is_cached_within_the_process_and_a_factory_is_not():
    # the recommender plans the same recipe again (modes, objectives, the explore panel)
    faketrace.clear_trace_cache()
    first = planner.plan("tiny", 2, seq_len=32, target=CPU_TARGET, find_max_batch=False)
    assert len(faketrace._TRACE_CACHE) == 1
    again = planner.plan("tiny", 2, seq_len=32, target=CPU_TARGET, find_max_batch=False)
    assert again.peak_bytes == first.peak_bytes and again.by_phase == first.by_phase and again.method == "trace"
    planner.plan("tiny", 3, seq_len=32, target=CPU_TARGET, find_max_batch=False)  # another shape: another entry
    planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, target=CPU_TARGET, find_max_batch=False)
    planner.plan("tiny", 2, seq_len=32, target=CPU_TARGET)  # the max-batch search needs the tracer: not cached
    assert len(faketrace._TRACE_CACHE) == 2
    faketrace.clear_trace_cache()


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_chunked_16bit_updates_are_traced_exactly(corpus, monkeypatch, mode):
    """UpdateRounding steps large parameters in row chunks (fp32 transient bounded); the trace follows it."""
    from colab_memopt import rounding

    monkeypatch.setattr(rounding, "CHUNK_ELEMENTS", 2048)  # the tiny model's matrices then go by chunks
    recipe = cm.Recipe(precision="bf16", update_rounding=mode)
    plan = planner.plan(lambda: cm.build_model("tiny"), 4, seq_len=64, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    measured = _measured("tiny", 4, 64, recipe, corpus)
    assert plan.method == "trace", plan.warnings
    assert plan.peak_bytes == measured.peak_bytes
    monkeypatch.setattr(rounding, "CHUNK_ELEMENTS", 10**9)
    whole = _measured("tiny", 4, 64, recipe, corpus)
    assert measured.by_phase["optimizer"] < whole.by_phase["optimizer"]  # the chunks hold less fp32 at once


@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
def test_fp16_lomo_is_traced_in_fp16_and_says_so(optimizer):
    plan = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, recipe=cm.Recipe(precision="fp16", optimizer=optimizer),
                        target=CPU_TARGET, find_max_batch=False)
    assert plan.method == "trace"
    assert any("traced in fp16" in w for w in plan.warnings)
    assert any("two backward passes" in w for w in plan.warnings)


def test_fp16_autocast_says_how_it_was_traced_as_a_note_not_a_warning():
    """On a CUDA target the trace takes CUDA's autocast lists (softmax, layer_norm, ... in float32): a note says so;
    nothing warns that CPU autocast keeps them in fp16, which the trace no longer does there."""
    recipe = cm.Recipe(precision="fp16-autocast")
    t4 = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, recipe=recipe, target="t4", find_max_batch=False)
    cpu = planner.plan(lambda: cm.build_model("tiny"), 2, seq_len=32, recipe=recipe, target=CPU_TARGET,
                       find_max_batch=False)
    assert not any("autocast" in w for w in t4.warnings + cpu.warnings), t4.warnings + cpu.warnings
    assert any("CUDA's autocast lists" in n for n in t4.notes), t4.notes
    assert any("GradScaler" in n for n in cpu.notes) and not any("CUDA" in n for n in cpu.notes), cpu.notes
    assert "note: fp16 autocast traced" in t4.explain()


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                               num_heads=4, decoder_start_token_id=0, pad_token_id=0))


def test_fp16_is_traced_in_fp16_where_the_model_branches_on_it(corpus):
    """T5 clamps its hidden states only when they are fp16 (transformers' modeling_t5, "clamp inf values to
    enable fp16 training"): traced in fp16 the plan is the CPU's measurement; bf16 as a proxy plans less."""
    recipe = cm.Recipe(precision="fp16")
    plan = planner.plan(_tiny_t5, 2, seq_len=32, recipe=recipe, target=CPU_TARGET, find_max_batch=False)
    model, opt = recipe.build(_tiny_t5())
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=32, recipe=recipe)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    assert plan.method == "trace", plan.warnings
    assert plan.peak_bytes == measured.peak_bytes and plan.by_phase == measured.by_phase
    proxy = planner.plan(_tiny_t5, 2, seq_len=32, recipe=cm.Recipe(precision="bf16", update_rounding=recipe.rounding_mode),
                         target=CPU_TARGET, find_max_batch=False)
    assert proxy.peak_bytes < measured.peak_bytes  # the clamps' copies: the proxy was low, the unsafe direction


def _tiny_llama_big_vocab():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))


@pytest.mark.parametrize("fields", [{"loss_chunk_tokens": 16},
                                    {"loss_chunk_tokens": 16, "quantization": "nf4", "lora_rank": 4,
                                     "lora_targets": ("q_proj", "v_proj"), "checkpointing": "offload"}],
                         ids=["full", "qlora-offload"])
def test_chunked_loss_on_a_transformers_llama_is_traced_exactly(corpus, fields):
    """The loss from the base model's hidden states by chunks, traced as the CPU measures it."""
    recipe = cm.Recipe.from_dict(fields)
    plan, measured, _ = _plan_and_measure(_tiny_llama_big_vocab, 2, 48, recipe, corpus)
    assert plan.peak_bytes == measured.peak_bytes and plan.by_category == measured.by_category
    plain = planner.plan(_tiny_llama_big_vocab, 2, seq_len=48, recipe=recipe.with_(loss_chunk_tokens=None),
                         target=CPU_TARGET, find_max_batch=False)
    # the (96 x 4096) fp32 logits (1.5 MiB) and their gradient are gone: one 16-token chunk's instead
    assert plan.by_phase["forward"] < plain.by_phase["forward"] - 96 * 4096 * 4


# -- what CUDA allocates that the trace cannot see ---------------------------------------------------------

def test_cuda_plans_every_cublas_and_cublaslt_workspace(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)
    costs = {c.name: c for c in untraced.cuda_workspace_costs((7, 5))}
    assert set(costs) == {"cuBLAS workspace", "cuBLAS workspace (autograd thread)", "cuBLASLt workspace"}
    assert costs["cuBLAS workspace"].bytes == costs["cuBLAS workspace (autograd thread)"].bytes == 8_519_680
    assert costs["cuBLASLt workspace"].bytes == 1024 * 1024
    assert all(c.in_allocator and not c.in_step and "CublasHandlePool" in c.source for c in costs.values())
    # sm_90 exactly takes 32 MiB (torch: `major == 9 && minor == 0`); others the ':4096:2:16:8' default
    assert untraced.cuda_workspace_costs((9, 0))[1].bytes == 32 * 2**20
    assert untraced.cuda_workspace_costs((10, 0))[1].bytes == 8_519_680
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")  # this machine's setting is not the target run's
    assert targets.cublaslt_workspace_bytes()[0] == 2**20
    assert targets.cublaslt_workspace_bytes("4096")[0] == 4 * 2**20
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    assert targets.cublaslt_workspace_bytes()[0] == 2**20
    assert targets.cublaslt_workspace_bytes("", "1")[0] == 0
    assert len(untraced.cuda_workspace_costs((7, 5))) == 3
    with pytest.raises(ValueError, match="CUBLASLT_WORKSPACE_SIZE must be a size in KiB"):
        targets.cublaslt_workspace_bytes("1MB", "")


def test_four_bit_dequant_bytes_follow_bitsandbytes_cuda_path():
    # the weight in the compute dtype, plus the nested absmax dequantized to fp32 and shifted: 2 x 4 B per 64 values
    assert quantized.four_bit_dequant_bytes(4096 * 4096, 2, nested=True) == 32 * 2**20 + 2 * 2**20
    assert quantized.four_bit_dequant_bytes(4096 * 4096, 2, nested=False) == 32 * 2**20
    assert quantized.four_bit_dequant_bytes(100, 4, nested=True) == 512 + 2 * 512  # allocator blocks


@pytest.mark.parametrize("precision", ["fp32", "fp16-autocast"])
def test_qlora_cuda_plan_counts_the_forward_dequantization_and_the_load_peak(precision):
    fields = {"quantization": "nf4", "lora_rank": 4, "precision": precision}
    if precision == "fp16-autocast":
        fields["base_dtype"] = "fp16"
    p = planner.plan("small", 16, seq_len=128, recipe=fields, target="t4", find_max_batch=False)  # 2048 tokens
    meta = cm.build_model("small", device="meta")
    biggest = max(m.weight.numel() for _, m in cm.quantization.linear_layers(meta))
    itemsize = 2 if precision == "fp16-autocast" else 4
    dequant = next(c for c in p.device_costs if c.name == "4-bit dequantized weight")
    assert dequant.bytes == quantized.four_bit_dequant_bytes(biggest, itemsize, nested=True)
    assert dequant.in_step and dequant.in_allocator and "_dequant_linear_fallback" in dequant.source
    assert "2048 tokens per micro-batch > 1536" in dequant.source  # above bitsandbytes' fused-kernel range
    assert dequant.phases == ("forward",)  # no checkpointing: backward does not run the forward's gemm_4bit again
    assert p.step_peak_bytes == max(p.peak_bytes, p.by_phase["forward"] + dequant.bytes)
    assert p.device_need_bytes == p.step_peak_bytes + sum(c.bytes for c in p.device_costs if not c.in_step)
    # loading: the whole (fp32) model is on the device before Recipe.build quantizes it
    names = [c.name for c in p.load_costs]
    assert names[:2] == ["CUDA context", "unquantized model"] and len(names) == 3
    unquantized = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in [*meta.parameters(), *meta.buffers()])
    assert p.load_costs[1].bytes == unquantized
    assert p.run_peak_bytes == max(p.device_need_bytes, p.load_need_bytes)
    assert p.run_peak_phase in ("loading", "step")
    d = p.to_dict()
    assert d["run_peak_bytes"] == p.run_peak_bytes and d["load_costs"][1]["name"] == "unquantized model"
    assert "device memory while loading" in p.explain() and "run peak" in str(p)  # each loading line: explain()


def test_the_forward_dequantization_adds_to_the_forward_peak_not_to_a_backward_one():
    # cuda-run-1 #11(c): one block of 4-bit LoRA layers, width 1024, 32 x 64 tokens: the traced peak is in backward
    # (the H100 measured it to 4 KiB) and the forward's dequantized weight, with the forward, stays below it
    rec = cm.Recipe(quantization="nf4", lora_rank=8)
    factory = lambda: cm.build_model("tiny", n_layer=1, d_model=1024)  # noqa: E731
    p = planner.plan(factory, 32, seq_len=64, recipe=rec, target="t4", find_max_batch=False)
    dequant = next(c for c in p.device_costs if c.in_step)
    assert p.by_phase["forward"] + dequant.bytes < p.by_phase["backward"] == p.peak_bytes
    assert p.step_peak_bytes == p.by_phase["backward"]
    assert p.allocator_peak_bytes == p.step_peak_bytes + sum(c.bytes for c in p.device_costs if c.in_allocator and not c.in_step)
    assert "4-bit dequantized weight: in forward, below the backward peak" in p.explain()
    assert "off the peak" in str(p)
    # with checkpointing, backward recomputes the forward: there the transient adds to backward's peak
    ckpt = planner.plan(factory, 32, seq_len=64, recipe=rec.with_(checkpointing="full"), target="t4", find_max_batch=False)
    dequant = next(c for c in ckpt.device_costs if c.in_step)
    assert dequant.phases == ("forward", "backward")
    assert ckpt.step_peak_bytes == max(ckpt.by_phase["forward"], ckpt.by_phase["backward"]) + dequant.bytes
    # the largest batch that fits counts the same way: the planned batch fits with 1 MiB to spare, and so is found
    tight = dict(name="tight", device_bytes=int((p.device_need_bytes + 2**20) / 0.95), host_bytes=2**40,
                 compute_capability=(7, 5), cuda_context_bytes=planner.get_target("t4").cuda_context_bytes)
    fit = planner.plan(factory, 32, seq_len=64, recipe=rec, target=tight, find_max_batch=True)
    assert fit.fits_device and fit.max_batch >= 32


def test_qlora_load_peak_can_be_the_run_peak_and_says_whether_the_run_fits():
    # batch 1 x 8 tokens: a tiny step, while the fp32 model (124M parameters) sits whole on the device before quantization
    p = planner.plan("gpt2-small", 1, seq_len=8, recipe={"quantization": "nf4", "lora_rank": 4}, target="t4", find_max_batch=False)
    assert p.run_peak_phase == "loading" and p.run_peak_bytes == p.load_need_bytes > p.device_need_bytes
    squeezed = dict(device_bytes=int((p.device_need_bytes + p.load_need_bytes) // 2 / 0.95), host_bytes=2**40,
                    compute_capability=(7, 5), cuda_context_bytes=planner.get_target("t4").cuda_context_bytes)
    q = planner.plan("gpt2-small", 1, seq_len=8, recipe={"quantization": "nf4", "lora_rank": 4}, target=squeezed, find_max_batch=False)
    assert q.fits_device and not q.fits_run  # the step fits; loading (the whole fp32 model first) does not
    assert any(w.startswith("loading needs") and "load_model" in w for w in q.warnings)
    assert p.fits_run and not any(w.startswith("loading needs") for w in p.warnings)


def test_qlora_plan_lines_only_where_cuda_runs_a_4bit_base():
    lora = planner.plan("tiny", 2, seq_len=32, recipe={"lora_rank": 4}, target="t4", find_max_batch=False)
    assert lora.load_costs == [] and lora.run_peak_phase == "step" and lora.step_peak_bytes == lora.peak_bytes
    cpu = planner.plan("tiny", 2, seq_len=32, recipe={"quantization": "nf4", "lora_rank": 4}, target=CPU_TARGET,
                       find_max_batch=False)
    assert cpu.load_costs == [] and not any(c.name == "4-bit dequantized weight" for c in cpu.device_costs)
    # 4 tokens or fewer per micro-batch: bitsandbytes always runs its fused kernel, which dequantizes nothing
    fused = planner.plan("tiny", 1, seq_len=4, recipe={"quantization": "nf4", "lora_rank": 4}, target="t4", find_max_batch=False)
    assert not any(c.name == "4-bit dequantized weight" for c in fused.device_costs)


def test_qlora_from_a_checkpoint_is_quantized_per_tensor_while_loading(monkeypatch):
    import colab_memopt.training.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "has_weights", lambda spec: True)  # as for a hub id: transformers quantizes on load
    p = planner.plan("small", 2, seq_len=64, recipe={"quantization": "nf4", "lora_rank": 4}, target="t4", find_max_batch=False)
    names = [c.name for c in p.load_costs]
    assert names == ["CUDA context", "loaded 4-bit model", "weight being quantized"]
    meta = cm.build_model("small", device="meta")
    biggest = max(m.weight.numel() for _, m in cm.quantization.linear_layers(meta))
    # loading.load_dtype: LoRA on a GPU without native bf16 loads the frozen base in fp16; no double quantization
    assert p.load_costs[2].bytes == quantized.four_bit_dequant_bytes(biggest, 2, nested=False)
    assert p.load_costs[1].bytes >= p.by_category["parameters"]


def test_offloaded_checkpoints_on_cuda_count_pinned_host_bytes_rounded():
    # 4 blocks x (4 x 48 x 64 fp32 = 48 KiB): a single pinned copy would take 64 KiB on CUDA (PowerOf2Ceil); the
    # offloader stores each in power-of-two pieces (32 KiB + 16 KiB), which the pinned allocator takes unrounded
    recipe = {"checkpointing": "offload"}
    cuda = planner.plan(lambda: cm.build_model("tiny", n_layer=4), 4, seq_len=48, recipe=recipe, target="t4",
                        find_max_batch=False)
    cpu = planner.plan(lambda: cm.build_model("tiny", n_layer=4), 4, seq_len=48, recipe=recipe, target=CPU_TARGET,
                       find_max_batch=False)
    host = {p: {c.name: c for c in plan.host_costs}["offloaded checkpoints"] for p, plan in (("cuda", cuda), ("cpu", cpu))}
    assert host["cpu"].bytes == host["cuda"].bytes == 4 * 4 * 48 * 64 * 4
    assert cm.offload.pinned_bytes(4 * 48 * 64 * 4) == 64 * 1024  # what one unsplit pinned copy would take
    assert "PowerOf2Ceil" in host["cuda"].source
    meta = cm.build_model("tiny", n_layer=4, device="meta")
    rec = cm.Recipe(checkpointing="offload")
    assert untraced.offloaded_checkpoint_bytes(meta, 4, 48, rec, pinned=True) == 4 * 4 * 48 * 64 * 4
    assert untraced.offloaded_checkpoint_bytes(meta, 4, 48, rec) == 4 * 4 * 48 * 64 * 4


@pytest.mark.parametrize("factory", [
    lambda: cm.build_model("tiny", device="cuda", seed=0),  # notebook 15's factory on a GPU machine
    lambda: cm.build_model("tiny").cuda(),
    lambda: cm.build_model("tiny").to("cuda", torch.float32),
], ids=["build_model-device-cuda", "dot-cuda", "to-cuda"])
def test_a_factory_that_moves_its_model_to_cuda_plans_on_a_gpu_machine(factory):
    # cuda-run-1 #2/#3: shape_model builds the factory on meta and the trace under fake tensors; the factory's move
    # to CUDA must be a no-op there ("Cannot copy out of meta tensor" on a GPU, "not compiled with CUDA" here).
    from unittest import mock

    import bitsandbytes  # noqa: F401 - imported before the mock, as on a GPU machine (it picks its backend at import)

    expected = planner.plan("tiny", 1, seq_len=32, target="t4", find_max_batch=False, method="trace")
    with mock.patch("torch.cuda.is_available", return_value=True):
        p = planner.plan(factory, 1, seq_len=32, target="t4", find_max_batch=False, method="trace")
    assert (p.peak_bytes, p.by_phase) == (expected.peak_bytes, expected.by_phase)


def test_planning_never_moves_a_real_tensor_to_another_device():
    with faketrace._fake_safe_module_to(), pytest.raises(ValueError, match="moves its real tensors to meta"):
        torch.nn.Linear(2, 2).to("meta")
    linear = torch.nn.Linear(2, 2)
    with faketrace._fake_safe_module_to():
        assert linear.to(torch.float16).weight.dtype == torch.float16  # a dtype change still happens, in place
    assert torch.nn.Module.to.__qualname__ == "Module.to" and torch.nn.Module.cuda.__qualname__ == "Module.cuda"


@pytest.fixture
def flash_flag_off():
    """The process-wide flag `env.apply_emulation` (and many 'T4 tips') set: CPU dispatch reads it too."""
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    yield
    torch.backends.cuda.enable_flash_sdp(was)


def test_a_plan_does_not_depend_on_the_process_sdpa_flags(flash_flag_off):
    """cuda-run-1 #1: with flash SDPA off process-wide the trace ran math attention (375,884,800 B)."""
    medium = lambda: cm.build_model("medium")  # noqa: E731
    off = planner.plan(medium, 8, seq_len=256, target="t4", find_max_batch=False)
    assert torch.backends.cuda.flash_sdp_enabled() is False  # left as the user set it
    faketrace.clear_trace_cache()
    torch.backends.cuda.enable_flash_sdp(True)
    on = planner.plan(medium, 8, seq_len=256, target="t4", find_max_batch=False)
    assert off.peak_bytes == on.peak_bytes == 272_216_064, (off.peak_bytes, on.peak_bytes)
    assert off.by_category == on.by_category


def _small_llama():
    import transformers

    from colab_memopt import architectures

    return transformers.AutoModelForCausalLM.from_config(architectures.small_config("llama"))  # 4 heads, 2 KV heads


# cuda-run-1 #6: fp32, 4 x 512, no mask -> transformers passes enable_gqa=True; CUDA runs math attention (measured on the
# emulated T4: 94.44 MiB, of which 16 MiB were inside one op: softmax's backward makes `grad * output` there, measured
# by benchmarks/cuda_in_op_buffers.py on 2026-11-28).
LLAMA_TENSORS_PEAK_BYTES = 82_260_992  # 78.45 MiB: the tensors at the moment before that op
LLAMA_IN_OP_BYTES = 4 * 4 * 512 * 512 * 4  # (B, heads, T, T) fp32
LLAMA_MATH_PEAK_BYTES = LLAMA_TENSORS_PEAK_BYTES + LLAMA_IN_OP_BYTES  # 94.45 MiB


@pytest.mark.parametrize("flash_flag", [True, False])
def test_grouped_query_attention_without_a_mask_is_planned_as_math_on_a_t4(flash_flag):
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(flash_flag)
    try:
        plan = planner.plan(_small_llama, 4, seq_len=512, target="t4", find_max_batch=False)
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
    assert plan.peak_bytes == plan.step_peak_bytes == LLAMA_MATH_PEAK_BYTES, plan.peak_bytes
    assert abs(plan.step_peak_bytes - 94.44 * 2**20) <= 0.0005 * plan.step_peak_bytes  # the emulated T4's measurement
    assert max(plan.by_phase, key=plan.by_phase.get) == "backward"
    assert plan.by_category["temporaries"] >= LLAMA_IN_OP_BYTES
    assert any("math kernel on t4" in w for w in plan.warnings)
    # the CPU's own plan counts no CUDA kernel's buffers: the tensors alone
    cpu = planner.plan(_small_llama, 4, seq_len=512, target={"name": "cpu", "device_bytes": 2**40, "host_bytes": 2**40,
                                                            "cuda": False}, find_max_batch=False)
    assert cpu.peak_bytes < LLAMA_MATH_PEAK_BYTES


def test_grouped_query_attention_keeps_flash_where_the_target_runs_it():
    """sm_80+ runs flash for grouped-query heads in fp16/bf16 (O(T)); in fp32 flash refuses and so does
    memory-efficient (grouped-query heads), so math runs there too."""
    bf16 = planner.plan(_small_llama, 4, seq_len=512, target="a100-40gb", recipe={"precision": "bf16-autocast"},
                        find_max_batch=False)
    fp16 = planner.plan(_small_llama, 4, seq_len=512, target="h100-80gb", recipe={"precision": "fp16-autocast"},
                        find_max_batch=False)
    fp32 = planner.plan(_small_llama, 4, seq_len=512, target="a100-40gb", find_max_batch=False)
    for plan in (bf16, fp16):
        assert not any("math kernel" in w for w in plan.warnings)
        assert plan.peak_bytes < 0.4 * LLAMA_MATH_PEAK_BYTES, plan.peak_bytes
    assert fp32.peak_bytes == LLAMA_MATH_PEAK_BYTES
    assert any("math kernel" in w for w in fp32.warnings)


def test_max_batch_counts_what_cuda_kernels_hold_inside_an_op_at_each_batch():
    plan = planner.plan(_small_llama, 4, seq_len=512, target="t4")
    budget = plan.device_limit_bytes - sum(c.bytes for c in plan.device_costs)
    traced = lambda b: planner.plan(_small_llama, b, seq_len=512, target="t4", find_max_batch=False)  # noqa: E731
    best = plan.max_batch
    fits, over = traced(best), traced(best + 1)
    assert fits.peak_bytes <= budget < over.peak_bytes
    assert over.by_category["temporaries"] >= (best + 1) * LLAMA_IN_OP_BYTES // 4  # softmax's backward's buffer, per row
