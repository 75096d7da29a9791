"""TokenLoader: determinism, packing, data-parallel sharding, epochs, resumption, errors."""

import json

import numpy as np
import pytest
import torch

from d9d.data import TokenLoader, byte_corpus, epoch_permutation, stdlib_corpus, tokens_digest
from d9d.data._packing import gather_windows
from d9d.errors import DataError

SEQ_LEN = 8
# 1,203 tokens pack into 150 windows: not a multiple of the global batch of 8, so some
# global batches straddle two epochs.
STREAM = (np.arange(1_203, dtype=np.int64) * 7919 % 251 + 1).astype(np.uint8)


def _loader(**overrides):
    config = {"global_batch_size": 8, "seq_len": SEQ_LEN, "seed": 0} | overrides
    return TokenLoader(STREAM, **config)


def _window(w: int) -> np.ndarray:
    return STREAM[w * SEQ_LEN : w * SEQ_LEN + SEQ_LEN + 1].astype(np.int64)


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys() == {"tokens", "labels"}
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_same_config_same_batches_other_seed_other_batches():
    a, b, c = _loader(), _loader(), _loader(seed=1)
    differs = False
    for _ in range(40):
        batch_a, batch_c = next(a), next(c)
        _assert_batches_equal(batch_a, next(b))
        differs |= not torch.equal(batch_a["tokens"], batch_c["tokens"])
    assert differs


def test_batches_are_the_permuted_windows_across_epochs():
    loader = _loader()
    assert loader.num_windows == 150
    samples = [epoch_permutation(150, seed=0, epoch=e)[i] for e in range(3) for i in range(150)]
    for step in range(50):  # 400 samples: epochs 0, 1 and 2
        assert loader.step == step and loader.epoch == step * 8 // 150
        batch = next(loader)
        assert batch["tokens"].shape == batch["labels"].shape == (8, SEQ_LEN)
        assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
        for row in range(8):
            window = _window(samples[step * 8 + row])
            np.testing.assert_array_equal(batch["tokens"][row].numpy(), window[:-1])
            np.testing.assert_array_equal(batch["labels"][row].numpy(), window[1:])


def test_each_epoch_visits_every_window_once():
    loader = TokenLoader(STREAM[: 40 * SEQ_LEN + 1], global_batch_size=8, seq_len=SEQ_LEN)
    for _ in range(2):
        firsts = torch.cat([next(loader)["tokens"] for _ in range(5)])
        expected = np.stack([_window(w)[:-1] for w in range(40)])
        got = firsts.numpy()
        assert sorted(map(tuple, got)) == sorted(map(tuple, expected))


def test_batch_is_random_access_and_does_not_move():
    loader = _loader()
    later = loader.batch(30)
    assert loader.step == 0
    for _ in range(30):
        next(loader)
    _assert_batches_equal(next(loader), later)


