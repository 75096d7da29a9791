"""``context_parallel`` (alone, with ``tensor_parallel`` and with ``shard_params``) against the
same step on one device; its traffic and errors."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from equivalence import assert_equivalent, batches, hf_llama, hf_model, llama, reference, train_step

import d9d
from d9d.errors import RankFailedError
from d9d.testing import run_on_ranks

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh)]),
    "cp=2 contiguous": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh, load_balance=None)]),
    "cp=4": ({"cp": 4}, lambda mesh: [d9d.context_parallel(mesh)]),
    "cp=2 x tp=2": (
        {"cp": 2, "tp": 2},
        lambda mesh: [d9d.tensor_parallel(mesh), d9d.context_parallel(mesh)],
    ),
    "fsdp=2 x cp=2": (
        {"fsdp": 2, "cp": 2},
        lambda mesh: [d9d.context_parallel(mesh), d9d.shard_params(mesh, "fsdp")],
    ),
}


@functools.cache
def _reference(model: str, dtype: torch.dtype, n_layers: int, opt: str):
    build = (hf_llama if model == "hf" else llama)(dtype, n_layers)
    return reference(build, batches(97 if model == "hf" else 256), opt=opt)


def _check(
    model: str,
    layout: str,
    dtype: torch.dtype,
    *,
    jit: bool | str = False,
    n_layers: int = 2,
    opt: str = "adamw",
    params_too: bool = True,
) -> None:
    mesh_axes, transforms = LAYOUTS[layout]
    assert_equivalent(
        (hf_llama if model == "hf" else llama)(dtype, n_layers),
        transforms,
        mesh_axes,
        batches(97 if model == "hf" else 256),
        _reference(model, dtype, n_layers, opt),
        dtype=dtype,
        jit=jit,
        opt=opt,
        params_too=params_too,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eager_equals_one_device(layout: str) -> None:
    _check("d9d", layout, torch.float64)


def test_hf_llama_equals_one_device() -> None:
    """Positions go in as position_ids; attention runs as the "d9d_ring" implementation."""
    _check("hf", "cp=2", torch.float64)


def test_hf_llama_under_pipeline_equals_one_device() -> None:
    """pp=2 x cp=2: each stage's blocks are checked to call ring attention (a block whose
    attention is its own code is refused), the other stage's stand-ins are not."""
    build, data = hf_llama(torch.float64), batches(97, steps=2)

    def transforms(mesh):
        return [d9d.context_parallel(mesh), d9d.pipeline(mesh, microbatches=2)]

    expected = reference(build, data)
    assert_equivalent(
        build,
        transforms,
        {"pp": 2, "cp": 2},
        data,
        expected,
        dtype=torch.float64,
        params_too=False,
        method="fork",
    )


def test_fp32_losses_and_sgd_params_equal_one_device() -> None:
    _check("d9d", "cp=2", torch.float32, params_too=False)
    _check("d9d", "cp=2", torch.float32, opt="sgd")


def test_sdpa_block_attention_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring attention's blocks on the fused CPU SDPA kernel (forced through the registry)."""
    from d9d.kernels import _registry
    from d9d.parallel import BlockAttention

    backends = _registry._OPS["block_attention"].backends
    sdpa, calls = backends["sdpa"].impl, []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa.forward(*args, **kwargs)

    counted_backend = dataclasses.replace(
        backends["sdpa"], impl=BlockAttention("sdpa", counted, sdpa.backward)
    )
    monkeypatch.setitem(backends, "sdpa", counted_backend)
    monkeypatch.setenv("D9D_KERNELS", "block_attention=sdpa")
    _check("d9d", "cp=2", torch.float64)
    assert calls


