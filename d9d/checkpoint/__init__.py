"""Sharded, asynchronous, atomic checkpoints over tensorstore/zarr v3 (``d9d.checkpoint``).

Every rank writes its own shards of one global array per leaf; a restore reads, on each
rank, exactly the slices of the target layout it needs, whatever layout wrote them.
Train-state helpers bundle params, optimizer state, step, data position and RNG; the
Hugging Face helpers convert the d9d Llama and MoE models to and from ``transformers``
folders (Llama, Qwen3-MoE),
and read each rank's shards of a ``transformers`` folder without loading the whole model.
"""

from ._format import all_checkpoints as all_checkpoints
from ._format import latest as latest
from ._format import metadata as metadata
from ._format import sweep as sweep
from ._hf import LLAMA_KEYS as LLAMA_KEYS
from ._hf import export_hf as export_hf
from ._hf import import_hf as import_hf
from ._hf import llama_from_hf as llama_from_hf
from ._hf import llama_to_hf as llama_to_hf
from ._hf_config import read_hf_config as read_hf_config
from ._hf_moe import export_hf_moe as export_hf_moe
from ._hf_moe import import_hf_moe as import_hf_moe
from ._hf_moe import moe_from_hf as moe_from_hf
from ._hf_moe import moe_to_hf as moe_to_hf
from ._hf_weights import load_hf_weights as load_hf_weights
from ._restore import Abstract as Abstract
from ._restore import restore as restore
from ._save import SaveHandle as SaveHandle
from ._save import save as save
from ._train_state import TrainState as TrainState
from ._train_state import restore_train_state as restore_train_state
from ._train_state import save_train_state as save_train_state

__all__ = [
    "LLAMA_KEYS",
    "Abstract",
    "SaveHandle",
    "TrainState",
    "all_checkpoints",
    "export_hf",
    "export_hf_moe",
    "import_hf",
    "import_hf_moe",
    "latest",
    "llama_from_hf",
    "llama_to_hf",
    "load_hf_weights",
    "metadata",
    "moe_from_hf",
    "moe_to_hf",
    "read_hf_config",
    "restore",
    "restore_train_state",
    "save",
    "save_train_state",
    "sweep",
]
