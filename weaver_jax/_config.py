"""Target model configuration: one frozen dataclass covers Llama 3.x / SmolLM2, Qwen2.5 and Qwen3."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (HF `rope_type="llama3"`), a `ModelConfig`'s `rope_scaling`; conversion
    reads it from a checkpoint's config.json:

        RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        weaver_jax.load("Meta-Llama-3.1-8B-Instruct/").config.rope_scaling   # the same, from its config.json
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape and numerics.

    `family` is informational ("llama", "qwen2", "qwen3"); the switches that change the
    computation are `qkv_bias` (Qwen2.5), `qk_norm` (Qwen3) and `tie_embeddings`. Frozen; `replace` for a
    variant (a loaded target's is `bundle.target.config`):

        config = weaver_jax.smollm2_135m("bfloat16")
        tiny = config.replace(num_layers=2, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1)
        target = weaver_jax.Transformer(tiny, rngs=nnx.Rngs(0))  # random weights of that shape
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_seq_len: int = 8192
    dtype: str = "float32"
    family: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


def smollm2_135m(dtype: str = "float32") -> ModelConfig:
    """SmolLM2-135M(-Instruct)'s shape: Llama architecture, tied embeddings (the shipped pair's target; random
    weights for benchmarks and tests):

        weaver_jax.Transformer(weaver_jax.smollm2_135m("bfloat16"), rngs=nnx.Rngs(0))
    """
    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100_000.0, rms_norm_eps=1e-5,
        tie_embeddings=True, max_seq_len=8192, dtype=dtype, family="llama",
    )


def qwen3_8b(dtype: str = "bfloat16") -> ModelConfig:
    """Qwen3-8B's shape (the benchmarks' 8B shape), a `ModelConfig` for random-weight timings without the
    checkpoint:

        config = weaver_jax.qwen3_8b()                                    # bfloat16, 36 layers, 32 / 8 heads
        config.replace(num_layers=2)                                      # a slice of it
    """
    return ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_embeddings=False, qk_norm=True, max_seq_len=40960, dtype=dtype, family="qwen3",
    )
