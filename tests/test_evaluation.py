from types import SimpleNamespace

import pytest
import torch

import colab_memopt as cm
from colab_memopt.techniques.evaluation import generate


@pytest.fixture(scope="module")
def model():
    return cm.build_model("tiny", seed=0)


def test_generate_is_greedy_deterministic_and_leaves_the_mode(model):
    model.train()
    first = generate(model, "def main():", max_new_tokens=8)
    assert model.training  # restored
    assert first == generate(model, "def main():", max_new_tokens=8)  # greedy: the same text
    assert len(first.encode("utf-8", errors="surrogateescape")) >= 1
    with torch.no_grad():  # changing the weights changes what it says
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5, alpha=1.0)
    assert generate(model, "def main():", max_new_tokens=8) != first


class _Prefers300(torch.nn.Module):
    """A 512-token model whose best next token is always id 300 (then 65, 'A')."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        logits = torch.zeros(*ids.shape, 512) + self.w
        logits[..., 300], logits[..., 65] = 2.0, 1.0
        return SimpleNamespace(logits=logits)


def test_generate_decodes_only_the_tokenizers_vocabulary():
    """A model whose vocabulary is larger than the byte tokens never emits an id that bytes() cannot decode."""
    assert generate(_Prefers300(), "x", max_new_tokens=3) == "AAA"


class _Tokenizer:
    """Four words, one token each."""

    words = ["<s>", "a", "b", "c"]

    def encode(self, text, add_special_tokens=False):
        return [self.words.index(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == 0))

    def __len__(self):
        return len(self.words)


def test_generate_with_a_tokenizer_stays_in_its_vocabulary(model):
    out = generate(model, "a b", tokenizer=_Tokenizer(), max_new_tokens=5)
    assert set(out.split()) <= {"a", "b", "c"}


def test_generate_in_fp16_autocast(model):
    """The T4's forward precision: fp16 autocast runs on the CPU and gives text."""
    out = generate(model, "import os", max_new_tokens=4, precision="fp16-autocast")
    assert isinstance(out, str)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt must be a non-empty string"),
    (dict(prompt="a", max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(prompt="a", precision="fp8"), "precision"),
])
def test_generate_names_bad_arguments(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)
