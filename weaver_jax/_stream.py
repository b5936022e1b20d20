"""Streaming and stop strings: `generate`'s prefill and rounds, a few per jitted call.

`Run` drives a batch through `ar_start` / `ar_advance` (or `spec_start` / `spec_advance`): each call runs up to
`rounds_per_call` rounds on the device and returns the tokens they emitted; the next call is dispatched before
the last one's tokens are read, so the device does not wait on the host between calls (a host callback per
round would). What a sequence emits is what `generate` emits for it: the same functions, keys and order.
`Text` turns a sequence's tokens into text increments safe to show (no half of a UTF-8 character, no text
that may still become a stop string) and finds where a stop string ends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from weaver_jax import _generate

# Rounds per jitted call: a call costs a dispatch and a device-to-host read (~10-60 us), a round 1-20 ms on a GPU
DEFAULT_ROUNDS_PER_CALL = {"ar": 8, "spec": 4}


class StreamChunk(NamedTuple):
    tokens: list[int]  # the ids generated since the last chunk (EOS included when hit)
    text: str  # their text, as far as it is safe to show ("" without a tokenizer)


class Text:
    """One sequence's text as its tokens arrive, cut at the first of `stop` (strings)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.tokens: list[int] = []
        self.text = ""  # what has been shown
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def add(self, new: list[int]) -> StreamChunk:
        """-> the tokens of `new` kept (up to the one that completes a stop string) and the text to show now."""
        start = len(self.tokens)
        self.tokens += new
        if self.tokenizer is None:
            return StreamChunk(new, "")
        text = self._decode(self.tokens)
        cut = self._stop_at(text)
        if cut is not None:  # the sequence ends with the token that completed the stop string
            end = next(n for n in range(start + 1, len(self.tokens) + 1)
                       if self._stop_at(self._decode(self.tokens[:n])) is not None)
            del self.tokens[end:]
            self.stopped = True
            return self._show(text[:cut], new[: end - start])
        safe = text.rstrip("\ufffd")  # a character whose bytes have not all arrived
        hold = max((k for s in self.stop for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
        return self._show(safe[: len(safe) - hold], new)

    def _show(self, upto: str, tokens: list[int]) -> StreamChunk:
        increment = upto[len(self.text):] if upto.startswith(self.text) else ""  # shown text is never taken back
        self.text += increment
        return StreamChunk(tokens, increment)

    def finish(self) -> str:
        """The text held back at the end of the sequence (a stop string's prefix that never completed)."""
        if self.tokenizer is None or self.stopped:
            return ""
        return self._show(self._decode(self.tokens), []).text


class Run:
    """A batch through the chunked loop: iterate for each call's new tokens per sequence; `halt(i)` ends
    sequence i from a later call on (its extra tokens are the caller's to drop); `stats` once done."""

    def __init__(self, bundle, prompts, *, method: str, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, eos_token_id=None, pad_to=None, exact=False, rounds_per_call: int | None = None,
                 **method_options):
        fn, static, args = _generate._prepare(bundle, prompts, method, max_new_tokens, temperature, top_k, top_p,
                                              seed, eos_token_id, method_options, pad_to=pad_to, exact=exact)
        plain = method == "ar"
        rounds = DEFAULT_ROUNDS_PER_CALL["ar" if plain else "spec"] if rounds_per_call is None else rounds_per_call
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds_per_call must be a positive integer, got {rounds!r}")
        self.bundle, self.method, self.static, self.real = bundle, method, static, len(prompts)
        self.max_new_tokens, self.eos_ids = max_new_tokens, static["eos_ids"]
        batch = args[1 if plain else 2].lengths.shape[0]  # the cache's: a mesh may have padded the batch
        self.halted = np.zeros((batch,), bool)
        self.done = np.zeros((batch,), bool)
        self.counts = np.zeros((batch,), np.int64)
        from weaver_jax._speculative import spec_advance, spec_start

        t0 = time.perf_counter()
        with _generate._mesh_scope(bundle):
            if plain:
                self.state = _generate.ar_start(*args, **static)
                self._advance = lambda s, halt: _generate.ar_advance(args[0], s, args[4], halt, steps=rounds, **static)
            else:
                self.state = spec_start(*args, **static)
                self._advance = lambda s, halt: spec_advance(*args[:2], s, args[6], halt, *args[7:], rounds=rounds,
                                                             **static)
        self.first = [int(t) for t in np.asarray(self.state.tokens)[:, 0]]
        self.start_seconds = time.perf_counter() - t0
        self.seconds = 0.0

    def halt(self, i: int) -> None:
        self.halted[i] = True

    def _update(self, i: int, new: list[int]) -> None:
        self.counts[i] += len(new)
        if (self.eos_ids and new and new[-1] in self.eos_ids) or self.counts[i] >= self.max_new_tokens:
            self.done[i] = True

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Each call's new tokens per prompt (the prefill's first token first)."""
        t0 = time.perf_counter()
        first = [[t] for t in self.first]
        for i, new in enumerate(first):
            self._update(i, new)
        yield first[: self.real]
        pending = None if self._finished() else self._dispatch(self.state)
        while pending is not None:
            state, window = pending
            # the next call goes out before this one's tokens are read (halts reach the call after it);
            # `self.state` is always the newest state, the one no call has been given (donated) yet
            pending = None if self._finished() else self._dispatch(state)
            window = np.asarray(window)
            new = [[int(t) for t in row if t >= 0] if not self.done[i] else [] for i, row in enumerate(window)]
            for i, tokens in enumerate(new):
                self._update(i, tokens)
            yield new[: self.real]
            if self._finished():
                pending = None
        self.seconds = time.perf_counter() - t0

    def _finished(self) -> bool:
        return bool(np.all((self.done | self.halted)[: self.real]))

    def _dispatch(self, state):
        with _generate._mesh_scope(self.bundle):
            out = self._advance(state, _generate._on_mesh(self.bundle.mesh, jnp.asarray(self.halted)))
        self.state = out[0]
        return out

    def stats(self, tokens: list[list[int]], finish_reasons: list[str]) -> dict:
        """`generate`'s stats for this run's tokens (rounds as run on the device)."""
        return _generate.run_stats(self.state, self.method, tokens, self.seconds + self.start_seconds, 0.0,
                                   self.static, self.real, finish_reasons)


def finish_reason(tokens: list[int], eos_ids, max_new_tokens: int, stopped: bool = False) -> str:
    """OpenAI's: "stop" for EOS or a stop string, "length" at max_new_tokens."""
    if stopped or (tokens and tokens[-1] in eos_ids):
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else "stop"


def check_stop(stop, tokenizer) -> tuple[str, ...]:
    if stop is None:
        return ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    if stop and tokenizer is None:
        raise ValueError("stop strings need the bundle's tokenizer to read the text (bundle.tokenizer is None)")
    return stop


class TokenStream:
    """What `stream` returns: iterate for `StreamChunk`s; afterwards `tokens`, `text`, `finish_reason`, `stats`."""

    def __init__(self, run: Run, text: Text):
        self._run, self._text = run, text
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats: dict = {}

    def __iter__(self) -> Iterator[StreamChunk]:
        for new in self._run:
            if self._text.stopped:
                break
            chunk = self._text.add(new[0])
            if self._text.stopped:
                self._run.halt(0)
            self.tokens += chunk.tokens
            self.text += chunk.text
            if chunk.tokens or chunk.text:
                yield chunk
            if self._text.stopped:
                break
        tail = self._text.finish()
        self.text += tail
        if tail:
            yield StreamChunk([], tail)
        self.finish_reason = finish_reason(self.tokens, self._run.eos_ids, self._run.max_new_tokens,
                                           self._text.stopped)
        self.stats = self._run.stats([self.tokens], [self.finish_reason])


def stream(bundle, prompt: Sequence[int], *, max_new_tokens: int, method: str = "ar", stop=None,
           rounds_per_call: int | None = None, **options) -> TokenStream:
    """Generate for one prompt (token ids), yielding `StreamChunk(tokens, text)` as rounds complete.

    Takes `generate`'s arguments (method, sampling, seed, exact, method options) for one sequence; the
    concatenated tokens equal `generate(bundle, [prompt], ...)`'s. stop: a string or strings; the sequence
    ends at the first occurrence in its text (the text stops before it, the tokens after the token that
    completed it). rounds_per_call: rounds (or decode steps for "ar") per jitted call (default 4, "ar" 8).

        for chunk in weaver_jax.stream(bundle, ids, max_new_tokens=64, method="weaver"):
            print(chunk.text, end="", flush=True)
    """
    stop = check_stop(stop, bundle.tokenizer)
    run = Run(bundle, [prompt], method=method, max_new_tokens=max_new_tokens, rounds_per_call=rounds_per_call,
              **options)
    return TokenStream(run, Text(bundle.tokenizer, stop))


def generate_with_stop(bundle, prompts, *, stop, max_new_tokens: int, method: str, **options):
    """`generate` with stop strings: the chunked loop, each sequence halted once its text holds one."""
    stop = check_stop(stop, bundle.tokenizer)
    run = Run(bundle, prompts, method=method, max_new_tokens=max_new_tokens, **options)
    texts = [Text(bundle.tokenizer, stop) for _ in prompts]
    for new in run:
        for i, tokens in enumerate(new):
            if not texts[i].stopped:
                texts[i].add(tokens)
                if texts[i].stopped:
                    run.halt(i)
    tokens = [t.tokens for t in texts]
    reasons = [finish_reason(t.tokens, run.eos_ids, max_new_tokens, t.stopped) for t in texts]
    return _generate.GenerateResult(tokens, run.stats(tokens, reasons))
