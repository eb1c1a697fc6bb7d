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


def test_t4_constants():
    assert cm.T4_USABLE_BYTES == int(14.74 * 2**30)
    assert cm.COLAB_HOST_RAM_BYTES == int(12.7e9)


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
