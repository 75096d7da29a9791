"""``MoEConfig`` of the d9d MoE decoder: its shapes, its MoE layers, and its presets."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from d9d.errors import ConfigError
from d9d.moe import MoEConfig as LayerConfig

from .._fields import check_positive_finite, check_positive_ints, check_seed
from ..llama._pad import check_pad_token_id

__all__ = ["MoEConfig"]

_POSITIVE_INTS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shapes of a Llama-style decoder whose MLPs are MoE layers (Qwen3-MoE, DeepSeek-style).

    Blocks ``0 .. n_dense_layers - 1`` keep a dense SwiGLU MLP of width ``ffn_dim``; the others
    hold a :class:`d9d.moe.MoE` built from ``moe``. Attention is grouped-query with RoPE and,
    with ``qk_norm``, an RMSNorm of queries and keys, per head (Qwen3) or over all heads
    (OLMoE). Presets: :meth:`tiny`,
    :meth:`small` (CPU), and the shapes of OLMoE-1B-7B, Qwen3-30B-A3B and DeepSeek-V3 (for
    ``d9d plan`` on the meta device; DeepSeek-V3's multi-head latent attention is stood in
    for by GQA of the same width), or by name with :meth:`preset`.

    Args:
        vocab_size: Token ids.
        dim: Width of the residual stream (``moe.dim`` must equal it).
        n_layers: Blocks.
        n_heads: Query heads.
        n_kv_heads: Key/value heads (divides ``n_heads``).
        ffn_dim: Hidden width of the dense MLPs.
        moe: The MoE layers' options.
        n_dense_layers: Leading blocks with a dense MLP. Default 0.
        head_dim: Width of one head; default ``dim // n_heads``.
        qk_norm: RMSNorm of q and k before RoPE: ``True`` per head (width ``head_dim``,
            Qwen3), ``"full"`` over all heads at once (widths ``n_heads * head_dim`` and
            ``n_kv_heads * head_dim``, OLMoE; ``tensor_parallel`` refuses it), or False
            (default).
        max_seq_len: Longest sequence. Default 4096.
        rope_theta: RoPE base. Default 10000.
        norm_eps: RMSNorm epsilon. Default 1e-6.
        tie_embeddings: The head reuses the embedding. Default False.
        init_std: Std of the normal init (output projections: ``/ sqrt(2 * n_layers)``).
        seed: Seed of the deterministic init.
        pad_token_id: The padding token, or None (default): its embedding row gets no
            gradient and starts at zero (``nn.Embedding(padding_idx=...)``).

    Raises:
        ConfigError: A size (``head_dim`` included) is not a positive int, ``rope_theta``,
            ``norm_eps`` or ``init_std`` is not finite and positive, ``seed`` is not an int,
            heads do not divide, an odd head dim,
            ``qk_norm`` is not False, True or ``"full"``, or ``moe.dim != dim``.

    Example:
        >>> cfg = MoEConfig.tiny()
        >>> cfg.moe.n_experts, cfg.n_moe_layers
        (6, 1)
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    moe: LayerConfig
    n_dense_layers: int = 0
    head_dim: int | None = None
    qk_norm: bool | Literal["full"] = False
    max_seq_len: int = 4096
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    seed: int = 0
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, (*_POSITIVE_INTS, "max_seq_len"))
        if self.head_dim is not None:  # 0 is refused, not read as None (dim // n_heads)
            check_positive_ints(self, ("head_dim",))
        check_positive_finite(self, ("rope_theta", "norm_eps", "init_std"))
        check_seed(self)
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"MoEConfig.n_dense_layers={self.n_dense_layers} must be in [0, n_layers="
                f"{self.n_layers}]."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"MoEConfig.n_heads={self.n_heads} must be divisible by "
                f"n_kv_heads={self.n_kv_heads}."
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ConfigError(
                f"MoEConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}, or "
                "give head_dim."
            )
        if self.attention_head_dim % 2:
            raise ConfigError(f"MoEConfig head dim {self.attention_head_dim} must be even (RoPE).")
        if not (isinstance(self.qk_norm, bool) or self.qk_norm == "full"):
            raise ConfigError(
                f"MoEConfig.qk_norm={self.qk_norm!r} must be False, True (a norm per head, "
                "Qwen3) or 'full' (one norm over all heads, OLMoE)."
            )
        if self.moe.dim != self.dim:
            raise ConfigError(
                f"MoEConfig.moe.dim={self.moe.dim} must equal dim={self.dim}: the MoE layers "
                "read and write the residual stream."
            )
        check_pad_token_id(self)

    @property
    def attention_head_dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def n_moe_layers(self) -> int:
        """Blocks holding an MoE layer."""
        return self.n_layers - self.n_dense_layers

    @property
    def num_params(self) -> int:
        """All distinct params (a tied head counted once)."""
        heads = self.attention_head_dim
        attn = 2 * self.dim * heads * (self.n_heads + self.n_kv_heads)
        if self.qk_norm == "full":
            attn += heads * (self.n_heads + self.n_kv_heads)
        elif self.qk_norm:
            attn += 2 * heads
        norms = 2 * self.dim
        dense = self.n_dense_layers * (attn + norms + 3 * self.dim * self.ffn_dim)
        sparse = self.n_moe_layers * (attn + norms + self.moe.num_params)
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + dense + sparse + self.dim

    @classmethod
    def tiny(cls, **overrides: Any) -> MoEConfig:
        """2 blocks (1 dense), 6 experts top-2 of width 40 plus one shared, byte vocab: CPU tests.

        Six experts (not a power of two) with the Switch aux loss, the z-loss and the
        aux-loss-free bias all on, so every balancing path runs.
        """
        moe = LayerConfig(
            dim=64, n_experts=6, top_k=2, expert_dim=40, n_shared_experts=1, norm_topk=True,
            aux_loss_coef=0.01, z_loss_coef=1e-3, bias_update_rate=1e-3,
        )  # fmt: skip
        fields = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176)
        return cls(**(fields | dict(moe=moe, n_dense_layers=1, max_seq_len=256) | overrides))

    @classmethod
    def small(cls, **overrides: Any) -> MoEConfig:
        """4 blocks of width 256, 16 experts top-4, sigmoid scores in 4 groups: short CPU runs."""
        moe = LayerConfig(
            dim=256, n_experts=16, top_k=4, expert_dim=128, n_shared_experts=1,
            score_func="sigmoid", norm_topk=True, n_group=4, topk_group=2,
            aux_loss_coef=1e-3, bias_update_rate=1e-3,
        )  # fmt: skip
        fields = dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688)
        return cls(**(fields | dict(moe=moe, n_dense_layers=1, max_seq_len=1024) | overrides))

    @classmethod
    def olmoe_1b_7b(cls, **overrides: Any) -> MoEConfig:
        """OLMoE-1B-7B shapes: 16 blocks, 64 experts top-8 of width 1024, aux loss 0.01, q/k
        norms over all heads, norm eps 1e-5 (allenai/OLMoE-1B-7B-0924's config)."""
        moe = LayerConfig(
            dim=2048, n_experts=64, top_k=8, expert_dim=1024, aux_loss_coef=0.01,
            z_loss_coef=1e-3,
        )  # fmt: skip
        fields = dict(vocab_size=50_304, dim=2048, n_layers=16, n_heads=16, n_kv_heads=16)
        rest = dict(ffn_dim=1024, moe=moe, qk_norm="full", norm_eps=1e-5)
        return cls(**(fields | rest | overrides))

    @classmethod
    def qwen3_30b_a3b(cls, **overrides: Any) -> MoEConfig:
        """Qwen3-30B-A3B shapes: 48 blocks, 128 experts top-8 of width 768, head dim 128."""
        moe = LayerConfig(
            dim=2048, n_experts=128, top_k=8, expert_dim=768, norm_topk=True, aux_loss_coef=1e-3
        )
        fields = dict(vocab_size=151_936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4)
        rest = dict(head_dim=128, qk_norm=True, rope_theta=1e6, max_seq_len=40_960)
        return cls(**(fields | rest | dict(ffn_dim=6144, moe=moe) | overrides))

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> MoEConfig:
        """DeepSeek-V3 shapes: 61 blocks (3 dense), 256 experts top-8 in 8 groups (4 used),
        1 shared expert, sigmoid scores scaled by 2.5, aux-loss-free bias."""
        moe = LayerConfig(
            dim=7168, n_experts=256, top_k=8, expert_dim=2048, n_shared_experts=1,
            score_func="sigmoid", norm_topk=True, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, aux_loss_coef=1e-4, bias_update_rate=1e-3,
        )  # fmt: skip
        fields = dict(vocab_size=129_280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128)
        rest = dict(head_dim=128, ffn_dim=18_432, n_dense_layers=3, max_seq_len=4096)
        return cls(**(fields | rest | dict(moe=moe) | overrides))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MoEConfig:
        """The preset called ``name``: ``"tiny"``, ``"small"``, ``"olmoe-1b-7b"``,
        ``"qwen3-30b-a3b"`` or ``"deepseek-v3"``.

        Raises:
            ConfigError: ``name`` is not a preset.

        Example:
            >>> MoEConfig.preset("qwen3-30b-a3b").moe.n_experts
            128
        """
        builders = {
            "tiny": cls.tiny,
            "small": cls.small,
            "olmoe-1b-7b": cls.olmoe_1b_7b,
            "qwen3-30b-a3b": cls.qwen3_30b_a3b,
            "deepseek-v3": cls.deepseek_v3,
        }
        if name not in builders:
            raise ConfigError(
                f"Unknown MoE preset {name=}; valid presets are {tuple(builders)}, or build "
                "MoEConfig(...) with explicit fields."
            )
        return builders[name](**overrides)
