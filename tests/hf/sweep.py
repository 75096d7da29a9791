"""The family sweep: every causal-LM family of the installed ``transformers`` whose config has a
tensor-parallel plan, tiny and in float64, under ``fsdp=2``, ``tp=2``, ``cp=2`` and ``pp=2``
against one device over 3 AdamW steps with uneven ignored labels (``hf_families.data``).

Each cell ends as one of: ``equal`` (at float64's rel 1e-9), ``equal~`` (at rel 1e-5: the
float32 rounding that ``transformers`` norms do, as Gemma's in ``test_hf_families.py``),
``refused`` (a ``PlanError`` naming the reason), ``wrong`` (no error, other numbers: a bug),
``crash`` (another error: a bug, or a family whose tiny config ``transformers`` cannot run) or
``unbuilt`` (no tiny config of this family builds; no layout ran). ``tp=2`` first runs with
sequence parallelism; refused for a module kept whole on tp, it reruns with
``sequence_parallel=False`` (``equal (no sp)``). An ``fsdp=2`` or ``pp=2`` cell that is not
equal to the whole batch's run is compared with one device fed the same two halves of each
batch (``transformers`` alone): equal to that, it is ``equal (split)`` (``equal~ (split)``),
as for families that compute in float32 inside a float64 model (:func:`_split_reference`).
A ``tp=2`` or ``cp=2`` cell that is ``wrong`` runs again, layout and one device both, with
``transformers``' float32 casts kept float64 (:func:`float64_islands`): equal at rel 1e-9
then, it is ``equal~ (f64)`` (the difference was float32 rounding, counted ``equal~``); if
not, once more so with SGD, ``equal~ (f64, sgd)`` if equal then (AdamW's ``lr / eps`` on
grads near 0: :func:`_float64_verdict`).

``python sweep.py --all`` (from ``tests/hf``) runs every cell and prints the table;
``--write-docs`` writes it into ``docs/huggingface.md`` between its markers; ``--merge``
takes the printed cells of earlier runs (a run cut short, a rerun of some cells) instead.
``test_hf_sweep.py`` runs the fixed sample :data:`SAMPLE` in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "distributed")]

from equivalence import optimizer, reference, run  # noqa: E402
from hf_families import data  # noqa: E402

import d9d  # noqa: E402
from d9d.errors import RankFailedError  # noqa: E402

LAYOUT_NAMES = ("fsdp=2", "tp=2", "cp=2", "pp=2")
_LAYOUTS: dict[str, tuple[dict[str, int], Callable[[Any], list]]] = {
    "fsdp=2": ({"fsdp": 2}, lambda mesh: [d9d.shard_params(mesh, "fsdp")]),
    "tp=2": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh)]),
    "tp=2 no sp": ({"tp": 2}, lambda mesh: [d9d.tensor_parallel(mesh, sequence_parallel=False)]),
    "cp=2": ({"cp": 2}, lambda mesh: [d9d.context_parallel(mesh)]),
    "pp=2": ({"pp": 2}, lambda mesh: [d9d.pipeline(mesh, microbatches=2)]),
    # Not in the table's columns: run with --layouts ep=2 (docs/huggingface.md, "Under
    # expert_parallel"); a dense family is refused as a model without routed experts.
    "ep=2": ({"ep": 2}, lambda mesh: [d9d.expert_parallel(mesh)]),
}

# Sizes every family gets where its config has the field: vocab 97 (an uneven shard over 2
# ranks), hidden 48, 2 layers, 6 query heads of 8 dims over 2 kv heads (latent attention:
# ranks 16 and 24, 4 + 4 q/k dims, 8 v dims), 4 experts of which 2 per token in one group, no dropout (its draws would differ between layouts); every config gets eager
# experts (torch's grouped mm takes no float64).
_SIZES: dict[str, Any] = {
    "vocab_size": 97,
    "hidden_size": 48,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "rotary_dim": 4,
    "attention_dropout": 0.0,
    "hidden_dropout": 0.0,
    "embd_pdrop": 0.0,
    "resid_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "dropout": 0.0,
}
# Sizes a family gets where its default leaves the field None but its model multiplies by it
# (Dots1's shared experts: `moe_intermediate_size * n_shared_experts`).
_UNSET_SIZES: dict[str, Any] = {"n_shared_experts": 1}
# Families whose default config cannot build a tiny model that runs in ``transformers`` for a
# reason no config field says, with what makes one run (each reason is the family's code).
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # layer_types defaults to None, and each layer reads config.layer_types[i]: "conv" or not.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # layer_types defaults to Mamba layers only, and its cache then has no attention layer.
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    # A sliding layer has twice num_key_value_heads: the query heads must divide by 4.
    "mimo_v2_flash": {"num_attention_heads": 8},
}
_MAX_PARAMS = 5_000_000
# Layouts whose ranks compute each batch as two halves of its rows (see _split_reference).
_SPLIT_LAYOUTS = ("fsdp=2", "pp=2", "ep=2")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")

SAMPLE: tuple[tuple[str, str, str, str], ...] = (
    # (family, layout, result, a part of the reason): one cell per path of d9d.hf it covers.
    ("granite", "tp=2", "equal", ""),  # rules from the plan alone
    ("starcoder2", "tp=2", "equal", ""),  # other names (c_fc, c_proj), biases
    ("phi", "tp=2", "equal", ""),  # a head with a bias: vocab-parallel too
    ("hunyuan_v1_dense", "tp=2", "equal", ""),  # FILL: the plan names the embedding only
    ("olmo2", "tp=2", "equal (no sp)", "no sp: module"),  # norms over all heads, gathered
    ("granitemoe", "tp=2", "equal", ""),  # a router named router, a position-wise block
    ("beam", "tp=2", "equal~ (f64)", "float32 casts kept float64"),  # gate_bias: colwise
    ("gpt_oss", "cp=2", "equal", ""),  # attention sinks (s_aux), merged after the ring
    ("cwm", "cp=2", "equal", ""),  # full and sliding layers: nothing cp refuses
    ("gpt_neox", "fsdp=2", "equal", ""),
    ("gptj", "pp=2", "equal", ""),
    ("apertus", "fsdp=2", "equal", ""),  # params of one row (xIELU's [1] scalars)
    ("llama4_text", "pp=2", "equal", ""),  # stand-ins read as their modules (weight.device)
    ("dory", "pp=2", "refused", "again after block"),  # looped blocks
    ("lfm3", "tp=2", "equal (no sp)", "no sp: module"),  # a short convolution kept whole
    ("minimax", "tp=2", "equal (no sp)", "no sp: module"),  # a mixer no rule names, whole
    ("dory", "tp=2", "equal~ (no sp)", "casts kept float64"),  # its table; a head's vocab scale
    ("deepseek_v32", "pp=2", "equal", ""),  # latent attention: as many kv heads as query heads
    ("cohere_compass_text", "tp=2", "equal~", ""),  # rope per layer type, none in its default
    ("gemma4_unified_text", "cp=2", "equal~ (f64, sgd)", "and SGD"),  # AdamW's lr/eps
    ("mimo_v2_flash", "tp=2", "equal (no sp)", "no sp: module"),  # _FAMILY_FIELDS; 2x kv on SWA
)
"""The cells CI runs (``test_hf_sweep.py``), as the full sweep of ``transformers`` 5.24 found
them: fixed, so CI runs the same cells every time; a later session rotates them by hand."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One family under one layout: ``result`` (see the module docstring) and why."""

    family: str
    layout: str
    result: str
    reason: str = ""
    seconds: float = 0.0


