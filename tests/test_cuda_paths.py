"""A CUDA target traced by its CUDA path (issue 41, item 3), on the CPU.

Each library branch a CUDA run takes and a CPU trace would not, checked where it acts: dropout's 1-byte mask (A),
peft's 4-bit LoRA reading CUDA's autocast flag (B), autocast over the forward only (C), bitsandbytes' in-op
dequantization (D), `prepare_model_for_kbit_training` said to a plan and read from a Trainer's model (E), both cuBLAS
workspaces (F). The layer checks are exact (saved tensors by dtype, by formula over the shapes); tiny shapes.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("peft")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    LlamaConfig,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from colab_memopt import trainer as tr  # noqa: E402
from colab_memopt.planning import cudapaths, kbitprep  # noqa: E402
from colab_memopt.planning.quantized import four_bit_dequant_bytes, traced_linear4bit  # noqa: E402
from colab_memopt.planning.untraced import cuda_workspace_costs  # noqa: E402

HALF = torch.bfloat16  # CUDA's fp16, as the planner traces it
T, K, R = 64, 64, 4  # tokens, hidden, LoRA rank of the layer checks


class Three(nn.Module):
    """q, k, v projections of one hidden state (a Llama block's attention input)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(K, K, bias=False, dtype=HALF) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(getattr(self, n)(x).float().sum() for n in ("q_proj", "k_proj", "v_proj"))


def three_adapters(base: str, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    net = Three()
    if base == "4-bit":
        for name in ("q_proj", "k_proj", "v_proj"):
            layer = traced_linear4bit(getattr(net, name), "nf4", compress_statistics=True)
            layer.compute_dtype = HALF
            setattr(net, name, layer)
        net.is_loaded_in_4bit = True  # as transformers marks it: peft wraps the layers in its lora.bnb.Linear4bit
    config = LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=dropout, target_modules=["q_proj", "k_proj", "v_proj"])
    return get_peft_model(net, config)


def saved_by_dtype(model: nn.Module, *, cuda: bool) -> dict[str, int]:
    """Run forward (CPU bf16 autocast, as the trace) and backward once; return {dtype: bytes} of the distinct
    storages autograd saved (parameters left out), with the CUDA paths on or off."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes())
        return t

    x = torch.randn(1, T, K, dtype=HALF, requires_grad=True)
    with cudapaths.as_on_cuda(cuda, HALF, model), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=HALF):
        loss = model(x * 1.0)  # a hidden state, not a leaf
    loss.backward()
    out: dict[str, int] = {}
    for dtype, nbytes in seen.values():
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


# each adapter saves lora_A's output (for lora_B) and autocast's bf16 copies of its A and B weights
ADAPTERS = 3 * (T * R * 2 + (R * K + K * R) * 2)


def test_dropout_on_a_cuda_target_keeps_a_one_byte_mask():
    """A: CUDA runs training dropout as native_dropout (a bool mask); the CPU as input * noise (fp32 noise here)."""
    model = three_adapters("16-bit", 0.05)
    cuda = saved_by_dtype(model, cuda=True)
    assert cuda == {"bool": 3 * T * K, "bfloat16": 3 * T * K * 2 + ADAPTERS}
    cpu = saved_by_dtype(model, cuda=False)  # what the trace held before: 4-byte noise per value, no mask
    assert cpu == {"float32": 3 * T * K * 4, "bfloat16": 3 * T * K * 2 + ADAPTERS}


def test_peft_4_bit_lora_takes_its_input_as_it_is_under_cuda_autocast():
    """B: peft's bnb LoRA asks torch.is_autocast_enabled() (CUDA's flag): on, the three adapters share the input."""
    model = three_adapters("4-bit", 0.0)
    assert saved_by_dtype(model, cuda=True) == {"bfloat16": T * K * 2 + ADAPTERS}
    assert saved_by_dtype(model, cuda=False) == {"bfloat16": 3 * T * K * 2 + ADAPTERS}  # a copy per adapter


def test_the_cuda_autocast_flag_is_set_on_this_thread_only_and_put_back():
    for before in (False, True):
        torch.set_autocast_enabled("cuda", before)
        dtype = torch.get_autocast_dtype("cuda")
        try:
            seen: list[bool] = []
            with cudapaths.as_on_cuda(True, HALF, nn.Linear(2, 2)) as paths:
                inside = torch.is_autocast_enabled()
                other = threading.Thread(target=lambda: seen.append(torch.is_autocast_enabled("cuda")))
                other.start()
                other.join()
            assert inside is True and seen == [False] and paths.autocast_flag
            assert torch.is_autocast_enabled("cuda") is before and torch.get_autocast_dtype("cuda") == dtype
            with pytest.raises(RuntimeError), cudapaths.as_on_cuda(True, HALF, nn.Linear(2, 2)):
                raise RuntimeError("a failing step")
            assert torch.is_autocast_enabled("cuda") is before
        finally:
            torch.set_autocast_enabled("cuda", False)
    with cudapaths.as_on_cuda(False, HALF, nn.Linear(2, 2)) as paths:  # a CPU target: nothing set
        assert paths is None and not torch.is_autocast_enabled("cuda")


def test_forward_autocast_wraps_the_forward_only_and_puts_it_back():
    """C: accelerate autocasts the model's forward; its cache (the adapters' 16-bit copies) empties when it returns."""
    net = nn.Linear(8, 8)
    own = net.forward
    with cudapaths.forward_autocast(net, HALF):
        out = net(torch.randn(2, 8))
        assert out.dtype == torch.float32  # convert_outputs_to_fp32, as accelerate wraps it
        assert not torch.is_autocast_enabled("cpu")  # outside the forward: backward runs without autocast
    assert "forward" not in vars(net) and net.forward == own


DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=4096)


def nf4() -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float16)


def args(tmp: Any, batch: int = 2, **changes: Any) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp), fp16=True, per_device_train_batch_size=batch, report_to=[],
                             use_cpu=True, optim="adamw_torch", **changes)


def qv(dropout: float = 0.0) -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def plan(**kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tr.plan_trainer(**kw)


def test_a_cuda_plan_counts_both_cublas_workspaces_as_plan_does(tmp_path):
    """F: forward's thread and the autograd thread each hold a cuBLAS workspace (and cuBLASLt its own)."""
    p = plan(trainer=args(tmp_path), model=LlamaConfig(**DIMS), target="t4", seq_len=16)
    lines = {c.name: c.bytes for c in p.device_costs if "workspace" in c.name}
    assert lines == {c.name: c.bytes for c in cuda_workspace_costs((7, 5))}
    assert lines["cuBLAS workspace"] == lines["cuBLAS workspace (autograd thread)"] == 8_519_680