@pytest.mark.parametrize("dp_size", [2, 4])
def test_dp_ranks_concatenate_to_the_single_device_batch(dp_size):
    single = _loader()
    ranks = [_loader(dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for _ in range(40):  # steps 18 and 37 straddle epoch boundaries
        local = [next(rank) for rank in ranks]
        assert local[0]["tokens"].shape == (8 // dp_size, SEQ_LEN)
        glued = {key: torch.cat([batch[key] for batch in local]) for key in local[0]}
        _assert_batches_equal(glued, next(single))
        assert {json.dumps(rank.state_dict()) for rank in ranks} == {
            json.dumps(single.state_dict())
        }


def test_resume_is_exact():
    uninterrupted = _loader(seed=7)
    first = _loader(seed=7)
    for _ in range(17):
        next(uninterrupted)
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {
        "step": 17, "epoch": 0, "seed": 7, "seq_len": SEQ_LEN, "global_batch_size": 8,
        "num_windows": 150, "tokens_digest": tokens_digest(STREAM),
    }  # fmt: skip
    resumed = _loader(seed=7)
    resumed.load_state_dict(state)
    assert resumed.step == 17
    for _ in range(25):  # crosses into epoch 1
        _assert_batches_equal(next(resumed), next(uninterrupted))


def test_resume_on_another_dp_size():
    single = _loader()
    for _ in range(19):
        next(single)
    ranks = [_loader(dp_rank=r, dp_size=2) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(single.state_dict())
    for _ in range(5):
        glued = torch.cat([next(rank)["tokens"] for rank in ranks])
        torch.testing.assert_close(glued, next(single)["tokens"], rtol=0, atol=0)


def test_byte_corpus_documents_are_separated_by_zero(tmp_path):
    docs = [bytes(range(1 + i, 40 + i)) * 3 for i in range(5)]
    for i, doc in enumerate(docs):
        (tmp_path / f"{i}.txt").write_bytes(doc)
    tokens = byte_corpus(tmp_path)
    assert tokens.tobytes() == b"\0".join(docs)
    loader = TokenLoader(tmp_path, global_batch_size=4, seq_len=16)
    np.testing.assert_array_equal(loader.tokens, tokens)
    seen_zero = False
    for _ in range(loader.num_windows // 4):
        batch = next(loader)
        assert int(batch["tokens"].min()) >= 0 and int(batch["labels"].max()) <= 255
        torch.testing.assert_close(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        seen_zero |= bool((batch["tokens"] == 0).any())
    assert seen_zero


def test_stdlib_corpus_through_the_loader():
    corpus = stdlib_corpus(max_bytes=100_000)
    loader = TokenLoader(corpus, global_batch_size=16, seq_len=64, seed=5)
    batch = loader.batch(3)
    assert batch["tokens"].shape == (16, 64)
    windows = epoch_permutation(loader.num_windows, seed=5, epoch=0)[48:64]
    expected = gather_windows(corpus, windows, seq_len=64).astype(np.int64)
    np.testing.assert_array_equal(batch["tokens"].numpy(), expected[:, :-1])
    np.testing.assert_array_equal(batch["labels"].numpy(), expected[:, 1:])


def test_indivisible_global_batch():
    with pytest.raises(
        ValueError, match=r"global_batch_size=6 is not divisible by dp_size=4.*e\.g\. 8"
    ):
        _loader(global_batch_size=6, dp_size=4)


def test_too_few_tokens():
    with pytest.raises(
        DataError,
        match=r"too few tokens: 1203 tokens pack into 18 windows of seq_len \+ 1 = 65 tokens, "
        r"fewer than global_batch_size=32; .* at least 2049 tokens",
    ):
        TokenLoader(STREAM, global_batch_size=32, seq_len=64)
    with pytest.raises(DataError, match=r"too few tokens: 1 tokens pack into 0 windows"):
        TokenLoader(np.zeros(1, dtype=np.uint8), global_batch_size=1, seq_len=1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"seq_len": 0}, r"seq_len must be an int >= 1, got seq_len=0"),
        ({"global_batch_size": 2.0}, r"global_batch_size must be an int >= 1"),
        ({"seed": -1}, r"seed must be an int in \[0, 18446744073709551616\), got seed=-1"),
        ({"dp_size": 2, "dp_rank": 2}, r"dp_rank must be an int in \[0, 2\), got dp_rank=2"),
        ({"dp_size": 0}, r"dp_size must be an int >= 1"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        _loader(**overrides)


def test_bad_step():
    with pytest.raises(ValueError, match=r"step must be an int >= 0, got step=-1"):
        _loader().batch(-1)


def test_bad_sources():
    with pytest.raises(DataError, match=r"1-D of an integer dtype, got shape=\(2, 3\)"):
        TokenLoader(np.zeros((2, 3), dtype=np.int64), global_batch_size=1, seq_len=1)
    with pytest.raises(DataError, match=r"1-D of an integer dtype, got shape=\(9,\) dtype=float"):
        TokenLoader(np.zeros(9), global_batch_size=1, seq_len=1)
    with pytest.raises(DataError, match=r"cannot read tokens from a int; pass a 1-D integer"):
        TokenLoader(3, global_batch_size=1, seq_len=1)
    # Token ids in a list (or bytes) were taken for paths: a bare TypeError from pathlib.
    with pytest.raises(DataError, match=r"holds int 5: pass token ids as a 1-D integer np.nd"):
        TokenLoader([5, 6, 7], global_batch_size=1, seq_len=1)
    with pytest.raises(
        DataError, match=r"a bytes source is read as a list of paths of text, but it holds int 104"
    ):
        TokenLoader(b"hello", global_batch_size=1, seq_len=1)


def test_missing_and_empty_paths(tmp_path):
    with pytest.raises(DataError, match=r"'.*missing' does not exist"):
        TokenLoader(tmp_path / "missing", global_batch_size=1, seq_len=1)
    with pytest.raises(DataError, match=r"holds no non-empty files"):
        TokenLoader(tmp_path, global_batch_size=1, seq_len=1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"seed": 1}, r"saved with seed=1, this loader has seed=0: build the loader"),
        ({"seq_len": 16}, r"saved with seq_len=16, this loader has seq_len=8"),
        ({"global_batch_size": 4}, r"saved with global_batch_size=4, this loader has .*=8"),
        ({"num_windows": 149}, r"saved with num_windows=149, this loader has num_windows=150"),
        (
            {"tokens_digest": 5},
            r"saved with tokens_digest=5, this loader has tokens_digest=\d+ "
            r"\(other tokens: another file or corpus, or one edited since\)",
        ),
        ({"epoch": 1}, r"inconsistent: step=3 is in epoch 0, but it says epoch=1"),
        ({"step": -1}, r"values must be ints, step >= 0"),
        ({"step": 3.0}, r"values must be ints, step >= 0"),
        ({"extra": 1}, r"not a TokenLoader state: got keys \[.*'extra'.*\], expected"),
    ],
)
def test_bad_state_dict(change, match):
    source = _loader()
    for _ in range(3):
        next(source)
    state = source.state_dict() | change
    target = _loader()
    with pytest.raises(DataError, match=match):
        target.load_state_dict(state)
    assert target.step == 0


def test_resume_on_other_tokens_of_the_same_length_is_refused():
    # Another corpus that packs into as many windows passed every check: the resumed run
    # went on, silently, over other data.
    other = STREAM.copy()
    other[600] += 1  # a sampled position: 1,203 tokens are all sampled
    source = _loader()
    for _ in range(3):
        next(source)
    target = TokenLoader(other, global_batch_size=8, seq_len=SEQ_LEN)
    assert target.num_windows == source.num_windows
    with pytest.raises(DataError, match=r"saved with tokens_digest=\d+, this loader has"):
        target.load_state_dict(source.state_dict())
    assert target.step == 0


def test_a_state_saved_before_the_digest_still_loads():
    source = _loader()
    for _ in range(3):
        next(source)
    state = source.state_dict()
    del state["tokens_digest"]
    resumed = _loader()
    resumed.load_state_dict(state)
    _assert_batches_equal(next(resumed), next(source))


def test_state_dict_missing_key_or_not_a_mapping():
    state = _loader().state_dict()
    del state["step"]
    with pytest.raises(DataError, match=r"not a TokenLoader state: got keys \['epoch', "):
        _loader().load_state_dict(state)
    with pytest.raises(DataError, match=r"not a TokenLoader state: got keys list"):
        _loader().load_state_dict([1, 2])
