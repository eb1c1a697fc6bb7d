"""tests/gpu: what only CUDA shows. Skipped without CUDA; under CM_EMULATE=t4 (make test-gpu's default on a
GPU that is not a T4) the session runs with the T4 emulation applied (`env.apply_emulation`)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = str(__file__).rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu runs these)"))


@pytest.fixture(scope="session", autouse=True)
def t4_emulation():
    if torch.cuda.is_available():
        from colab_memopt import env

        env.apply_emulation("cuda")
    yield


@pytest.fixture
def cuda():
    torch.cuda.empty_cache()
    return torch.device("cuda")
