import gc
import importlib.util
import os
import re

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")


# What most test files load: imported here, once per worker, so that the freeze below covers it too.
_PRELOAD = ("transformers", "transformers.models.llama.modeling_llama", "transformers.trainer", "peft", "bitsandbytes",
            "trl")


def pytest_collection_finish(session):
    """Take every module the tests load (torch, transformers, peft, TRL, this package) out of the cyclic collector's
    reach. measure_step's full gc.collect() then scans only what the tests themselves make: with those modules loaded
    it took 0.24 s a call (17 s of tests/test_planner.py's 198 s), frozen 0.002 s. A short session (one file, the
    notebook-record checks) skips the preload: it would spend more importing than it saves."""
    for name in _PRELOAD if len(session.items) >= 200 else ():
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a speed-up: a test that needs an absent package says so itself
            pass
    gc.collect()
    gc.freeze()
    _FROZEN["on"] = True
    # Every planning call asks whether the caller froze objects (then it leaves the collector alone): gc's count walks
    # each frozen object, 47 ms a call here, and 465 calls were 41 s of 190 s in seven planning test files. The session
    # froze them: the answer is yes, without the walk (tests/test_isolation.py puts the real question back).
    from colab_memopt.core import isolation

    isolation._caller_froze = lambda: True


# What the tests keep alive grows too (traced models, fake-tensor caches, modules imported on first use): 400,000
# objects in a worker after a few hundred tests, and each full collection (measure_step's, accelerate's, Python's own
# every few hundred thousand allocations) scanned them again, 0.15-0.4 s each: 15% of the planner tests' time. Every
# `_REFREEZE_EVERY` tests, what is still alive after a full collection is frozen too (garbage is collected first, so
# nothing a test dropped is kept).
_REFREEZE_EVERY = 10
_FROZEN = {"on": False, "since": 0}


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if _FROZEN["on"]:
            _FROZEN["since"] += 1
            if _FROZEN["since"] >= _REFREEZE_EVERY:
                _FROZEN["since"] = 0
                gc.collect()
                gc.freeze()


@pytest.fixture(scope="session")
def corpus():
    from colab_memopt import load_corpus

    return load_corpus()


@pytest.fixture
def tiny(corpus):
    """A tiny model, its AdamW optimizer and a step function, freshly built."""
    from colab_memopt import build_model, make_optimizer, make_train_step

    model = build_model("tiny")
    opt = make_optimizer("adamw", model.parameters())
    step = make_train_step(model, opt, corpus, batch_size=4, seq_len=32)
    return model, opt, step


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# make test-gpu on a lent machine runs with only the packages one wheelhouse part carries (colab_memopt.tooling.gpucheck):
# a test that fails only because an optional package is absent there is skipped, naming it. Where the package is
# installed (CI, this repository's .venv) nothing changes: the test passes or fails as it is.
_NEEDS = re.compile(r"needs ([\w\-]+)(?:, ([\w\-]+))*(?:/([\w\-]+))*|pip install ([\w\-]+)")


def _absent_package(exc: BaseException) -> str | None:
    """Return the optional package whose absence caused `exc`, if that is why (else None)."""
    from colab_memopt.tooling.gpucheck import NEEDED

    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top in NEEDED and importlib.util.find_spec(top) is None:
            return NEEDED[top]
    if isinstance(exc, RuntimeError):
        names = set(re.findall(r"[\w\-]+", " ".join(m.group(0) for m in _NEEDS.finditer(str(exc)))))
        for module, pip in NEEDED.items():
            if pip in names and importlib.util.find_spec(module) is None:
                return pip
    return None


def _skip_if_absent(exc: Exception) -> None:
    package = _absent_package(exc)
    if package is not None:
        pytest.skip(f"needs {package}, which is not installed here ({type(exc).__name__}: {str(exc)[:120]})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    try:
        return (yield)
    except Exception as exc:
        _skip_if_absent(exc)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except Exception as exc:
        _skip_if_absent(exc)
        raise
