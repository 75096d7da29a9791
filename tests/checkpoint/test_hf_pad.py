"""``pad_token_id`` survives an import: the d9d model's pad row gets no gradient, as in
``transformers`` (``nn.Embedding(padding_idx=...)``), so both train alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import d9d
from d9d import checkpoint
from d9d.models import Llama

transformers = pytest.importorskip("transformers")

PAD = 60


def _train(model: d9d.Model, logits_of, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps on batches where the pad token occurs in every row."""
    opt = d9d.optim.adamw(1e-2, weight_decay=0.1)

    def loss_fn(params, batch):
        return d9d.losses.cross_entropy(logits_of(model.apply(params, batch[:, :-1])), batch[:, 1:])

    params = {k: v.detach().clone() for k, v in model.params.items()}
    state = opt.init(params)
    generator = torch.Generator().manual_seed(2)
    for _ in range(steps):
        batch = torch.randint(0, 96, (3, 12), generator=generator)
        batch[:, ::4] = PAD
        grads = d9d.grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = d9d.optim.apply_updates(params, updates)
    return params


def _float64_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm in the input's dtype, as d9d's: transformers' rounds to float32, which
    AdamW's normalized updates turn into ~1e-6 differences after 3 steps."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_an_imported_pad_token_trains_like_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _float64_rms_norm)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # a pad row away from zero, so weight decay moves it too
        hf.model.embed_tokens.weight[PAD].normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    ours_config, imported = checkpoint.import_hf(tmp_path)
    assert ours_config.pad_token_id == PAD
    ours = d9d.functionalize(Llama(ours_config).to(torch.float64))
    ours.module.load_state_dict(imported)

    expected = _train(d9d.functionalize(hf), lambda out: out.logits)
    got = checkpoint.llama_to_hf(_train(ours, lambda logits: logits), ours_config)
    for key, value in expected.items():  # ~1e-10 apart: transformers' RoPE tables are float32
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-8)
    embed = got["model.embed_tokens.weight"]
    initial = hf.model.embed_tokens.weight.detach()
    shrunk = initial[PAD] * (1 - 1e-2 * 0.1) ** 3  # weight decay only: no gradient reached it
    torch.testing.assert_close(embed[PAD], shrunk)
    assert not torch.allclose(embed[PAD + 1], initial[PAD + 1])


def test_a_fresh_model_starts_its_pad_row_at_zero() -> None:
    model = Llama(d9d.models.LlamaConfig.tiny(pad_token_id=3))
    assert model.embed.padding_idx == 3 and not model.embed.weight[3].any()
    with pytest.raises(d9d.errors.ConfigError, match=r"pad_token_id must be None or a token id"):
        d9d.models.LlamaConfig.tiny(pad_token_id=256)
