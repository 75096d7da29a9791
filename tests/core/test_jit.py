"""``d9d.jit``: the compiled step equals the eager step, donates, and does not recompile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import d9d
from d9d.cli._train_step import make_train_step
from d9d.core._jit import _shared_patch
from d9d.core._step import TransformedStep
from d9d.errors import DonatedTreeError, IndexRangeError, ParamShapeError, RecompileError
from d9d.models import Llama, LlamaConfig
from d9d.testing import assert_trees_all_close

pytestmark = pytest.mark.compile


def _setup(dtype: torch.dtype = torch.float32, n_layers: int = 2):
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=n_layers)).to(dtype))
    opt = d9d.optim.chain(
        d9d.optim.clip_by_global_norm(1.0),
        d9d.optim.adamw(d9d.optim.warmup_cosine(1e-2, 2, 10), weight_decay=0.1, mask=r"weight$"),
    )
    step = make_train_step(model, opt)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        tokens = torch.randint(0, 256, (4, 33), generator=g)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return model, opt, step, batches


def _clone(tree_):
    return d9d.tree.map(torch.clone, tree_)


@pytest.mark.usefixtures("math_attention")
def test_jit_step_equals_eager_for_five_steps_without_recompiling() -> None:
    """float64: in float32, AdamW turns the rounding differences of the compiled grads into
    param differences of 1.5e-6 (rel 5e-5) after five steps, while eager float32 itself is
    3.8e-6 away from float64: no float32 tolerance tells a bug from rounding there."""
    model, opt, step, batches = _setup(torch.float64)
    params, state = _clone(model.params), opt.init(model.params)
    jparams, jstate = _clone(model.params), opt.init(model.params)
    jitted = d9d.jit(step, fail_on_recompile=True)
    eager_losses, jit_losses = [], []
    for batch in batches[:5]:
        params, state, metrics = step(params, state, batch)
        eager_losses.append(metrics["loss"])
        jparams, jstate, jmetrics = jitted(jparams, jstate, batch)
        jit_losses.append(jmetrics["loss"])
    tol = {"rtol": 1e-9, "atol": 1e-12}
    torch.testing.assert_close(torch.stack(jit_losses), torch.stack(eager_losses), **tol)
    assert_trees_all_close(jparams, params, **tol)
    assert_trees_all_close(jstate, state, **tol)
    assert jitted.traces == 1 and jitted.calls == 5

    first_buffer = jparams["embed.weight"].data_ptr()
    old = jparams
    jparams, jstate, _ = jitted(jparams, jstate, batches[5])
    assert jparams["embed.weight"].data_ptr() == first_buffer, (
        "donated params must be updated in place"
    )
    with pytest.raises(DonatedTreeError, match=r"argument 0 leaf '.*' was donated to call 6"):
        jitted(old, jstate, batches[5])
    short = {k: v[:, :16] for k, v in batches[0].items()}
    with pytest.raises(RecompileError, match=r"(?s)would be traced again on call 7.*size mismatch"):
        jitted(jparams, jstate, short)


def test_aot_eager_backend_runs_the_captured_step_on_eager_kernels() -> None:
    model, opt, step, batches = _setup()
    params, state = _clone(model.params), opt.init(model.params)
    jparams, jstate = _clone(model.params), opt.init(model.params)
    compile_with = d9d.jit(backend="aot_eager")
    jitted = compile_with(step)
    for batch in batches[:2]:
        params, state, metrics = step(params, state, batch)
        jparams, jstate, jmetrics = jitted(jparams, jstate, batch)
        torch.testing.assert_close(jmetrics["loss"], metrics["loss"], rtol=1e-6, atol=0)
    assert_trees_all_close(jparams, params, rtol=1e-5, atol=1e-7)
    assert jitted.traces == 1
    assert compile_with(step).traces == 0, "one set of options builds several jitted steps"


def test_traces_count_graphs_not_a_compile_restarted_for_a_float_input() -> None:
    """A float input seen with a second value is traced as a symbolic float, which AOT cannot
    turn into a tensor here (``math.floor``): the compile restarts with it specialized, the
    graph of the second value. Two graphs, not three traces."""

    @d9d.jit(donate=(), backend="aot_eager", dynamic=None)
    def step(params, opt_state, batch):
        scale = batch["scale"]
        return params, opt_state, {"y": torch.tensor(scale) * batch["x"] + math.floor(scale)}

    for scale in (3.0, 4.0):
        assert (
            step({}, {}, {"x": torch.ones(2), "scale": scale})[2]["y"].tolist() == [2 * scale] * 2
        )
    assert step.traces == 2


def test_mode_needs_the_inductor_backend() -> None:
    with pytest.raises(
        ValueError,
        match=r"mode='max-autotune' is an inductor option but "
        r"backend='aot_eager'",
    ):
        d9d.jit(lambda p, s, b: (p, s, b), mode="max-autotune", backend="aot_eager")


def test_param_of_wrong_shape_stops_the_trace_with_its_path() -> None:
    """The model's check runs while Dynamo traces, so the error comes before any compile."""
    model, opt, step, batches = _setup()
    params = {**_clone(model.params), "layers.1.mlp.w_up.weight": torch.zeros(176, 65)}
    jitted = d9d.jit(step)
    with pytest.raises(
        ParamShapeError,
        match=r"param 'layers\.1\.mlp\.w_up\.weight' has shape \(176, 65\) but the model's is "
        r"\(176, 64\)",
    ):
        jitted(params, opt.init(params), batches[0])
    assert jitted.traces == 0


