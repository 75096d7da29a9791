"""Families whose learned positions are an ``nn.Embedding`` subclass that computes its ids in
its own forward (OPT and BioGPT from the attention mask, BART from the tokens' length) run
under ``Model.apply`` as in ``transformers``: before, d9d's eager id check read the forward's
first argument as the ids and refused them (a float mask: TypeError; tokens past the 66
position rows: IndexRangeError), on one device."""

from __future__ import annotations

import pytest
import torch

import d9d

_CONFIGS = {
    # (config class, model class, fields): odd sizes, the families' other defaults
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 35, "word_embed_proj_dim": 42}),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", {"intermediate_size": 35}),
    "bart": (
        "BartConfig",
        "BartForCausalLM",
        {"d_model": 42, "decoder_ffn_dim": 35, "decoder_attention_heads": 3, "encoder_layers": 1},
    ),
}


@pytest.mark.parametrize("family", sorted(_CONFIGS))
def test_learned_positions_run_as_in_transformers(family: str) -> None:
    import transformers

    config_name, model_name, fields = _CONFIGS[family]
    sizes = {"vocab_size": 101, "hidden_size": 42, "num_hidden_layers": 3}
    sizes |= {"num_attention_heads": 3, "max_position_embeddings": 64}
    config = getattr(transformers, config_name)(**sizes, **fields)
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(config).to(torch.float64).eval()  # no dropout
    model = d9d.functionalize(hf)
    tokens = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    tokens[0, 0] = 100  # past the position table's 66 rows

    def loss_fn(params, tokens):
        return model.apply(params, tokens).logits.square().mean()

    loss, grads = d9d.value_and_grad(loss_fn)(model.params, tokens)
    expected = hf(tokens, use_cache=False).logits.square().mean()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    named = dict(hf.named_parameters())
    for path, grad in grads.items():  # BART's cross-attention is unused: no grad, zeros
        want = named[path].grad
        want = torch.zeros_like(grad) if want is None else want
        torch.testing.assert_close(grad, want, rtol=0, atol=0, msg=path)
