"""`weaver-jax` console script.

    weaver-jax generate "What is the capital of France?" --max-new-tokens 64
    weaver-jax generate --ids 1,4093,198 --model path/to/model.gguf --json
    weaver-jax chat                                   # a chat in the terminal, answers streamed
    weaver-jax tune                                   # time method="auto"'s tiers on this device (once)
    weaver-jax serve --port 8000                      # OpenAI-compatible: /v1/chat/completions, /v1/completions

Training a drafter and an adapter for a target (each step resumes where an interrupted run stopped):

    weaver-jax train-prompts data/prompts            # CPU: the prompt mix and the evaluation sets
    weaver-jax train-data data/prompts/prompts.json data/train   # GPU: the target's own responses
    weaver-jax train-drafter data/train runs/drafter --export out/drafter
    weaver-jax train-adapter data/train runs/adapter --drafter out/drafter --export out/adapter
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from flax import nnx

import weaver_jax

METHODS = ["auto", "ar", "dflash", "ddtree", "weaver"]


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
    options = dict(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, **_method_options(args))
    stream = sys.stdout.isatty() if args.stream is None else args.stream
    if stream and not args.json and bundle.tokenizer is not None:
        chunks = weaver_jax.stream(bundle, ids, **options)
        for chunk in chunks:
            print(chunk.text, end="", flush=True)
        print()
        s = chunks.stats
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tokens/s with compilation, "
              f"{s['rounds']} rounds]", file=sys.stderr)
        return 0
    result = weaver_jax.generate(bundle, [ids], **options)
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


def _method_options(args) -> dict:
    if args.budget is not None and args.method not in ("ddtree", "weaver"):
        raise SystemExit(f"error: --budget is a tree's size: it needs --method ddtree or weaver, not {args.method}")
    return {} if args.budget is None else {"budget": args.budget}


def _tune(args) -> int:
    from weaver_jax._auto import cost_file, tune

    bundle = weaver_jax.load(args.model, dtype=args.dtype)
    rows = tune(bundle, batch_sizes=args.batch, temperatures=args.temperature, exact=args.exact)
    for row in rows:
        times = ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in row["round_ms"].items())
        compiles = row["compile_seconds"]
        print(f"B = {row['batch']}, T = {row['temperature']:g}: ms per round {times}; fastest at the prior "
              f"acceptance: {row['fastest']} ({row['seconds']} s; compiling the prefill {compiles['prefill']} s, "
              f"the slowest tier {compiles['slowest_tier']} s)")
    print(f"kept in {cost_file()}")
    return 0


def _chat(args) -> int:
    from weaver_jax._chat import Conversation, repl

    bundle = weaver_jax.load(args.model, dtype=args.dtype)
    conversation = Conversation(bundle, method=args.method, max_new_tokens=args.max_new_tokens, context=args.context,
                                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                **_method_options(args))
    repl(conversation)
    return 0


def _serve(args) -> int:
    from weaver_jax._serve import serve

    bundle = weaver_jax.load(args.model, dtype=args.dtype)
    serve(bundle, host=args.host, port=args.port, model_name=args.model, method=args.method,
          max_batch=args.max_batch, max_queue=args.max_queue, context=args.context,
          api_key=args.api_key or os.environ.get("WEAVER_JAX_API_KEY"), warmup=tuple(args.warmup),
          **_method_options(args))
    return 0


def _train_prompts(args) -> int:
    from weaver_jax import _prompts

    packages = Path(args.packages) if args.packages else Path(args.out) / "packages"
    if not args.offline:
        _prompts.fetch_distributions(packages)
    mix = _prompts.training_prompts(packages, code_prompts=args.code_prompts,
                                    samples_per_request=args.samples_per_request, seed=args.seed,
                                    code_roots=tuple(Path(r) for r in args.code_root),
                                    exclude=tuple(json.loads(Path(e).read_text()) for e in args.exclude))
    if len(mix["code"]) < args.code_prompts and not args.exclude:
        print(f"note: the code sources hold {len(mix['code'])} prompts, fewer than --code-prompts "
              f"{args.code_prompts} (add sources with --code-root DIR)")
    evaluation = _prompts.evaluation_sets(packages)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prompts.json").write_text(json.dumps(mix))
    (out / "eval_prompts.json").write_text(json.dumps(evaluation))
    print(f"training prompts: {', '.join(f'{k} {len(v)}' for k, v in mix.items())}; evaluation: "
          f"{', '.join(f'{k} {len(v)}' for k, v in evaluation.items())} -> {out}")
    return 0


def _train_data(args) -> int:
    from weaver_jax._train_data import generate_dataset, spread

    prompts = json.loads(Path(args.prompts).read_text())
    held_out = any(isinstance(item, dict) for items in prompts.values() for item in items)  # {"text": ...} items
    if args.held_out != held_out:
        raise ValueError(f"{args.prompts} is {'an eval_prompts.json (held-out sets)' if held_out else 'a training mix'}"
                         f": {'add' if held_out else 'drop'} --held-out")
    if held_out and args.sampled_copies:
        raise ValueError("--held-out answers greedily only: drop --sampled-copies")
    if held_out:  # every set's prompts as chat messages, answered greedily (what tau.py decodes)
        prompts = {"chat": [item["text"] for items in prompts.values() for item in items]}
    if args.limit:
        prompts = {k: spread(v, args.limit) for k, v in prompts.items()}
    bundle = weaver_jax.load(args.model, dtype=args.dtype)
    out = generate_dataset(bundle, prompts, args.out, batch=args.batch, max_prompt_tokens=args.max_prompt_tokens,
                           max_new_tokens=args.max_new_tokens, seed=args.seed,
                           sampled_copies=0 if held_out else 1 if args.sampled_copies is None else args.sampled_copies)
    print(f"data -> {out}")
    return 0


def _mask_token_id(bundle) -> int:
    """The highest-id control token that is neither BOS nor EOS (SmolLM2: 16, `<empty_output>`)."""
    tok = bundle.tokenizer
    if tok is None:
        return bundle.config.vocab_size - 1
    specials = [i for i in tok.special_ids if i != tok.bos_token_id and i not in tok.eos_token_ids]
    return max(specials) if specials else bundle.config.vocab_size - 1


def _module_config(run_dir, kind: str, proposed):
    """A training run keeps its module config in `run_dir/module.json` (written by `_fit_and_export`
    once the run's inputs check): a resumed run reuses it and refuses flags that would change it."""
    path = Path(run_dir) / "module.json"
    if path.exists():
        stored = json.loads(path.read_text())
        fresh = json.loads(json.dumps(dataclasses.asdict(proposed)))
        if stored != fresh:
            changed = sorted(k for k in fresh if stored.get(k) != fresh[k])
            raise ValueError(f"{run_dir} was started with another {kind} config (differs in {changed}); "
                             "resume with the same flags or choose a new run directory")
    return proposed


def _init_module(path, kind: str, config):
    """The parameters a run starts from (`--init`): a weaver_jax checkpoint of this kind and config."""
    from weaver_jax.convert import checkpoint

    path = Path(path)
    if not checkpoint.is_checkpoint(path):
        raise FileNotFoundError(f"--init {path} is not a weaver_jax checkpoint (train-export or --export writes one)")
    if checkpoint.kind_of(path) != kind:
        raise ValueError(f"--init {path} is a checkpoint of kind {checkpoint.kind_of(path)!r}, not {kind!r}")
    module = checkpoint.load(path, config.dtype)[0]
    if module.config != config:
        changed = sorted(f.name for f in dataclasses.fields(config)
                         if getattr(module.config, f.name) != getattr(config, f.name))
        raise ValueError(f"--init {path}: its {kind} differs from the run's in {changed}")
    return module


def _fit_and_export(args, module, loss_fn, frozen, kind: str) -> int:
    from weaver_jax import _train
    from weaver_jax._train_data import load_dataset, subset
    from weaver_jax.convert import checkpoint

    if args.export:  # refused now, not after the whole schedule has run
        checkpoint.require_new(args.export)
    data = load_dataset(args.data)
    if args.max_sequences:
        data = subset(data, args.max_sequences, args.seed)
    config = _train.TrainConfig(steps=args.steps, batch_size=args.batch_size, anchors=args.anchors,
                                learning_rate=args.lr, seed=args.seed, save_every=args.save_every,
                                keep_every=args.keep_every, distill=args.distill)
    if args.init:
        module = _init_module(args.init, kind, module.config)
    elif args.init_step:
        raise ValueError("--init-step needs --init (the parameters to continue from)")
    eval_data = load_dataset(args.eval_data) if args.eval_data else None
    module_json = Path(args.run) / "module.json"
    if not module_json.exists():
        module_json.parent.mkdir(parents=True, exist_ok=True)
        module_json.write_text(json.dumps(dataclasses.asdict(module.config), indent=1))
    module, info = _train.fit(module, loss_fn(config), data, config, args.run,
                              max_seconds=args.max_minutes * 60 if args.max_minutes else None,
                              desc=f"train-{kind}", frozen=frozen, start_step=args.init_step, eval_data=eval_data,
                              mesh=_mesh(args.mesh))
    print(json.dumps({"kind": kind, **info}))
    try:
        _train.plot_log(args.run, Path(args.run) / "loss.png")
    except ImportError:
        print("matplotlib is not installed: no loss plot (the log is in log.jsonl)", file=sys.stderr)
    if not info["finished"]:
        print(f"stopped at step {info['step']} of {config.steps}: run the same command again to resume",
              file=sys.stderr)
    elif args.export:
        _export(module, kind, args.export, args.export_dtype)
    return 0


def _export(module, kind: str, dst, dtype: str) -> None:
    from weaver_jax._model import module_from_params, module_params
    from weaver_jax.convert import checkpoint

    cls, _ = checkpoint.KINDS[kind]
    config = dataclasses.replace(module.config, dtype=dtype)
    checkpoint.save(dst, module_from_params(lambda: cls(config, rngs=nnx.Rngs(0)), config.dtype, module_params(module)))
    print(f"{kind} -> {dst}")


def _train_export(args) -> int:
    """A training run's parameters at a kept step as a weaver_jax checkpoint (a τ-against-steps curve)."""
    from weaver_jax import _train
    from weaver_jax.convert import checkpoint

    path = Path(args.run) / "module.json"
    if not path.exists():
        raise FileNotFoundError(f"{args.run} is not a training run directory (no module.json)")
    cls, config_cls = checkpoint.KINDS[args.kind]
    try:
        config = checkpoint.config_from_fields(config_cls, json.loads(path.read_text()))
    except TypeError as e:
        raise ValueError(f"{args.run} holds no {args.kind} training run: {e}") from e
    module = _train.restore(cls(config, rngs=nnx.Rngs(0)), args.run, args.step)
    _export(module, args.kind, args.out, args.export_dtype)
    return 0


def _train_drafter(args) -> int:
    from weaver_jax import training
    from weaver_jax._drafter import Drafter, DrafterConfig

    bundle = weaver_jax.load(args.model, dtype="float32")
    config = _module_config(args.run, "drafter", DrafterConfig.like(
        bundle.config, num_layers=args.layers, num_features=args.num_features, block_size=args.block_size,
        mask_token_id=_mask_token_id(bundle) if args.mask_token_id is None else args.mask_token_id))

    return _fit_and_export(args, Drafter(config, rngs=nnx.Rngs(args.seed)), training.drafter_loss_fn,
                           (bundle.target,), "drafter")


def _train_adapter(args) -> int:
    from weaver_jax import training
    from weaver_jax._adapter import Adapter, AdapterConfig

    bundle = weaver_jax.load(args.model, dtype="float32", drafter=args.drafter)
    c = bundle.config
    config = _module_config(args.run, "adapter", dataclasses.replace(AdapterConfig.like(
        c, d_rank=args.d_rank, num_layers=args.layers, num_heads=args.heads, mlp_dim=args.mlp_dim,
        K=bundle.drafter.config.block_size - 1, candidate_pool_size=args.pool_size), rope_base=args.rope_base))

    return _fit_and_export(args, Adapter(config, rngs=nnx.Rngs(args.seed)),
                           lambda cfg: training.adapter_loss_fn(cfg, args.pool_size), (bundle.target, bundle.drafter),
                           "adapter")


def _mesh(text: str | None):
    """`--mesh DATAxMODEL` ("4x2") -> a jax Mesh with axes ("data", "model") over the first devices; None: none."""
    if text is None:
        return None
    import jax

    try:
        data, model = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh must be DATAxMODEL, e.g. 4x1, got {text!r}") from None
    if data < 1 or model < 1 or data * model > jax.device_count():
        raise ValueError(f"--mesh {text}: {data * model} devices asked for, {jax.device_count()} present")
    return jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[: data * model])