def test_out_of_range_ids_raise_naming_the_input_and_leave_donated_params_untouched() -> None:
    """Inductor's own bounds check aborts the process (exit 134); the guard raises first.
    One block: the guarded lookups are the embedding's and the loss's."""
    model, opt, step, batches = _setup(n_layers=1)
    params, state = _clone(model.params), opt.init(model.params)
    jitted = d9d.jit(step)
    bad_tokens, bad_labels, ignored = (_clone(batches[0]) for _ in range(3))  # same strides
    bad_tokens["tokens"][1, 5] = 256
    with pytest.raises(
        IndexRangeError,
        match=r"batch\['tokens'\], the index of an embedding over 256 entries, holds 256 at "
        r"position \(1, 5\), outside \[0, 256\); check the data against the model",
    ):
        jitted(params, state, bad_tokens)
    bad_labels["labels"][0, 2] = -1
    with pytest.raises(IndexRangeError, match=r"batch\['labels'\], the index of a gather .* -1"):
        jitted(params, state, bad_labels)
    assert_trees_all_close(params, model.params, rtol=0, atol=0)
    ignored["labels"][0, 2] = -100  # the ignore index is not looked up
    _, _, metrics = jitted(params, state, ignored)
    assert torch.isfinite(metrics["loss"]) and jitted.traces == 1


def test_out_of_range_ids_of_a_hugging_face_model_are_named_under_any_backend() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = d9d.functionalize(transformers.LlamaForCausalLM(config))

    @d9d.jit(backend="aot_eager", donate=())
    def step(params, opt_state, batch):
        logits = model.apply(params, batch["tokens"]).logits
        return params, opt_state, {"loss": d9d.losses.cross_entropy(logits, batch["labels"])}

    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone()}
    batch["tokens"][0, 7] = 97
    with pytest.raises(
        IndexRangeError,
        match=r"batch\['tokens'\], the index of an embedding over 97 entries, holds 97 at "
        r"position \(0, 7\)",
    ):
        step(model.params, (), batch)


