"""Token files: memory-mapped round trips and errors."""

import numpy as np
import pytest
import torch

from d9d.data import TokenLoader, token_file
from d9d.errors import DataError


def test_round_trip_uint16(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50_257, size=1_000, dtype=np.uint16)
    assert ids.max() > 255
    path = tmp_path / "train.bin"
    ids.tofile(path)
    tokens = token_file(path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert not tokens.flags.writeable
    np.testing.assert_array_equal(tokens, ids)


def test_round_trip_uint32(tmp_path):
    ids = np.array([0, 70_000, 2**32 - 1], dtype=np.uint32)
    ids.tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(token_file(tmp_path / "t.bin", dtype=np.uint32), ids)


def test_loader_reads_a_bin_path_as_uint16_windows(tmp_path):
    ids = (np.arange(1_000, dtype=np.uint16) * 61) % 50_000
    path = tmp_path / "train.bin"
    ids.tofile(path)
    seq_len = 16
    for source in (path, str(path), token_file(path)):
        loader = TokenLoader(source, global_batch_size=4, seq_len=seq_len, seed=3)
        assert loader.num_windows == (1_000 - 1) // seq_len
        for step in range(20):
            batch = loader.batch(step)
            assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
            for tokens, labels in zip(batch["tokens"], batch["labels"], strict=True):
                start = int(np.flatnonzero(ids == tokens[0].item())[0])
                window = ids[start : start + seq_len + 1].astype(np.int64)
                np.testing.assert_array_equal(tokens.numpy(), window[:-1])
                np.testing.assert_array_equal(labels.numpy(), window[1:])
        assert int(loader.batch(0)["tokens"].max()) > 255


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"token file '.*none.bin' does not exist"):
        token_file(tmp_path / "none.bin")
    with pytest.raises(DataError, match=r"token file '.*none.bin' does not exist"):
        TokenLoader(tmp_path / "none.bin", global_batch_size=1, seq_len=1)


def test_token_file_in_a_list_of_text_paths(tmp_path):
    (tmp_path / "doc.txt").write_text("text")
    with pytest.raises(DataError, match=r"token files \['.*a.bin'\] are in a list of paths"):
        TokenLoader([tmp_path / "doc.txt", tmp_path / "a.bin"], global_batch_size=1, seq_len=1)


def test_directory_is_not_a_token_file(tmp_path):
    with pytest.raises(DataError, match=r"token file '.*' is not a file"):
        token_file(tmp_path)


def test_empty_file(tmp_path):
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"'.*e.bin' is empty; it must hold at least one token"):
        token_file(tmp_path / "e.bin")


def test_size_not_a_multiple_of_the_dtype(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match=r"has 3 bytes, not a multiple of 2 \(uint16\)"):
        token_file(tmp_path / "odd.bin")


def test_float_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"integer dtype, got dtype=dtype\('float32'\)"):
        token_file(tmp_path / "x.bin", dtype=np.float32)
