"""`weaver-convert`: PyTorch / Hugging Face / GGUF weights -> a weaver_jax checkpoint directory.

    weaver-convert target SRC DST [--dtype bfloat16|float32]
    weaver-convert drafter SRC DST [--dtype ...] [--target-layers N]
    weaver-convert adapter SRC.pt DST [--dtype ...]

target: SRC is a Hugging Face directory (config.json + model.safetensors, a sharded index, or
pytorch_model.bin / .pth read weights-only; Llama 3.x, SmolLM2, Qwen2.5, Qwen3, and the hybrid Gated DeltaNet
Qwen3.5 / Qwen3.6 (text-only or a multimodal checkpoint's language model) and dense-MLP Qwen3-Next) or a GGUF file
(llama, qwen2); `weaver_jax.load(DST)` reads it.
drafter: SRC is a DFlash drafter directory (published z-lab layout); `weaver_jax.load(TARGET,
drafter=DST)` reads it. `--target-layers` gives the target's layer count when the drafter's config
has no target_layer_ids (DFlash's default rule then applies).
adapter: SRC is a published Weaver adapter file (torch.save of {config, state_dict});
`weaver_jax.load(TARGET, drafter=..., adapter=DST)` reads it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def convert_target(src: Path, dst: Path, dtype: str) -> str:
    from weaver_jax._tokenizer import Tokenizer
    from weaver_jax.convert import checkpoint, gguf, hf

    checkpoint.require_new(dst)  # before any work
    tokenizer = None
    if src.is_dir():
        target = hf.load_hf_target(src, dtype, progress=True)
        tokenizer = Tokenizer.from_directory(src)
    elif src.exists():
        target = gguf.load_gguf_target(src, dtype, progress=True)
        metadata = gguf.open_gguf(src).metadata
        if "tokenizer.ggml.tokens" in metadata:
            tokenizer = Tokenizer.from_gguf_metadata(metadata)
    else:
        raise FileNotFoundError(f"{src} does not exist")
    checkpoint.save(dst, target, tokenizer)
    c = target.config
    params = sum(int(x.size) for x in _leaves(target))
    return (f"{src} -> {dst}: {c.family}, {c.num_layers} layers, width {c.hidden_size}, vocab {c.vocab_size}, "
            f"{params / 1e6:.1f}M parameters in {dtype}{', tokenizer included' if tokenizer else ''}")


def convert_drafter(src: Path, dst: Path, dtype: str, target_layers: int | None) -> str:
    from weaver_jax.convert import checkpoint, dflash

    checkpoint.require_new(dst)  # before any work
    drafter = dflash.load_dflash_drafter(src, dtype, progress=True, num_target_layers=target_layers)
    checkpoint.save(dst, drafter)
    c = drafter.config
    return (f"{src} -> {dst}: DFlash drafter, {c.num_layers} layers, block {c.block_size}, target layers "
            f"{list(c.target_layer_ids)}, mask token {c.mask_token_id}, "
            f"{sum(int(x.size) for x in _leaves(drafter)) / 1e6:.1f}M parameters in {dtype}")


def convert_adapter(src: Path, dst: Path, dtype: str) -> str:
    from weaver_jax.convert import checkpoint, weaver

    checkpoint.require_new(dst)  # before any work
    adapter = weaver.load_published_adapter(src, dtype, progress=True)
    checkpoint.save(dst, adapter)
    c = adapter.config
    return (f"{src} -> {dst}: Weaver adapter, {c.num_layers} layers, width {c.d_rank}, K {c.K}, pool "
            f"{c.candidate_pool_size}, for targets of width {c.d_model}, "
            f"{sum(int(x.size) for x in _leaves(adapter)) / 1e6:.2f}M parameters in {dtype}")


def _leaves(target):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(target, nnx.Param))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weaver-convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("target", help="a target model (Hugging Face directory or GGUF file)")
    t.add_argument("src", type=Path)
    t.add_argument("dst", type=Path)
    t.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d = sub.add_parser("drafter", help="a DFlash drafter directory")
    d.add_argument("src", type=Path)
    d.add_argument("dst", type=Path)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument("--target-layers", type=int, default=None)
    a = sub.add_parser("adapter", help="a published Weaver adapter file")
    a.add_argument("src", type=Path)
    a.add_argument("dst", type=Path)
    a.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    try:
        if args.kind == "target":
            print(convert_target(args.src, args.dst, args.dtype))
        elif args.kind == "adapter":
            print(convert_adapter(args.src, args.dst, args.dtype))
        else:
            print(convert_drafter(args.src, args.dst, args.dtype, args.target_layers))
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
