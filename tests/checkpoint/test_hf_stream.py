"""Reading each rank's shards of a Hugging Face folder equals the full import, bitwise."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import d9d
from d9d import checkpoint
from d9d.errors import ConfigError, ParamShapeError, ParamTreeMismatchError
from d9d.models import Llama, LlamaConfig, MoE, MoEConfig
from d9d.moe import MoEConfig as LayerConfig
from d9d.testing import peak_rss_growth, run_on_ranks

transformers = pytest.importorskip("transformers")

# vocab 97 and 5 experts split unevenly over 2 ranks (49 | 48 rows, 3 | 2 experts).
LLAMA = LlamaConfig.tiny(vocab_size=97, n_layers=1)
QWEN3_MOE = MoEConfig.tiny(
    vocab_size=97,
    n_layers=2,
    qk_norm=True,
    head_dim=8,
    moe=LayerConfig(dim=64, n_experts=5, top_k=2, expert_dim=24, norm_topk=True),
)


def _random(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=generator) for k, v in params.items()}


def _step(layout: str) -> Any:
    mesh = d9d.make_mesh("cpu", **{layout: 2})

    def body(params: Any, opt_state: Any, batch: Any) -> Any:
        return params, opt_state, {}

    if layout == "fsdp":
        return d9d.shard_params(mesh, "fsdp")(body)
    return d9d.tensor_parallel(mesh, sequence_parallel=False)(body)


def _mismatches(got: dict[str, DTensor], full: dict[str, torch.Tensor]) -> list[str]:
    """Params whose shard is not this rank's shard of ``full`` (bitwise, same placements)."""
    bad = []
    for path, shard in got.items():
        expected = distribute_tensor(full[path], shard.device_mesh, shard.placements)
        if not torch.equal(shard.to_local(), expected.to_local()):
            bad.append(path)
    return bad


def _place_meta(module_type: type, config: Any, layout: str) -> dict[str, DTensor]:
    with torch.device("meta"):
        model = d9d.functionalize(module_type(config))
    placed, _ = _step(layout).place(model.params, (), model=model)
    return placed


