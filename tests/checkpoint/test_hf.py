"""Hugging Face interop: exported folders load in transformers with the same logits, and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from d9d import checkpoint, functionalize
from d9d.errors import ConfigError, ParamTreeMismatchError
from d9d.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")


def _params(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The model's params, norms included, perturbed so a swapped or dropped weight shows."""
    generator = torch.Generator().manual_seed(0)
    params = functionalize(Llama(config)).params
    return {
        k: v.detach() + 0.1 * torch.randn(v.shape, generator=generator) for k, v in params.items()
    }


def _tokens(config: LlamaConfig) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_and_imports_back(tmp_path: Path, tied: bool) -> None:
    config = LlamaConfig.tiny(rope_theta=1234.0, norm_eps=1e-6, tie_embeddings=tied)
    params = _params(config)
    folder = checkpoint.export_hf(params, config, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    model = functionalize(Llama(config))
    with torch.no_grad():
        expected = hf(_tokens(config)).logits
        got = model.apply(params, _tokens(config))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    imported_config, imported = checkpoint.import_hf(folder)
    assert imported_config == config
    assert imported.keys() == params.keys()
    assert all(torch.equal(imported[k], params[k]) for k in params)


def test_imports_a_save_pretrained_folder(tmp_path: Path) -> None:
    config = LlamaConfig.tiny(n_layers=1)
    hf_config = transformers.LlamaConfig(**json.loads(_exported_config(config, tmp_path)))
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.save_pretrained(tmp_path / "saved")
    imported_config, params = checkpoint.import_hf(tmp_path / "saved")
    assert imported_config == config
    with torch.no_grad():
        expected = hf(_tokens(config)).logits
        got = functionalize(Llama(config)).apply(params, _tokens(config))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _exported_config(config: LlamaConfig, tmp_path: Path) -> str:
    folder = checkpoint.export_hf(_params(config), config, tmp_path / "ours")
    return (folder / "config.json").read_text()


def test_key_table_maps_every_param_both_ways() -> None:
    config = LlamaConfig.tiny()
    params = _params(config)
    state = checkpoint.llama_to_hf(params, config)
    assert "model.layers.1.mlp.down_proj.weight" in state and len(state) == len(params)
    assert checkpoint.llama_from_hf(state, config) == params


def test_unsupported_configs_and_mismatched_weights(tmp_path: Path) -> None:
    config = LlamaConfig.tiny()
    folder = checkpoint.export_hf(_params(config), config, tmp_path / "hf")
    raw = json.loads((folder / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 128}  # fmt: skip
    scaled = {**raw, "rope_parameters": {**llama3, "rope_theta": 5e5}}
    (folder / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(ConfigError, match=r"RoPE scaling .*only rope_type 'default' loads"):
        checkpoint.import_hf(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    with pytest.raises(
        ConfigError,
        match=r"hidden_act='gelu', which the d9d Llama does not implement: it "
        r"computes hidden_act='silu' only",
    ):
        checkpoint.import_hf(folder)

    state = checkpoint.llama_to_hf(_params(config), config)
    with pytest.raises(ParamTreeMismatchError, match=r"no counterpart .*'model.extra.weight'"):
        checkpoint.llama_from_hf({**state, "model.extra.weight": torch.ones(1)}, config)
    del state["model.norm.weight"]
    with pytest.raises(ParamTreeMismatchError, match=r"missing \['norm.weight'\]"):
        checkpoint.llama_from_hf(state, config)
    tied = LlamaConfig.tiny(tie_embeddings=True)
    untied_state = checkpoint.llama_to_hf(_params(config), config)
    with pytest.raises(ParamTreeMismatchError, match=r"lm_head.weight differs from"):
        checkpoint.llama_from_hf(untied_state, tied)


def test_incomplete_folders_and_odd_heads(tmp_path: Path) -> None:
    config = LlamaConfig.tiny()
    folder = checkpoint.export_hf(_params(config), config, tmp_path / "hf")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "head_dim": 32}))
    with pytest.raises(ConfigError, match=r"head_dim=32, but hidden_size / num_attention_heads"):
        checkpoint.import_hf(folder)
    (folder / "config.json").write_text(json.dumps(raw))
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model.safetensors' is missing"):
        checkpoint.import_hf(folder)
    with pytest.raises(ParamTreeMismatchError, match=r"params do not fit .* missing \['head"):
        checkpoint.llama_to_hf(
            {k: v for k, v in _params(config).items() if k != "head.weight"}, config
        )
