"""A damaged Hugging Face folder is refused naming the file: a truncated or garbled
safetensors file, an index that is not JSON, a tensor held by two files."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import d9d
from d9d import checkpoint
from d9d.errors import CheckpointCorruptError, ParamShapeError
from d9d.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

LLAMA = LlamaConfig.tiny(vocab_size=97, n_layers=1)
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "truncated": lambda data: data[:-100],  # an interrupted download
    "header cut": lambda data: data[:50],
    "header garbled": lambda data: data[:8] + b"x" * 20 + data[28:],
}


def _indexed_llama(folder: Path) -> Path:
    """A d9d Llama exported and split into two files with an index."""
    params = d9d.functionalize(Llama(LLAMA)).params
    checkpoint.export_hf(params, LLAMA, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[::2]}
    halves["model-00002-of-00002.safetensors"] = keys[1::2]
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, folder / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _target() -> dict[str, torch.Tensor]:
    return d9d.functionalize(Llama(LLAMA, device="meta")).params


READS = {
    "import_hf": lambda folder: checkpoint.import_hf(folder),
    "import_hf target": lambda folder: checkpoint.import_hf(folder, target=_target()),
    "load_hf_weights": lambda folder: checkpoint.load_hf_weights(
        folder, {"model.norm.weight": torch.empty(64, device="meta")}, partial=True
    ),
}


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_safetensors_file_is_named(tmp_path: Path, damage: str, read: str) -> None:
    """Before, safetensors' own error escaped without the file ("Error while deserializing
    header: incomplete metadata, file not fully covered"), one of a folder's many files."""
    folder = _indexed_llama(tmp_path)
    file = folder / "model-00002-of-00002.safetensors"
    file.write_bytes(DAMAGE[damage](file.read_bytes()))
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{str(file)!r} is not a readable")):
        READS[read](folder)


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("index", ["{not json", '{"other": 1}', '{"weight_map": [1]}'])
def test_a_damaged_index_is_named(tmp_path: Path, index: str, read: str) -> None:
    folder = _indexed_llama(tmp_path)
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointCorruptError, match=r"model.safetensors.index.json' is not a"):
        READS[read](folder)


@pytest.mark.parametrize("read", READS)
def test_a_tensor_stored_in_two_files_is_named(tmp_path: Path, read: str) -> None:
    """Before, the file listed last won, whichever value it held."""
    folder = _indexed_llama(tmp_path)
    other = folder / "model-00001-of-00002.safetensors"
    assert "model.norm.weight" not in load_file(other)
    state = load_file(other)
    state["model.norm.weight"] = torch.zeros(64)
    save_file(state, other, metadata={"format": "pt"})
    with pytest.raises(CheckpointCorruptError, match=r"'model.norm.weight' is in both"):
        READS[read](folder)


def test_a_shape_mismatch_names_the_file(tmp_path: Path) -> None:
    folder = _indexed_llama(tmp_path)
    target = {"norm.weight": checkpoint.Abstract((63,), torch.float32)}
    file = folder / "model-00002-of-00002.safetensors"  # the one holding model.norm.weight
    with pytest.raises(ParamShapeError, match=re.escape(f"shape (64,) in {str(file)!r}")):
        checkpoint.import_hf(folder, target=target)