def _training_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("data", help="directory written by `weaver-jax train-data`")
    p.add_argument("run", help="run directory: checkpoints, log.jsonl, loss.png; resumed when it exists")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the target: name, .gguf, HF dir or checkpoint")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--distill", type=float, default=0.0,
                   help="weight of the KL to the target's distribution in the loss (0: hard labels only, 1: KL only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-sequences", type=int, default=0,
                   help="train on this many sequences drawn by --seed (0: all): τ against data size")
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--keep-every", type=int, default=0,
                   help="also keep the checkpoints at multiples of this step (for `train-export --step`)")
    p.add_argument("--max-minutes", type=float, default=None, help="checkpoint and stop after this long")
    p.add_argument("--export", help="when training finishes, write a weaver_jax checkpoint here")
    p.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--eval-data", help="held-out sequences (`train-data --held-out`): their metrics at every "
                   "checkpoint, as eval_* in log.jsonl (eval_tau_chain: the chain's τ at T = 0, teacher-forced)")
    p.add_argument("--init", help="a new run starts from this checkpoint's parameters (same config), optimiser fresh")
    p.add_argument("--init-step", type=int, default=0,
                   help="with --init: the step it was exported at; the run continues the schedule from there")
    p.add_argument("--mesh", help="DATAxMODEL devices (e.g. 8x1): data parallel over DATA, the target split over "
                   "MODEL; the run resumes on any other mesh (default: one device)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weaver-jax", description="Speculative decoding for JAX LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("prompt", nargs="?", help="prompt text (chat-templated unless --raw)")
    g.add_argument("--ids", help="comma-separated prompt token ids instead of text")
    g.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF directory")
    g.add_argument("--method", default="auto", choices=METHODS, help="auto: chosen per call from this device's "
                   "measured round times (weaver-jax tune) and the running acceptance")
    g.add_argument("--budget", type=int, help="the tree's nodes (ddtree, weaver; default: the method's)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    g.add_argument("--raw", action="store_true", help="encode the prompt as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the text as it is generated (default: when the output is a terminal)")

    p = sub.add_parser("chat", help="a multi-turn chat in the terminal (the conversation's KV cache kept)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF directory")
    p.add_argument("--method", default="auto", choices=METHODS)
    p.add_argument("--budget", type=int, help="the tree's nodes (ddtree, weaver; default: the method's)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per answer")
    p.add_argument("--context", type=int, help="the conversation's tokens (default: the model's, at most 4096)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--method", default="auto", choices=METHODS,
                   help="the default method (a request may name its own, or send speculative: false)")
    p.add_argument("--budget", type=int, help="the default method's tree budget")
    p.add_argument("--max-batch", type=int, default=8, help="requests run together at most (the batch's slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most (then 429)")
    p.add_argument("--context", type=int, help="tokens per slot (default: the model's, at most 8192)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set WEAVER_JAX_API_KEY)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--warmup", type=float, nargs="*", default=[0.0, 1.0], metavar="TEMPERATURE",
                   help="compile the default method's programs for these temperatures before serving (every batch "
                        "size; default 0 and 1, OpenAI's default; none: compile on first use)")

    p = sub.add_parser("tune", help="measure each method=auto tier's round time on this device (kept on disk)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (each a bucket: the next "
                   "power of two)")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                   help="greedy (0) and sampled (> 0) rounds are timed apart")
    p.add_argument("--exact", action="store_true", help="time exact mode's rounds")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)

    p = sub.add_parser("train-prompts", help="CPU: the training prompt mix and the evaluation prompt sets")
    p.add_argument("out", help="directory for prompts.json and eval_prompts.json")
    p.add_argument("--packages", help="where the prompt sets' distributions are (default OUT/packages)")
    p.add_argument("--offline", action="store_true", help="do not download the distributions")
    p.add_argument("--code-prompts", type=int, default=4000)
    p.add_argument("--code-root", action="append", default=[], metavar="DIR",
                   help="more Python sources for code prompts after the standard library (e.g. a site-packages "
                        "folder); repeatable")
    p.add_argument("--samples-per-request", type=int, default=8, help="self-written prompts per topic and kind")
    p.add_argument("--exclude", action="append", default=[], metavar="PROMPTS_JSON",
                   help="an earlier prompts.json whose chat and code prompts are left out (a set of new prompts "
                        "for more data; train-data --seed then samples the written prompts afresh); repeatable")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("train-data", help="the target's own responses to the prompt mix (resumable)")
    p.add_argument("prompts", help="prompts.json from train-prompts (eval_prompts.json with --held-out)")
    p.add_argument("out", help="output directory (part-*.npz, token ids only)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sampled-copies", type=int, default=None, help="temperature-1 responses per prompt, besides "
                   "the greedy one (default 1)")
    p.add_argument("--limit", type=int, default=0, help="use only N prompts of each kind, spread evenly over "
                   "its list (smoke tests, the τ-against-data-size runs)")
    p.add_argument("--held-out", action="store_true", help="PROMPTS is train-prompts' eval_prompts.json: greedy "
                   "answers only, for train-drafter / train-adapter --eval-data")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("train-drafter", help="train a block drafter on train-data output (resumable)")
    _training_arguments(p, steps=4000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-features", type=int, default=3, help="target layers read (DFlash's spacing rule)")
    p.add_argument("--mask-token-id", type=int, default=None)

    p = sub.add_parser("train-adapter", help="train a Weaver adapter with the drafter frozen (resumable)")
    _training_arguments(p, steps=3000)
    p.add_argument("--drafter", required=True, help="the drafter checkpoint (train-drafter --export)")
    p.add_argument("--d-rank", type=int, default=192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--mlp-dim", type=int, default=512)
    p.add_argument("--pool-size", type=int, default=512)
    p.add_argument("--rope-base", type=float, default=10_000.0)

    p = sub.add_parser("train-export", help="export a training run's parameters at a kept step")
    p.add_argument("kind", choices=["drafter", "adapter"])
    p.add_argument("run", help="the run directory of train-drafter / train-adapter")
    p.add_argument("out", help="the weaver_jax checkpoint to write (for weaver_jax.load's drafter= / adapter=)")
    p.add_argument("--step", type=int, default=None, help="a kept step (default: the latest)")
    p.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="bfloat16")

    args = parser.parse_args(argv)
    commands = {"generate": _generate, "chat": _chat, "serve": _serve, "tune": _tune, "train-prompts": _train_prompts,
                "train-data": _train_data, "train-drafter": _train_drafter, "train-adapter": _train_adapter,
                "train-export": _train_export}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
