"""Byte corpora: file order, separators, NUL removal, caps and errors."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from d9d.data import BYTE_VOCAB_SIZE, byte_corpus, stdlib_corpus
from d9d.data._corpus import _stdlib_files
from d9d.errors import DataError


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def tree(tmp_path):
    _write(tmp_path / "b.txt", b"bee")
    _write(tmp_path / "a.txt", b"a\0y")  # the NUL is dropped
    _write(tmp_path / "a" / "z.py", b"zed")  # ("a", "z.py") sorts before ("a.txt",)
    _write(tmp_path / "empty.txt", b"")  # skipped inside a directory
    _write(tmp_path / ".hidden", b"no")
    _write(tmp_path / ".git" / "HEAD", b"no")
    _write(tmp_path / "__pycache__" / "m.pyc", b"no")
    return tmp_path


def test_directory_is_read_in_sorted_path_order_with_nul_separators(tree):
    tokens = byte_corpus(tree)
    assert tokens.dtype == np.uint8 and tokens.ndim == 1
    assert tokens.tobytes() == b"zed\0ay\0bee"
    assert not tokens.flags.writeable
    assert BYTE_VOCAB_SIZE == 256


def test_suffixes_filter_directory_entries_but_not_named_files(tree):
    assert byte_corpus(tree, suffixes=[".py"]).tobytes() == b"zed"
    assert byte_corpus([tree / "b.txt", tree], suffixes=(".py",)).tobytes() == b"bee\0zed"


def test_list_keeps_the_given_order(tree):
    assert byte_corpus([tree / "b.txt", str(tree / "a.txt")]).tobytes() == b"bee\0ay"


def test_max_bytes_cuts_the_stream(tree):
    full = byte_corpus(tree)
    for cap in (1, 3, 4, 7, 100):
        np.testing.assert_array_equal(byte_corpus(tree, max_bytes=cap), full[:cap])
    # Reading stops at the cap: a later path is not read (nor checked for emptiness).
    _write(tree / "later.txt", b"")
    assert byte_corpus([tree / "b.txt", tree / "later.txt"], max_bytes=3).tobytes() == b"bee"


def test_stdlib_corpus_is_deterministic_python_source():
    small = stdlib_corpus(max_bytes=50_000)
    large = stdlib_corpus(max_bytes=200_000)
    assert small.dtype == np.uint8 and small.shape == (50_000,) and large.shape == (200_000,)
    np.testing.assert_array_equal(small, large[:50_000])
    documents = large.tobytes().split(b"\0")
    assert len(documents) > 3 and all(documents)
    assert documents[0].startswith(b'"""Record of phased-in incompatible language changes.')


def test_stdlib_files_leave_out_installs_and_tests():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    parts = {part for path in files for part in path.relative_to(root).parts[:-1]}
    assert {"asyncio", "json"} <= parts
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert all(path.suffix == ".py" for path in files)
    assert files == sorted(files, key=lambda path: path.relative_to(root).parts)


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"'.*nowhere' does not exist; pass a text file"):
        byte_corpus([tmp_path, tmp_path / "nowhere"])


def test_empty_directory(tmp_path):
    with pytest.raises(DataError, match=r"holds no non-empty files; pass a text file"):
        byte_corpus(tmp_path)
    _write(tmp_path / "x.txt", b"\0\0")  # only NULs: empty once they are dropped
    with pytest.raises(DataError, match=r"holds no non-empty files"):
        byte_corpus(tmp_path)


def test_directory_without_matching_files(tmp_path):
    _write(tmp_path / "x.txt", b"text")
    with pytest.raises(DataError, match=r"holds no files ending with \('.md',\)"):
        byte_corpus(tmp_path, suffixes=[".md"])


def test_empty_file(tmp_path):
    empty = _write(tmp_path / "e.txt", b"")
    with pytest.raises(DataError, match=r"'.*e.txt' is empty"):
        byte_corpus([_write(tmp_path / "x.txt", b"x"), empty])


def test_no_paths():
    with pytest.raises(DataError, match=r"got no paths \(paths=\[\]\)"):
        byte_corpus([])


@pytest.mark.parametrize("cap", [0, -1, 1.5])
def test_bad_max_bytes(tmp_path, cap):
    with pytest.raises(ValueError, match=r"max_bytes must be a positive int or None"):
        byte_corpus(tmp_path, max_bytes=cap)
    with pytest.raises(ValueError, match=r"max_bytes must be a positive int"):
        stdlib_corpus(max_bytes=cap)