def _resave_indexed(folder: Path, out: Path) -> Path:
    """``folder``'s weights as two safetensors files and a ``model.safetensors.index.json``."""
    state = load_file(folder / "model.safetensors")
    keys = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    for name, part in halves.items():
        save_file({k: state[k] for k in part}, out / name, metadata={"format": "pt"})
    weight_map = {k: name for name, part in halves.items() for k in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


@pytest.mark.parametrize("indexed", [False, True], ids=["one-file", "indexed"])
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_llama_shards_equal_the_full_import(tmp_path: Path, layout: str, indexed: bool) -> None:
    folder = checkpoint.export_hf(
        _random(d9d.functionalize(Llama(LLAMA)).params), LLAMA, tmp_path / "hf"
    )
    if indexed:
        folder = _resave_indexed(folder, tmp_path / "indexed")
    _, full = checkpoint.import_hf(folder)

    def rank() -> list[str]:
        config = checkpoint.read_hf_config(folder)
        _, got = checkpoint.import_hf(folder, target=_place_meta(Llama, config, layout))
        assert got.keys() == full.keys()
        return _mismatches(got, full)

    assert run_on_ranks(rank, 2) == [[], []]


def _merged_experts(folder: Path, config: MoEConfig) -> None:
    """Rewrite ``folder`` with ``transformers``' merged experts (``gate_up_proj [E, 2I, H]``)."""
    state = load_file(folder / "model.safetensors")
    n = config.moe.n_experts
    for i in range(config.n_dense_layers, config.n_layers):
        prefix = f"model.layers.{i}.mlp.experts"
        stack = {
            name: torch.stack([state.pop(f"{prefix}.{e}.{name}.weight") for e in range(n)])
            for name in ("gate_proj", "up_proj", "down_proj")
        }
        state[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], 1)
        state[f"{prefix}.down_proj"] = stack["down_proj"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("merged", [False, True], ids=["per-expert", "merged"])
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_moe_shards_equal_the_full_import(tmp_path: Path, layout: str, merged: bool) -> None:
    params = _random(d9d.functionalize(MoE(QWEN3_MOE)).params)
    folder = checkpoint.export_hf_moe(params, QWEN3_MOE, tmp_path)
    if merged:
        _merged_experts(folder, QWEN3_MOE)
    _, full = checkpoint.import_hf_moe(folder)

    def rank() -> list[str]:
        config = checkpoint.read_hf_config(folder)
        _, got = checkpoint.import_hf_moe(folder, target=_place_meta(MoE, config, layout))
        assert got.keys() == full.keys()
        return _mismatches(got, full)

    assert run_on_ranks(rank, 2) == [[], []]


@pytest.mark.parametrize("merged", [False, True], ids=["per-expert", "merged"])
def test_experts_sharded_across_their_transposed_dims(tmp_path: Path, merged: bool) -> None:
    params = _random(d9d.functionalize(MoE(QWEN3_MOE)).params)
    folder = checkpoint.export_hf_moe(params, QWEN3_MOE, tmp_path)
    if merged:
        _merged_experts(folder, QWEN3_MOE)
    _, full = checkpoint.import_hf_moe(folder)
    experts = {
        f"layers.1.mlp.experts.{n}": d for n, d in (("w_gate", 1), ("w_up", 2), ("w_down", 1))
    }

    def rank() -> list[str]:
        mesh = d9d.make_mesh("cpu", fsdp=2)
        target = {
            path: checkpoint.Abstract(tuple(full[path].shape), torch.float32, mesh, (Shard(dim),))
            for path, dim in experts.items()
        }
        _, got = checkpoint.import_hf_moe(folder, target=target)
        return _mismatches(got, full)

    assert run_on_ranks(rank, 2) == [[], []]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_functionalized_hf_model_shards_equal_its_state_dict(
    tmp_path: Path, layout: str, tied: bool
) -> None:
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(tmp_path)
    full = {k: v.detach() for k, v in hf.state_dict().items()}

    def rank() -> list[str]:
        with torch.device("meta"):
            model = d9d.functionalize(transformers.LlamaForCausalLM(config))
        placed, _ = _step(layout).place(model.params, (), model=model)
        got = checkpoint.load_hf_weights(tmp_path, placed, tied=model.tied)
        assert got.keys() == model.params.keys()
        return _mismatches(got, full)

    assert run_on_ranks(rank, 2) == [[], []]


QWEN3_MOE_HF = dict(
    vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=5,
    num_experts_per_tok=2, head_dim=8,
)  # fmt: skip


@pytest.mark.parametrize("layout", ["fsdp", "tp", "gate|up over 3 ranks"])
def test_merged_experts_read_from_per_expert_weights(tmp_path: Path, layout: str) -> None:
    config = transformers.Qwen3MoeConfig(**QWEN3_MOE_HF)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(config)
    hf.save_pretrained(tmp_path)  # per expert: experts.<e>.gate_proj.weight, ...
    full = {k: v.detach() for k, v in hf.state_dict().items()}
    merged = "model.layers.0.mlp.experts.gate_up_proj"

    def rank() -> list[str]:
        with torch.device("meta"):
            model = d9d.functionalize(transformers.Qwen3MoeForCausalLM(config))
        if layout == "gate|up over 3 ranks":  # rows 0-10 | 11-21 | 22-31: 16 is gate|up
            mesh = d9d.make_mesh("cpu", fsdp=3)
            target = {merged: checkpoint.Abstract((5, 32, 32), torch.float32, mesh, (Shard(1),))}
        else:
            target, _ = _step(layout).place(model.params, (), model=model)
        partial = layout == "gate|up over 3 ranks"  # one param of the folder's
        got = checkpoint.load_hf_weights(tmp_path, target, tied=model.tied, partial=partial)
        return _mismatches(got, full)

    world = 3 if layout == "gate|up over 3 ranks" else 2
    assert run_on_ranks(rank, world) == [[]] * world


DEEPSEEK_V3_HF = dict(
    vocab_size=97, hidden_size=24, intermediate_size=40, moe_intermediate_size=10,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=12,
    kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
    experts_implementation="eager",
)  # fmt: skip
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _deepseek_v3_folder(folder: Path) -> Any:
    """A DeepSeek-V3 whose routing bias (a persistent buffer, which ``save_pretrained``
    writes) steers every token to experts 1 and 0 of group 0, saved to ``folder``."""
    config = transformers.DeepseekV3Config(**DEEPSEEK_V3_HF)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        hf.get_buffer(BIAS).copy_(torch.tensor([0.0, 3.0, 0.0, -3.0]))
    hf.save_pretrained(folder)
    return hf


def test_a_stored_tensor_no_target_leaf_reads_is_named(tmp_path: Path) -> None:
    """A stored tensor no target leaf reads was dropped: DeepSeek-V3's routing bias, loaded
    into a target of the params, left the bias of a fresh module (zeros) and logits 0.012
    off at a peak of 0.33, with no error; a Qwen2 folder's biases, read into a Llama."""
    hf = _deepseek_v3_folder(tmp_path / "deepseek")
    with torch.device("meta"):
        model = d9d.functionalize(transformers.DeepseekV3ForCausalLM(hf.config))
    with pytest.raises(ParamTreeMismatchError, match=rf"\['{BIAS}'\].*read by no leaf"):
        checkpoint.load_hf_weights(tmp_path / "deepseek", model.params, tied=model.tied)

    llama = dict(
        vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**llama)).save_pretrained(
        tmp_path / "qwen2"
    )
    with torch.device("meta"):
        model = d9d.functionalize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)))
    with pytest.raises(ParamTreeMismatchError, match=r"self_attn.k_proj.bias"):
        checkpoint.load_hf_weights(tmp_path / "qwen2", model.params, tied=model.tied)
    part = {"model.norm.weight": model.params["model.norm.weight"]}
    got = checkpoint.load_hf_weights(tmp_path / "qwen2", part, partial=True)
    assert got["model.norm.weight"].shape == (24,)


