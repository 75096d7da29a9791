"""``LlamaConfig``: the shapes of a Llama decoder, its presets and its size and FLOP counts."""

from __future__ import annotations

import dataclasses
from typing import Any

from d9d.errors import ConfigError

from .._fields import check_positive_finite, check_positive_ints, check_seed
from ._pad import check_pad_token_id

__all__ = ["LlamaConfig"]

_POSITIVE_INTS = (
    "vocab_size",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "max_seq_len",
)
_POSITIVE_FLOATS = ("rope_theta", "norm_eps", "init_std")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shapes and init of a Llama decoder (pre-norm, RoPE, GQA attention, SwiGLU MLP).

    Fields are validated when the config is built, so a bad config fails before any
    tensor is allocated. Presets: :meth:`tiny`, :meth:`small`, :meth:`llama_1b`,
    :meth:`llama_8b`, or by name with :meth:`preset`.

    Args:
        vocab_size: Number of token ids (rows of the embedding).
        dim: Width of the residual stream; ``n_heads * head_dim``.
        n_layers: Number of transformer blocks.
        n_heads: Query heads per block.
        n_kv_heads: Key/value heads per block (grouped-query attention); divides ``n_heads``.
        ffn_dim: Hidden width of the SwiGLU MLP.
        max_seq_len: Longest sequence ``forward`` accepts.
        rope_theta: RoPE base; wavelengths run from 2*pi to 2*pi*theta.
        norm_eps: Epsilon of every RMSNorm.
        tie_embeddings: Whether the output head reuses the token embedding matrix.
        init_std: Standard deviation of the normal init of embeddings and linears
            (default 0.02); output projections ``wo``/``w_down`` use
            ``init_std / sqrt(2 * n_layers)``.
        seed: Seed of the deterministic init (default 0).
        pad_token_id: The padding token, or None (default): its embedding row gets no
            gradient and starts at zero, as ``nn.Embedding(padding_idx=...)`` (and
            ``transformers``) does.

    Raises:
        ConfigError: ``pad_token_id`` is not a token id, a size is not positive, ``rope_theta``,
            ``norm_eps`` or ``init_std`` is not finite and positive, ``dim`` is not divisible by ``n_heads``,
            ``n_heads`` by ``n_kv_heads``, or the head dim is odd (RoPE rotates pairs).

    Example:
        >>> cfg = LlamaConfig.tiny()
        >>> cfg.head_dim, cfg.num_params
        (16, 125248)
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, _POSITIVE_INTS)
        check_positive_finite(self, _POSITIVE_FLOATS)
        if self.dim % self.n_heads:
            raise ConfigError(
                f"LlamaConfig.dim must be divisible by n_heads, got dim={self.dim}, "
                f"n_heads={self.n_heads}: pick n_heads among the divisors of dim."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"LlamaConfig.n_heads must be divisible by n_kv_heads (each kv head serves a "
                f"group of query heads), got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}: pick n_kv_heads among the divisors of n_heads."
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"LlamaConfig head dim dim // n_heads must be even for RoPE, got "
                f"dim={self.dim}, n_heads={self.n_heads}, head_dim={self.head_dim}."
            )
        check_seed(self)
        check_pad_token_id(self)

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """A 2-layer byte-level model (vocab 256, token 0 separates documents) for CPU tests.

        ``ffn_dim=176`` is deliberately not a power of two, so shape bugs that powers of two
        hide show up. Keyword ``overrides`` replace fields (``LlamaConfig.tiny(seed=1)``).
        """
        fields = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
        return cls(**(fields | dict(max_seq_len=256) | overrides))

    @classmethod
    def small(cls, **overrides: Any) -> LlamaConfig:
        """A 4-layer byte-level model of width 256 (about 3.0M params) for short real runs."""
        fields = dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)
        return cls(**(fields | dict(max_seq_len=1024) | overrides))

    @classmethod
    def llama_1b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3.2 1B shapes (tied embeddings, about 1.24e9 params), without RoPE scaling."""
        fields = dict(vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8)
        rest = dict(ffn_dim=8192, max_seq_len=8192, rope_theta=500_000.0, tie_embeddings=True)
        return cls(**(fields | rest | overrides))

    @classmethod
    def llama_8b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3 8B shapes (untied embeddings, about 8.03e9 params)."""
        fields = dict(vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8)
        rest = dict(ffn_dim=14_336, max_seq_len=8192, rope_theta=500_000.0)
        return cls(**(fields | rest | overrides))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The preset called ``name``: one of ``"tiny"``, ``"small"``, ``"1b"``, ``"8b"``.

        Raises:
            ConfigError: ``name`` is not a preset.

        Example:
            >>> LlamaConfig.preset("8b").num_params
            8030261248
        """
        builders = {"tiny": cls.tiny, "small": cls.small, "1b": cls.llama_1b, "8b": cls.llama_8b}
        if name not in builders:
            raise ConfigError(
                f"Unknown Llama preset {name=}; valid presets are {tuple(builders)}, or build "
                "LlamaConfig(...) with explicit fields."
            )
        return builders[name](**overrides)

    @property
    def head_dim(self) -> int:
        """Width of one attention head, ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def num_block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP and its two norms)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv_dim
        return attn + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def num_params(self) -> int:
        """All distinct parameters; a tied head is counted once, with the embedding."""
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * self.num_block_params + self.dim

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

        ``6 * N`` with ``N`` the weights used in matmuls (every block linear and the output
        head, tied or not; the embedding lookup and norms excluded), plus the attention
        score and value matmuls ``12 * n_layers * dim * seq_len``, counted over the whole
        (not causally masked) score matrix as in PaLM (arXiv:2204.02311, appendix B).

        Args:
            seq_len: Tokens per sequence; defaults to ``max_seq_len``.

        Returns:
            FLOPs per token, an int.

        Raises:
            ConfigError: ``seq_len`` is not a positive int.

        Example:
            >>> LlamaConfig.tiny().flops_per_token(128)
            847872
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ConfigError(f"flops_per_token needs a positive int seq_len, got {seq_len=}.")
        matmul_params = self.n_layers * (self.num_block_params - 2 * self.dim)
        matmul_params += self.vocab_size * self.dim
        return 6 * matmul_params + 12 * self.n_layers * self.dim * seq_len