def families() -> list[str]:
    """Every causal-LM ``model_type`` of the installed ``transformers`` with a tp plan."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except (KeyError, ImportError, AttributeError):
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(model_type)
    return found


def tiny_config(model_type: str, *, derived: bool = False) -> Any:
    """The family's default config with :data:`_SIZES` where it has the field, token ids moved
    into the vocab, per-layer lists cut to 2 layers; ``derived`` also sizes an int field whose
    name joins a field of :data:`_SIZES` with a prefix or suffix (Gemma-4's
    ``vocab_size_per_layer_input``), for a family still over :data:`_MAX_PARAMS` without."""
    import transformers

    config_class = transformers.CONFIG_MAPPING[model_type]
    defaults = config_class()
    defaults.allow_global_per_layer_attribute_access = True  # to read, where fields vary per layer
    fields = {k: v for k, v in _SIZES.items() if hasattr(defaults, k)}
    fields |= {
        k: v
        for k, v in _UNSET_SIZES.items()
        if hasattr(defaults, k) and getattr(defaults, k) is None
    }
    for key in _TOKEN_IDS:
        value = getattr(defaults, key, None)
        if isinstance(value, int) and value >= _SIZES["vocab_size"]:
            fields[key] = _SIZES["vocab_size"] - 1
        elif isinstance(value, list):
            fields[key] = [v if v < _SIZES["vocab_size"] else 2 for v in value]
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # latent attention ropes these
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:  # it expands keys and
        fields["num_key_value_heads"] = fields["num_attention_heads"]  # values per query head
    for key, value in vars(defaults).items() if derived else ():
        size = next((s for s in _SIZES if re.search(rf"(^|_){s}(_|$)", key)), None)
        if isinstance(value, int) and size is not None and key != size:
            fields.setdefault(key, _SIZES[size])
    layers = _SIZES["num_hidden_layers"]
    for key, value in vars(defaults).items():  # random draws differ between layouts
        if isinstance(value, float) and re.search(r"dropout|jitter|pdrop", key):
            fields[key] = 0.0
        elif key == "layer_types" and isinstance(value, list) and value:
            fields[key] = (value * layers)[:layers]
    if getattr(defaults, "rope_parameters", None) == {} and "layer_types" in fields:
        # rope read per layer type, none given (Cohere-Compass's default cannot build)
        fields["rope_parameters"] = {
            t: {"rope_type": "default", "rope_theta": 1e4} for t in fields["layer_types"]
        }
    fields |= _FAMILY_FIELDS.get(model_type, {})
    try:
        return config_class(**fields, experts_implementation="eager")
    except Exception as error:  # huggingface_hub's StrictDataclassClassValidationError
        if "validat" not in type(error).__name__.lower():
            raise
        return config_class(**_validated(fields, defaults), experts_implementation="eager")


def _validated(fields: dict[str, Any], defaults: Any) -> dict[str, Any]:
    """``fields`` made consistent where the config class's own validator refused them: Mamba
    heads that tile ``mamba_expand * hidden_size`` (6 of 16 dims), and one layer of each of the
    first two layer types where the first two layers were of one (OLMo-Hybrid needs both)."""
    fields = dict(fields)
    if hasattr(defaults, "mamba_n_heads") and hasattr(defaults, "mamba_d_head"):
        inner = getattr(defaults, "mamba_expand", 2) * fields["hidden_size"]
        heads = fields["num_attention_heads"]
        fields |= {"mamba_n_heads": heads, "mamba_d_head": inner // heads}
    types = list(dict.fromkeys(getattr(defaults, "layer_types", None) or []))
    if len(types) > 1 and len(set(fields.get("layer_types", []))) == 1:
        fields["layer_types"] = (types * _SIZES["num_hidden_layers"])[: _SIZES["num_hidden_layers"]]
    return fields


@functools.cache
def _module(model_type: str) -> torch.nn.Module:
    import transformers

    config = tiny_config(model_type)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    size = _size(model_class, config)
    if size > _MAX_PARAMS:
        config = tiny_config(model_type, derived=True)
        size = _size(model_class, config)
    if size > _MAX_PARAMS:
        raise ValueError(f"the tiny config still has {size:,} params (> {_MAX_PARAMS:,})")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return model_class(config).to(torch.float64)


def _size(model_class: type, config: Any) -> int:
    with torch.device("meta"):  # sub-configs _SIZES does not reach (Phi-4-multimodal's
        return sum(p.numel() for p in model_class(config).parameters())  # encoders: 18 GB)


def build(model_type: str) -> Callable[[], d9d.Model]:
    """A builder of the family's tiny float64 model, functionalized with d9d.hf's rules."""
    module = _module(model_type)
    return lambda: d9d.functionalize(copy.deepcopy(module))


@functools.cache
def _reference(model_type: str):
    return reference(build(model_type), data())


@functools.cache
def _split_reference(model_type: str):
    """One device fed each batch as the two halves of its rows that ``fsdp=2`` ranks and
    ``pp=2``'s 2 microbatches compute (their losses weighed by valid tokens, grads summed),
    ``transformers`` alone: a family computing in float32 inside a float64 model (DeepSeek-V4's
    hyper-connections, Qwen3.5's gated delta rule) rounds by the batch's shape, so its grads
    from two halves differ from the whole batch's at rel ~1e-7, which AdamW turns into rel
    1e-2 or more on params whose grads are near 0 (measured: DeepSeek-V4, Qwen3.5, LaRA)."""
    model = build(model_type)()
    opt = optimizer()

    def loss_fn(params, batch):
        labels = batch["labels"]
        total = (labels != -100).sum()
        loss = 0.0
        for rows in (slice(0, len(labels) // 2), slice(len(labels) // 2, None)):
            logits = model.apply(params, batch["tokens"][rows]).logits
            count = (labels[rows] != -100).sum()
            loss = loss + d9d.losses.cross_entropy(logits, labels[rows]) * count / total
        return loss

    params, state = d9d.tree.map(torch.clone, model.params), opt.init(model.params)
    losses = []
    for batch in data():
        loss, grads = d9d.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = d9d.optim.apply_updates(params, updates)
        losses.append(loss)
    return torch.stack(losses), params


def run_cell(family: str, layout: str) -> Cell:
    """Run one cell (see the module docstring)."""
    start = time.perf_counter()
    try:
        make = build(family)
        expected = _reference(family)
    except Exception as error:
        return Cell(family, layout, "unbuilt", _first_line(error), time.perf_counter() - start)
    result, reason = _compare(make, layout, expected)
    if layout in _SPLIT_LAYOUTS and result in ("wrong", "equal~"):
        split_result, split_reason = _compare(make, layout, _split_reference(family))
        if split_result in ("equal", "equal~"):
            result = split_result + " (split)"
            reason = (
                f"{reason} against the whole batch; {split_reason or 'rel 1e-9'} against its halves"
            )
    if result == "wrong" and layout.startswith(("tp=", "cp=")):
        how = _float64_verdict(make, layout)
        if how:
            result, reason = f"equal~ ({how})", f"{reason}; rel 1e-9 with {_VERDICTS[how]}"
    if layout == "tp=2" and result == "refused" and "sequence_parallel=False" in reason:
        result, again = _compare(make, "tp=2 no sp", expected)
        reason = again if result not in ("equal", "equal~") else "no sp: " + reason
        if result == "wrong":
            how = _float64_verdict(make, "tp=2 no sp")
            if how:
                result, reason = "equal~", f"{reason}; rel 1e-9 with {_VERDICTS[how]}"
        if result in ("equal", "equal~"):
            result += " (no sp)"
    return Cell(family, layout, result, reason, time.perf_counter() - start)


_VERDICTS = {
    "f64": "float32 casts kept float64",
    "f64, sgd": "float32 casts kept float64 and SGD (AdamW's lr / eps on grads near 0)",
}


def _float64_verdict(make, layout: str) -> str | None:
    """How a ``wrong`` cell equals one device at rel 1e-9 when run again, layout and one
    device both: ``"f64"`` with :func:`float64_islands`; else ``"f64, sgd"`` so and with SGD
    in place of AdamW; else None. AdamW moves a param whose grad ``g`` is far below its
    ``eps`` (1e-8) by about ``lr * g / eps`` (1e6 g here), so float64 sums in another order
    (1e-17 on such a grad) move it by 1e-11, above the sweep's atol of 1e-12, where SGD moves
    it by ``lr * g``; a wrong grad shows under both (Gemma-4 at ``tp=2`` and ``cp=2``: params
    1e-11 apart after AdamW, 1e-13 after SGD)."""
    if _compare_float64(make, layout) == "equal":
        return "f64"
    if _compare_float64(make, layout, opt="sgd") == "equal":
        return "f64, sgd"
    return None


def _compare_float64(make, layout: str, opt: str = "adamw") -> str:
    """The result of ``layout`` against one device, both with :func:`float64_islands` and
    ``opt``; ``crash`` where one device cannot run so (NemotronH's MoE adds a float64 expert
    output into the float32 buffer it keeps)."""
    with float64_islands():
        try:
            expected = reference(make, data(), opt=opt)
        except Exception:
            return "crash"
        return _compare(make, layout, expected, fresh=True, opt=opt)[0]


def _compare(
    make, layout: str, expected, fresh: bool = False, opt: str = "adamw"
) -> tuple[str, str]:
    try:
        ranks = _ranks(make, layout, fresh, opt)
    except RankFailedError as error:
        text = str(error)
        found = re.search(r"PlanError: (.*)", text)
        if found:
            return "refused", found.group(1).strip()
        return "crash", _first_error(text)
    except Exception as error:
        return "crash", _first_line(error)
    ref_losses, ref_params = expected
    pairs = [
        pair
        for losses, params in ranks
        for pair in [(losses, ref_losses), *((v, ref_params[k]) for k, v in params.items())]
    ]
    if all(torch.allclose(got, want, rtol=1e-9, atol=1e-12) for got, want in pairs):
        return "equal", ""
    worst = max(
        float(((got - want).abs() / want.abs().clamp_min(1e-7)).max()) for got, want in pairs
    )
    if all(torch.allclose(got, want, rtol=1e-5, atol=1e-7) for got, want in pairs):
        return "equal~", f"rel {worst:.1e}"
    return "wrong", f"rel {worst:.1e}"


_RAN: dict[tuple[int, str, str], Any] = {}


def _ranks(make, layout: str, fresh: bool = False, opt: str = "adamw"):
    """The ranks' losses and params, run once per builder, layout and optimizer (a cell
    compared with the split reference too reuses its run); ``fresh`` runs them again."""
    key = (id(make), layout, opt)
    if fresh or key not in _RAN:
        mesh_axes, transforms = _LAYOUTS[layout]
        method = "fork" if "pp" in mesh_axes else "thread"
        _RAN.clear()
        _RAN[key] = (make, run(make, transforms, mesh_axes, data(), method=method, opt=opt))
    return _RAN[key][1]


@contextlib.contextmanager
def float64_islands() -> Iterator[None]:
    """Keep float64 tensors float64 where ``transformers`` casts them to float32 (norms'
    ``.to(torch.float32)``, ``.float()``, ``.type(torch.float32)``, ``softmax(dtype=
    torch.float32)``), for the length of the block. Beam and DeepSeek-V3 at ``tp=2`` differ from one device at rel
    1e-2 on params whose grads are near 0 (float64 sums in another order, rounded to float32
    in the next norm, then AdamW); with these casts kept float64 they equal it at rel 1e-12:
    a cell ``wrong`` as computed and equal so is ``equal~ (f64)``."""
    to, as_float, as_type = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type
    softmax = torch.nn.functional.softmax

    def wide(dtype: Any) -> Any:
        return torch.float64 if dtype is torch.float32 else dtype

    def to64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(wide(a) for a in args)
            kwargs = {k: wide(v) if k == "dtype" else v for k, v in kwargs.items()}
        return to(self, *args, **kwargs)

    def float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else as_float(self, *args, **kwargs)

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=wide(dtype) if x.dtype == torch.float64 else dtype)

    def type64(self, dtype=None, *args, **kwargs):  # NemotronH's router: .type(torch.float32)
        if dtype is None or self.dtype != torch.float64:
            return as_type(self, dtype, *args, **kwargs)
        return as_type(self, wide(dtype), *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to64, float64, type64
    torch.nn.functional.softmax = softmax64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, as_float, as_type
        torch.nn.functional.softmax = softmax


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"


def _first_error(text: str) -> str:
    found = re.search(r"rank \d+: (\w+(Error|Exception)[^\n]*)", text)
    return found.group(1) if found else text.strip().splitlines()[0]


def reason_group(reason: str) -> str:
    """A refusal's reason without its paths and values, to count refusals by reason."""
    text = re.sub(r" \(rules cover \[[^]]*\]\)", "", reason.split(";")[0])
    text = re.sub(r" \(shape \([^)]*\)\)", "", text)
    text = re.sub(r"'[\w-]+(\.[\w-]+)+'", "'…'", text)  # module and param paths
    return re.sub(r"\b\d+(\.\d+)?\b", "N", text)[:160]


