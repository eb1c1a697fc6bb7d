import pytest
import torch

import colab_memopt as cm
from colab_memopt import batching, estimate
from colab_memopt.planning.monitor import MemoryMonitor

SEQ = 16


@pytest.fixture(scope="module")
def corpus():
    return cm.load_corpus()


def _model():
    model = cm.build_model("tiny", seed=0)
    opt = cm.make_optimizer("adamw", model.parameters())
    return model, opt


def _fits(model, opt, corpus, batch, limit):
    try:
        with cm.MemoryBudget(limit, model, opt):
            step = cm.make_train_step(model, opt, corpus, batch_size=batch, seq_len=SEQ)
            step()
            step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        batching.release_memory([model, opt])


def test_search_finds_the_true_boundary(corpus):
    model, opt = _model()
    cm.make_train_step(model, opt, corpus, batch_size=1, seq_len=SEQ)()  # optimizer state exists
    limit = 3 * 2**20
    # A step's memory grows with the batch: the true boundary is the batch before the first one that does not fit.
    truth = next(b for b in range(1, 40) if not _fits(model, opt, corpus, b, limit)) - 1
    assert truth >= 2, truth
    result = cm.find_max_batch_size(lambda b: cm.make_train_step(model, opt, corpus, batch_size=b, seq_len=SEQ),
                                    start=2, limit_bytes=limit, track=(model, opt), device="cpu")
    assert result.max_batch_size == truth
    assert any(not t.fits for t in result.tries)
    assert all(t.stranded_bytes == 0 for t in result.tries if not t.fits), "a failed try left memory behind"
    assert all(p.grad is None for p in model.parameters())


def test_bytes_freed_late_during_a_failed_try_are_released_not_negative_stranded(monkeypatch):
    # cuda-run-1 #9: on CUDA bytes of an earlier try can be freed during a later failed one; "stranded" came out
    # negative (-4,103,168 B). Resident bytes here: 1000 before the OOM, 600 after it; then 600 and 600.
    resident = iter([1000, 600, 600, 600])
    monkeypatch.setattr(batching, "resident_bytes", lambda track=(), device=None: next(resident))

    def step_factory(batch):
        def step():
            if batch > 1:
                raise torch.OutOfMemoryError("CUDA out of memory")
        return step

    result = cm.find_max_batch_size(step_factory, start=2, max_batch_size=2, limit_bytes=2**30, device="cpu")
    assert result.max_batch_size == 1
    failed = result.tries[0]
    assert (failed.batch_size, failed.fits, failed.stranded_bytes, failed.released_bytes) == (2, False, 0, 400)


def test_search_bad_input(corpus):
    with pytest.raises(ValueError, match="start must be an integer >= 1, got 0"):
        cm.find_max_batch_size(lambda b: None, start=0, limit_bytes=10)
    with pytest.raises(ValueError, match="pass limit_bytes"):
        cm.find_max_batch_size(lambda b: None, start=1, device="cpu")
    with pytest.raises(TypeError, match="callable"):
        cm.find_max_batch_size(3, limit_bytes=10)


def _run(samples, limit=None, pressure=None, micro=None):
    model, opt = _model()
    ballast = []

    def hook(step):
        ballast.clear()
        if pressure and step in pressure:
            ballast.append(torch.empty(pressure[step], dtype=torch.uint8))

    mon = MemoryMonitor(limit, device="cpu") if limit else None
    return cm.train_with_oom_recovery(model, opt, samples, effective_batch_size=8, micro_batch_size=micro,
                                      limit_bytes=limit, monitor=mon, restore_after=1, on_step_start=hook)


