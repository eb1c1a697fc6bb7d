"""The optimizers with almost no state (lowstate.py): state bytes, one step against a reference, the recipe's refusals."""

import copy
import math
import warnings

import pytest
import torch

import colab_memopt as cm
from colab_memopt import estimate, lowstate
from colab_memopt.techniques.optimizers import OPTIMIZERS

warnings.filterwarnings("ignore", message=".*kernels.*")

@pytest.fixture(autouse=True)
def _fresh_bitsandbytes_overrides():
    """Each test builds its optimizers as a fresh process does. A real Trainer with an 8-bit optimizer, run earlier in
    this worker, registers its embeddings for 32-bit state in bitsandbytes' process-wide GlobalOptimManager, which
    every later 8-bit optimizer reads by parameter position: GaLore's 8-bit state then grew (full suite, once)."""
    bnb = pytest.importorskip("bitsandbytes")
    manager = bnb.optim.GlobalOptimManager.get_instance()
    saved = dict(vars(manager))
    manager.initialize()
    yield
    manager.initialize()
    vars(manager).update(saved)


NAMES = ["galore_adamw8bit", "galore_adamw8bit_in_backward", "apollo", "apollo_mini", "torchao_adamw8bit",
         "torchao_adamw4bit", "badam"]


def _state_storage_bytes(opt):
    """Sum the storages an optimizer's state holds, each once (torchao's subclasses by their inner tensors)."""
    seen, total = set(), 0
    for state in opt.state.values():
        for t in lowstate.torchao_state_tensors(state):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_match_the_formula_the_tracker_and_the_tensors(corpus, name):
    recipe = cm.Recipe(optimizer=name)
    model, opt = recipe.build(cm.build_model("tiny"))
    step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=32, recipe=recipe)
    report = cm.measure_step(step, model=model, optimizer=opt, repeat=1)
    base = name.removesuffix("_in_backward")
    expected = estimate.optimizer_state_bytes([p for p in model.parameters() if p.requires_grad], name, model=model)
    assert report.resident_bytes["optimizer_state"] == expected > 0
    assert _state_storage_bytes(opt) == expected
    n = sum(p.numel() for p in model.parameters())
    adamw = estimate.optimizer_state_bytes(list(model.parameters()), "adamw")
    if base == "badam":  # 12 B/param of the block being trained (fp32 copy + AdamW), 4 B per tensor
        block = [p for p in model.parameters() if p.requires_grad]
        assert expected == 12 * sum(p.numel() for p in block) + 4 * len(block)
    elif base != "apollo":  # APOLLO's rank 256 is capped at the tiny model's width (64): full rank, more than AdamW
        assert expected < adamw, (base, expected / n)


def test_projected_state_is_rank_sized_on_a_wide_weight():
    # One 512 x 256 weight: GaLore at rank 16 keeps 8-bit moments of 512 x 16 and a 16 x 256 projection.
    w = torch.nn.Parameter(torch.randn(512, 256))
    assert lowstate.state_bytes("galore_adamw8bit", [w], rank=16) == 2 * (512 * 16 + 4 * 32) + 4 * 16 * 256 + 2 * 1024
    # APOLLO-Mini: fp32 moments of 512 x 1, a 1 x 256 projection and the limiter's 0-d norm: 0.03 B/param.
    mini = lowstate.state_bytes("apollo_mini", [w])
    assert mini == 2 * 4 * 512 + 4 * 256 + 4 and mini / w.numel() < 0.04
    # torchao: 1 (8-bit) or 1/2 (4-bit) byte per value plus scales and code books, and a step.
    assert lowstate.state_bytes("torchao_adamw8bit", [w]) == 2 * (w.numel() + 4 * w.numel() // 256 + 1024) + 4
    assert lowstate.state_bytes("torchao_adamw4bit", [w]) == 2 * (w.numel() // 2 + 4 * w.numel() // 128 + 64) + 4


def test_galore_first_step_matches_a_hand_computation():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False))
    w = model[0].weight  # (128, 64): m >= n, so the right singular vectors project
    w0 = w.detach().clone()
    opt = lowstate.make_low_state_optimizer("galore_adamw8bit", model.parameters(), lr=1e-2, model=model, rank=8)
    g = torch.randn_like(w)
    w.grad = g.clone()
    opt.step()
    b = torch.linalg.svd(g, full_matrices=False)[2][:8]  # (8, 64)
    low = g @ b.T  # (128, 8)
    adam = low / (low.abs() + 1e-8)  # Adam's first step: m_hat / (sqrt(v_hat) + eps)
    expected = (w0 - 1e-2 * (adam @ b) * 0.25) * (1 - 1e-2 * 0.01)  # GaLore's scale 0.25, then weight decay
    torch.testing.assert_close(w.detach(), expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(opt.state[w]["projection"], b) or torch.allclose(opt.state[w]["projection"].abs(), b.abs(), atol=1e-5)
    # rank 8 of 64: only the rank rows of the SVD factor stay (galore-torch alone keeps the whole 64 x 64 factor)
    assert _state_storage_bytes(opt) == lowstate.state_bytes("galore_adamw8bit", [w], rank=8, model=model)


def test_galore_per_layer_in_backward_equals_one_optimizer(corpus):
    losses = {}
    for name in ("galore_adamw8bit", "galore_adamw8bit_in_backward"):
        torch.manual_seed(0)
        recipe = cm.Recipe(optimizer=name)
        model, opt = recipe.build(cm.build_model("tiny"))
        step = cm.make_train_step(model, opt, corpus, batch_size=2, seq_len=32, recipe=recipe)
        losses[name] = [step() for _ in range(3)]
        if name.endswith("_in_backward"):
            assert all(p.grad is None for p in model.parameters())  # freed in backward
    assert losses["galore_adamw8bit"] == pytest.approx(losses["galore_adamw8bit_in_backward"], rel=1e-5)


@pytest.mark.parametrize("name, scale, channel", [("apollo", 1.0, True), ("apollo_mini", 128.0, False)])
def test_apollo_first_step_matches_a_hand_computation(name, scale, channel):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96, bias=False))
    w = model[0].weight  # (96, 32)
    w0 = w.detach().clone()
    opt = lowstate.make_low_state_optimizer(name, model.parameters(), lr=1e-3, model=model, rank=4 if channel else None)
    g = torch.randn_like(w)
    w.grad = g.clone()
    opt.step()
    proj = opt.state[w]["projection"]  # (r, 32): a seeded random projection
    low = g @ proj.T  # (96, r)
    b1, b2, eps = 0.9, 0.999, 1e-6
    norm_grad = (1 - b1) * low / ((1 - b2) ** 0.5 * low.abs() + eps)
    factor = (norm_grad.norm(dim=1) / (low.norm(dim=1) + 1e-8)).unsqueeze(1) if channel else norm_grad.norm() / (low.norm() + 1e-8)
    step_size = 1e-3 * math.sqrt(1 - b2) / (1 - b1)
    expected = (w0 - step_size * g * factor * math.sqrt(scale)) * (1 - 1e-3 * 0.01)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["torchao_adamw8bit", "torchao_adamw4bit"])