def test_a_graph_break_in_the_loss_leaves_the_step_exact() -> None:
    """A loss that breaks the graph (a ``print`` or ``.item()`` in real code) makes Dynamo run
    ``value_and_grad``'s frames eagerly on values its trace made; a tree structure it made
    could not unflatten there (optree raised ``length mismatch`` or ``unhashable type``),
    so none crosses the break."""
    params = {"w": torch.randn(4, 3), "layer": {"b": torch.randn(3), "scales": (torch.ones(3),)}}
    opt = d9d.optim.sgd(0.1)

    def loss_fn(p, x):
        y = (x @ p["w"] + p["layer"]["b"]) * p["layer"]["scales"][0]
        torch._dynamo.graph_break()
        return y.square().mean()

    def step(params, opt_state, x):
        loss, grads = d9d.value_and_grad(loss_fn)(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    want = step(_clone(params), opt.init(params), x)
    got = d9d.jit(step, backend="aot_eager")(_clone(params), opt.init(params), x)
    assert_trees_all_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2]["loss"], want[2]["loss"], rtol=1e-6, atol=0)


@pytest.mark.usefixtures("math_attention")
def test_jitted_grads_equal_eager_grads_of_one_block_in_float64() -> None:
    """The graph in which torch 2.11's CPU fusion read the logits' grad before the scatter of
    the cross entropy's backward had written it (every grad wrong, by up to 100%), before
    ``jit`` had inductor scatter in its own kernels."""
    torch.manual_seed(0)
    model = d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=1)).to(torch.float64))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(model.apply(params, batch["tokens"]), batch["labels"])

    def step(params, opt_state, batch):
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        return grads, opt_state, {"loss": loss}

    want = step(model.params, (), batch)
    got = d9d.jit(step, donate=())(model.params, (), batch)
    assert_trees_all_close(got[0], want[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[2]["loss"], want[2]["loss"], rtol=1e-12, atol=0)


def test_options_stay_set_until_the_last_of_concurrent_calls_leaves() -> None:
    """Ranks as threads share torch's config: a rank leaving its call must not unset the
    options another rank still traces with (it broke its graph and hung in a collective)."""
    config, name = torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"
    before = getattr(config, name)
    first = _shared_patch(config, {name: not before})
    second = _shared_patch(config, {name: not before})
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert getattr(config, name) is (not before)
    second.__exit__(None, None, None)
    assert getattr(config, name) is before
    with (
        _shared_patch(config, {name: True}),
        pytest.raises(
            RuntimeError,
            match=rf"two jitted calls running at once \(ranks as threads\) need .*\.{name} = True "
            "and False",
        ),
    ):
        _shared_patch(config, {name: False}).__enter__()
    assert getattr(config, name) is before
    # An unknown option fails the call and leaves no hold behind: the next call sets freely.
    with pytest.raises(AttributeError), _shared_patch(config, {name: True, "no_such": 1}):
        pass
    with _shared_patch(config, {name: False}):
        assert getattr(config, name) is False
    assert getattr(config, name) is before


def _sgd_step(params, opt_state, x):
    """Each param's grad differs (its loss is weighted by its position), so two params that
    share a buffer get different new values."""

    def loss_fn(p, x):
        return sum((i + 1) * (x[: len(v)] * v).sum() for i, v in enumerate(p.values()))

    loss, grads = d9d.value_and_grad(loss_fn)(params, x)
    return d9d.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt_state, {"loss": loss}


def test_donated_leaves_that_share_memory_are_refused_by_name() -> None:
    """Each donated leaf is overwritten with its own new value: one tensor passed twice, or a
    view of another, came back holding the last value written for both (no error)."""
    w, x = torch.zeros(4, 3), torch.ones(4, 3)
    jitted = d9d.jit(_sgd_step, backend="aot_eager")
    for params, state, other in (
        ({"a": w, "b": w}, {}, "argument 0 leaf 'b'"),
        ({"a": w, "b": w[1:3]}, {}, "argument 0 leaf 'b'"),
        ({"a": w}, {"m": w[3]}, "argument 1 leaf 'm'"),
    ):
        with pytest.raises(
            DonatedTreeError,
            match=rf"argument 0 leaf 'a' and {other} share memory .* pass separate tensors",
        ):
            jitted(params, state, x)
    assert jitted.traces == 0 and not w.any()
    # Views of one buffer that do not overlap are updated each in its own place, as eagerly.
    want = _sgd_step({"a": w[:2].clone(), "b": w[2:].clone()}, {}, x)[0]
    got = jitted({"a": w[:2], "b": w[2:]}, {}, x)[0]
    assert_trees_all_close(got, want, rtol=0, atol=0)
    assert_trees_all_close(w, torch.cat([want["a"], want["b"]]), rtol=0, atol=0)
    # Without donation nothing is written in place, and a shared buffer is fine.
    got = d9d.jit(_sgd_step, donate=(), backend="aot_eager")({"a": w, "b": w}, {}, x)[0]
    assert_trees_all_close(got, _sgd_step({"a": w, "b": w}, {}, x)[0], rtol=0, atol=0)


def test_donated_leaves_on_one_memory_through_two_storages_are_refused_by_name() -> None:
    """Tensors of two numpy views of one array have storages of their own on one memory: the
    check compared storages, so ``a`` came back holding ``b``'s new values where they overlap
    (no error). An output on that memory is refused too."""
    array = np.zeros(6, dtype=np.float32)
    a, b = torch.from_numpy(array), torch.from_numpy(array[2:])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    jitted = d9d.jit(_sgd_step, backend="aot_eager")
    with pytest.raises(DonatedTreeError, match="argument 0 leaf 'a' and argument 0 leaf 'b' share"):
        jitted({"a": a, "b": b}, {}, torch.ones(6))
    assert not array.any()

    def step(params, opt_state, x):
        new, opt_state, metrics = _sgd_step(params, opt_state, x)
        return new, opt_state, {**metrics, "b": x}

    with pytest.raises(DonatedTreeError, match="output 2 leaf 'b' of the step shares memory"):
        d9d.jit(step, backend="aot_eager")({"a": a[:2].clone()}, {"m": a[3:]}, b)


def test_an_output_that_reads_a_donated_buffer_is_refused_by_name() -> None:
    """A metric that is a donated input (or a view of one) read the new value written into its
    buffer, where the eager step returns the old one."""
    x = torch.ones(4, 3)
    for metric in (lambda w: w, lambda w: w.detach()[0]):

        def step(params, opt_state, x, metric=metric):
            new, opt_state, metrics = _sgd_step(params, opt_state, x)
            return new, opt_state, {**metrics, "w": metric(params["w"])}

        jitted = d9d.jit(step, backend="aot_eager")
        params, state = {"w": torch.zeros(4, 3)}, {"m": torch.zeros(1)}
        with pytest.raises(
            DonatedTreeError,
            match=r"output 2 leaf 'w' of the step shares memory with argument 0 leaf 'w' .*"
            r"return a copy \(\.clone\(\)\)",
        ):
            jitted(params, state, x)
        with pytest.raises(DonatedTreeError, match="was donated to call 1"):
            jitted(params, state, x)  # it was written: not to be stepped again


def test_a_new_donated_leaf_that_is_another_donated_input_is_refused_by_name() -> None:
    """The donated leaves are overwritten one after the other: a step that kept the old params
    in its state (or swapped two params) copied a buffer already overwritten (no error: the
    state held the new params). Refused in the compiled graph, and where Dynamo runs the
    step eagerly (here: disabled), by the same check there."""

    def keep_old(params, opt_state, x):
        return {"w": params["w"] - x}, {"prev": params["w"].detach()}, {}

    def swap(params, opt_state, x):
        return {"a": params["b"], "b": params["a"]}, opt_state, {}

    x = torch.ones(3)
    swapped = {"a": torch.zeros(3), "b": torch.ones(3)}
    for step, params, state, match, eager in (
        (
            keep_old,
            {"w": torch.zeros(3)},
            {"prev": torch.ones(3)},
            r"opt_state\['prev'\], .*",
            False,
        ),
        (swap, swapped, {}, r"params\['a'\], .*", False),
        (swap, swapped, {}, r"argument 0 leaf 'a', .*", True),
    ):
        before = _clone((params, state))
        jitted = d9d.jit(step, backend="aot_eager")
        with (
            torch._dynamo.config.patch(disable=eager),
            pytest.raises(DonatedTreeError, match=rf"new value of {match}\.clone\(\)"),
        ):
            jitted(params, state, x)
        assert_trees_all_close((params, state), before, rtol=0, atol=0)

    # Leaves returned as they came are copied onto themselves, also views of one buffer.
    w = torch.arange(4.0)
    params, state = {"a": w[:1], "b": w[1:]}, {"n": torch.zeros(1)}
    got = d9d.jit(lambda p, s, x: (p, s, {"x": x.sum()}), backend="aot_eager")(params, state, x)
    assert_trees_all_close(got[0], {"a": w[:1], "b": w[1:]}, rtol=0, atol=0)
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0]

    # A new leaf that is another input returned as it came in its own place (a lookahead step
    # resetting the params to the snapshot its state keeps): that input is not overwritten.
    def reset(params, opt_state, x):
        return {"w": opt_state["slow"]}, opt_state, {}

    params, state = {"w": torch.ones(3)}, {"slow": torch.zeros(3)}
    eager = reset(_clone(params), _clone(state), x)
    got = d9d.jit(reset, backend="aot_eager")(params, state, x)
    assert_trees_all_close(got[:2], eager[:2], rtol=0, atol=0)