def test_recovery_keeps_samples_and_losses(corpus):
    samples = corpus.batch(64, SEQ, generator=torch.Generator().manual_seed(0))
    ref = _run(samples)
    assert ref.events == [] and ref.micro_batch_sizes == [8] * 8
    limit = max(ref.peak_bytes) + 2**20
    rec = _run(samples, limit=limit, pressure={1: 2**20 + 2**19})  # step 1 no longer fits at micro-batch 8
    assert rec.recoveries >= 1 and rec.events[0].kind == "oom" and rec.events[0].step == 1
    assert min(rec.micro_batch_sizes) < 8 and rec.micro_batch_sizes[-1] == 8, "the micro-batch must be restored"
    assert rec.restores >= 1
    assert sorted(rec.sample_ids) == list(range(64)) and rec.samples_lost(64) == 0
    assert [m * a >= 8 for m, a in zip(rec.micro_batch_sizes, rec.accumulation_steps)] == [True] * 8
    assert max(abs(a - b) for a, b in zip(ref.losses, rec.losses)) < 1e-5


def test_accumulation_matches_one_big_batch(corpus):
    samples = corpus.batch(6, SEQ, generator=torch.Generator().manual_seed(1))
    grads = []
    for micro in (6, 4, 1):
        model, _ = _model()
        loss = batching.accumulate_gradients(model, samples, torch.arange(6), micro, torch.device("cpu"))
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    for loss, g in grads[1:]:
        assert loss == pytest.approx(grads[0][0], abs=1e-6)
        torch.testing.assert_close(g, grads[0][1], atol=1e-6, rtol=1e-5)


def test_recovery_bad_input(corpus):
    model, opt = _model()
    samples = corpus.batch(8, SEQ)
    with pytest.raises(ValueError, match="effective_batch_size must be an integer in"):
        cm.train_with_oom_recovery(model, opt, samples, effective_batch_size=9)
    with pytest.raises(ValueError, match="micro_batch_size must be an integer in"):
        cm.train_with_oom_recovery(model, opt, samples, effective_batch_size=4, micro_batch_size=5)
    with pytest.raises(ValueError, match=r"samples must be a \(N, T\)"):
        cm.train_with_oom_recovery(model, opt, samples[0], effective_batch_size=4)


def test_samples_lost_counts_missing_and_repeated():
    run = batching.RecoveryRun(effective_batch_size=2, sample_ids=[0, 1, 1, 3])
    assert run.samples_lost(4) == 2


def test_prefetch_formula_and_measurement():
    assert estimate.dataloader_prefetch_bytes(8, 2, 12, 256, 2) == 8 * 2 * 12 * 256 * 2
    with pytest.raises(ValueError, match="prefetch_factor must be an integer >= 1"):
        estimate.dataloader_prefetch_bytes(1, 0, 1, 1)
    data = torch.arange(96 * 2048).reshape(96, 2048)  # int64 rows; batches of 256 KiB, well above shm's page overhead
    got = batching.measure_prefetch_bytes(data, batch_size=16, num_workers=1, prefetch_factor=2)
    expected = estimate.dataloader_prefetch_bytes(1, 2, 16, 2048, 8)
    assert got["batch_bytes"] == 16 * 2048 * 8
    assert expected <= got["measured_bytes"] <= 1.25 * expected


def test_training_peak_estimate_is_near_the_measurement(corpus):
    model, opt = _model()
    step = cm.make_train_step(model, opt, corpus, batch_size=4, seq_len=32)
    measured = cm.measure_step(step, model=model, optimizer=opt, repeat=1).peak_bytes
    paper = estimate.training_peak_bytes(cm.get_config("tiny"), 4, 32)
    assert measured <= paper <= 1.3 * measured
    assert estimate.training_peak_bytes(cm.get_config("tiny"), 4, 32, checkpointing=True) < paper


def test_probe_row_115_micro_batch_1_not_fitting_raises_with_the_record(corpus):
    # was: the raw budget OOM, no word that micro-batch 1 was reached, and the finished steps' record lost
    samples = corpus.batch(24, SEQ, generator=torch.Generator().manual_seed(0))
    ref = _run(samples)
    limit = max(ref.peak_bytes) + 2**20
    model, _ = _model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    ballast = limit - 4 * params - 4096  # parameters, gradients and AdamW's two states are live at a step's start
    with pytest.raises(cm.OOMNotRecovered, match=r"gave up at step 2: out of memory in forward/backward at micro-batch 1, "
                       r"the smallest allowed .*2 step\(s\) finished before it, their weight updates applied") as info:
        _run(samples, limit=limit, pressure={2: ballast})  # at step 2 not even micro-batch 1 fits
    err = info.value
    assert isinstance(err, torch.OutOfMemoryError) and err.where == "micro-batch" and err.step == 2
    assert len(err.run.losses) == 2 and sorted(err.run.sample_ids) == sorted(ref.sample_ids[:16])
    assert err.run.losses == pytest.approx(ref.losses[:2])


