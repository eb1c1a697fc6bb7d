import json

import pytest
import torch

import colab_memopt as cm


def test_corpus_is_real_deterministic_text(corpus):
    from colab_memopt.techniques.data import _stdlib_corpus

    again = _stdlib_corpus.__wrapped__()
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
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 1024, got 10"):
        cm.load_corpus(10)
    with pytest.raises(ValueError, match="val_fraction"):
        cm.load_corpus(4096, 0.9)


def _text(tmp_path, name="notes.txt", n=400):
    path = tmp_path / name
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(n)))
    return path


def test_a_text_file_a_folder_and_the_same_split_and_batches(tmp_path):
    path = _text(tmp_path)
    corpus = cm.load_corpus(source=path)
    raw = path.read_bytes()
    n_val = int(len(raw) * 0.1)
    assert corpus.tokenizer == "bytes" and corpus.vocab_size == 256
    assert bytes(corpus.train.tolist()) == raw[:-n_val] and bytes(corpus.val.tolist()) == raw[-n_val:]
    a, b = next(corpus.batches(2, 32, seed=3)), next(corpus.batches(2, 32, seed=3))
    assert a.shape == (2, 32) and a.dtype == torch.long and torch.equal(a, b)
    (tmp_path / "more").mkdir()
    _text(tmp_path / "more", "b.md", 50)
    (tmp_path / "more" / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "more" / ".hidden").mkdir()
    _text(tmp_path / "more" / ".hidden", "skip.txt", 50)
    folder = cm.load_corpus(source=tmp_path)
    assert "2 text files" in folder.source
    assert len(folder.train) + len(folder.val) == len(raw) + len((tmp_path / "more" / "b.md").read_bytes())
    assert len(cm.load_corpus(2048, source=tmp_path).train) + len(cm.load_corpus(2048, source=tmp_path).val) == 2048


def _word_tokenizer(texts, folder):
    """A word-level tokenizer trained here (no download), saved like a model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return fast


def test_the_models_tokenizer_when_there_is_one_bytes_otherwise(tmp_path):
    path = _text(tmp_path)
    tok = _word_tokenizer([path.read_text()], tmp_path / "model")
    corpus = cm.load_corpus(source=path, tokenizer=str(tmp_path / "model"))
    assert corpus.vocab_size == len(tok) < 256 + 500 and corpus.tokenizer != "bytes"
    assert len(corpus.train) + len(corpus.val) == len(tok.encode(path.read_text(), add_special_tokens=False))
    assert int(next(corpus.batches(2, 16)).max()) < corpus.vocab_size
    assert cm.load_corpus(source=path, tokenizer=tok).vocab_size == len(tok)  # a tokenizer object works too
    (tmp_path / "no_tokenizer").mkdir()
    fallback = cm.load_corpus(source=path, tokenizer=str(tmp_path / "no_tokenizer"))
    assert fallback.tokenizer.startswith("bytes (no tokenizer") and fallback.vocab_size == 256


class _FakeDataset:
    """The part of `datasets.Dataset` that load_corpus reads: column_names, features and rows."""

    def __init__(self, rows):
        self.rows = rows
        self.column_names = list(rows[0])
        self.features = {c: type("F", (), {"dtype": "string" if isinstance(rows[0][c], str) else "int64"})() for c in rows[0]}

    def __iter__(self):
        return iter(self.rows)


def test_a_dataset_its_text_column_and_its_train_split():
    rows = [{"id": i, "body": f"document number {i} " * 20} for i in range(50)]
    corpus = cm.load_corpus(source=_FakeDataset(rows))
    assert "column 'body'" in corpus.source
    assert bytes(corpus.train[:19].tolist()) == b"document number 0 d"
    with pytest.raises(ValueError, match="no text column 'title'"):
        cm.load_corpus(source=_FakeDataset(rows), text_column="title")


def test_a_real_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [f"row {i} " * 30 for i in range(40)]})})
    corpus = cm.load_corpus(source=ds)
    assert len(corpus.train) > 0 and "column 'text'" in corpus.source


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        cm.load_corpus(source=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="holds no text files"):
        cm.load_corpus(source=tmp_path)
    with pytest.raises(TypeError, match="source must be"):
        cm.load_corpus(source=3)
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(ValueError, match="too few for a validation split"):
        cm.load_corpus(source=tmp_path / "tiny.txt")


def test_a_jsonl_file_gives_its_text_field_and_names_a_bad_record(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"text": f"record {i}: " + "x" * 200, "id": i} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    corpus = cm.load_corpus(2048, source=path)
    text = bytes(torch.cat([corpus.train, corpus.val]).tolist()).decode()
    assert text.startswith("record 0: xxx") and "\n\nrecord 1: " in text and '"id"' not in text  # the field, not the JSON
    assert "JSON Lines" in corpus.source and "'text'" in corpus.source
    assert len(text) == 2048  # max_bytes still caps it
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "a"}\n')
    with pytest.raises(ValueError, match=r"line 1 has no 'text' field \(it has \['body'\]\)"):
        cm.load_corpus(2048, source=other)
    other.write_text('{"body": "%s"}\n' % ("b" * 100))
    assert set(bytes(cm.load_corpus(1024, source=other, text_column="body").train.tolist()).decode()) == {"b"}  # the newlines fall in the validation tail
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        cm.load_corpus(2048, source=broken)
