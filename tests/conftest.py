import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")


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
