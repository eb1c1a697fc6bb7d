import pytest
import torch

import colab_memopt as cm
from colab_memopt.techniques.compression import compress_activations, int8_saved_tensors, no_compression, pack_int8, unpack_int8


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x, labels=x).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("per", ["tensor", "channel"])
def test_pack_round_trip(per):
    t = torch.randn(4, 8, 16)
    q, scale, dtype = pack_int8(t, per)
    assert q.dtype == torch.int8 and dtype == torch.float32
    assert ((unpack_int8((q, scale, dtype)) - t).abs() <= scale / 2 + 1e-7).all()
    assert pack_int8(torch.ones(3, dtype=torch.long)).dtype == torch.long


@pytest.mark.parametrize("mode,ckpt,tol", [("int8_tensor", False, 0.05), ("int8_channel", False, 0.05),
                                          ("cpu_offload", False, 1e-6), (None, True, 1e-6), ("int8_channel", True, 0.05)])
def test_gradients_close_to_exact(mode, ckpt, tol):
    x = cm.load_corpus().batch(2, 32, generator=torch.Generator().manual_seed(0))
    exact = _grads(cm.build_model("tiny"), x)
    model = compress_activations(cm.build_model("tiny"), mode, checkpoint_blocks=ckpt)
    rel = ((_grads(model, x) - exact).norm() / exact.norm()).item()
    assert rel <= tol
    if mode and mode.startswith("int8") and not ckpt:
        assert rel > 0  # lossy: the hooks ran
    with no_compression(model):
        assert ((_grads(model, x) - exact).norm() / exact.norm()).item() < 1e-6


def test_int8_saves_activation_memory():
    corpus = cm.load_corpus()
    peaks = {}
    for mode in (None, "int8_channel"):
        model = compress_activations(cm.build_model("tiny"), mode)
        opt = cm.make_optimizer("sgd", model.parameters())
        rep = cm.measure_step(cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=64), model=model, optimizer=opt, repeat=1)
        peaks[mode] = rep.category_peaks["activations"]
    assert peaks["int8_channel"] < 0.6 * peaks[None]


def test_bad_mode():
    with pytest.raises(ValueError, match="mode must be None or one of"):
        compress_activations(cm.build_model("tiny"), "int4")
    with pytest.raises(ValueError, match="per must be"):
        int8_saved_tensors("row")
