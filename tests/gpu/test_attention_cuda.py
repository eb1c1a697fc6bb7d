"""tests/gpu: the SDPA kernel CUDA runs for grouped-query calls, and the plan of a grouped-query model's step
(cuda-run-1 #6: math attention with a score buffer inside one op that the tracker cannot see)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import colab_memopt as cm
from colab_memopt import attention, env, planner


def _capability(device) -> tuple[int, int]:
    return (7, 5) if env.emulated_gpu(device) == "t4" else torch.cuda.get_device_capability()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_query_sdpa_runs_the_kernel_the_planner_expects(cuda, dtype):
    q = torch.randn(2, 4, 128, 64, device=cuda, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 128, 64, device=cuda, dtype=dtype, requires_grad=True) for _ in range(2))
    recorder = attention._OpRecorder()
    with recorder:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    fused = [attention.SDPA_OPS[op] for op in recorder.ops if op in attention.SDPA_OPS]
    got = fused[0] if fused else "math"
    expected = attention.expected_cuda_backend(_capability(cuda), dtype, gqa=True)
    assert got == expected or {got, expected} == {"cuDNN", "flash"}, (got, expected, recorder.ops)


def test_grouped_query_llama_step_matches_the_plan_with_its_hidden_scores(cuda):
    import transformers

    from colab_memopt import architectures

    def llama():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(architectures.small_config("llama"))

    model = llama().to(cuda)
    opt = cm.make_optimizer("adamw", model.parameters())
    step = cm.make_train_step(model, opt, cm.load_corpus(), batch_size=4, seq_len=512)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    p = planner.plan(llama, 4, seq_len=512, target="t4", find_max_batch=False)
    assert any("math kernel" in w for w in p.warnings)  # fp32 + enable_gqa: math anywhere
    # emulated T4 (review): 94.44 MiB measured; 94.45 MiB planned, 16 MiB of it inside softmax's backward
    assert abs(p.step_peak_bytes - report.peak_bytes) <= 0.02 * report.peak_bytes, (
        p.step_peak_bytes, report.peak_bytes, report.by_category)
