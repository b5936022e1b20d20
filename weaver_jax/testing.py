"""Small random models for tests and examples."""

from __future__ import annotations

from flax import nnx

from weaver_jax._adapter import Adapter, random_adapter_config
from weaver_jax._config import ModelConfig, RopeScaling
from weaver_jax._drafter import Drafter, random_drafter_config
from weaver_jax._hybrid import qwen_layer_types, random_hybrid
from weaver_jax._load import Bundle
from weaver_jax._model import Transformer
from weaver_jax._tokenizer import Tokenizer


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


def random_hybrid_config(*, vocab_size: int = 128, hidden_size: int = 32, num_layers: int = 3,
                         layer_types: tuple[str, ...] | None = None, max_seq_len: int = 512,
                         tie_embeddings: bool = False, dtype: str = "float32") -> dict:
    """`random_hybrid`'s options for a small Qwen3.5-style target: Qwen's schedule (every fourth layer
    full attention, the last one if there are fewer) unless `layer_types` is given."""
    return dict(vocab_size=vocab_size, hidden_size=hidden_size,
                layer_types=tuple(layer_types or qwen_layer_types(num_layers, min(4, num_layers))),
                linear_key_head_dim=16, linear_value_head_dim=16,  # the smallest the tree-GDN kernel takes
                max_seq_len=max_seq_len, tie_embeddings=tie_embeddings, dtype=dtype)


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


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(vocab_size: int = 128) -> Tokenizer:
    """A tokenizer for random targets: ids 0-1 the control tokens <|im_start|> and <|im_end|> (an end of
    generation), then one byte each - newline, printable ASCII, the bytes of "é" and "€", other bytes >= 0x80
    (so random output meets characters split over tokens, and invalid UTF-8) - and a ChatML template."""
    if vocab_size < 98:
        raise ValueError(f"vocab_size must be >= 98 (2 control tokens, newline, printable ASCII), got {vocab_size}")
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    byte_char = dict(zip(printable, map(chr, printable), strict=True))  # GPT-2's byte-level alphabet
    byte_char |= {b: chr(0x100 + n) for n, b in enumerate(b for b in range(256) if b not in byte_char)}
    split = [0xC3, 0xA9, 0xE2, 0x82, 0xAC]  # "é" and "€" over 2 and 3 tokens
    ids = [0x0A, *range(0x20, 0x7F), *split, *(b for b in range(0x80, 0x100) if b not in split)][: vocab_size - 2]
    tokens = ["<|im_start|>", "<|im_end|>", *(byte_char[b] for b in ids)]
    return Tokenizer.from_bpe(tokens, [], [3, 3] + [1] * len(ids), "default", bos_token_id=None, eos_token_ids=[1],
                              chat_template=CHAT_TEMPLATE)


def random_bundle(seed: int = 0, *, eos_token_ids: tuple[int, ...] = (), drafter: bool = True,
                  block_size: int = 8, drafter_layers: int = 2, family: str = "llama", tokenizer: bool = False,
                  **config_options) -> Bundle:
    """A bundle with a small random target and, unless `drafter=False`, a random drafter and a random
    Weaver adapter for it. family "llama" / "qwen2" / "qwen3": `random_config` options; "qwen3_5": a
    hybrid Gated DeltaNet target (`random_hybrid_config` options: by default both layer kinds). tokenizer:
    a `byte_tokenizer` of the target's vocabulary (EOS ids stay `eos_token_ids`)."""
    if family == "qwen3_5":
        target = random_hybrid(seed, **random_hybrid_config(**config_options))
    else:
        target = random_target(random_config(family=family, **config_options), seed)
    draft = adapt = None
    if drafter:
        dconfig = random_drafter_config(target.config, num_layers=drafter_layers, block_size=block_size)
        draft = Drafter(dconfig, rngs=nnx.Rngs(seed + 7))
        adapt = Adapter(random_adapter_config(target.config, depth=block_size - 1), rngs=nnx.Rngs(seed + 11))
    return Bundle(target, byte_tokenizer(target.config.vocab_size) if tokenizer else None, drafter=draft,
                  adapter=adapt, eos_token_ids=tuple(eos_token_ids), name=f"random-{seed}")


def float32_copy(target: Transformer) -> Transformer:
    """The same target with float32 weights (a reference for a bfloat16 one's rounding)."""
    import dataclasses

    from weaver_jax._model import module_params, target_from_params

    return target_from_params(dataclasses.replace(target.config, dtype="float32"), module_params(target))


def rounding_explanation(target: Transformer, reference: Transformer, prompt: list[int], ar: list[int],
                         other: list[int]) -> dict:
    """Why `other` (a speculative method's greedy tokens) leaves `ar`'s for `prompt`, if rounding.

    At the first differing token i, the float32 `reference` gives the logits l32 after prompt + ar[:i],
    and delta is the largest |target - reference| logit difference there, `target` (bfloat16) run as a
    prefill, several rows at once like a verification. A decode step and a tree both compute the
    logits within about delta of l32, rounding in different orders, so their argmaxes can disagree only
    between tokens whose float32 logits are within 2 delta: `explained` is |l32[ar[i]] - l32[other[i]]|
    <= 2 delta. Also: `bf16_top_two_gap` of the target's logits there."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    i = next(j for j, (a, b) in enumerate(zip(ar + [-1], other + [-2], strict=False)) if a != b)
    if i >= min(len(ar), len(other)):  # one stopped first (EOS or length) after equal tokens
        return dict(first_difference=i, explained=False, note="lengths differ")
    context = prompt + ar[:i]
    width = -(-len(context) // 128) * 128  # few shapes: one compile per 128 tokens
    ids = jnp.asarray(np.pad(context, (0, width - len(context)))[None], jnp.int32)

    def logits(model):
        out = model(ids, jnp.arange(width)[None], model.init_cache(1, width),
                    logits_rows=jnp.asarray([[len(context) - 1]]))
        return np.asarray(out.logits[0, 0], np.float64)

    with jax.default_matmul_precision("highest"):  # a GPU's float32 default rounds products through TF32
        l32 = logits(reference)
    l16 = logits(target)
    delta = float(np.abs(l16 - l32).max())
    gap = float(abs(l32[ar[i]] - l32[other[i]]))
    top = np.sort(l16)[-2:]
    return dict(first_difference=i, ar_token=ar[i], other_token=other[i], gap_float32=gap, delta=delta,
                bf16_top_two_gap=float(top[1] - top[0]), explained=gap <= 2 * delta)
