"""The byte corpus: built-in standard-library corpus, --data file / folder, split, batches.

B = sequences in a batch, T = sequence length, U8 = flat uint8 byte stream.

    .venv/bin/python -m pytest tests/data -q
"""

from __future__ import annotations

import pytest
import torch

from spikeguard.data import DEFAULT_MAX_BYTES, Corpus, load_corpus, split_bytes
from spikeguard.errors import UsageError


@pytest.fixture(scope="module")
def default_corpus() -> Corpus:
    return load_corpus()


def test_default_corpus_is_deterministic_and_capped(default_corpus):
    again = load_corpus()
    assert torch.equal(default_corpus.train_U8, again.train_U8)
    assert torch.equal(default_corpus.val_U8, again.val_U8)
    assert default_corpus.num_bytes <= DEFAULT_MAX_BYTES
    # The standard library is far larger than the cap: a short read would mean files were missed.
    assert default_corpus.num_bytes > DEFAULT_MAX_BYTES // 2
    assert "standard library" in default_corpus.source


def test_default_corpus_is_python_source(default_corpus):
    head = bytes(default_corpus.train_U8[:200_000].tolist())
    assert b"def " in head and b"import " in head


def test_split_is_last_tenth_of_bytes():
    corpus = split_bytes(bytearray(range(100)), "test")
    assert corpus.train_U8.tolist() == list(range(90))
    assert corpus.val_U8.tolist() == list(range(90, 100))


def test_max_bytes_caps_the_read(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"a" * 1000)
    (tmp_path / "b.txt").write_bytes(b"b" * 1000)
    corpus = load_corpus(tmp_path, max_bytes=1500)
    assert corpus.num_bytes == 1500
    assert load_corpus(max_bytes=4096).num_bytes == 4096


def test_data_file(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(100)).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    corpus = load_corpus(path)
    assert bytes(torch.cat([corpus.train_U8, corpus.val_U8]).tolist()) == text
    assert corpus.val_U8.numel() == len(text) // 10
    assert str(path) in corpus.source


def test_data_folder_reads_all_files_recursively_in_sorted_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_bytes(b"B" * 40)
    (tmp_path / "sub" / "z.txt").write_bytes(b"Z" * 40)
    (tmp_path / "sub" / "a.txt").write_bytes(b"A" * 40)
    (tmp_path / "a.txt").write_bytes(b"a" * 40)
    corpus = load_corpus(tmp_path)
    stream = bytes(torch.cat([corpus.train_U8, corpus.val_U8]).tolist())
    assert stream == b"a" * 40 + b"B" * 40 + b"A" * 40 + b"Z" * 40
    assert "4 files" in corpus.source


@pytest.mark.parametrize("make", ["missing", "empty_file", "empty_folder", "only_empty_files"])
def test_bad_data_paths_are_usage_errors(tmp_path, make):
    path = tmp_path / "data"
    if make == "empty_file":
        path.write_bytes(b"")
    elif make == "empty_folder":
        path.mkdir()
    elif make == "only_empty_files":
        path.mkdir()
        (path / "x.txt").write_bytes(b"")
    with pytest.raises(UsageError) as info:
        load_corpus(path)
    assert "\n" not in str(info.value)


def test_too_little_data_for_one_sequence(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 100)      # 90 train / 10 validation bytes
    corpus = load_corpus(path)
    corpus.check_seq_len(9)
    with pytest.raises(UsageError, match="too little data"):
        corpus.check_seq_len(10)
    with pytest.raises(UsageError, match="too little data"):
        corpus.get_batch("val", 2, 32, torch.Generator().manual_seed(0))


def test_get_batch_windows_shapes_and_shift():
    # Bytes 0..255 repeated: a window is fully determined by its first byte.
    corpus = split_bytes(bytearray(list(range(256)) * 40), "ramp")
    gen = torch.Generator().manual_seed(0)
    idx_BT, targets_BT = corpus.get_batch("train", 6, 16, gen)
    assert idx_BT.shape == targets_BT.shape == (6, 16)
    assert idx_BT.dtype == targets_BT.dtype == torch.int64
    ramp_BT = (idx_BT[:, :1] + torch.arange(16)) % 256
    assert torch.equal(idx_BT, ramp_BT)
    assert torch.equal(targets_BT, (ramp_BT + 1) % 256)


def test_get_batch_is_deterministic_per_seed(default_corpus):
    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return [default_corpus.get_batch(split, 4, 32, gen) for split in ("train", "val", "train")]

    first, second, other = draw(7), draw(7), draw(8)
    for (a_idx, a_tgt), (b_idx, b_tgt) in zip(first, second):
        assert torch.equal(a_idx, b_idx) and torch.equal(a_tgt, b_tgt)
    assert not torch.equal(first[0][0], other[0][0])


def test_unknown_split():
    corpus = split_bytes(bytearray(b"x" * 1000), "x")
    with pytest.raises(ValueError, match="split"):
        corpus.get_batch("test", 1, 4, torch.Generator())