def table(cells: list[Cell], refusals: bool = True) -> str:
    """The Markdown summary: a family count per layout and result, and (``refusals``) the
    refusals by reason."""
    by_layout: dict[str, Counter] = defaultdict(Counter)
    for cell in cells:
        by_layout[cell.layout][cell.result.split(" ")[0]] += 1
    results = ("equal", "equal~", "refused", "wrong", "crash", "unbuilt")
    lines = [
        "| layout | families | " + " | ".join(results) + " |",
        "|---" * (len(results) + 2) + "|",
    ]
    for layout in LAYOUT_NAMES:
        if layout in by_layout:
            counts = by_layout[layout]
            row = [layout, str(sum(counts.values()))] + [str(counts[r]) for r in results]
            lines.append("| " + " | ".join(row) + " |")
    reasons = Counter(
        (c.layout, reason_group(c.reason)) for c in cells if c.result.startswith("refused")
    )
    if refusals and reasons:
        lines += ["", "| layout | refusals | reason |", "|---|---|---|"]
        for (layout, reason), count in sorted(reasons.items(), key=lambda x: (x[0][0], -x[1])):
            lines.append(f"| {layout} | {count} | {reason.replace('|', '/')} |")
    return "\n".join(lines)


_BEGIN = "<!-- sweep table: begin (python sweep.py --all --write-docs, from tests/hf) -->"
_END = "<!-- sweep table: end -->"


