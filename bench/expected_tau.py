"""Expected τ of one round, without sampling noise: a quick way to compare tree builders and their
options on CPU before spending GPU time on full τ runs (bench/tau.py).

    python bench/expected_tau.py --prompts .stage/prompts/prompts.json --per-set 16 \
        --config ddtree:budget=64 --config weaver:budget=64,expansions_per_call=8 --json out.json

Contexts: prompts from `weaver-jax train-prompts`'s prompts.json (the *training* mix, never the
evaluation sets, so option choices are not tuned on them), each continued by the target at
temperature 1 (or greedily: `--continuation-temperature 0`, what greedy decoding meets) and cut at
random points. For each context and configuration one round is drafted, built and verified, and
scored two ways:
- greedy τ: the tokens the temperature-0 walk accepts plus the bonus (what `generate` would emit);
- expected τ at temperature 1: 1 + the sum over nodes of the target's probability of the node's
  path - the mean number of tokens target-only sampling accepts from this tree, plus the bonus;
  also by depth (`expected_tau_t1_by_depth`: where a tree's expected tokens come from).
Both are per round and pooled as means with standard errors; the contexts are the same for every
configuration, so differences between configurations are paired.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tau import parse_options  # noqa: E402

import weaver_jax as wj  # noqa: E402
from weaver_jax import _generate, _speculative  # noqa: E402


@functools.partial(jax.jit, static_argnames=(*_speculative._STATIC, "coupled"))
def round_scores(params, drafter_params, cache, drafter_cache, prompts, prompt_lengths, keys, adapter_params=None,
                 tables=None, limit=None, eos_ids=(), *,
                 graphdef, drafter_graphdef, adapter_graphdef=None, method, options=(), max_new_tokens,
                 sampling=_speculative._GREEDY, kernels=(), exact=False, coupled=True):
    """`spec_first_round`'s arguments -> (greedy τ `[B]`, expected τ at temperature 1 by depth `[B, K + 1]`:
    the summed path probability of each depth's nodes, the root's 1 first; its sum is the expected τ of
    independent draws; sampled τ `[B]`: the walk of the round's own draws at `sampling` - with the tree
    coupled to them, as `generate` builds it, unless `coupled=False`)."""
    p = _speculative._parts(params, drafter_params, adapter_params, graphdef, drafter_graphdef, adapter_graphdef,
                            method, options, exact, tables)
    s = _speculative._prefill(p, cache, drafter_cache, prompts, prompt_lengths, keys, sampling, eos_ids,
                              max_new_tokens, limit)
    build = sampling if coupled else _speculative._GREEDY  # what the tree is built for
    noise = _speculative.round_noise(p, s, keys, sampling)
    tree, ancestors, verify = _speculative._propose_and_verify(p, s, noise, build)
    rows = jnp.arange(tree.tokens.shape[0])
    greedy = _speculative.walk_choices(tree, jnp.argmax(verify.logits, -1).astype(jnp.int32), p.depth, ancestors)
    draws = _speculative.depth_choices(tree, verify.logits, noise, sampling)
    sampled = _speculative.walk_choices(tree, draws, p.depth, ancestors)
    parent = jnp.maximum(tree.parent, 0)
    probs = jax.nn.softmax(verify.logits, -1)
    own = jnp.where(tree.valid & (tree.parent >= 0), probs[rows[:, None], parent, tree.tokens], 0.0)  # [B, N]

    def reach(i, r):  # parents come before children, so one pass in node order
        return r.at[:, i].set(r[rows, parent[:, i]] * own[:, i])

    path_probability = jax.lax.fori_loop(1, tree.size, reach, jnp.ones(own.shape).at[:, 1:].set(0.0))
    # invalid nodes have probability 0 (`own`), so they add nothing to their depth-0 slot
    by_depth = jnp.zeros((own.shape[0], p.depth + 1)).at[rows[:, None], tree.depth].add(path_probability)
    return greedy.length, by_depth, sampled.length  # the root's 1 stands for the bonus


def parse_config(text: str) -> tuple[str, dict]:
    method, _, rest = text.partition(":")
    return method, parse_options(rest)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", help="a drafter checkpoint instead of the model's shipped one")
    parser.add_argument("--adapter", help="an adapter checkpoint instead of the model's shipped one")
    parser.add_argument("--prompts", type=Path, default=Path(".stage/prompts/prompts.json"))
    parser.add_argument("--per-set", type=int, default=16, help="prompts drawn from each set of prompts.json")
    parser.add_argument("--cuts", type=int, default=2, help="contexts cut from each continuation")
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--continuation-temperature", type=float, default=1.0,
                        help="0: contexts cut from the target's greedy answers, where greedy τ is a decode's own "
                        "(long confident stretches: depth counts more than on sampled text)")
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--config", action="append", required=True, help="method:option=value,... (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="> 0: also the τ of the round's own draws at this temperature (sampled_tau), the tree "
                        "coupled to them as `generate` builds it; each context --draws times with other keys")
    parser.add_argument("--draws", type=int, default=1)
    parser.add_argument("--uncoupled", action="store_true", help="with --temperature: trees from the drafter's "
                        "logits alone (as before coupled drafts), for comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bundle = wj.load(args.model, drafter=args.drafter, adapter=args.adapter)
    rng = np.random.default_rng(args.seed)
    texts = []
    for items in json.loads(args.prompts.read_text()).values():
        if isinstance(items, list) and items:
            picks = rng.choice(len(items), min(args.per_set, len(items)), replace=False)
            texts += [items[i]["text"] if isinstance(items[i], dict) else items[i] for i in picks]
    prompts = [bundle.tokenizer.apply_chat_template([{"role": "user", "content": t}])[: args.max_prompt]
               for t in texts]
    out = wj.generate(bundle, prompts, max_new_tokens=args.continuation, temperature=args.continuation_temperature,
                      seed=args.seed + 1)
    contexts = [list(p) + list(o[:c]) for p, o in zip(prompts, out.tokens, strict=True)
                for c in rng.integers(0, max(1, len(o) - 1), args.cuts)]
    contexts = contexts * (args.draws if args.temperature > 0 else 1)  # the copies draw with other keys
    rows = []
    for text in args.config:
        method, options = parse_config(text)
        t0 = time.time()
        fn, static, call = _generate._prepare(bundle, contexts, method, bundle.drafter.config.block_size + 1,
                                              args.temperature, 0, 1.0, args.seed, [], options, round_only=True)
        greedy, by_depth, sampled = (np.asarray(x, np.float64)
                                     for x in round_scores(*call, **static, coupled=not args.uncoupled))
        expected = by_depth.sum(1)
        extra = {}
        if args.temperature > 0:
            extra = dict(temperature=args.temperature, coupled=not args.uncoupled, draws=args.draws,
                         sampled_tau=sampled.mean(), sampled_tau_se=sampled.std() / np.sqrt(len(sampled)))
        row = dict(config=text, drafter=args.drafter or "shipped", adapter=args.adapter or "shipped",
                   contexts=len(contexts), continuation=args.continuation,
                   continuation_temperature=args.continuation_temperature, greedy_tau=greedy.mean(),
                   greedy_tau_se=greedy.std() / np.sqrt(len(greedy)), expected_tau_t1=expected.mean(),
                   expected_tau_t1_se=expected.std() / np.sqrt(len(expected)),
                   expected_tau_t1_by_depth=by_depth.mean(0).round(4).tolist(), seconds=time.time() - t0,
                   device=jax.devices()[0].device_kind, **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
