"""``context_parallel`` refuses by name what ring attention cannot split in a Hugging Face
model (``d9d/transforms/context_parallel/_hf_refusals.py``): layers that mix positions outside
attention (a module, or a layer type), a mask the attention module builds itself, a chunk
shorter than the sequence, an attention argument it does not implement, each found by the
family sweep as a ``wrong`` cell (other numbers, no error) before; and a padding mask,
positions or labels given to the model. Sliding windows shorter than the sequence are
computed, the config's where the module passes none (PhiMoE). The tiny configs are the sweep's. A plain family still
equals one device: ``SAMPLE`` in ``sweep.py`` (Cwm, whose layers are full and sliding
attention)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from equivalence import assert_equivalent, reference
from hf_families import data
from sweep import tiny_config
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: F401

import d9d
from d9d.errors import PlanError, RankFailedError
from d9d.testing import run_on_ranks
from d9d.transforms.context_parallel._hf_refusals import attention_window, check_attention_call

pytestmark = pytest.mark.distributed


def _build(model_type: str, **overrides: Any) -> Callable[[], d9d.Model]:
    import transformers

    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).double()
    return lambda: d9d.functionalize(copy.deepcopy(module))


def _cp_forward(make: Callable[[], d9d.Model]) -> None:
    model = make()
    step = d9d.context_parallel(d9d.make_mesh("cpu", cp=2))(
        lambda p, s, b: (p, s, {"logits": model.apply(p, b["tokens"]).logits})
    )
    params, state = step.place(model.params, (), model=model)
    step(params, state, data(1)[0])


def test_a_layer_holding_a_causal_conv1d_is_refused_by_path_and_class() -> None:
    """Jamba's Mamba mixer: a causal conv1d and a selective scan over the sequence."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: model\.layers\.0\.mamba \(JambaMambaMixer\) mixes positions outside "
        r"attention: it holds model\.layers\.0\.mamba\.conv1d \(Conv1d\)",
    ):
        run_on_ranks(_cp_forward, 2, _build("jamba"))


def test_a_layer_type_other_than_attention_is_refused() -> None:
    """MiniMax's lightning attention (a linear attention with no convolution; its second
    layer in the tiny config) is named by its config's layer_types only."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: model\.layers\.1 \(MiniMaxDecoderLayer\) is a 'linear_attention' "
        r"layer \(config\.layer_types\[1\]\)",
    ):
        run_on_ranks(_cp_forward, 2, _build("minimax"))


def test_a_sparse_attention_layer_is_refused_for_its_top_k_indexer() -> None:
    """DeepSeek-V3.2's indexed attention: each query's keys are chosen among all positions."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: model\.layers\.0 \(DeepseekV32DecoderLayer\) is a 'indexed_attention' "
        r"layer \(config\.layer_types\[0\]\), which picks each query's top-k keys among all the "
        r"sequence's positions .* passes attention that choice as a mask",
    ):
        run_on_ranks(_cp_forward, 2, _build("deepseek_v32"))


def test_an_attention_mask_the_module_builds_is_refused() -> None:
    """Doge's dynamic mask, computed from the values of every key."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: DogeAttention passes attention a mask of its own \(shape ",
    ):
        run_on_ranks(_cp_forward, 2, _build("doge"))


def test_a_block_whose_attention_is_its_own_code_is_refused() -> None:
    """OpenAI GPT's attention (GPT-Neo's, XGLM's too) is its own code, which never reads
    config._attn_implementation, so switching it to "d9d_ring" left each rank attending
    over its own slice of the sequence, with no error: the sweep's 3 AdamW steps at cp=2 gave
    losses 4.57310, 4.66796, 4.54237 for one device's 4.57334, 4.66798, 4.54044, and params
    up to rel 0.61 off."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: transformer\.h\.0 \(Block\) ran without calling attention through "
        r"transformers' attention interface, .* its attention is its own code",
    ):
        run_on_ranks(_cp_forward, 2, _build("openai-gpt"))