def write_docs(cells: list[Cell], root: Path) -> None:
    """The table into ``docs/huggingface.md`` and its counts into ``README.md``, each between
    :data:`_BEGIN` and :data:`_END`."""
    for name, summary in (
        ("docs/huggingface.md", table(cells)),
        ("README.md", table(cells, False)),
    ):
        path = root / name
        text = path.read_text()
        start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
        path.write_text(text[:start] + "\n" + summary + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every family with a tp plan")
    parser.add_argument("--families", default="", help="comma-separated model types")
    parser.add_argument("--layouts", default=",".join(LAYOUT_NAMES))
    parser.add_argument("--json", type=Path, help="write every cell here")
    parser.add_argument("--write-docs", action="store_true")
    parser.add_argument(
        "--merge",
        nargs="*",
        type=Path,
        default=[],
        help="outputs of earlier runs (their JSON lines), later ones and this run winning per cell",
    )
    args = parser.parse_args(argv)
    chosen = families() if args.all else [f for f in args.families.split(",") if f]
    merged: dict[tuple[str, str], Cell] = {}
    for path in args.merge:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                cell = Cell(**json.loads(line))
                merged[cell.family, cell.layout] = cell
    for family in chosen:
        for layout in args.layouts.split(","):
            cell = run_cell(family, layout)
            merged[cell.family, cell.layout] = cell  # a cell run now replaces a merged one
            print(json.dumps(dataclasses.asdict(cell)), flush=True)
    cells = list(merged.values())
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in cells], indent=1))
    print(table(cells))
    if args.write_docs:
        write_docs(cells, Path(__file__).parents[2])


if __name__ == "__main__":
    main()
