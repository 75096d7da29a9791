"""What ``d9d bench kernels`` times of the fp8 ops: quantize, GEMM, grouped GEMM and the
experts' weight-grad GEMM grouped along K, per recipe."""

from __future__ import annotations

import torch

from ...kernels._fp8_gemm import fp8_gemm, fp8_grouped_gemm, operand_groups
from ...kernels._fp8_gemm import reference as fp8_gemm_reference
from ...kernels._fp8_grouped_gemm_k import dequantize_by_expert, fp8_grouped_gemm_k
from ...kernels._fp8_quantize import fp8_quantize
from ...kernels._fp8_quantize import reference as fp8_quantize_reference
from ...kernels._fp8_recipes import dequantize
from ...kernels._grouped_gemm import _offsets, _pad, grouped_gemm
from ._cases import Case, _expert_loop, _Maker

__all__ = ["fp8_cases"]


def fp8_cases(sizes: dict, dtype: torch.dtype, device: str) -> list[Case]:
    """Each recipe: quantize ``[m, k]`` activations of ``dtype`` (to e4m3), an ``[m, k] x
    [k, n]`` GEMM into bfloat16 against the bfloat16 matmul, and (rowwise, blockwise) a grouped
    GEMM at the first MoE model's gate+up shape against ``grouped_gemm`` in bfloat16, and that
    GEMM's weight grad (``fp8_grouped_gemm_k``) against ``torch._grouped_mm``'s in bfloat16.
    Forward only: the ops have no backward."""
    m = _Maker(dtype, device)
    rows, k, n = sizes["fp8"]["m"], sizes["fp8"]["k"], sizes["fp8"]["n"]
    model, moe = next(iter(sizes["moe"].items()))
    experts, top_k, hidden = moe["experts"], moe["top_k"], moe["hidden"]
    moe_rows, moe_n = sizes["tokens"] * top_k, 2 * moe["expert_mlp"]
    bf16 = torch.bfloat16
    cases = []
    for recipe in ("tensorwise", "rowwise", "blockwise"):

        def quantize_inputs(recipe=recipe):
            return {"x": m.randn(rows, k).detach(), "recipe": recipe}

        def gemm_inputs(recipe=recipe):
            a = torch.randn(rows, k, device=m.device)
            b = torch.randn(n, k, device=m.device) * k**-0.5  # a linear's weight, [out, in]
            a_data, a_scale = fp8_quantize(a, recipe)
            w_data, w_scale = fp8_quantize(b, recipe, block=(128, 128))
            operands = {"a_data": a_data, "a_scale": a_scale, "b_data": w_data.t()}
            return {
                **operands,
                "b_scale": w_scale.t(),
                "recipe": recipe,
                "a": a.to(bf16),
                "b": b.t().to(bf16),
            }

        def grouped_inputs(recipe=recipe):
            ids = torch.rand(sizes["tokens"], experts, device=m.device).topk(top_k, dim=1).indices
            sizes_ = torch.bincount(ids.flatten(), minlength=experts).to(torch.int32)
            x = torch.randn(moe_rows, hidden, device=m.device)
            w = torch.randn(experts, hidden, moe_n, device=m.device) * hidden**-0.5
            a_data, a_scale = fp8_quantize(x, recipe)
            # Laid out k fastest, as the fp8 experts pass it (d9d/transforms/fp8/_experts.py).
            b_data, b_scale = fp8_quantize(w.transpose(1, 2), recipe, block=(128, 128))
            return {
                "a_data": a_data,
                "a_scale": a_scale,
                "b_data": b_data.transpose(1, 2),
                "b_scale": b_scale.transpose(1, 2),
                "group_sizes": sizes_,
                "recipe": recipe,
                "x": x.to(bf16),
                "w": w.to(bf16),
            }

        def weight_grad_inputs(recipe=recipe):
            group_sizes = grouped_inputs(recipe)["group_sizes"]
            x = torch.randn(moe_rows, hidden, device=m.device)
            dy = torch.randn(moe_rows, moe_n, device=m.device) * moe_n**-0.5
            by_expert = {"dim": -2, "group_sizes": group_sizes}
            a_data, a_scale = fp8_quantize(x, recipe, block=(128, 128), **by_expert)
            grad_dtype = torch.float8_e4m3fn if recipe == "blockwise" else torch.float8_e5m2
            b_data, b_scale = fp8_quantize(dy, recipe, grad_dtype, block=(128, 1), **by_expert)
            return {
                "a_data": a_data,
                "a_scale": a_scale,
                "b_data": b_data,
                "b_scale": b_scale,
                "group_sizes": group_sizes,
                "recipe": recipe,
                "x": x.to(bf16),
                "dy": dy.to(bf16),
            }

        def quantized(**kw):
            return {key: kw[key] for key in ("a_data", "a_scale", "b_data", "b_scale")}

        gemm = {
            "triton": lambda **kw: fp8_gemm(
                **quantized(**kw), recipe=kw["recipe"], out_dtype=bf16, backend="triton"
            ),
            "eager": lambda **kw: fp8_gemm_reference(*quantized(**kw).values(), kw["recipe"], bf16),
            "bf16": lambda **kw: kw["a"] @ kw["b"],
        }
        if recipe != "blockwise":
            gemm["torch"] = lambda **kw: fp8_gemm(
                **quantized(**kw), recipe=kw["recipe"], out_dtype=bf16, backend="torch"
            )
        grouped = {
            "triton": lambda **kw: fp8_grouped_gemm(
                **quantized(**kw),
                group_sizes=kw["group_sizes"],
                recipe=kw["recipe"],
                out_dtype=bf16,
                backend="triton",
            ),
            # The eager baseline of grouped_gemm: dequantize, one matmul per expert (syncs).
            "eager": lambda **kw: _expert_loop(
                *_dequantized(*quantized(**kw).values(), kw["recipe"]),
                kw["group_sizes"],
            ).to(bf16),
            "bf16": lambda **kw: grouped_gemm(kw["x"], kw["w"], kw["group_sizes"]),
        }
        weight_grad = {
            "triton": lambda **kw: fp8_grouped_gemm_k(
                **quantized(**kw),
                group_sizes=kw["group_sizes"],
                recipe=kw["recipe"],
                out_dtype=bf16,
                backend="triton",
            ),
            # Dequantize, one matmul per expert over its split rows (syncs).
            "eager": lambda **kw: _weight_grad_loop(
                *quantized(**kw).values(), kw["group_sizes"], kw["recipe"]
            ),
            # grouped_gemm's torch backward: _grouped_mm of x.T and dy, offsets along K.
            "bf16": lambda **kw: torch._grouped_mm(
                _pad(kw["x"], (1,)).t(), _pad(kw["dy"], (1,)), offs=_offsets(kw["group_sizes"])
            ),
        }
        quantize = {
            "triton": lambda x, recipe: fp8_quantize(x, recipe, backend="triton"),
            "eager": lambda x, recipe: fp8_quantize_reference(
                x, recipe, torch.float8_e4m3fn, -1, (1, 128)
            ),
        }
        gemm_bytes = rows * k + k * n + 2 * rows * n  # fp8 operands, bfloat16 out (scales: few)
        grouped_bytes = moe_rows * hidden + experts * hidden * moe_n + 2 * moe_rows * moe_n
        weight_grad_bytes = moe_rows * (hidden + moe_n) + 2 * experts * hidden * moe_n
        cases += [
            Case(
                "fp8_quantize",
                f"{rows}x{k}:{recipe}",
                quantize_inputs,
                quantize,
                rows * k * (m.size + 1),
                None,
            ),
            Case(
                "fp8_gemm",
                f"{rows}x{k}x{n}:{recipe}",
                gemm_inputs,
                gemm,
                gemm_bytes,
                None,
                flops_fwd=2 * rows * k * n,
                compile_eager=False,
            ),
        ]
        if recipe == "tensorwise":  # MoE recipes are rowwise (torchao) and blockwise (DeepSeek)
            continue
        cases += [
            Case(
                "fp8_grouped_gemm",
                f"{model}:gate_up:{moe_rows}x{hidden}x{moe_n}/E{experts}:{recipe}",
                grouped_inputs,
                grouped,
                grouped_bytes,
                None,
                flops_fwd=2 * moe_rows * hidden * moe_n,
                graph=False,  # the eager loop syncs the host, which a capture cannot
                compile_eager=False,
            ),
            Case(
                "fp8_grouped_gemm_k",
                f"{model}:gate_up_weight_grad:{moe_rows}x{hidden}x{moe_n}/E{experts}:{recipe}",
                weight_grad_inputs,
                weight_grad,
                weight_grad_bytes,
                None,
                flops_fwd=2 * moe_rows * hidden * moe_n,
                graph=False,  # as above
                compile_eager=False,
            ),
        ]
    return cases


def _weight_grad_loop(a_data, a_scale, b_data, b_scale, group_sizes, recipe) -> torch.Tensor:
    """The eager baseline of ``fp8_grouped_gemm_k``: both operands dequantized to float32
    (``_fp8_grouped_gemm_k``'s dequantize), one ``a_e.T @ b_e`` per expert (syncs)."""
    a = dequantize_by_expert(a_data, a_scale, group_sizes, recipe)
    b = dequantize_by_expert(b_data, b_scale, group_sizes, recipe)
    sizes = group_sizes.tolist()
    pairs = zip(a.split(sizes), b.split(sizes), strict=True)
    return torch.stack([a_e.t() @ b_e for a_e, b_e in pairs]).to(torch.bfloat16)


def _dequantized(a_data, a_scale, b_data, b_scale, recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands in float32, each scale repeated over its group."""
    a_group, b_group = operand_groups(recipe, a_data.shape[0], a_data.shape[1], b_data.shape[2])
    return dequantize(a_data, a_scale, a_group), dequantize(b_data, b_scale, b_group)