def test_a_folder_of_renamed_weights_names_what_it_lacks_first(tmp_path: Path) -> None:
    """Mixtral's folders rename the experts (``block_sparse_moe.experts.<e>.w1``), which
    ``load_hf_weights`` does not map: the params it lacks are named, not the renamed
    tensors as if a buffer or a pipeline stage's were left over (``partial=True``)."""
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=24, intermediate_size=10, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = d9d.functionalize(transformers.MixtralForCausalLM(config))
    with pytest.raises(ParamTreeMismatchError, match=r"lacks weights.*mlp.experts.down_proj"):
        checkpoint.load_hf_weights(tmp_path, model.params, tied=model.tied)


def test_a_persistent_buffer_in_the_target_is_read(tmp_path: Path) -> None:
    """With the model's persistent buffers in the target, the loaded model computes the
    saved one's logits."""
    hf = _deepseek_v3_folder(tmp_path)
    with torch.device("meta"):
        skeleton = d9d.functionalize(transformers.DeepseekV3ForCausalLM(hf.config))
    persistent = [k for k in skeleton.module.state_dict() if k in skeleton.buffers]
    assert persistent == [BIAS]
    target = {**skeleton.params, **{k: skeleton.buffers[k] for k in persistent}}
    loaded = checkpoint.load_hf_weights(tmp_path, target, tied=skeleton.tied)
    model = d9d.functionalize(transformers.DeepseekV3ForCausalLM(hf.config))
    for k in persistent:
        model.buffers[k].copy_(loaded[k])
    params = {k: loaded[k] for k in model.params}
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.apply(params, tokens).logits, hf(tokens).logits)


