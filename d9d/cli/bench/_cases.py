"""What ``d9d bench kernels`` times: each op at a model's shapes, its implementations, its work.

Byte counts are what an ideal kernel must move (each input read once, each output written
once); FLOP counts are given where matmuls dominate. Implementations are the registry's
Triton backend, the eager reference, plain torch where d9d's reference is not the lean
baseline, and Liger-Kernel when it is installed (GPU runs only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ...kernels import _reference as R
from ...kernels._adamw import adamw
from ...kernels._cross_entropy import cross_entropy
from ...kernels._fused_linear_cross_entropy import fused_linear_cross_entropy
from ...kernels._grouped_gemm import grouped_gemm
from ...kernels._moe_permute import (
    moe_permute,
    moe_unpermute,
    permute_reference,
    route,
    unpermute_reference,
)
from ...kernels._rms_norm import fused_add_rms_norm, rms_norm
from ...kernels._rope import rope
from ...kernels._swiglu import swiglu

__all__ = ["OPS", "SHAPES", "Case", "cases"]

# Llama-3 8B: hidden 4096, MLP 14336, vocab 128256, 32 query and 8 key/value heads of 128,
# one batch of 8192 tokens. "tiny" only exercises the code path (CPU, Triton interpreter).
# The MoE ops run at the "moe" models' shapes with the same tokens: OLMoE-1B-7B (64 experts,
# top-8, hidden 2048, expert MLP 1024) and Qwen3-30B-A3B (128 experts, top-8, 2048, 768).
# The fp8 ops (_fp8_cases.py) run at "fp8" (K and N multiples of 16 in "tiny" too, as
# torch._scaled_mm needs) and at the first MoE model's gate+up GEMM.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "tokens": 8192,
        "hidden": 4096,
        "mlp": 14336,
        "vocab": 128256,
        "heads": (32, 8, 128),
        "moe": {
            "olmoe-1b-7b": {"experts": 64, "top_k": 8, "hidden": 2048, "expert_mlp": 1024},
            "qwen3-30b-a3b": {"experts": 128, "top_k": 8, "hidden": 2048, "expert_mlp": 768},
        },
        "fp8": {"m": 8192, "k": 4096, "n": 4096},
    },
    "tiny": {
        "tokens": 24,
        "hidden": 40,
        "mlp": 56,
        "vocab": 300,
        "heads": (4, 2, 16),
        "moe": {"tiny-moe": {"experts": 5, "top_k": 2, "hidden": 40, "expert_mlp": 24}},
        "fp8": {"m": 24, "k": 48, "n": 32},
    },
}
OPS = (
    "rms_norm",
    "swiglu",
    "fused_add_rms_norm",
    "rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "adamw",
    "grouped_gemm",
    "moe_permute",
    "moe_unpermute",
    "fp8_quantize",
    "fp8_gemm",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_k",
)


@dataclass(frozen=True)
class Case:
    """One op at one shape: how to make inputs, run each implementation, and count work."""

    op: str
    shape: str  # the model shape it stands for, e.g. "8192x4096"
    make: Callable[[], dict]  # -> keyword inputs
    impls: dict[str, Callable[..., object]]  # name -> fn(**inputs) -> output tensor(s)
    bytes_fwd: int
    bytes_fwd_bwd: int | None  # None: no backward (adamw)
    flops_fwd: int = 0
    flops_fwd_bwd: int = 0
    memory: bool = False  # record peak memory of forward + backward
    # Timed as CUDA graph replays (GPU time alone), or by events around plain calls where
    # an implementation cannot be captured: a failed capture leaves CUDA's random-number
    # state unusable for the rest of the process (seen with Liger's cross-entropy).
    graph: bool = True
    # Also time torch.compile of "eager" (GPU runs), unless "eager" is no competitor worth a
    # compile: the fp8 GEMMs' dequantize-then-matmul, whose rival is the bfloat16 matmul.
    compile_eager: bool = True


class _Maker:
    """Random inputs of one dtype on one device."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        self.dtype, self.device = dtype, device
        self.size = torch.tensor([], dtype=dtype).element_size()

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = scale * torch.randn(*shape, device=self.device)
        return x.to(self.dtype).requires_grad_()

    def labels(self, n: int, vocab: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n,), device=self.device)


def _triton(fn: Callable[..., object]) -> Callable[..., object]:
    return lambda **kw: fn(**kw, backend="triton")


