"""``tokens_digest``: what a loader's saved position checks the data by."""

import numpy as np

from d9d.data import tokens_digest
from d9d.data._digest import SAMPLED_TOKENS

STREAM = np.arange(100_003, dtype=np.int64) * 7919 % 65_521


def test_the_same_ids_in_any_dtype_give_one_digest():
    digest = tokens_digest(STREAM)
    assert tokens_digest(STREAM.astype(np.uint32)) == digest
    assert tokens_digest(STREAM.astype(np.uint16)) == digest
    assert 0 <= digest < 2**63


def test_a_memmap_gives_the_digest_of_its_ids(tmp_path):
    STREAM.astype(np.uint16).tofile(tmp_path / "t.bin")
    tokens = np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r")
    assert tokens_digest(tokens) == tokens_digest(STREAM)


def test_length_and_sampled_ids_change_it():
    digest = tokens_digest(STREAM)
    assert tokens_digest(STREAM[:-1]) != digest
    assert tokens_digest(STREAM[1:]) != digest
    for position in (0, STREAM.size - 1, (STREAM.size - 1) // (SAMPLED_TOKENS - 1)):
        edited = STREAM.copy()
        edited[position] += 1
        assert tokens_digest(edited) != digest, position
    assert tokens_digest(np.roll(STREAM, 1)) != digest  # a stream shifted by one file's bytes


def test_a_short_stream_is_read_whole():
    stream = np.arange(SAMPLED_TOKENS - 5)
    for position in range(0, stream.size, 97):
        edited = stream.copy()
        edited[position] = -1
        assert tokens_digest(edited) != tokens_digest(stream), position