def test_probe_row_116_an_oom_in_the_optimizer_step_says_so(corpus):
    # was: an OOM "in aten.zeros_like.default", nothing saying it was the optimizer step
    samples = corpus.batch(16, SEQ, generator=torch.Generator().manual_seed(0))
    model, opt = _model()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with cm.MemoryBudget(2**40, model, opt) as mem:
        batching.accumulate_gradients(model, samples, torch.arange(1), 1, torch.device("cpu"))
        forward_backward = mem.peak_bytes
    opt.zero_grad(set_to_none=True)
    with_state = 4 * params  # parameters, gradients and AdamW's two states
    assert forward_backward < with_state
    limit = (forward_backward + with_state) // 2  # forward and backward fit, AdamW's first step does not
    with pytest.raises(cm.OOMNotRecovered, match=r"gave up at step 0: out of memory in optimizer.step, whose memory does "
                       r"not depend on the micro-batch.*No earlier step had finished") as info:
        cm.train_with_oom_recovery(model, opt, samples, effective_batch_size=1, limit_bytes=limit)
    assert info.value.where == "optimizer.step" and info.value.run.losses == []


def test_an_optimizer_oom_after_finished_steps_carries_their_record(corpus):
    samples = corpus.batch(32, SEQ, generator=torch.Generator().manual_seed(0))
    model, opt = _model()
    real_step, calls = opt.step, []

    def step_then_oom(*args, **kwargs):  # a stand-in for an OOM in the third optimizer step
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("emulated: out of memory in the optimizer step")
        return real_step(*args, **kwargs)

    opt.step = step_then_oom
    with pytest.raises(cm.OOMNotRecovered, match=r"step 2: out of memory in optimizer.step.*2 step\(s\) finished") as info:
        cm.train_with_oom_recovery(model, opt, samples, effective_batch_size=8)
    assert len(info.value.run.losses) == 2 and len(info.value.run.sample_ids) == 16


@pytest.mark.parametrize("kwargs, says", [
    ({"effective_batch_size": True}, "effective_batch_size must be an integer in"),
    ({"effective_batch_size": 4, "micro_batch_size": True}, "micro_batch_size must be an integer in"),
    ({"effective_batch_size": 4, "epochs": 1.5}, "epochs and restore_after must be integers >= 1"),
    ({"effective_batch_size": 4, "samples": "float"}, "samples must hold integer token ids, got dtype torch.float32"),
    ({"effective_batch_size": 4, "samples": "big"}, r"samples hold token ids in \[.*\]; the model takes \[0, "),
])
def test_probe_row_118_bad_samples_and_booleans_are_named(corpus, kwargs, says):
    # was: torch errors from split(), the embedding ('indices' ... Long) and IndexError
    model, opt = _model()
    samples = corpus.batch(8, SEQ)
    kind = kwargs.pop("samples", None)
    if kind == "float":
        samples = samples.float()
    elif kind == "big":
        samples = samples + model.config.vocab_size
    with pytest.raises(ValueError, match=says):
        cm.train_with_oom_recovery(model, opt, samples, **kwargs)


def test_probe_row_110_a_factory_that_returns_no_step_is_named():
    # was: TypeError: 'int' object is not callable (inside batching.py)
    with pytest.raises(TypeError, match=r"step_factory\(1\) must return a zero-argument step function, got int"):
        cm.find_max_batch_size(lambda b: 5, start=1, limit_bytes=2**30, device="cpu")
