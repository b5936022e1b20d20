"""A conversation that keeps its KV cache between turns, and `weaver-jax chat`'s terminal loop.

Each turn renders the whole conversation with the chat template, but only the tokens past what the caches
already hold are prefilled: the caches keep every earlier turn (the prompt and all generated tokens but the
last, which opens the next turn's prefill). Where the rendering of the history differs from the tokens that
were generated (a template that strips whitespace, text that re-tokenizes differently), the caches are cut
back to the common prefix (a hybrid target's recurrent state cannot be: it starts over).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from weaver_jax._auto import Plan, tree_nodes
from weaver_jax._generate import target_parameters
from weaver_jax._hybrid import HybridCache
from weaver_jax._model import fresh_cache
from weaver_jax._stream import Run, Text, TokenStream

SAMPLING = ("temperature", "top_k", "top_p", "seed", "exact", "eos_token_id")
HELP = "commands: /stats (the last answer's speed and acceptance), /reset (forget the conversation), /quit"


class Conversation:
    """Turns of a chat with `bundle` (which needs a tokenizer with a chat template): `reply(text)` streams the
    answer (`StreamChunk`s) and keeps the caches for the next turn. `context`: the cache's slots (default: the
    target's maximum, at most 4096); `max_new_tokens` per answer; the rest are `generate`'s options."""

    def __init__(self, bundle, *, method: str = "weaver", max_new_tokens: int = 512, context: int | None = None,
                 **options):
        if bundle.tokenizer is None:
            raise ValueError("a chat needs the bundle's tokenizer (bundle.tokenizer is None)")
        self.bundle, self.method, self.max_new_tokens, self.options = bundle, method, max_new_tokens, options
        self.context = context or min(bundle.config.max_seq_len, 4096)
        self.parameters = target_parameters(nnx.split(bundle.target)[1])  # for the default tree budget
        self.plan = None
        if method == "auto":  # chosen once: the caches kept between turns are plain decoding's or the tiers'
            self.plan = Plan(bundle, [[0]], options.get("temperature", 0), options.get("exact", False),
                             self._method_options())
            self.method = "auto" if self.plan.loop_tiers else "ar"
        self.stats: dict = {}
        self.prefilled = 0  # tokens the last turn's prefill covered
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = []
        self.cached: list[int] = []  # the tokens whose K/V the caches hold
        target, drafter = self.bundle.target, self.bundle.drafter
        self.caches = (fresh_cache(target, 1, self.context),) + (
            () if self.method == "ar" else (fresh_cache(drafter, 1, self.context),))

    def _rewind(self, tokens: list[int]) -> list[int]:
        """-> the tokens to prefill: past the longest prefix of `tokens` the caches hold (cut back to it)."""
        held = min(len(tokens), len(self.cached))
        same = next((i for i in range(held) if tokens[i] != self.cached[i]), held)
        if same == len(tokens):  # at least one token to prefill: it gives the first new token's logits
            same -= 1
        if same < len(self.cached):
            if any(isinstance(c, HybridCache) for c in self.caches):
                self.reset()  # a recurrent state cannot be cut back
                return tokens
            self.caches = tuple(c.with_lengths(jnp.full((1,), same, jnp.int32)) for c in self.caches)
            self.cached = self.cached[:same]
        return tokens[same:]

    def reply(self, text: str) -> TokenStream:
        """Add a user message and stream the answer; the answer joins the conversation when the stream ends
        (or is closed early: then as far as it was generated)."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.bundle.tokenizer.apply_chat_template(self.messages)
        new = self._rewind(prompt)
        pad = -(-len(new) // 64) * 64  # few prompt shapes, so few compilations of the prefill
        # what a call needs past the cache's tokens: the padded prompt, the answer and a tree, rounded up to 128
        room = (self.context - len(self.cached) - pad - self._tree_nodes()) // 128 * 128
        if room < 16:
            self.messages.pop()
            raise ValueError(f"the conversation fills the {self.context}-token context: /reset to start over")
        self.prefilled = len(new)
        options = self.options if self.method != "ar" else {k: v for k, v in self.options.items() if k in SAMPLING}
        run = Run(self.bundle, [new], method=self.method, max_new_tokens=min(self.max_new_tokens, room),
                  caches=self.caches, pad_to=pad, plan=self.plan, **options)
        stream = TokenStream(run, Text(self.bundle.tokenizer))
        return _Turn(self, stream, run, new)

    def _method_options(self) -> dict:
        return {k: v for k, v in self.options.items() if k not in SAMPLING}

    def _tree_nodes(self) -> int:
        return tree_nodes(self.bundle, self.method, {} if self.method == "ar" else self._method_options(),
                          sampled=self.options.get("temperature", 0) > 0, batch=1, parameters=self.parameters)

    def _end_turn(self, run: Run, new: list[int], stream: TokenStream) -> None:
        answer = run.generated(0)  # what the caches hold, even past what was read
        state = run.state
        self.caches = (state.cache,) if run.method == "ar" else (state.cache, state.drafter_cache)
        self.cached += new + answer[:-1]
        self.messages.append({"role": "assistant",
                              "content": self.bundle.tokenizer.decode(answer, skip_special_tokens=True)})
        self.stats = stream.stats or run.stats([answer], ["stop"])


class _Turn:
    """A `TokenStream` that hands its caches back to the conversation when it ends or is closed."""

    def __init__(self, conversation: Conversation, stream: TokenStream, run: Run, new: list[int]):
        self._conversation, self._stream, self._run, self._new = conversation, stream, run, new

    def __iter__(self):
        try:
            yield from self._stream
        finally:
            self._conversation._end_turn(self._run, self._new, self._stream)

    def __getattr__(self, name: str):  # the stream's `tokens`, `text`, `finish_reason`, `stats`
        return getattr(self._stream, name)


def repl(conversation: Conversation, read: Callable[[str], str] = input, write=sys.stdout.write) -> None:
    """The terminal loop: a line is a message (or a command); Ctrl-C ends the current answer, Ctrl-D quits."""
    write(f"weaver-jax chat ({conversation.bundle.name or 'model'}, method {conversation.method}). {HELP}\n")
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            continue
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            conversation.reset()
            write("(the conversation starts over)\n")
            continue
        if line == "/stats":
            write(_stats_line(conversation.stats) + "\n")
            continue
        if line.startswith("/"):
            write(f"unknown command {line.split()[0]}; {HELP}\n")
            continue
        t0, first = time.perf_counter(), None
        try:
            with contextlib.closing(iter(conversation.reply(line))) as chunks:  # closed: the turn is kept
                for chunk in chunks:
                    first = first or time.perf_counter() - t0
                    write(chunk.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            write(" [stopped]")
        except ValueError as e:
            write(f"error: {e}")
        conversation.stats["first_token_seconds"] = first
        write("\n")


def _stats_line(stats: dict) -> str:
    if "new_tokens" not in stats:
        return "no answer yet"
    parts = [f"{stats['new_tokens']} tokens", f"{stats['tokens_per_second']:.1f} tokens/s"]
    if stats.get("first_token_seconds"):
        parts.append(f"first token after {stats['first_token_seconds'] * 1e3:.0f} ms")
    if "mean_accepted_length" in stats:
        hist = np.asarray(stats["accepted_length_histogram"])
        parts += [f"τ {stats['mean_accepted_length']:.2f} tokens per verification",
                  "tokens per round: " + " ".join(f"{n}:{c}" for n, c in enumerate(hist) if c)]
    return ", ".join(parts)