def test_a_refused_donated_tree_leaves_every_donated_buffer_as_it_was() -> None:
    """The params were written before the state's layout was checked: the call raised with the
    params already stepped (a second call stepped them twice)."""

    def step(params, opt_state, x):
        return {"w": params["w"] - x}, {"n": opt_state["n"] + 0.5}, {}  # int64 -> float32

    params, state = {"w": torch.zeros(3)}, {"n": torch.zeros((), dtype=torch.int64)}
    with pytest.raises(TypeError, match=r"argument 1 leaf 'n' is torch\.int64\[\] but the step"):
        d9d.jit(step, backend="aot_eager")(params, state, torch.ones(3))
    assert params["w"].tolist() == [0.0, 0.0, 0.0]


def test_a_donated_leaf_that_is_not_a_tensor_is_refused_by_name() -> None:
    def step(params, opt_state, x):
        return {"w": params["w"] - x}, {"count": opt_state["count"] + 1}, {}

    with pytest.raises(
        TypeError,
        match=r"argument 1 leaf 'count' is not a tensor but a int .* hold the value in a tensor",
    ):
        d9d.jit(step, backend="aot_eager")({"w": torch.zeros(3)}, {"count": 0}, torch.ones(3))


@pytest.mark.parametrize(
    ("old", "new", "found"),
    [
        ({"m": torch.zeros(1)}, {"m": torch.ones(1), "v": torch.ones(1)}, r"unexpected=\['v'\]"),
        ({"m": torch.zeros(1)}, {"m": (torch.ones(1), torch.ones(1))}, r"missing=\['m'\]"),
        ({"m": [torch.zeros(1)]}, {"m": (torch.ones(1),)}, r"its containers differ"),
        ({"m": torch.zeros(1)}, {"m": None}, r"missing=\['m'\]"),
    ],
)
def test_a_donated_tree_of_another_structure_is_refused_by_name(old, new, found) -> None:
    """The traced check (a ``tree.map``) refuses what the eager one does, containers too, so
    Dynamo runs the frame eagerly and the message names the paths; nothing is written."""

    def step(params, opt_state, x):
        return {"w": params["w"] - x}, new, {}

    params = {"w": torch.zeros(3)}
    with pytest.raises(TypeError, match=rf"argument 1 is not laid out like .*{found}"):
        d9d.jit(step, backend="aot_eager")(params, old, torch.ones(3))
    assert params["w"].tolist() == [0.0, 0.0, 0.0]


