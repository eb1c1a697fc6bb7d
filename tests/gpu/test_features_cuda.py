"""tests/gpu: the features added since the first CUDA run, each planned and measured on the GPU at a tiny size
(cuda-readiness-2, R4): grouped-query K/V repeated for SDPA, two-level offloaded checkpoints, the RMSNorm by tiles,
int8 weights trained by AdaLomo in fp16, and `cm.load_int8` quantizing on the GPU. Plan against `measure_step`, as
`test_grouped_query_llama_step_matches_the_plan_with_its_hidden_scores` does."""

from __future__ import annotations

import pytest
import torch

import colab_memopt as cm
from colab_memopt.planning import planner

TOLERANCE = 0.03  # of the measured step peak: the CPU trace is exact; CUDA adds allocator rounding and workspaces


def _llama_config(layers: int = 4):
    from colab_memopt.techniques.architectures import small_config

    return small_config("llama", num_hidden_layers=layers, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=4096)


def _llama_factory(layers: int = 4):
    import transformers

    def build():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(_llama_config(layers))

    return build


def _planned_and_measured(cuda, factory, recipe: cm.Recipe, batch: int = 4, seq_len: int = 512):
    plan = planner.plan(factory, batch, seq_len=seq_len, recipe=recipe, target="t4", find_max_batch=False)
    model, opt = recipe.build(factory().to(cuda))
    step = cm.make_train_step(model, opt, cm.load_corpus(), batch_size=batch, seq_len=seq_len, recipe=recipe)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    return plan, report


def _close(plan, report) -> None:
    assert plan.method == "trace", plan.warnings
    assert abs(plan.step_peak_bytes - report.peak_bytes) <= TOLERANCE * report.peak_bytes, (
        plan.step_peak_bytes, report.peak_bytes, report.by_category, plan.by_category)


def test_repeated_kv_for_sdpa_runs_the_o_t_kernel_as_planned(cuda):
    from colab_memopt.techniques import attention

    factory = _llama_factory()
    recipe = cm.Recipe(attention="sdpa_repeated_kv", precision="fp16-autocast")
    plan, report = _planned_and_measured(cuda, factory, recipe)
    assert not any("math kernel" in w for w in plan.warnings)  # K/V repeated: no math kernel
    _close(plan, report)
    grouped = planner.plan(factory, 4, seq_len=512, recipe=cm.Recipe(precision="fp16-autocast"), target="t4",
                           find_max_batch=False)
    assert plan.step_peak_bytes < grouped.step_peak_bytes  # the math kernel's scores are gone
    assert callable(attention.repeat_kv_for_sdpa)


@pytest.mark.parametrize("interval", [1, 2])
def test_offloaded_checkpoints_one_or_two_level_hold_what_the_plan_says(cuda, interval):
    from colab_memopt.techniques import checkpointing

    recipe = cm.Recipe(checkpointing="offload", checkpoint_interval=interval, precision="fp16-autocast")
    plan, report = _planned_and_measured(cuda, _llama_factory(), recipe)
    _close(plan, report)
    host = [c for c in plan.host_costs if "checkpoint" in c.name]
    assert host, plan.host_costs  # the host copies are planned on the host side
    assert checkpointing.checkpoint_offloader is not None


def test_the_rmsnorm_by_tiles_holds_what_the_plan_says(cuda):
    recipe = cm.Recipe(norm_tile_tokens=128, checkpointing="full", precision="fp16-autocast")
    plan, report = _planned_and_measured(cuda, _llama_factory(), recipe)
    _close(plan, report)


def test_int8_weights_with_adalomo_in_fp16_hold_what_the_plan_says(cuda):
    """The capacity table's Llama-3.1-8B full fine-tune recipe at a tiny size: int8 weights, AdaLomo inside backward,
    fp16 with its loss scale (2^16 to start), full checkpointing."""
    recipe = cm.Recipe(weight_dtype="int8", optimizer="adalomo", precision="fp16", checkpointing="full")
    plan, report = _planned_and_measured(cuda, _llama_factory(), recipe, batch=2)
    _close(plan, report)


def test_load_int8_quantizes_on_the_gpu_one_tensor_at_a_time(cuda, tmp_path):
    """`cm.load_int8` on CUDA: the device holds the int8 model and about one 16-bit tensor beyond it while loading, and
    the model equals the same load on the CPU."""
    import transformers

    folder = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(_llama_config()).to(torch.float16).save_pretrained(
        folder, max_shard_size="2MB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    from colab_memopt.training.loading import safetensors_largest_bytes

    largest = safetensors_largest_bytes(folder)  # bytes of the largest tensor in the checkpoint (fp16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = cm.load_int8(folder, dtype=torch.float16, device=cuda)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    assert held > 0
    # beyond the loaded model: the 16-bit tensor being quantized, quantize_int8's transient (one fp32 copy of a row
    # chunk and the chunk's per-group min and max) and the tensor's own int8 values and scales, each allocation rounded
    # up to 512 bytes. 2026-11-28, an NVIDIA H200 emulating a T4, three fp32 copies then: (peak, held, largest) =
    # (16875520, 4466176, 2097152), 12,409,344 B beyond; the CPU count of the same load gives 4,054,528 with one copy.
    from colab_memopt.techniques.int8train import Int8Embedding, Int8Linear, quantize_int8_transient_bytes

    biggest = max((m for m in model.modules() if isinstance(m, (Int8Linear, Int8Embedding))),
                  key=lambda m: m.qweight.numel())
    rows, cols = biggest.qweight.shape
    assert rows * cols * 2 == largest  # the largest tensor is a quantized one (4096 x 256)
    own = biggest.qweight.nbytes + biggest.scale.nbytes  # its int8 values and fp32 scales, as loaded
    bound = largest + quantize_int8_transient_bytes(rows, cols) + own + 4 * 512
    assert peak - held <= bound, (peak, held, largest, bound)
    on_cpu = cm.load_int8(folder, dtype=torch.float16, device="cpu")
    x = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gpu_logits = model(x.to(cuda)).logits.float().cpu()
        cpu_logits = on_cpu(x).logits.float()
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=0.05, atol=0.05)
