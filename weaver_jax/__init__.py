"""weaver_jax: lossless speculative decoding for JAX with Weaver trees.

Public API: `load`, `generate` (host wrapper) and `ar_generate` (the pure jitted function),
`Transformer`, `KVCache`, `ModelConfig`, `Sampling`; `weaver_jax.testing` builds random models.
"""

from weaver_jax._config import ModelConfig, RopeScaling, qwen3_8b, smollm2_135m
from weaver_jax._generate import AROutput, GenerateResult, ar_generate, generate, sequence_keys
from weaver_jax._load import Bundle, load
from weaver_jax._model import ForwardOutput, KVCache, Transformer, target_from_params
from weaver_jax._sampling import Sampling
from weaver_jax._tokenizer import Tokenizer

__all__ = [
    "AROutput", "Bundle", "ForwardOutput", "GenerateResult", "KVCache", "ModelConfig", "RopeScaling",
    "Sampling", "Tokenizer", "Transformer", "ar_generate", "generate", "load", "qwen3_8b",
    "sequence_keys", "smollm2_135m", "target_from_params",
]
from weaver_jax import testing  # noqa: E402, F401  (weaver_jax.testing.random_bundle)