def _liger_rms_norm(liger, x, weight, eps):
    module = liger.LigerRMSNorm(weight.shape[0], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module(x)


def _norm_and_mlp_cases(sizes: dict, m: _Maker, liger) -> list[Case]:
    cases = []
    for rows, cols in ((sizes["tokens"], sizes["hidden"]), (sizes["tokens"], sizes["mlp"])):
        nbytes = rows * cols * m.size

        def norm_inputs(rows=rows, cols=cols):
            return {"x": m.randn(rows, cols), "weight": m.randn(cols), "eps": 1e-6}

        def mlp_inputs(rows=rows, cols=cols):
            return {"gate": m.randn(rows, cols), "up": m.randn(rows, cols)}

        norm = {"triton": _triton(rms_norm), "eager": R.rms_norm}
        mlp = {"triton": _triton(swiglu), "eager": R.swiglu}
        if liger is not None:
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            norm["liger"] = lambda x, weight, eps: _liger_rms_norm(liger, x, weight, eps)
            mlp["liger"] = lambda gate, up: LigerSiLUMulFunction.apply(gate, up)
        shape = f"{rows}x{cols}"
        cases.append(Case("rms_norm", shape, norm_inputs, norm, 2 * nbytes, 5 * nbytes))
        cases.append(Case("swiglu", shape, mlp_inputs, mlp, 3 * nbytes, 8 * nbytes))
    n, h = sizes["tokens"], sizes["hidden"]

    def add_norm_inputs():
        return {"x": m.randn(n, h), "residual": m.randn(n, h), "weight": m.randn(h), "eps": 1e-6}

    impls = {"triton": _triton(fused_add_rms_norm), "eager": R.fused_add_rms_norm}
    nbytes = n * h * m.size
    cases.append(
        Case("fused_add_rms_norm", f"{n}x{h}", add_norm_inputs, impls, 4 * nbytes, 8 * nbytes)
    )
    return cases


def _rope_case(sizes: dict, m: _Maker, liger) -> Case:
    n, (q_heads, k_heads, head_dim) = sizes["tokens"], sizes["heads"]

    def inputs():
        angles = torch.randn(n, head_dim // 2, device=m.device)
        angles = torch.cat([angles, angles], dim=-1)
        q, k = m.randn(1, n, q_heads, head_dim), m.randn(1, n, k_heads, head_dim)
        return {"q": q, "k": k, "cos": angles.cos(), "sin": angles.sin()}

    impls = {"triton": _triton(rope), "eager": R.rope}
    if liger is not None:
        impls["liger"] = lambda q, k, cos, sin: liger.liger_rotary_pos_emb(
            q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None]
        )
    qk = n * (q_heads + k_heads) * head_dim * m.size
    tables = 2 * n * head_dim * 4
    shape = f"{n}x({q_heads}+{k_heads})x{head_dim}"
    return Case("rope", shape, inputs, impls, 2 * qk + tables, 4 * qk + 2 * tables)


def _loss_cases(sizes: dict, m: _Maker, liger) -> list[Case]:
    n, h, v = sizes["tokens"], sizes["hidden"], sizes["vocab"]

    def ce_inputs():
        return {"logits": m.randn(n, v, scale=4.0), "labels": m.labels(n, v), "ignore_index": -100}

    def flce_inputs():
        weight = m.randn(v, h, scale=h**-0.5)
        return {
            "hidden": m.randn(n, h),
            "weight": weight,
            "labels": m.labels(n, v),
            "ignore_index": -100,
            "chunk_size": 1024,
        }

    # "eager" is d9d's reference (float32 math); "torch" is F.cross_entropy in the logits'
    # dtype, the leaner baseline the memory target is measured against.
    ce = {
        "triton": _triton(cross_entropy),
        "eager": R.cross_entropy,
        "torch": lambda logits, labels, ignore_index: F.cross_entropy(
            logits, labels, ignore_index=ignore_index
        ),
    }
    flce = {
        "triton": _triton(fused_linear_cross_entropy),
        "eager": R.fused_linear_cross_entropy,
        "torch": lambda hidden, weight, labels, ignore_index, chunk_size: F.cross_entropy(
            F.linear(hidden, weight), labels, ignore_index=ignore_index
        ),
    }
    if liger is not None:
        ce["liger"] = lambda logits, labels, ignore_index: liger.LigerCrossEntropyLoss(
            ignore_index=ignore_index
        )(logits, labels)
        flce["liger"] = lambda hidden, weight, labels, ignore_index, chunk_size: (
            liger.LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index)(
                weight, hidden, labels
            )
        )
    logits = n * v * m.size
    operands = (n * h + v * h) * m.size
    return [
        Case(
            "cross_entropy",
            f"{n}x{v}",
            ce_inputs,
            ce,
            logits,
            3 * logits,
            memory=True,
            graph=False,
        ),
        Case(
            "fused_linear_cross_entropy",
            f"{n}x{h}x{v}",
            flce_inputs,
            flce,
            operands,
            2 * operands,
            flops_fwd=2 * n * h * v,  # the logits
            flops_fwd_bwd=6 * n * h * v,  # the logits, grad of hidden, grad of weight
            memory=True,
            graph=False,
        ),
    ]


