import warnings

import pytest
import torch

import colab_memopt as cm
from colab_memopt import env


def test_auto_picks_cpu_without_a_gpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert cm.pick_device("auto").type == expected
    assert cm.pick_device(None).type == expected
    assert cm.pick_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["tpu", "banana", "cuda:x"])
def test_unknown_device_strings(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        cm.pick_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_without_gpu_says_so():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        cm.pick_device("cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cm.cap_device_memory(cm.T4_USABLE_BYTES, "cpu")
    assert env.gpu_name("cpu") is None and env.compute_capability("cpu") is None
    assert cm.bf16_native("cpu") is False
    assert cm.autocast_dtype("cpu") == torch.bfloat16


def test_one_t4_every_tool_reads():
    """The 2026 T4 (FACTS.md): 14,912 MiB total as PyTorch reports it, a measured CUDA context, one margin."""
    from colab_memopt.planning.targets import DEFAULT_HEADROOM, TARGETS
    from colab_memopt.tooling import cli

    assert env.T4_TOTAL_BYTES == 14_912 * 2**20 and round(env.T4_TOTAL_BYTES / 2**30, 2) == 14.56
    assert 133 * 2**20 <= env.T4_CUDA_CONTEXT_BYTES <= 147 * 2**20 and "133-147 MiB" in env.T4_CUDA_CONTEXT_SOURCE
    t4 = TARGETS["t4"]
    assert (t4.device_bytes, t4.cuda_context_bytes, t4.host_bytes) == (env.T4_TOTAL_BYTES, env.T4_CUDA_CONTEXT_BYTES,
                                                                       env.COLAB_HOST_RAM_BYTES)
    assert cm.T4_USABLE_BYTES == t4.usable_bytes() == int(env.T4_TOTAL_BYTES * (1 - DEFAULT_HEADROOM))
    assert env.COLAB_HOST_USABLE_BYTES == t4.host_usable_bytes() and cm.COLAB_HOST_RAM_BYTES == int(12.7e9)
    assert cli.HEADROOM == DEFAULT_HEADROOM == env.PLAN_MARGIN


def test_cap_rejects_non_positive():
    with pytest.raises(ValueError, match="limit_bytes must be > 0, got 0"):
        cm.cap_device_memory(0)


def test_preflight_reports(capsys, monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    info = cm.preflight("cpu")
    out = capsys.readouterr().out
    assert "torch" in out and "autocast dtype" in out
    assert info.device == "cpu" and info.usable_device_bytes > 0 and info.colab is False
    assert info.torch_version == torch.__version__
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-x")
    assert cm.in_colab()


def test_preflight_warns_loudly_on_colab_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="no GPU"):
        info = cm.preflight("auto")
    out = capsys.readouterr().out
    assert "*** WARNING" in out and "Change runtime type > T4 GPU" in out and info.device == "cpu"
    # asked for the CPU on purpose, or not on Colab: nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cm.preflight("cpu", verbose=False).warnings == ()
        monkeypatch.delenv("COLAB_RELEASE_TAG")
        assert cm.preflight("auto", verbose=False).warnings == ()


def test_bf16_never_chosen_below_sm80_even_when_torch_says_supported(monkeypatch):
    # A T4 (sm_75): torch.cuda.is_bf16_supported() may say True (it counts emulation). Simulated CUDA facts.
    import colab_memopt as cm
    from colab_memopt import env, presets

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    cuda = torch.device("cuda")
    assert env.bf16_native(cuda) is False
    assert env.autocast_dtype(cuda) == torch.float16
    assert presets.mixed_precision("t4") == "fp16-autocast"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (8, 0))
    assert env.bf16_native(cuda) is True and env.autocast_dtype(cuda) == torch.bfloat16
    assert cm.Recipe().precision == "fp32"


def test_t4_emulation_caps_the_allocator_and_forces_t4_paths(monkeypatch):
    # CM_EMULATE=t4 on a bigger GPU (simulated CUDA facts: an 80 GiB sm_90 card); nothing is measured here.
    from types import SimpleNamespace

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.setdefault("fraction", f))
    for name in ("enable_flash_sdp", "enable_cudnn_sdp", "enable_mem_efficient_sdp"):
        monkeypatch.setattr(torch.backends.cuda, name, lambda on, name=name: calls.setdefault(name, on))
    monkeypatch.setattr(env, "_emulating", {})
    monkeypatch.setenv("CM_EMULATE", "t4")
    cuda = torch.device("cuda")
    assert env.bf16_native(cuda) is True  # before the emulation is applied
    assert env.apply_emulation(cuda) == "t4"
    assert calls["fraction"] == pytest.approx((env.T4_TOTAL_BYTES - env.T4_CUDA_CONTEXT_BYTES) / (80 * 2**30))
    assert calls["enable_flash_sdp"] is False and calls["enable_cudnn_sdp"] is False and calls["enable_mem_efficient_sdp"] is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert env.bf16_native(cuda) is False and env.autocast_dtype(cuda) == torch.float16
    assert env.device_label(cuda) == "NVIDIA H100 80GB HBM3 emulating t4"
    assert env.usable_device_memory(cuda) == env.T4_TOTAL_BYTES - env.T4_CUDA_CONTEXT_BYTES
    monkeypatch.setenv("CM_EMULATE", "a100")
    with pytest.raises(ValueError, match=r"CM_EMULATE must be one of \('t4',\) or 'none', got 'a100'"):
        env.apply_emulation(cuda)


def test_emulation_does_nothing_on_the_cpu_or_when_not_asked(monkeypatch):
    monkeypatch.delenv("CM_EMULATE", raising=False)
    assert env.apply_emulation("cpu") is None and env.requested_emulation() is None
    monkeypatch.setenv("CM_EMULATE", "t4")
    assert env.apply_emulation("cpu") is None and env.device_label("cpu") == "cpu"