def test_a_donated_tree_returned_with_its_keys_in_another_order_compiles_as_one_graph() -> None:
    """What the eager check accepts the traced one accepts: a refusal there alone would run
    the step eagerly on every call (``fullgraph=True`` raises on it instead)."""

    def step(params, opt_state, x):
        state = {"v": opt_state["v"] + 1, "m": opt_state["m"] + x}  # given as m, v
        return {"w": params["w"] - x}, state, {}

    params, state = {"w": torch.zeros(3)}, {"m": torch.zeros(3), "v": torch.zeros(())}
    jitted = d9d.jit(step, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        params, state, _ = jitted(params, state, torch.ones(3))
    assert jitted.traces == 1
    assert params["w"].tolist() == [-2.0] * 3 and state["v"].item() == 2.0


def _donated_and_returned():
    """A params tree donated to a jitted call, and the tree that call returned."""
    params, state, x = {"w": torch.zeros(4, 3)}, {"m": torch.zeros(1)}, torch.ones(4, 3)
    new, _, _ = d9d.jit(_sgd_step, backend="aot_eager")(params, state, x)
    return params, new


def _use_in_jit_without_donation(params):
    return d9d.jit(_sgd_step, donate=(), backend="aot_eager")(params, {}, torch.ones(4, 3))


def _use_as_batch(params):
    step = d9d.jit(lambda p, s, x: (p, s, {"x": x["w"].sum()}), backend="aot_eager")
    return step({"v": torch.zeros(1)}, {}, params)


def _use_in_eager_step(params):
    return _sgd_step(params, {}, torch.ones(4, 3))


def _use_in_place(params):
    return TransformedStep(_sgd_step, ()).place(params, {})


def _use_in_checkpoint_save(params, directory):
    return d9d.checkpoint.save(directory, {"params": params}, step=0, async_=False)


@pytest.mark.parametrize(
    ("use", "name"),
    [
        (_use_in_jit_without_donation, "argument 0"),
        (_use_as_batch, "argument 2"),
        (_use_in_eager_step, "value_and_grad's params"),
        (_use_in_place, "params"),
        (_use_in_checkpoint_save, "the tree to save"),
    ],
)
def test_a_donated_tree_is_refused_wherever_d9d_reads_it(use, name, tmp_path) -> None:
    """A donated tree's buffers hold the jitted call's new values: a checkpoint of the old
    params saved step N+1's values as step N, and an eager step, another jitted step or a
    batch read them as if they were the old ones (no error; JAX raises on a deleted array).
    The returned tree, or a copy taken before the call, is read as usual."""
    args = (tmp_path,) if use is _use_in_checkpoint_save else ()
    params, new = _donated_and_returned()
    with pytest.raises(
        DonatedTreeError,
        match=rf"^{name} leaf '(w|params\.w|)' was donated to call 1 of a jitted step .* "
        r"use the tree that call returned",
    ):
        use(params, *args)
    use(new, *args)


def test_a_donated_tree_is_refused_by_an_eager_call_of_the_transformed_step() -> None:
    step = TransformedStep(lambda p, s, x: ({"w": p["w"] * x}, s, {}), ())
    params, state = step.place({"w": torch.ones(3)}, {"m": torch.zeros(1)})
    x = 2.0
    new, new_state, _ = d9d.jit(step, backend="aot_eager")(params, state, x)
    with pytest.raises(DonatedTreeError, match=r"^argument 0 leaf 'w' was donated to call 1"):
        step(params, new_state, x)
    assert step(new, new_state, x)[0]["w"].full_tensor().tolist() == [4.0, 4.0, 4.0]


def test_a_donated_tree_is_refused_by_model_apply() -> None:
    """An evaluation of the old params (``model.apply``) read the new values."""
    model = d9d.functionalize(torch.nn.Linear(3, 2))
    params = _clone(model.params)

    def step(params, opt_state, x):
        return d9d.tree.map(lambda p: p * 2, params), opt_state, {}

    new, _, _ = d9d.jit(step, backend="aot_eager")(params, {"m": torch.zeros(1)}, None)
    x = torch.ones(1, 3)
    with pytest.raises(DonatedTreeError, match=r"^params leaf 'bias' was donated to call 1"):
        model.apply(params, x)
    torch.testing.assert_close(model.apply(new, x), 2 * model.apply(model.params, x))
