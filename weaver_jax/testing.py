"""Small random models for tests and examples."""

from __future__ import annotations

from flax import nnx

from weaver_jax._adapter import Adapter, random_adapter_config
from weaver_jax._config import ModelConfig, RopeScaling
from weaver_jax._drafter import Drafter, random_drafter_config
from weaver_jax._load import Bundle
from weaver_jax._model import Transformer


def random_config(*, vocab_size: int = 128, hidden_size: int = 64, intermediate_size: int = 96,
                  num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                  family: str = "llama", tie_embeddings: bool = False, llama3_scaling: bool = False,
                  max_seq_len: int = 512, dtype: str = "float32") -> ModelConfig:
    if family not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"unknown family {family!r}")
    scaling = RopeScaling(8.0, 1.0, 4.0, 64) if llama3_scaling else None
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rope_theta=10_000.0, rope_scaling=scaling, rms_norm_eps=1e-5, tie_embeddings=tie_embeddings,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", max_seq_len=max_seq_len,
        dtype=dtype, family=family)


def random_target(config: ModelConfig, seed: int = 0) -> Transformer:
    """A target with random weights; norm scales are randomised too so that no weight is trivial."""
    import jax

    model = Transformer(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed + 1_000_003)
    for path, param in nnx.iter_graph(model):
        if isinstance(param, nnx.Param) and path[-1] in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
            key, sub = jax.random.split(key)
            param[...] = (1 + 0.2 * jax.random.normal(sub, param.shape)).astype(param.dtype)
    return model


def random_bundle(seed: int = 0, *, eos_token_ids: tuple[int, ...] = (), drafter: bool = True,
                  block_size: int = 8, drafter_layers: int = 2, **config_options) -> Bundle:
    """A bundle with a small random target (`random_config` options) and, unless `drafter=False`,
    a random drafter and a random Weaver adapter for it."""
    target = random_target(random_config(**config_options), seed)
    draft = adapt = None
    if drafter:
        dconfig = random_drafter_config(target.config, num_layers=drafter_layers, block_size=block_size)
        draft = Drafter(dconfig, rngs=nnx.Rngs(seed + 7))
        adapt = Adapter(random_adapter_config(target.config, depth=block_size - 1), rngs=nnx.Rngs(seed + 11))
    return Bundle(target, drafter=draft, adapter=adapt, eos_token_ids=tuple(eos_token_ids), name=f"random-{seed}")