def test_a_4_bit_plan_adds_gemm_4bit_s_dequantized_weight_nested_as_loaded(tmp_path):
    """D: above 1536 tokens per micro-batch bitsandbytes' CUDA gemm_4bit dequantizes the whole weight inside the op;
    a transformers load with double quantization dequantizes the nested absmax too."""
    p = plan(trainer=args(tmp_path), model=LlamaConfig(**DIMS), lora=qv(), bnb=nf4(), dtype=torch.float16,
             target="t4", seq_len=1024)
    lines = [c for c in p.device_costs if c.name == "4-bit dequantized weight"]
    largest = DIMS["intermediate_size"] * DIMS["hidden_size"]  # gate/up/down
    assert [c.bytes for c in lines] == [four_bit_dequant_bytes(largest, 2, nested=True)]
    assert lines[0].in_step and lines[0].phases == ("forward",)  # no checkpointing: no recompute in backward
    short = plan(trainer=args(tmp_path), model=LlamaConfig(**DIMS), lora=qv(), bnb=nf4(), dtype=torch.float16,
                 target="t4", seq_len=2)  # 4 tokens: the fused kernel only
    assert not any(c.name == "4-bit dequantized weight" for c in short.device_costs)
    cpu = plan(trainer=args(tmp_path), model=LlamaConfig(**DIMS), lora=qv(), bnb=nf4(), dtype=torch.float16,
               target="cpu", seq_len=1024)
    assert not any(c.name == "4-bit dequantized weight" for c in cpu.device_costs)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_cuda_plan_says_what_it_traced_as_cuda_runs_it(tmp_path, checkpointing):
    """Checkpointing recomputes the dropout in backward: it takes the CUDA path there too (the same mask)."""
    p = plan(trainer=args(tmp_path, gradient_checkpointing=checkpointing), model=LlamaConfig(**DIMS), lora=qv(0.1),
             bnb=nf4(), dtype=torch.float16, target="t4", seq_len=16)
    line = next(w for w in p.warnings if w.startswith("traced as CUDA runs it"))
    assert "1-byte mask" in line and "16-bit input as it is" in line and len(line) <= 200
    cpu = plan(trainer=args(tmp_path), model=LlamaConfig(**DIMS), lora=qv(0.1), target="cpu", seq_len=16)
    assert not any(w.startswith("traced as CUDA runs it") for w in cpu.warnings)