def test_unevenly_ignored_labels_give_the_token_weighted_mean() -> None:
    """The last quarter of every sequence is padding (-100): under zigzag cp=2 rank 0 holds
    all of it, so the ranks' valid counts differ; losses and params still equal one
    device's, whose mean is over all valid tokens."""
    data = batches(256)
    for batch in data:
        batch["labels"] = batch["labels"].clone()  # a view of the tokens
        batch["labels"][:, -batch["labels"].shape[1] // 4 :] = -100
    build = llama(torch.float64)
    assert_equivalent(
        build,
        LAYOUTS["cp=2"][1],
        {"cp": 2},
        data,
        reference(build, data),
        dtype=torch.float64,
    )


@pytest.mark.compile
def test_jit_equals_one_device() -> None:
    _check("d9d", "cp=2", torch.float64, jit=True, n_layers=1)


@pytest.mark.compile
@pytest.mark.parametrize("layout", ["cp=4", "cp=2 x tp=2", "fsdp=2 x cp=2"])
def test_jit_captures_the_wider_layouts_as_one_graph(layout: str) -> None:
    """The captured forward+backward graph on eager kernels (``backend="aot_eager"``): the
    capture is what these layouts add over cp=2; inductor's code generation for it is
    tested above, and per layout would cost 2-3 min of CI each on two cores."""
    _check("d9d", layout, torch.float64, jit="aot_eager", n_layers=1)


@pytest.mark.compile
def test_hf_jit_captures_one_graph() -> None:
    """A Hugging Face model's "d9d_ring" attention is registered, and its layers checked,
    when the step is placed, before the compile: registering it inside the first traced call
    compiled a second graph."""
    build, data = hf_llama(torch.float64, 1), batches(97, steps=2)
    mesh_axes, transforms = LAYOUTS["cp=2"]
    expected = reference(build, data)
    assert_equivalent(
        build, transforms, mesh_axes, data, expected, dtype=torch.float64, jit="aot_eager"
    )


def test_ring_exchanges_and_grad_reduction_are_the_analytic_bytes() -> None:
    """Per attention layer: cp - 1 K/V exchanges forward; backward cp - 1 exchanges of
    K, V, dK, dV and one of dK, dV. Grads are all-reduced over cp once each, and the loss,
    and the loss's count of valid tokens (int64)."""

    def rank():
        mesh = d9d.make_mesh("cpu", cp=2)
        model, opt = llama(torch.float64)(), d9d.optim.adamw(1e-3)
        step = d9d.context_parallel(mesh)(train_step(model, opt))
        params, state = step.place(model.params, opt.init(model.params), axes=model.axes)
        return (
            step.comms(params, state, batches(256)[0]),
            sum(p.numel() * 8 for p in model.params.values()),
            len(model.params),
        )

    layers, cp, batch, kv_heads, local, head_dim, item = 2, 2, 8, 2, 8, 16, 8
    kv = batch * kv_heads * local * head_dim * item
    for stats, param_bytes, n_params in run_on_ranks(rank, 2):
        assert stats.count[("all_to_all", "cp")] == layers * (2 * cp - 1)
        per_layer = (cp - 1) * 2 * kv + (cp - 1) * 4 * kv + 2 * kv
        assert stats.bytes[("all_to_all", "cp")] == layers * per_layer
        assert stats.count[("all_reduce", "cp")] == n_params + 2
        assert stats.bytes[("all_reduce", "cp")] == param_bytes + 8 + 8
        assert set(stats.count) == {("all_to_all", "cp"), ("all_reduce", "cp")}


def test_a_sequence_that_does_not_split_is_named() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", cp=2)
        model = llama()()
        step = d9d.context_parallel(mesh)(train_step(model, d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, (), axes=model.axes)
        step(params, state, batches(256, seq_len=14)[0])

    with pytest.raises(
        RankFailedError,
        match=r"IndivisibleError: batch leaf 'labels' \(8, 14\): its sequence length 14 .*"
        r"multiple of 4",
    ):
        run_on_ranks(rank, 2)


def test_a_sequence_whose_part_does_not_split_over_tp_names_the_length_to_use() -> None:
    """cp=2 (contiguous) x tp=2 on sequences of 6: each cp rank holds 3 positions, which
    sequence parallelism cannot split over 2 tp ranks. The error asked for "a sequence length
    divisible by 2", which 6 is; it now says what the rank holds and asks for a multiple of 4."""

    def rank():
        mesh = d9d.make_mesh("cpu", cp=2, tp=2)
        model = llama()()
        step = train_step(model, d9d.optim.sgd(0.1))
        step = d9d.context_parallel(mesh, load_balance=None)(d9d.tensor_parallel(mesh)(step))
        params, state = step.place(model.params, (), axes=model.axes)
        step(params, state, batches(256, seq_len=6)[0])

    with pytest.raises(
        RankFailedError,
        match=r"IndivisibleError: .*activations \(8, 3, 64\) \(this rank's 3 positions of "
        r"sequences of 6, which context parallelism splits 2 ways\) over 2 'tp' ranks; use a "
        r"sequence length divisible by 4 that context parallelism also splits",
    ):
        run_on_ranks(rank, 4)


def test_a_sequence_longer_than_max_seq_len_is_refused_as_on_one_device() -> None:
    """Each rank's slice (8 tokens) fits max_seq_len=8, the sequence (16) does not: cp=2 took
    it, one device refuses it."""

    def rank():
        mesh = d9d.make_mesh("cpu", cp=2)
        model = llama(max_seq_len=8)()
        step = d9d.context_parallel(mesh)(train_step(model, d9d.optim.sgd(0.1)))
        params, state = step.place(model.params, (), axes=model.axes)
        step(params, state, batches(256)[0])

    with pytest.raises(RankFailedError, match=r"Sequence length 16 exceeds max_seq_len=8"):
        run_on_ranks(rank, 2)


def test_positions_the_step_body_passes_are_kept_by_keyword_or_position() -> None:
    """The step adds the rank's positions only where the call gives none: given positionally
    too (it added them as a keyword beside, a TypeError)."""
    build = llama(torch.float64)

    def rank():
        mesh = d9d.make_mesh("cpu", cp=2)
        model = build()
        own = d9d.parallel.positions_for(mesh.get_local_rank("cp"), 2, 16)

        outs = []

        def body(params, state, batch):
            outs.append(model.apply(params, batch["tokens"]))
            outs.append(model.apply(params, batch["tokens"], own))
            outs.append(model.apply(params, batch["tokens"], positions=own))
            return params, state, {}

        step = d9d.context_parallel(mesh)(body)
        params, state = step.place(model.params, (), model=model)
        step(params, state, batches(256)[0])
        return outs

    for outs in run_on_ranks(rank, 2):
        assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_a_model_without_positions_is_named() -> None:
    def rank():
        mesh = d9d.make_mesh("cpu", cp=2)
        model = d9d.functionalize(torch.nn.Sequential(torch.nn.Embedding(8, 4)))
        step = d9d.context_parallel(mesh)(lambda p, s, b: (p, s, {"x": model.apply(p, b).sum()}))
        params, state = step.place(model.params, ())
        step(params, state, torch.zeros(2, 8, dtype=torch.long))

    with pytest.raises(RankFailedError, match=r"neither positions= nor position_ids="):
        run_on_ranks(rank, 2)


@pytest.mark.parametrize("family", ["qwen2-pad0", "gemma", "gpt2", "gemma2-nocap"])
def test_hf_families_equal_one_device(family: str) -> None:
    """``pad_token_id`` set (Qwen2 with q/k/v biases; Gemma, tied, whose norms sum weight
    grads in float32: rel 1e-5), GPT-2 (``Conv1D``, learned positions, tied head) and Gemma2
    without soft-capping: the ``scaling`` its attention passes (1/16, from
    ``query_pre_attn_scalar``) reaches ring attention (dropped, its losses were rel 2e-4 off)
    and its sliding layers, whose window spans the sequence, run. Gemma2's params only
    losses: its float32 norms round by the split's shapes, which 5 AdamW steps make up to rel
    2e-2 on params near 0 (params rel 2e-15 after 2 steps with those casts kept float64,
    ``float64_islands`` in ``tests/hf/sweep.py``, by hand)."""
    build, data = hf_model(family, torch.float64), batches(97)
    tol = {"rtol": 1e-5, "atol": 1e-8} if family.startswith("gemma") else None
    mesh_axes, transforms = LAYOUTS["cp=2"]
    expected = reference(build, data)
    assert_equivalent(
        build,
        transforms,
        mesh_axes,
        data,
        expected,
        dtype=torch.float64,
        tol=tol,
        params_too=family != "gemma2-nocap",
    )