def _adamw_case(sizes: dict, m: _Maker) -> Case:
    """AdamW over one Llama decoder layer's params in float32 (read p, g, m, v; write p, m, v)."""
    h, f, (_, k_heads, head_dim) = sizes["hidden"], sizes["mlp"], sizes["heads"]
    kv = k_heads * head_dim
    layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    hyper = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}

    def inputs():
        p, g, mu, nu = ([torch.randn(s, device=m.device) for s in layer] for _ in "pgmv")
        return {"params": p, "grads": g, "exp_avgs": mu, "exp_avg_sqs": [t.abs() for t in nu]}

    def triton(**kw):
        adamw(**kw, lr=1e-4, step=1, backend="triton", **hyper)

    def eager(**kw):
        one = torch.ones((), device=m.device)
        R.adamw(**kw, lr=one * 1e-4, step=one, **hyper)

    elements = sum(torch.Size(s).numel() for s in layer)
    impls = {"triton": triton, "eager": eager}
    # Not captured: the Triton update copies its Python-number lr and step to the GPU.
    return Case("adamw", "decoder-layer-fp32", inputs, impls, 7 * 4 * elements, None, graph=False)


def _expert_loop(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The common baseline: one matmul per expert over split rows (syncs the host)."""
    chunks = x.split(group_sizes.tolist())
    return torch.cat([chunk @ w[e] for e, chunk in enumerate(chunks)])


def _moe_model_cases(n: int, model: str, moe: dict, m: _Maker) -> list[Case]:
    """One MoE model's ops: permute, the gate+up and down grouped GEMMs, unpermute.

    Routing is uniform: each token picks ``top_k`` distinct experts at random.
    """
    experts, top_k, h, inter = moe["experts"], moe["top_k"], moe["hidden"], moe["expert_mlp"]
    rows = n * top_k

    def routing() -> torch.Tensor:
        return torch.rand(n, experts, device=m.device).topk(top_k, dim=1).indices

    def permute_inputs():
        return {"x": m.randn(n, h), "expert_ids": routing(), "num_experts": experts}

    def unpermute_inputs():
        row_map, _ = route(routing(), experts)
        weights = torch.rand(n, top_k, device=m.device).requires_grad_()
        return {"permuted_out": m.randn(rows, h), "row_map": row_map, "weights": weights}

    def gemm_inputs(k: int, out: int) -> Callable[[], dict]:
        def make():
            sizes = torch.bincount(routing().flatten(), minlength=experts).to(torch.int32)
            w = m.randn(experts, k, out, scale=k**-0.5)
            return {"x": m.randn(rows, k), "w": w, "group_sizes": sizes}

        return make

    permuted, tokens = rows * h * m.size, n * h * m.size
    gemms = {
        "torch": lambda **kw: grouped_gemm(**kw, backend="torch"),
        "triton": _triton(grouped_gemm),
        "eager": _expert_loop,
    }
    cases = [
        Case(
            "moe_permute",
            f"{model}:{n}x{top_k}x{h}",
            permute_inputs,
            {"triton": _triton(moe_permute), "eager": permute_reference},
            tokens + permuted,
            2 * (tokens + permuted),
        )
    ]
    for name, k, out in (("gate_up", h, 2 * inter), ("down", inter, h)):
        operands = (rows * k + experts * k * out + rows * out) * m.size
        flops = 2 * rows * k * out
        shape = f"{model}:{name}:{rows}x{k}x{out}/E{experts}"
        cases.append(
            Case(
                "grouped_gemm",
                shape,
                gemm_inputs(k, out),
                gemms,
                operands,
                3 * operands,
                flops_fwd=flops,
                flops_fwd_bwd=3 * flops,
                graph=False,  # the eager loop syncs the host, which a capture cannot
            )
        )
    cases.append(
        Case(
            "moe_unpermute",
            f"{model}:{n}x{top_k}x{h}",
            unpermute_inputs,
            {"triton": _triton(moe_unpermute), "eager": unpermute_reference},
            permuted + tokens,
            3 * permuted + 2 * tokens,  # the weight gradient reads the expert outputs again
        )
    )
    return cases


def _liger():
    """Liger-Kernel's ``transformers`` module if installed, else None."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    return liger


def cases(sizes: dict[str, Any], dtype: torch.dtype, device: str, *, liger: bool) -> list[Case]:
    """Every op's cases at ``sizes`` (a :data:`SHAPES` entry); Liger's too if ``liger``."""
    module = _liger() if liger else None
    maker = _Maker(dtype, device)
    return [
        *_norm_and_mlp_cases(sizes, maker, module),
        _rope_case(sizes, maker, module),
        *_loss_cases(sizes, maker, module),
        _adamw_case(sizes, maker),
        # Last: they are captured in CUDA graphs for the first time, and a failed capture
        # would leave CUDA's random-number state unusable for the cases after it.
        *(
            case
            for model, moe in sizes["moe"].items()
            for case in _moe_model_cases(sizes["tokens"], model, moe, maker)
        ),
    ]
