"""`weaver-jax` console script.

    weaver-jax generate "What is the capital of France?" --max-new-tokens 64
    weaver-jax generate --ids 1,4093,198 --model path/to/model.gguf --json
"""

from __future__ import annotations

import argparse
import json
import sys

import weaver_jax


def _generate(args) -> int:
    bundle = weaver_jax.load(args.model, dtype=args.dtype)
    if (args.prompt is None) == (args.ids is None):
        raise SystemExit("error: give exactly one of a prompt text or --ids")
    if args.ids is not None:
        try:
            ids = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"error: --ids must be comma-separated integers, got {args.ids!r}") from None
    elif bundle.tokenizer is None:
        raise SystemExit(f"error: {args.model} has no tokenizer; pass --ids")
    elif args.raw:
        ids = bundle.tokenizer.encode(args.prompt)
    else:
        ids = bundle.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    result = weaver_jax.generate(
        bundle, [ids], method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    tokens = result.tokens[0]
    text = bundle.tokenizer.decode(tokens, skip_special_tokens=True) if bundle.tokenizer else None
    if args.json:
        print(json.dumps({"prompt_ids": ids, "tokens": tokens, "text": text, "stats": result.stats}))
    else:
        print(text if text is not None else tokens)
        s = result.stats
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tokens/s, "
              f"{s['rounds']} rounds, compile {s['compile_seconds']:.1f}s]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weaver-jax", description="Speculative decoding for JAX LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("prompt", nargs="?", help="prompt text (chat-templated unless --raw)")
    g.add_argument("--ids", help="comma-separated prompt token ids instead of text")
    g.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF directory")
    g.add_argument("--method", default="ar")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
