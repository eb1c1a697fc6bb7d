import math

import pytest
import torch

import colab_memopt as cm
from colab_memopt import estimate, phases as ph


def _phases(config, confident):
    s = ph.PhaseScheduler(config)
    out = []
    for ok in confident:
        out.append(s.phase[0])
        s.advance(confident=ok)
    return "".join(out)


def test_scheduler_transitions():
    cfg = ph.PhaseConfig(warmup_steps=2, full_steps=2, max_predict_steps=3, correction_interval=1)
    # warmup, predict to the maximum, full phase, predict cut short by low confidence, correct, predict.
    assert _phases(cfg, [True] * 10) == "wwpppffppp"
    assert _phases(cfg, [True, True, True, False, True, True, True, True]) == "wwppcppp"
    # max_predict_steps=0 is ordinary training; no warmup starts in a full phase.
    assert set(_phases(ph.PhaseConfig(warmup_steps=0, max_predict_steps=0), [True] * 9)) == {"f"}


def _trained_adamw(seed=0):
    model = cm.build_model("tiny", seed=seed)
    opt = cm.make_optimizer("adamw", model.parameters())
    x = cm.load_corpus().batch(2, 16, generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        cm.train_step(model, opt, x)
    return model, opt, x


@pytest.mark.parametrize("strategy", ["none", "cpu", "pinned_cpu"])
def test_offload_restores_bit_exactly(strategy):
    model, opt, x = _trained_adamw()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    off = ph.OptimizerStateOffloader(opt, strategy)
    off.offload()
    if strategy != "none":
        assert len(opt.state) == 0 and off.stats["bytes_freed"] > 0
    off.restore()
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[id(p)][k]) and v.dtype == before[id(p)][k].dtype, (strategy, k)
    # and training continues bit-exactly like a run that never offloaded
    ref_model, ref_opt, _ = _trained_adamw()
    cm.train_step(model, opt, x)
    cm.train_step(ref_model, ref_opt, x)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_int8_is_not_bit_exact_but_within_its_bound():
    model, opt, _ = _trained_adamw()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    for t in (before[id(p)]["exp_avg"] for p in opt.state):
        packed = ph.quantize_int8(t)
        err = (ph.dequantize_int8(packed) - t).abs().flatten()
        pad = (-err.numel()) % ph.INT8_BLOCK
        err = torch.nn.functional.pad(err, (0, pad)).view(-1, ph.INT8_BLOCK)
        assert (err <= ph.int8_error_bound(packed)[:, None]).all()
    off = ph.OptimizerStateOffloader(opt, "int8")
    off.offload()
    codes = off.device_tensors()
    assert codes and sum(c.numel() * c.element_size() for c in codes) < off.stats["bytes_freed"] / 3
    off.restore()
    exact = True
    for p, s in opt.state.items():
        assert torch.equal(s["step"], before[id(p)]["step"])  # scalars are kept exactly
        sq = before[id(p)]["exp_avg_sq"].sqrt()
        bound = sq.abs().max() / 510 * (1 + 1e-5) + 1e-12
        assert (s["exp_avg_sq"].sqrt() - sq).abs().max() <= bound
        exact &= torch.equal(s["exp_avg"], before[id(p)]["exp_avg"])
    assert not exact  # honest: int8 compression is lossy


def test_drop_reinitialises_the_state():
    model, opt, x = _trained_adamw()
    off = ph.OptimizerStateOffloader(opt, "drop")
    off.offload()
    off.restore()
    assert len(opt.state) == 0
    cm.train_step(model, opt, x)
    assert all(float(s["step"]) == 1.0 for s in opt.state.values())


def test_trainer_predicts_frees_state_and_restores_ahead(corpus):
    model = cm.build_model("tiny")
    opt = cm.make_optimizer("adamw", model.parameters())
    cfg = ph.PhaseConfig(warmup_steps=3, full_steps=2, max_predict_steps=3, confidence_threshold=0.0, lookahead=1)
    trainer = ph.PhaseTrainer(model, opt, cfg)
    batches = corpus.batches(2, 16, seed=0)
    results = [trainer.step(next(batches)) for _ in range(3)]
    assert [r.phase for r in results] == ["warmup"] * 3
    r = trainer.step(next(batches))
    assert r.phase == "predict" and r.confidence is not None and trainer.offloader.offloaded
    assert len(opt.state) == 0 and all(p.grad is None for p in model.parameters())
    trainer.step(next(batches))  # the 2nd of 3: afterwards the state comes back, ahead of the full step
    assert not trainer.offloader.offloaded and trainer.counts["restores_ahead"] == 1
    trainer.step(next(batches))
    assert trainer.step(next(batches)).phase == "full"
    assert trainer.counts["restores_on_demand"] == 0
    assert trainer.compute_units == 3 * 4 + 3


def test_train_phased_and_recipe(corpus):
    model = cm.build_model("tiny")
    opt = cm.make_optimizer("adamw", model.parameters())
    log = ph.train_phased(model, opt, corpus, ph.PhaseConfig(warmup_steps=2, full_steps=1, max_predict_steps=2,
                                                             confidence_threshold=0.0), steps=8, batch_size=2, seq_len=16)
    assert math.isfinite(log.val_loss) and log.predicted_share == 0.5
    model2 = cm.build_model("tiny")
    opt2 = cm.make_optimizer("adamw", model2.parameters())
    step = cm.make_train_step(model2, opt2, corpus, batch_size=2, seq_len=16, recipe=cm.Recipe(phase_offload="int8"))
    assert all(math.isfinite(step()) for _ in range(3))


def test_phase_estimate_and_bad_values():
    assert estimate.phase_device_bytes(1000, "predict") == 4000
    assert estimate.phase_device_bytes(1000, "full", offload_optimizer=False) == 18000
    with pytest.raises(ValueError, match="offload must be one of"):
        ph.PhaseConfig(offload="disk")
    with pytest.raises(ValueError, match="confidence_threshold must be in"):
        ph.PhaseConfig(confidence_threshold=1.5)
    with pytest.raises(ValueError, match="full_steps must be an integer >= 1"):
        ph.PhaseConfig(full_steps=0)
    with pytest.raises(ValueError, match="recipe.phase_offload must be None or one of"):
        cm.Recipe(phase_offload="gpu")
    with pytest.raises(ValueError, match="predict_precision must be one of"):
        ph.PhaseConfig(predict_precision="fp8")


def test_predict_precision_auto_is_fp16_below_sm80_and_fp16_is_allowed(monkeypatch):
    # Review B4: a T4 has no native bf16; predicted (forward-only) steps take fp16 there. Simulated CUDA facts.
    from colab_memopt import phases as ph

    assert ph.PhaseConfig(predict_precision="fp16").predict_precision == "fp16"
    with pytest.raises(ValueError, match="full_precision must be one of"):
        ph.PhaseConfig(full_precision="fp16")
    with pytest.raises(ValueError, match=r"predict_precision must be one of .*'auto'.*got 'int8'"):
        ph.PhaseConfig(predict_precision="int8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    assert ph.autocast_dtype_for("auto", torch.device("cuda")) == torch.float16
    assert ph.autocast_dtype_for("auto", torch.device("cpu")) == torch.bfloat16
    assert ph.autocast_dtype_for("fp32", torch.device("cpu")) is None