def test_a_plain_target_reads_whole_tensors_in_its_dtype(tmp_path: Path) -> None:
    params = _random(d9d.functionalize(Llama(LLAMA)).params)
    folder = checkpoint.export_hf(params, LLAMA, tmp_path)
    target = {"norm.weight": checkpoint.Abstract((64,), torch.float64)}
    _, got = checkpoint.import_hf(folder, target=target)
    assert torch.equal(got["norm.weight"], params["norm.weight"].double())


def test_a_missing_stored_tensor_is_named(tmp_path: Path) -> None:
    folder = checkpoint.export_hf(_random(d9d.functionalize(Llama(LLAMA)).params), LLAMA, tmp_path)
    state = load_file(folder / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, folder / "model.safetensors")
    target = {"norm.weight": checkpoint.Abstract((64,), torch.float32)}
    with pytest.raises(ParamTreeMismatchError, match=r"stored tensors \['model.norm.weight'\]"):
        checkpoint.import_hf(folder, target=target)


@pytest.mark.parametrize("size", [63, 65])
def test_a_stored_shape_that_does_not_fit_is_named(tmp_path: Path, size: int) -> None:
    folder = checkpoint.export_hf(_random(d9d.functionalize(Llama(LLAMA)).params), LLAMA, tmp_path)
    target = {"norm.weight": checkpoint.Abstract((size,), torch.float32)}
    with pytest.raises(ParamShapeError, match=rf"'norm.weight' of shape \({size},\) needs stored"):
        checkpoint.import_hf(folder, target=target)


def test_a_python_value_in_the_target_is_refused(tmp_path: Path) -> None:
    folder = checkpoint.export_hf(_random(d9d.functionalize(Llama(LLAMA)).params), LLAMA, tmp_path)
    with pytest.raises(TypeError, match=r"Target leaves \['norm.weight'\] are Python values"):
        checkpoint.import_hf(folder, target={"norm.weight": 1.0})


def test_an_unknown_param_is_named(tmp_path: Path) -> None:
    folder = checkpoint.export_hf(_random(d9d.functionalize(Llama(LLAMA)).params), LLAMA, tmp_path)
    target = {"extra.weight": checkpoint.Abstract((3,), torch.float32)}
    with pytest.raises(ParamTreeMismatchError, match=r"target params \['extra.weight'\]"):
        checkpoint.import_hf(folder, target=target)


def _extra_stored_tensor(folder: Path, key: str) -> None:
    state = load_file(folder / "model.safetensors")
    state[key] = torch.zeros(3)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "target"])
@pytest.mark.parametrize(
    ("model", "key"),
    [
        ("llama", "model.layers.0.self_attn.q_proj.bias"),
        ("moe", "model.layers.1.self_attn.q_proj.bias"),
        ("moe", "model.layers.1.mlp.shared_expert.gate_proj.weight"),
        ("moe", "model.layers.1.mlp.experts.5.gate_proj.weight"),  # the config has 5 experts
        ("moe", "model.layers.2.input_layernorm.weight"),  # and 2 layers
    ],
)
def test_a_stored_tensor_the_model_does_not_convert_is_named(
    tmp_path: Path, model: str, key: str, whole: bool
) -> None:
    """Both imports, whole and into a target holding one param, refuse a stored tensor that
    no param of the model reads instead of dropping it."""
    if model == "llama":
        params = _random(d9d.functionalize(Llama(LLAMA)).params)
        folder, read = checkpoint.export_hf(params, LLAMA, tmp_path), checkpoint.import_hf
    else:
        params = _random(d9d.functionalize(MoE(QWEN3_MOE)).params)
        folder, read = (
            checkpoint.export_hf_moe(params, QWEN3_MOE, tmp_path),
            checkpoint.import_hf_moe,
        )
    _extra_stored_tensor(folder, key)
    target = None if whole else {"norm.weight": checkpoint.Abstract((64,), torch.float32)}
    with pytest.raises(ParamTreeMismatchError, match=re.escape(key)):
        read(folder, target=target)


