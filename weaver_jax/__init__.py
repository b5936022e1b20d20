"""weaver_jax: lossless speculative decoding for JAX with Weaver trees.

Public API: `load`, `shard` (a bundle over a device mesh), `generate` (host wrapper), `stream` (one sequence's
tokens and text as rounds complete), the pure jitted `ar_generate` and
`spec_generate`, the modules `Transformer`, `HybridTransformer` (Qwen3.5 Gated DeltaNet hybrids),
`Drafter`, `Adapter` with their configs, `KVCache` and `HybridCache`,
`Tree`, `Sampling`; `weaver_jax.testing` builds random models.
"""

from weaver_jax._adapter import Adapter, AdapterConfig
from weaver_jax._config import ModelConfig, RopeScaling, qwen3_8b, smollm2_135m
from weaver_jax._drafter import Drafter, DrafterConfig
from weaver_jax._generate import (
    AROutput,
    GenerateResult,
    ar_generate,
    exact_jit,
    generate,
    proposal_tree,
    sequence_keys,
)
from weaver_jax._hybrid import HybridCache, HybridConfig, HybridTransformer
from weaver_jax._load import Bundle, load
from weaver_jax._model import ForwardOutput, KVCache, Transformer, target_from_params
from weaver_jax._sampling import Sampling
from weaver_jax._sharding import shard
from weaver_jax._speculative import SpecOutput, spec_generate
from weaver_jax._stream import StreamChunk, TokenStream, stream
from weaver_jax._tokenizer import Tokenizer
from weaver_jax._tree import Tree

__all__ = [
    "AROutput", "Adapter", "AdapterConfig", "Bundle", "Drafter", "DrafterConfig", "ForwardOutput", "GenerateResult",
    "HybridCache", "HybridConfig", "HybridTransformer", "KVCache", "ModelConfig", "RopeScaling", "Sampling",
    "SpecOutput", "StreamChunk", "TokenStream", "Tokenizer", "Transformer", "Tree",
    "ar_generate", "exact_jit", "generate", "load", "proposal_tree", "qwen3_8b", "sequence_keys", "shard",
    "smollm2_135m", "spec_generate", "stream",
    "target_from_params",
]
from weaver_jax import testing  # noqa: E402, F401  (weaver_jax.testing.random_bundle)
