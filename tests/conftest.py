import gc
import importlib.util
import os
import re

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_finish(session):
    """Take what collection built (every module the tests import: torch, transformers, peft, this package) out of the
    cyclic collector's reach. measure_step's full gc.collect() then scans only what the tests themselves make: in a
    worker holding all those modules it took about 0.3 s a call, and tests/test_planner.py ran in 106 s instead of 136."""
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


# make test-gpu on a lent machine runs with only the packages one wheelhouse part carries (colab_memopt.gpucheck):
# a test that fails only because an optional package is absent there is skipped, naming it. Where the package is
# installed (CI, this repository's .venv) nothing changes: the test passes or fails as it is.
_NEEDS = re.compile(r"needs ([\w\-]+)(?:, ([\w\-]+))*(?:/([\w\-]+))*|pip install ([\w\-]+)")


def _absent_package(exc: BaseException) -> str | None:
    """Return the optional package whose absence caused `exc`, if that is why (else None)."""
    from colab_memopt.gpucheck import NEEDED

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