@pytest.fixture(scope="module")
def fp16_folder(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama_fp16")
    AutoModelForCausalLM.from_config(LlamaConfig(**DIMS)).to(torch.float16).save_pretrained(folder)
    return str(folder)


def prepared_trainer(folder: str, tmp: Any, **kbit: Any) -> Trainer:
    from peft import prepare_model_for_kbit_training

    seq = 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4(), device_map="cpu",
                                                     dtype=torch.float16)
        model = get_peft_model(prepare_model_for_kbit_training(model, **kbit), qv())
        data = Dataset.from_dict({"input_ids": [[1] * seq] * 4, "labels": [[1] * seq] * 4})
        return Trainer(model=model, args=args(tmp, gradient_checkpointing=True), train_dataset=data,
                       data_collator=default_data_collator)


def test_prepare_model_for_kbit_training_said_to_the_plan_is_the_plan_of_the_prepared_trainer(fp16_folder, tmp_path):
    """E: the settings' plan with prepare_model_for_kbit_training=True equals the plan of a Trainer whose model went
    through it (float32 embeddings, lm_head and norms; its checkpointing), which the plan reads as such."""
    trainer = prepared_trainer(fp16_folder, tmp_path)
    held = plan(trainer=trainer, target="t4", seq_len=64)
    said = dict(trainer=args(tmp_path, gradient_checkpointing=True), model=fp16_folder, lora=qv(), bnb=nf4(),
                dtype=torch.float16, target="t4", seq_len=64)
    prepared = plan(**said, prepare_model_for_kbit_training=True)
    assert prepared.peak_bytes == held.peak_bytes
    assert plan(**said).peak_bytes < prepared.peak_bytes  # without it: 16-bit embeddings, head and norms
    extra = 2 * (2 * DIMS["vocab_size"] * DIMS["hidden_size"] + (2 * DIMS["num_hidden_layers"] + 1) * DIMS["hidden_size"])
    assert kbitprep.float32_bytes(trainer.model) == extra  # embeddings and untied head, 2 norms a layer and the last
    for p in (held, prepared):
        assert any("prepare_model_for_kbit_training" in w for w in p.warnings), p.warnings
    assert any(w.startswith("your model went through prepare_model_for_kbit_training") for w in held.warnings)


def test_prepare_model_for_kbit_training_keeps_its_own_checkpointing_where_the_settings_have_none(fp16_folder, tmp_path):
    kw = dict(trainer=args(tmp_path), model=fp16_folder, lora=qv(), bnb=nf4(), dtype=torch.float16, target="t4",
              seq_len=64)
    own = plan(**kw, prepare_model_for_kbit_training=True)
    off = plan(**kw, prepare_model_for_kbit_training={"use_gradient_checkpointing": False})
    assert own.recipe["checkpointing"] == "full" and off.recipe["checkpointing"] == "none"
    assert own.peak_bytes < off.peak_bytes
    assert any("use_reentrant=True" in w for w in own.warnings)


