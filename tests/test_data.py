import pytest
import torch

import colab_memopt as cm


def test_corpus_is_real_deterministic_text(corpus):
    again = cm.load_corpus.__wrapped__()
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    assert len(corpus.train) + len(corpus.val) == 4 * 2**20
    assert len(corpus.val) == int(4 * 2**20 * 0.1)
    text = bytes(corpus.train[:2000].tolist()).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text


def test_batches_are_seeded_and_shaped(corpus):
    a = next(corpus.batches(4, 16, seed=1))
    b = next(corpus.batches(4, 16, seed=1))
    c = next(corpus.batches(4, 16, seed=2))
    assert a.shape == (4, 16) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.max()) < 256


def test_a_batch_owns_its_storage(corpus):
    x = corpus.batch(2, 8)
    assert x.untyped_storage().nbytes() == 2 * 8 * 8  # not a view of the corpus


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"batch_size": 0, "seq_len": 8}, "batch_size must be >= 1, got 0"),
        ({"batch_size": 1, "seq_len": 0}, "seq_len must be >= 1, got 0"),
        ({"batch_size": 1, "seq_len": 8, "split": "test"}, "split must be 'train' or 'val', got 'test'"),
        ({"batch_size": 1, "seq_len": 10**8}, "longer than the train split"),
    ],
)
def test_bad_batches(corpus, kwargs, message):
    with pytest.raises(ValueError, match=message):
        corpus.batch(**kwargs)


def test_bad_corpus_arguments():
    with pytest.raises(ValueError, match="max_bytes must be >= 1024, got 10"):
        cm.load_corpus(10)
    with pytest.raises(ValueError, match="val_fraction"):
        cm.load_corpus(4096, 0.9)