def test_torchao_first_step_equals_torch_adamw(name):
    # The first step updates from the fp32 moments before they are quantized: AdamW's own first step.
    torch.manual_seed(0)
    model = cm.build_model("tiny")
    ref = copy.deepcopy(model)
    opt = cm.make_optimizer(name, model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    for a, b in zip(model.parameters(), ref.parameters()):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    opt.step()
    ref_opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(type(s["exp_avg"]).__name__.startswith("OptimState") for s in opt.state.values())


def test_badam_steps_only_the_active_block_as_adamw_would(corpus):
    torch.manual_seed(0)
    model = cm.build_model("tiny")
    ref = copy.deepcopy(model)
    opt = cm.make_optimizer("badam", model.parameters(), lr=1e-3, model=model)
    active = [n for n, p in model.named_parameters() if p.requires_grad]
    assert active and all(n.startswith(f"blocks.{len(model.blocks) - 1}.") for n in active)  # descending: last block first
    x = next(corpus.batches(2, 32, seed=0))
    model(x, labels=x).loss.backward()
    opt.step()
    ref_params = dict(ref.named_parameters())
    ref_opt = torch.optim.AdamW([ref_params[n] for n in active], lr=1e-3, weight_decay=0.01)
    for p in ref.parameters():
        p.requires_grad_(False)
    for n in active:
        ref_params[n].requires_grad_(True)
    ref(x, labels=x).loss.backward()
    ref_opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-7)
        if n not in active:
            assert p.grad is None


def test_names_are_in_the_registry_and_packages_load_lazily():
    assert set(lowstate.LOW_STATE_OPTIMIZERS) <= set(OPTIMIZERS) and "galore_adamw8bit_in_backward" in OPTIMIZERS
    import subprocess
    import sys

    code = ("import sys, colab_memopt; "
            "print(sorted(m for m in ('galore_torch', 'apollo_torch', 'torchao', 'badam') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("fields, says", [
    ({"optimizer": "galore_adamw8bit", "lora_rank": 4}, "not LoRA adapters"),
    ({"optimizer": "badam", "lora_rank": 4}, "trains blocks of the full model"),
    ({"optimizer": "adamw", "optimizer_rank": 8}, "optimizer_rank applies to"),
    ({"optimizer": "apollo_mini", "optimizer_rank": 4}, "rank 1"),
    ({"optimizer": "apollo", "optimizer_rank": 0}, "optimizer_rank must be None or an integer >= 1, got 0"),
    ({"optimizer": "galore_adamw8bit_in_backward", "accumulation_steps": 2}, "cannot accumulate"),
    ({"optimizer": "galore_adamw8bit_in_backward", "precision": "fp16-autocast"}, "GradScaler"),
    ({"optimizer": "torchao_adamw8bit", "layer_offload_active": 1}, "layer_offload_active=1"),
])
def test_recipe_refuses_what_cannot_run(fields, says):
    with pytest.raises(ValueError, match=says):
        cm.Recipe(**fields)


def test_badam_needs_a_model_with_blocks():
    with pytest.raises(ValueError, match="needs the model"):
        cm.make_optimizer("badam", [torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    with pytest.raises(ValueError, match="repeated blocks"):
        cm.Recipe(optimizer="badam").build(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_torchao_steps_eagerly_as_measured_and_planned(monkeypatch):
    # torch.compile cannot run under the memory tracker: training compiled would differ from the measurement
    pytest.importorskip("torchao")

    def no_compile(*args, **kwargs):
        raise AssertionError("torchao's update must run eagerly")

    model = torch.nn.Linear(64, 128)
    opt = lowstate.make_low_state_optimizer("torchao_adamw8bit", model.parameters(), lr=1e-3)
    monkeypatch.setattr(torch, "compile", no_compile)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert torch.compile is no_compile  # put back after the step
