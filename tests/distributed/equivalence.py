"""The equivalence harness: a transformed step on N ranks against the same step on one device.

Every rank trains ``steps`` AdamW steps with global-norm clipping on its data-parallel shard
of the same global batches; the reference trains on the whole batches on one device. Ranks
return their losses and their params gathered whole (``full_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import d9d
from d9d.testing import assert_trees_all_close, run_on_ranks

STEPS = 5


def optimizer(kind: str = "adamw") -> d9d.optim.GradientTransformation:
    """AdamW with a schedule, or SGD with momentum; both after global-norm clipping. AdamW may
    run on float64 master copies of the params (``"adamw_master"``)."""
    match kind:
        case "adamw":
            inner = d9d.optim.adamw(
                d9d.optim.warmup_cosine(1e-2, 1, 10, init_value=1e-3), weight_decay=0.1
            )
        case "sgd":
            inner = d9d.optim.sgd(0.5, momentum=0.9, weight_decay=0.1)
        case "adamw_master":  # float64 masters of narrower params (d9d.optim.master_weights)
            return d9d.optim.master_weights(optimizer("adamw"), torch.float64)
        case _:
            raise ValueError(f"unknown optimizer {kind!r}")
    return d9d.optim.chain(d9d.optim.clip_by_global_norm(0.5), inner)


def batches(
    vocab: int, *, global_batch: int = 8, seq_len: int = 16, steps: int = STEPS
) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def _logits(model: d9d.Model, params: Any, tokens: torch.Tensor) -> torch.Tensor:
    out = model.apply(params, tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def train_step(model: d9d.Model, opt: Any) -> Callable[..., Any]:
    def loss_fn(params: Any, batch: dict) -> torch.Tensor:
        return d9d.losses.cross_entropy(_logits(model, params, batch["tokens"]), batch["labels"])

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, Any]:
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return d9d.optim.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def reference(build_model: Callable[[], d9d.Model], data: list[dict], *, opt: str = "adamw"):
    """Losses and final params of the step on one device."""
    model, opt = build_model(), optimizer(opt)
    step = train_step(model, opt)
    params, state = d9d.tree.map(torch.clone, model.params), opt.init(model.params)
    losses = []
    for batch in data:
        params, state, metrics = step(params, state, batch)
        losses.append(metrics["loss"])
    return torch.stack(losses), params


def _rank(build_model, make_transforms, mesh_axes, data, jit, opt):
    mesh = d9d.make_mesh("cpu", **mesh_axes)
    model, opt = build_model(), optimizer(opt)
    step = train_step(model, opt)
    for transform in make_transforms(mesh):
        step = transform(step)
    if jit:
        step = d9d.jit(step, backend=jit if isinstance(jit, str) else "inductor")
    params, state = step.place(model.params, opt.init(model.params), model=model)
    losses = []
    for batch in data:
        params, state, metrics = step(params, state, step.shard_batch(batch))
        losses.append(metrics["loss"])
    if jit:  # one graph for all steps: no recompile (ranks are threads: no fail_on_recompile)
        assert step.traces == 1, f"{step.traces} graphs compiled"
    return torch.stack(losses), {k: v.full_tensor() for k, v in params.items()}


def run(
    build_model,
    make_transforms,
    mesh_axes: dict[str, int],
    data,
    *,
    jit: bool | str = False,
    opt: str = "adamw",
    method: str = "thread",
):
    """Per-rank ``(losses, full params)`` of the transformed step (``method="fork"`` for
    pipelines: the threaded group has no point-to-point ops)."""
    world = math.prod(mesh_axes.values())
    return run_on_ranks(
        _rank,
        world,
        build_model,
        make_transforms,
        mesh_axes,
        data,
        jit,
        opt,
        method=method,
        timeout=600,
    )


def assert_equivalent(
    build_model,
    make_transforms,
    mesh_axes: dict[str, int],
    data,
    expected: tuple[torch.Tensor, Any],
    *,
    dtype: torch.dtype,
    jit: bool | str = False,
    opt: str = "adamw",
    params_too: bool = True,
    tol: dict[str, float] | None = None,
    method: str = "thread",
) -> None:
    """Every rank's losses (and final params) equal ``expected`` from :func:`reference`, at
    ``tol`` (default: rel 1e-9 in float64, rel 1e-5 in float32)."""
    ref_losses, ref_params = expected
    if tol is None:
        f64 = dtype == torch.float64
        tol = {"rtol": 1e-9, "atol": 1e-12} if f64 else {"rtol": 1e-5, "atol": 1e-7}
    ranks = run(build_model, make_transforms, mesh_axes, data, jit=jit, opt=opt, method=method)
    for losses, params in ranks:
        assert losses.shape == (len(data),)
        torch.testing.assert_close(losses, ref_losses, **tol)
        if params_too:  # under pipeline each rank holds its stages' params only
            assert_trees_all_close(params, {k: ref_params[k] for k in params}, **tol)
    assert set().union(*(params for _, params in ranks)) == set(ref_params)


def llama(
    dtype: torch.dtype = torch.float32, n_layers: int = 2, **config: Any
) -> Callable[[], d9d.Model]:
    """The tiny d9d Llama; ``config`` overrides its fields (``n_heads=8``)."""

    def build() -> d9d.Model:
        from d9d.models import Llama, LlamaConfig

        return d9d.functionalize(Llama(LlamaConfig.tiny(n_layers=n_layers, **config)).to(dtype))

    return build


_HF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"tie_word_embeddings": False}),
    # pad_token_id=0 (Gemma's default) and a pad row in the second vocab shard (issue 12.1)
    "qwen2-pad0": ("Qwen2", {"pad_token_id": 0, "tie_word_embeddings": False}),
    "qwen2-pad96": ("Qwen2", {"pad_token_id": 96, "tie_word_embeddings": True}),
    "gemma": ("Gemma", {"head_dim": 8}),
    # scaling query_pre_attn_scalar**-0.5 = 1/16, not head_dim**-0.5; sliding layers (4096)
    "gemma2-nocap": ("Gemma2", {"head_dim": 8, "attn_logit_softcapping": None}),
    "gpt2": ("GPT2", {"bos_token_id": 96, "eos_token_id": 96}),
}


def hf_model(
    family: str = "llama", dtype: torch.dtype = torch.float32, n_layers: int = 2
) -> Callable[[], d9d.Model]:
    """A small ``transformers`` causal LM of ``family`` (a key of ``_HF_CONFIGS``), built once
    here and copied for each rank (ranks may be threads sharing the global RNG, so none of
    them draws from it). Vocab 97 is an uneven shard over 2 ranks."""
    import copy

    import transformers

    name, extra = _HF_CONFIGS[family]
    if name == "GPT2":
        config = transformers.GPT2Config(
            vocab_size=97,
            n_embd=48,
            n_layer=n_layers,
            n_head=6,
            n_positions=64,
            embd_pdrop=0.0,  # dropout would differ between ranks and the reference
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            **extra,
        )
    else:
        config = getattr(transformers, f"{name}Config")(
            vocab_size=97,
            hidden_size=48,
            intermediate_size=100,
            num_hidden_layers=n_layers,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **extra,
        )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = getattr(
            transformers, f"{name}LMHeadModel" if name == "GPT2" else f"{name}ForCausalLM"
        )(config).to(dtype)

    def build() -> d9d.Model:  # logical axes from d9d.hf, chosen by the model's family
        return d9d.functionalize(copy.deepcopy(module))

    return build


def hf_llama(dtype: torch.dtype = torch.float32, n_layers: int = 2) -> Callable[[], d9d.Model]:
    """A small ``transformers.LlamaForCausalLM`` (see :func:`hf_model`)."""
    return hf_model("llama", dtype, n_layers)