def test_prepare_model_for_kbit_training_is_refused_where_it_cannot_apply(fp16_folder, tmp_path):
    with pytest.raises(ValueError, match="needs a quantized model: give bnb=BitsAndBytesConfig"):
        plan(trainer=args(tmp_path), model=fp16_folder, lora=qv(), target="t4", seq_len=16,
             prepare_model_for_kbit_training=True)
    with pytest.raises(ValueError, match=r"unknown keyword argument\(s\) \['use_reentrant'\].*use_gradient_checkpointing"):
        plan(trainer=args(tmp_path), model=fp16_folder, lora=qv(), bnb=nf4(), target="t4", seq_len=16,
             prepare_model_for_kbit_training={"use_reentrant": False})
    with pytest.raises(ValueError, match="must be True, False or a dict.*got 'yes'"):
        plan(trainer=args(tmp_path), model=fp16_folder, lora=qv(), bnb=nf4(), target="t4", seq_len=16,
             prepare_model_for_kbit_training="yes")
    trainer = prepared_trainer(fp16_folder, tmp_path)
    with pytest.raises(ValueError, match="a Trainer's model already shows"):
        plan(trainer=trainer, target="t4", seq_len=16, prepare_model_for_kbit_training=True)


def test_an_unprepared_4_bit_trainer_is_not_read_as_prepared(fp16_folder, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(fp16_folder, quantization_config=nf4(), device_map="cpu",
                                                     dtype=torch.float16)
    assert not kbitprep.prepared_signs(get_peft_model(model, qv()))


def test_bf16_autocast_covers_the_forward_only_as_accelerate_runs_it():
    """C, measured: accelerate autocasts the model's forward only (bf16 on the CPU too), so the adapters' 16-bit
    copies are gone when backward runs. A bf16 SFTTrainer step on the CPU is planned with the offset of the same
    step in fp32 (the tracker's few bytes); traced over the whole step, the plan held the copies on top."""
    import colab_memopt as cm
    from test_trainer import planned_and_measured, sft_trainer  # tests/ is on sys.path

    fp32_planned, fp32_measured = planned_and_measured("llama", "adamw_torch", 0.05, True)
    trainer = sft_trainer("llama", "adamw_torch", 0.05, bf16=True)
    planned = tr.plan_trainer(trainer, target="cpu").peak_bytes
    profiler = cm.MemoryProfiler(device="cpu", capacity_bytes=cm.T4_USABLE_BYTES)
    trainer.add_callback(profiler.callback())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    measured = profiler.samples[-1].peak_bytes
    assert planned - measured == pytest.approx(fp32_planned - fp32_measured, abs=64), (planned, measured)


def test_the_command_line_says_prepare_model_for_kbit_training(fp16_folder, tmp_path, capsys):
    import json

    from colab_memopt.tooling.cli import main

    path = tmp_path / "args.yaml"
    path.write_text(f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nfp16: true\nmax_length: 32\ngradient_checkpointing: false\n")
    base = ["plan", "--model", fp16_folder, "--training-args", str(path), "--no-max-batch", "--json", "--dtype",
            "float16", "--lora", "r=8", "target_modules=[\"q_proj\",\"v_proj\"]"]
    bnb = ["--bnb", "load_in_4bit=true", "bnb_4bit_quant_type=nf4", "bnb_4bit_compute_dtype=float16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*base, *bnb, "--prepare-model-for-kbit-training"]) == 0
        bare = json.loads(capsys.readouterr().out)
        assert main([*base, *bnb, "--prepare-model-for-kbit-training", "use_gradient_checkpointing=false"]) == 0
        off = json.loads(capsys.readouterr().out)
        assert main([*base, *bnb]) == 0
        plain = json.loads(capsys.readouterr().out)
        assert main([*base, "--prepare-model-for-kbit-training"]) == 2
        error = json.loads(capsys.readouterr().out)["error"]
    assert any(w.startswith("prepare_model_for_kbit_training: planned with peft's own function") for w in bare["warnings"])
    assert bare["recipe"]["checkpointing"] == "full" and off["recipe"]["checkpointing"] == "none"
    assert off["peak_bytes"] > plain["peak_bytes"]  # float32 embeddings, head and norms, no checkpointing either way
    assert "needs a quantized model" in error


# G: CUDA autocast's float32 op lists. PyTorch's CPU autocast runs softmax, LayerNorm, pow, sum ... in 16 bits,
# CUDA's in float32; the second CUDA run (an H200 emulating a T4, 2026-11-28) measured what that costs a plan.
def test_the_cuda_autocast_policy_keeps_float32_where_cuda_does_and_only_in_the_block():
    import torch.nn.functional as F

    x16 = torch.randn(2, 8, 16, dtype=torch.float16)
    ln = nn.LayerNorm(16)
    with torch.autocast("cpu", dtype=torch.float16):
        cpu_kinds = (ln(x16.float()).dtype, x16.softmax(-1).dtype, x16.sum().dtype, (x16 ** 3).dtype)
    assert cpu_kinds == (torch.float32, torch.float16, torch.float16, torch.float16)  # the CPU's lists
    with cudapaths.cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.float16):
        h = nn.Linear(16, 16)(x16.float())
        assert h.dtype == torch.float16  # matmuls stay 16-bit
        assert ln(h).dtype == torch.float32  # layer_norm: fp32
        assert F.softmax(h, -1).dtype == h.softmax(-1).dtype == torch.log_softmax(h, -1).dtype == torch.float32
        assert torch.softmax(h, -1, dtype=torch.float16).dtype == torch.float16  # a dtype given is kept
        assert h.sum().dtype == h.sum(-1).dtype == h.cumsum(0).dtype == torch.float32
        assert (h ** 3).dtype == torch.pow(h, 2.0).dtype == h.exp().dtype == h.rsqrt().dtype == torch.float32
        assert F.cross_entropy(h.view(-1, 16), torch.zeros(16, dtype=torch.long)).dtype == torch.float32
        assert h.argmax(-1).sum().dtype == torch.long  # integer inputs are not autocast's
        with torch.autocast("cpu", enabled=False):
            assert h.softmax(-1).dtype == torch.float16  # autocast off: nothing cast
        with cudapaths.cuda_autocast_policy():  # nested blocks share one registration
            assert h.softmax(-1).dtype == torch.float32
        assert h.softmax(-1).dtype == torch.float32
    assert x16.softmax(-1).dtype == torch.float16  # no autocast, no policy
    with torch.autocast("cpu", dtype=torch.float16):
        assert x16.softmax(-1).dtype == torch.float16 and (x16 ** 3).dtype == torch.float16  # put back


def test_the_cuda_autocast_policy_holds_in_checkpointing_s_recompute_and_backward():
    """Checkpointing recomputes the forward in backward: the policy sits at autocast's dispatch key, so the recompute
    sees the same float32 tensors (torch.utils.checkpoint would refuse other dtypes than the forward saved)."""
    from torch.utils.checkpoint import checkpoint

    ln, lin = nn.LayerNorm(16), nn.Linear(16, 16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    with cudapaths.cuda_autocast_policy():
        with torch.autocast("cpu", dtype=torch.float16):
            out = checkpoint(lambda t: lin(ln(t)).softmax(-1) + lin(t) ** 2, x, use_reentrant=False)
        assert out.dtype == torch.float32
        out.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def _cuda_measured(recipe: dict) -> int:
    import json
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks/results/cuda/h200-emulating-t4-2026-11-28/planner_accuracy.json"
    rows = json.loads(path.read_text())["rows"]
    return next(r["measured_bytes"] for r in rows if r["size"] == "medium" and r["batch"] == 8 and r["seq_len"] == 256
                and r["recipe"] == recipe)


@pytest.mark.parametrize("recipe", [dict(precision="fp16-autocast", attention="naive"),
                                    dict(quantization="nf4", lora_rank=4, precision="fp16-autocast", base_dtype="fp16")],
                         ids=["naive-attention", "qlora-fp16-base"])
def test_an_fp16_autocast_plan_for_a_t4_is_within_5_percent_of_what_cuda_measured(recipe):
    """The project's LayerNorm model at batch 8 x 256 under fp16 autocast, planned for a T4 on the CPU, against the step
    peak an H200 emulating a T4 measured (benchmarks/results/cuda/h200-emulating-t4-2026-11-28): the CPU's autocast
    lists planned these 33% and 27% under; CUDA's lists bring them within the planner's 5%."""
    import colab_memopt as cm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = cm.plan("medium", 8, seq_len=256, recipe=cm.Recipe(**recipe), target="t4", find_max_batch=False)
    measured = _cuda_measured(recipe)
    assert abs(plan.step_peak_bytes - measured) <= 0.05 * measured, (plan.step_peak_bytes, measured)