def test_a_block_failing_before_it_calls_attention_is_named() -> None:
    """Falcon's attention is its own code: for an attention implementation other than its
    few, it adds the mask transformers builds, None for "d9d_ring", and raised a TypeError
    deep in transformers that named neither the block nor context_parallel."""
    import transformers

    config = transformers.FalconConfig(
        vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = transformers.FalconForCausalLM(config).double()
    with pytest.raises(
        RankFailedError,
        match=r"(?s)TypeError: unsupported operand.*context_parallel: transformer\.h\.0 "
        r"\(FalconDecoderLayer\) raised this before calling attention through transformers' "
        r"attention interface.*train this model without context_parallel",
    ):
        run_on_ranks(_cp_forward, 2, lambda: d9d.functionalize(copy.deepcopy(module)))


# How a rank's step passes the model a padding mask, positions or labels, and what the
# refusal says.
_GIVEN = {
    "attention_mask": r"attention_mask \(shape \(4, 8\)\).* padding mask would be dropped",
    "labels": r"labels \(shape \(4, 8\)\).* scored against the wrong next token",
    "position_ids": r"position_ids \(shape \(4, 8\)\).* masks attention between the documents",
    "mask positionally": r"attention_mask \(shape \(4, 8\)\), which context_parallel",
}


@pytest.mark.parametrize("given", list(_GIVEN))
def test_a_padding_mask_positions_or_labels_given_to_the_model_are_refused(given: str) -> None:
    """transformers drops a 2-d padding mask for the "d9d_ring" attention, masks attention
    between the packed documents that position_ids show on one device only (left padding and
    two packed documents each gave other losses than one device, with no error), and its own
    loss shifts the labels within the rank's slice of each sequence."""
    make = _build("llama")

    def rank() -> None:
        model = make()
        tokens = data(1)[0]["tokens"]
        mask = torch.ones_like(tokens)
        mask[:, :3] = 0  # left padding
        packed = torch.cat([torch.arange(3), torch.arange(5)]).expand(tokens.shape[0], -1)
        args, kwargs = {
            "attention_mask": ((), {"attention_mask": mask}),
            "labels": ((), {"labels": tokens}),
            "position_ids": ((), {"position_ids": packed}),
            "mask positionally": ((mask,), {}),
        }[given]
        step = d9d.context_parallel(d9d.make_mesh("cpu", cp=2))(
            lambda p, s, b: (p, s, {"x": model.apply(p, b, *args, **kwargs).logits.sum()})
        )
        params, state = step.place(model.params, (), model=model)
        step(params, state, tokens)

    with pytest.raises(
        RankFailedError, match=r"PlanError: LlamaForCausalLM was given " + _GIVEN[given]
    ):
        run_on_ranks(rank, 2)


def test_an_attention_chunk_shorter_than_the_sequence_is_refused() -> None:
    """Llama 4's chunked attention, chunks of 4 over sequences of 8 (its default, 8192, spans
    the sequence and changes nothing)."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: the model has 'chunked_attention' layers over 4 positions "
        r"\(config\.attention_chunk_size=4\), shorter than the sequence \(8\)",
    ):
        run_on_ranks(_cp_forward, 2, _build("llama4_text", attention_chunk_size=4))


def _equals_one_device(make: Callable[[], d9d.Model]) -> None:
    """3 AdamW steps at cp=2 (zigzag) in float64: losses and params equal one device's."""
    batches = data()
    assert_equivalent(
        make,
        lambda mesh: [d9d.context_parallel(mesh)],
        {"cp": 2},
        batches,
        reference(make, batches),
        dtype=torch.float64,
    )


@pytest.mark.parametrize(
    ("model_type", "window"),
    [("phimoe", 3), ("mistral", 3), ("gpt_oss", 5)],
)
def test_a_sliding_window_shorter_than_the_sequence_is_computed(model_type: str, window: int):
    """Windows over sequences of 8 (zigzag chunks of 2): PhiMoE builds its mask from
    config.sliding_window and passes attention no sliding_window= (ring attention ran over the
    whole sequence before, with no error: 2 steps lost 4.60409, 4.56147 for one device's
    4.60530, 4.55672, params up to rel 1.0 off), so the config's is used; Mistral passes it;
    GPT-OSS's first layer is sliding (with sinks), its second full (config.layer_types)."""
    _equals_one_device(_build(model_type, sliding_window=window))


def test_a_dynamic_rope_past_max_position_embeddings_is_refused() -> None:
    """transformers rescales a "dynamic" RoPE by the largest position id of the call, which on
    a cp rank is its part's, not the sequence's: a Llama with max_position_embeddings=8 on
    sequences of 16, 2 AdamW steps at cp=2 in float64, lost 4.568417, 4.538961 for one
    device's 4.568399, 4.538964, params up to rel 1.6e-2 off, no error. Within
    max_position_embeddings the frequencies stay the configured ones and cp runs."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: the model's RoPE is 'dynamic' \(config\.rope_parameters\), which "
        r"rescales its frequencies .* the sequence \(8\) exceeds "
        r"config\.max_position_embeddings=4",
    ):
        run_on_ranks(
            _cp_forward, 2, _build("llama", rope_parameters=dynamic, max_position_embeddings=4)
        )
    run_on_ranks(
        _cp_forward, 2, _build("llama", rope_parameters=dynamic, max_position_embeddings=8)
    )


def test_attention_dropout_in_training_is_refused_by_module() -> None:
    """A module in training mode passes its attention dropout; ring attention has none."""
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: LlamaAttention drops out attention probabilities in training "
        r"\(dropout=0\.1\), .* attention dropout at 0",
    ) as failed:
        run_on_ranks(_cp_forward, 2, _build("llama", attention_dropout=0.1))
    # It did call the attention interface: no note says its attention may be its own code.
    assert "before calling attention" not in str(failed.value)


def test_an_alibi_model_is_refused_for_taking_no_positions() -> None:
    """Bloom's ALiBi biases come from the tokens a call is given, a rank's slice under cp."""
    import transformers

    config = transformers.BloomConfig(vocab_size=97, hidden_size=48, n_layer=2, n_head=6)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = transformers.BloomForCausalLM(config).double()
    with pytest.raises(
        RankFailedError,
        match=r"PlanError: .* neither positions= nor position_ids= \(an ALiBi model, as Bloom",
    ):
        run_on_ranks(_cp_forward, 2, lambda: d9d.functionalize(copy.deepcopy(module)))


def test_an_attention_argument_ring_attention_does_not_implement_is_refused() -> None:
    """Inkling's relative position bias, say; inert arguments pass."""
    module = torch.nn.Identity()
    check_attention_call(module, None, {"position_ids": torch.arange(4), "use_cache": False})
    with pytest.raises(
        PlanError, match=r"Identity passes attention \['position_bias'\], which context_parallel"
    ):
        check_attention_call(module, None, {"position_bias": torch.zeros(4), "use_cache": False})


def test_a_bidirectional_sliding_window_is_refused_by_the_call() -> None:
    """transformers' bidirectional window (``|q - k| <= window``) is another mask than the
    causal one ring attention computes; refused before any exchange of the ring."""
    from d9d.transforms.context_parallel._split import SequenceSplit

    split = SequenceSplit("unused", "cp", rank=0, size=2, load_balance="zigzag")
    q = k = v = torch.zeros(1, 2, 4, 8)
    with pytest.raises(
        PlanError,
        match=r"bidirectional sliding window of 7 positions, shorter than the sequence \(8\)",
    ):
        split.attention(q, k, v, causal=False, window=7)


class _Attention(torch.nn.Module):
    """An attention module of a model file that builds sliding masks (this one imports
    transformers' create_sliding_window_causal_mask)."""

    def __init__(self, layer_idx: int | None, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = SimpleNamespace(**config)
        if layer_idx is not None:
            self.layer_idx = layer_idx


def test_the_window_of_a_call_is_the_one_its_layer_mask_is_built_with() -> None:
    """config.sliding_window on the layer's 'sliding_attention' (or every layer, without
    layer_types); one that spans the sequence is none; a window passed that disagrees with
    the config's for the layer, or in a model file that builds no sliding mask, is refused."""
    types = ["sliding_attention", "full_attention"]

    def window(given: int | None, layer_idx: int | None = 0, **config: Any) -> int | None:
        return attention_window(_Attention(layer_idx, config), given, 8)

    assert window(None, sliding_window=4) == 4
    assert window(4, sliding_window=4, layer_types=types) == 4
    assert window(None, 1, sliding_window=4, layer_types=types) is None
    assert window(4, None, sliding_window=4, layer_types=types) == 4
    assert window(8, sliding_window=8) is None
    with pytest.raises(PlanError, match=r"layer 1\) passes attention sliding_window=4, but "):
        window(4, 1, sliding_window=4, layer_types=types)
    with pytest.raises(PlanError, match=r"sliding_window=3, but transformers builds .* with 4"):
        window(3, sliding_window=4)
    with pytest.raises(PlanError, match=r"sliding_window=5, but transformers builds .* with None"):
        window(5, sliding_window=None)
    with pytest.raises(PlanError, match=r"_Attention has no layer_idx, so context_parallel"):
        window(None, None, sliding_window=4, layer_types=types)
    moshi = torch.nn.Identity()  # a model file without sliding masks (Moshi's window: its cache)
    moshi.config = SimpleNamespace(sliding_window=4)
    with pytest.raises(PlanError, match=r"builds no mask with transformers' create_sliding_"):
        attention_window(moshi, None, 8)
