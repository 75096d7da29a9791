"""Imports and exports refuse every ``transformers`` config field d9d's models do not implement,
by name; the fields checked are the config class's own, so a new one fails safe."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import d9d
from d9d import checkpoint
from d9d.errors import ConfigError
from d9d.models import MoE, MoEConfig
from d9d.moe import MoEConfig as LayerConfig

transformers = pytest.importorskip("transformers")


def _qwen3_moe_folder(tmp_path: Path, **fields: object) -> Path:
    """A Qwen3-MoE folder's config.json (imports read it before any weight)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, **fields,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    return tmp_path


def test_a_qwen3_moe_config_at_what_d9d_implements_imports(tmp_path: Path) -> None:
    config = checkpoint.read_hf_config(_qwen3_moe_folder(tmp_path, pad_token_id=7))
    assert (config.moe.n_experts, config.head_dim, config.pad_token_id) == (4, 8, 7)
    assert config.moe.aux_loss_coef == transformers.Qwen3MoeConfig().router_aux_loss_coef


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"attention_bias": True}, "attention_bias=True"),
        ({"use_sliding_window": True, "sliding_window": 4}, "sliding_window=4"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
    ids=["attention_bias", "sliding_window", "gelu"],
)
def test_qwen3_moe_fields_d9d_does_not_implement_are_refused(
    tmp_path: Path, fields: dict, named: str
) -> None:
    folder = _qwen3_moe_folder(tmp_path, **fields)
    with pytest.raises(ConfigError, match=rf"{named}, which d9d's MoE does not implement"):
        checkpoint.import_hf_moe(folder)


def test_a_sliding_window_transformers_does_not_use_is_not_refused(tmp_path: Path) -> None:
    """Qwen3 folders carry sliding_window and max_window_layers with use_sliding_window=False,
    which transformers then ignores (it reads sliding_window as None)."""
    folder = _qwen3_moe_folder(tmp_path, use_sliding_window=False, sliding_window=4)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "max_window_layers": 2}))
    assert checkpoint.read_hf_config(folder).moe.n_experts == 4


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("attention_sink", 3, r"sets attention_sink=3, a field Qwen3MoeConfig does not define"),
        # transformers' typed fields refuse an int where a float goes: a ConfigError too.
        ("rms_norm_eps", 1, r"Qwen3MoeConfig does not read this config.json.*rms_norm"),
    ],
    ids=["undefined field", "value of the wrong type"],
)
def test_a_field_the_config_class_does_not_read_is_a_config_error(
    tmp_path: Path, field: str, value: object, match: str
) -> None:
    folder = _qwen3_moe_folder(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ConfigError, match=match):
        checkpoint.import_hf_moe(folder)


@dataclasses.dataclass(repr=False)
class _NewerLlamaConfig(transformers.LlamaConfig):
    """LlamaConfig as a later transformers might ship it: one more field, off by default."""

    attention_gate: bool = False


@pytest.fixture
def newer_llama_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(transformers.CONFIG_MAPPING._extra_content, "llama", _NewerLlamaConfig)


@pytest.mark.usefixtures("newer_llama_config")
def test_a_new_transformers_field_fails_safe(tmp_path: Path) -> None:
    """A field d9d has never heard of: at its default it changes nothing and imports; set, the
    import is refused by name."""
    config = d9d.models.LlamaConfig.tiny()
    params = d9d.functionalize(d9d.models.Llama(config)).params
    folder = checkpoint.export_hf(params, config, tmp_path)
    assert checkpoint.import_hf(folder)[0] == config
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "attention_gate": True}))
    with pytest.raises(
        ConfigError, match=r"attention_gate=True, which the d9d Llama does not implement: it "
        r"computes attention_gate=False only"
    ):  # fmt: skip
        checkpoint.import_hf(folder)


def test_llama_fields_d9d_does_not_implement_are_refused(tmp_path: Path) -> None:
    transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, mlp_bias=True,
    ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match=r"mlp_bias=True, which the d9d Llama does not"):
        checkpoint.import_hf(tmp_path)


def test_a_d9d_moe_field_qwen3_moe_cannot_hold_is_refused_on_export(tmp_path: Path) -> None:
    """The d9d side is derived too: every MoE field that the folder does not write must be at
    its default (or Qwen3-MoE's value)."""
    layer = LayerConfig(dim=64, n_experts=4, top_k=2, expert_dim=24, capacity_factor=1.25)
    config = MoEConfig.tiny(n_layers=2, qk_norm=True, moe=layer)
    with pytest.raises(
        ConfigError, match=r"needs capacity_factor=None, the config has moe.capacity_factor=1.25"
    ):
        checkpoint.export_hf_moe(d9d.functionalize(MoE(config)).params, config, tmp_path)