def test_a_tied_moe_head_that_differs_from_the_embedding_is_named(tmp_path: Path) -> None:
    config = dataclasses.replace(QWEN3_MOE, tie_embeddings=True)
    folder = checkpoint.export_hf_moe(
        _random(d9d.functionalize(MoE(config)).params), config, tmp_path
    )
    _extra_stored_tensor(folder, "lm_head.weight")
    with pytest.raises(ParamTreeMismatchError, match=r"lm_head.weight differs from"):
        checkpoint.import_hf_moe(folder)


def test_read_hf_config_names_an_unknown_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"model_type='gpt2'.*load_hf_weights"):
        checkpoint.read_hf_config(tmp_path)


def _fsdp_load(folder: Path, streamed: bool) -> tuple[int, int]:
    """Peak RSS growth of this rank while it places the Llama at ``folder`` on ``fsdp=2``,
    and the bytes of the local shards it ends up holding."""
    mesh = d9d.make_mesh("cpu", fsdp=2)
    step = d9d.shard_params(mesh, "fsdp")(lambda params, opt_state, batch: (params, opt_state))

    def load() -> dict[str, DTensor]:
        config = checkpoint.read_hf_config(folder)
        model = d9d.functionalize(Llama(config, device="meta"))
        if streamed:
            target, _ = step.place(model.params, (), model=model)
            return checkpoint.import_hf(folder, target=target)[1]
        return step.place(checkpoint.import_hf(folder)[1], (), model=model)[0]

    step.place(d9d.functionalize(Llama(LLAMA, device="meta")).params, ())  # imports, warmed
    placed, grown = peak_rss_growth(load)
    local = [p.to_local() for p in placed.values()]
    return grown, sum(t.numel() * t.element_size() for t in local)


def test_each_rank_peak_memory_is_its_shard_not_the_model(tmp_path: Path) -> None:
    config = LlamaConfig.tiny(vocab_size=16000, dim=1024, n_layers=4, n_heads=8, ffn_dim=2816)
    shapes = {k: v.shape for k, v in Llama(config, device="meta").named_parameters()}
    generator = torch.Generator().manual_seed(0)
    params = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    model_bytes = sum(p.numel() * 4 for p in params.values())  # 311 MB
    checkpoint.export_hf(params, config, tmp_path)
    del params
    streamed = run_on_ranks(_fsdp_load, 2, tmp_path, True, method="fork")
    full = run_on_ranks(_fsdp_load, 2, tmp_path, False, method="fork")
    # The measure sees what a rank holds: at least the shards it returns (about half the model).
    assert all(shard <= grown < 0.75 * model_bytes for grown, shard in streamed), streamed
    # The full import holds the whole model (measured 1.01x to 1.10x); 0.9x leaves room for
    # the page cache the kernel may reclaim from a loaded machine's mapped file pages.
    assert all(grown >= 0.9 * model_bytes for grown, _ in full), (full, model_bytes)


def test_tensors_transformers_skips_on_load_are_not_refused(tmp_path: Path) -> None:
    """A folder may hold tensors ``transformers`` itself skips when loading its model (its
    class's ``_keys_to_ignore_on_load_unexpected``: old GPT-2 checkpoints' ``attn.bias``
    masks, DeepSeek-V3's multi-token-prediction layer 61): refusing them refused the real
    folders; any other leftover is still named."""

    config = transformers.GPT2Config(vocab_size=97, n_embd=24, n_layer=1, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)  # as old checkpoints hold
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with torch.device("meta"):
        model = d9d.functionalize(transformers.GPT2LMHeadModel(config))
    got = checkpoint.load_hf_weights(tmp_path, model.params, tied=model.tied)
    assert torch.equal(
        got["transformer.h.0.attn.c_attn.weight"], weights["transformer.h.0.attn.c_attn.weight"]
    )
    weights["transformer.h.0.mlp.extra"] = torch.ones(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ParamTreeMismatchError, match=r"\['transformer.h.0.mlp.extra'\]"):
        checkpoint.load_hf_weights(tmp_path, model.params, tied=model.tied)
