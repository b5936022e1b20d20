"""Streaming and stop strings: `generate`'s prefill and rounds, a few per jitted call.

`Run` drives a batch through `ar_start` / `ar_advance` (or `spec_start` / `spec_advance`): each call runs a few
rounds on the device (`Pace`: about CALL_SECONDS of them) and returns the tokens they emitted, with no host
callback per round. The loop runs on the GPU as a command buffer (`_generate.ASYNC_LOOP`), so a call returns once
queued and `Run` sends the next before reading the last: the device does not wait on the host (a stream in
16-round calls took 0.98-0.99x `generate`'s time on an H200, against ~1.1x read one by one). What a sequence
emits is what `generate` emits for it: the same functions, keys and order. `Slots` is the same loop with rows
that sequences join (`insert_rows`) and leave between calls, each call read before the next goes out (a row
that frees takes the next request at once): the server's continuous batching. `Text` turns a
sequence's tokens into text increments safe to show (no half of a UTF-8 character, no text that may still become
a stop string) and finds where a stop string ends it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from weaver_jax import _generate
from weaver_jax._generate import finish_reason

# A call has a fixed cost besides its rounds (measured 1.5-2.5 ms on an H200 at SmolLM2's shape, BENCHMARKS), so
# unless told otherwise a stream sizes its calls to take about CALL_SECONDS each (text in ~10 updates a second),
# starting small (a quick first chunk); the rounds per call are traced, so changing them compiles nothing. A
# server's slots take shorter calls: a row whose sequence ends mid-call idles until the call ends, and a request
# that arrives waits for it (SLOT_CALL_SECONDS: a first guess, to be measured on the H200 - bench/serve_load.py).
CALL_SECONDS = 0.1
SLOT_CALL_SECONDS = 0.03
FIRST_ROUNDS = 4


class Pace:
    """Rounds for the next call: `fixed`, or adapted so that a call takes about `seconds` from how long the last
    took (`tick` after each read; `adapt=False` for a call that may have ended early)."""

    def __init__(self, fixed: int | None, seconds: float = CALL_SECONDS):
        if fixed is not None and (not isinstance(fixed, int) or not 1 <= fixed <= _generate.MAX_ROUNDS_PER_CALL):
            raise ValueError(f"rounds_per_call must be an integer in [1, {_generate.MAX_ROUNDS_PER_CALL}], "
                             f"got {fixed!r}")
        self.rounds, self.fixed, self.seconds, self.last = fixed or FIRST_ROUNDS, fixed is not None, seconds, None

    def tick(self, adapt: bool = True) -> None:
        now = time.perf_counter()
        if adapt and not self.fixed and self.last is not None:
            scaled = self.rounds * self.seconds / max(now - self.last, 1e-4)
            self.rounds = int(np.clip(round(scaled), 1, _generate.MAX_ROUNDS_PER_CALL))
        self.last = now


class Uploaded:
    """A small host array's device copy, uploaded again only when the array changes: an upload costs a streaming
    call ~0.5 ms on an H200 (measured), two a call (the halted rows, the rounds) before this."""

    def __init__(self, place=jnp.asarray):
        self.place, self.host, self.device = place, None, None

    def __call__(self, value) -> jax.Array:
        value = np.asarray(value)
        if self.host is None or not np.array_equal(self.host, value):
            self.host, self.device = value.copy(), self.place(value)
        return self.device


class Programs:
    """A loop's jitted functions compiled ahead (`generate`'s cache), then kept per argument shapes: a call skips
    hashing the static arguments, whose graph definitions cost ~1 ms each to hash. On a mesh (`sharded`) the
    arguments' shardings are part of the key: a state that comes back sharded otherwise than it went in (XLA
    chose) needs its own program."""

    def __init__(self, static: dict, sharded: bool = False):
        self.static, self.sharded, self.compiled = static, sharded, {}
        self.compile_seconds = 0.0  # spent looking up or compiling programs not yet kept here

    def __call__(self, fn, *args):
        return self.program(fn, *args)(*args)

    def program(self, fn, *args):
        """`fn`'s program for these arguments, compiled (and kept) first if need be."""
        key = (fn, *(getattr(a, "shape", None) for a in args))
        if self.sharded:
            key += tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(args))
        if key not in self.compiled:
            t0 = time.perf_counter()
            self.compiled[key] = _generate._compiled(fn, self.static, *args)
            self.compile_seconds += time.perf_counter() - t0
        return self.compiled[key]


def batch_keys(method: str, args: list) -> jax.Array:
    """The sequences' keys `[B]` among `_generate._prepare`'s `args` for `method`."""
    return args[4] if method == "ar" else args[6]


class Loop:
    """The chunked loop over `_generate._prepare`'s `args`, shared by `Run` and `Slots`: `start(args)` -> the
    prefilled state; `send(state, keys, halted, leave)` -> (state, the call's window), both still on the device,
    its rounds from `Pace` (calls of about `call_seconds`), the halted rows and the rounds uploaded only when they
    change; `read(window)` -> the window on the host; `advance` both at once; `keys` the sequences' keys.
    tiers: method="auto"'s, by name (`_auto.Tier`): a call runs the one `send` names, each its own program over
    the one state."""

    def __init__(self, bundle, method: str, static: dict, args: list, rounds_per_call: int | None,
                 call_seconds: float = CALL_SECONDS, tiers: list | None = None):
        from weaver_jax._speculative import spec_advance, spec_start

        self.programs = [Programs(static, bundle.mesh is not None)]
        if method == "ar":
            self._start = lambda a: self.programs[0](_generate.ar_start, *a)
            weights, tree = _generate.weight_leaves(args[0])
            advance = _generate.ar_advance
        else:
            self._start = lambda a: self.programs[0](spec_start, *a)
            weights, tree = _generate.weight_leaves(*args[:2], *args[7:9])  # adapter, tables (or None)
            advance = spec_advance
        self.keys = batch_keys(method, args)
        self.limits = [jnp.asarray(a) for a in args[-2:]]  # the traced limit and EOS ids, uploaded once
        self._calls = {}  # tier name -> (its programs, the advance, the weights)
        for tier in tiers or [None]:
            own = {} if tier is None else {"method": tier.method, "options": tier.options}
            programs = Programs(static | own | {"weights_tree": tree}, bundle.mesh is not None)
            self.programs.append(programs)
            self._calls[tier and tier.name] = programs, advance, weights
        self.bundle, self.pace = bundle, Pace(rounds_per_call, call_seconds)
        self._halt, self._rounds = Uploaded(functools.partial(_generate._on_mesh, bundle.mesh)), Uploaded()
        self._leave = Uploaded()

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.programs)

    def start(self, args: list):
        with _generate._mesh_scope(self.bundle):
            return self._start(args)

    def send(self, state, keys, halted: np.ndarray, leave: bool = False, tier: str | None = None,
             rounds: int | None = None):
        """leave: end the call once a sequence ends; tier: the tier's name (method="auto"); rounds: instead of the
        pace's. On a GPU the call returns as soon as it is queued (its loop runs inside a command buffer:
        `_generate.ASYNC_LOOP`), so the next can be sent before this one is read."""
        with _generate._mesh_scope(self.bundle):
            rounds = self._rounds(np.int32(self.pace.rounds if rounds is None else rounds))
            programs, advance, weights = self._calls[tier]
            return programs(advance, weights, state, keys, self._halt(halted), rounds, self._leave(np.bool_(leave)),
                            *self.limits)

    def compile(self, state, keys, halted: np.ndarray, tiers: list[str]) -> None:
        """Compile these tiers' calls at once (threads: XLA compiles outside the GIL), running none."""
        halted, rounds, leave = self._halt(halted), self._rounds(np.int32(1)), self._leave(np.bool_(False))

        def one(tier):
            programs, advance, weights = self._calls[tier]
            with _generate._mesh_scope(self.bundle):
                programs.program(advance, weights, state, keys, halted, rounds, leave, *self.limits)

        with concurrent.futures.ThreadPoolExecutor(len(tiers)) as pool:
            list(pool.map(one, tiers))

    def read(self, window, adapt: bool = True) -> np.ndarray:
        """adapt=False: the call may have ended early (`leave`), so its time says nothing of the pace."""
        window = np.asarray(window)
        self.pace.tick(adapt)
        return window

    def advance(self, state, keys, halted: np.ndarray, leave: bool = False, tier: str | None = None):
        state, window = self.send(state, keys, halted, leave, tier)
        return state, self.read(window, adapt=not leave)


class StreamChunk(NamedTuple):
    """One step of `stream`: the new token ids and the text that is safe to show for them (text that ends inside a
    multi-byte character or could begin a stop string is held for a later chunk; the ids come at once):

        for chunk in weaver_jax.stream(bundle, ids, method="weaver", max_new_tokens=256):
            print(chunk.text, end="", flush=True)                        # chunk.tokens: their ids
    """

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
    sequence i from the next call on; `stats` once done."""

    def __init__(self, bundle, prompts, *, method: str, max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0,
                 seed=0, eos_token_id=None, pad_to=None, exact=False, rounds_per_call: int | None = None,
                 caches: tuple | None = None, plan=None, **method_options):
        """plan: method="auto"'s `_auto.Plan` made before (a conversation's, whose caches are of one kind)."""
        from weaver_jax import _auto

        self.plan, self.autopilot, tiers, nodes = None, None, None, None
        if method == "auto":  # the tiers' programs over one speculative state, unless plain decoding wins outright
            self.plan = plan or _auto.Plan(bundle, prompts, temperature, exact, method_options,
                                           lockstep=len(prompts) > 1)
            method, method_options, tiers, nodes = self.plan.method, self.plan.request, self.plan.loop_tiers, \
                self.plan.nodes
        _, static, args = _generate._prepare(bundle, prompts, method, max_new_tokens, temperature, top_k, top_p,
                                             seed, eos_token_id, method_options, pad_to=pad_to, exact=exact,
                                             caches=caches, nodes=nodes)
        self.bundle, self.method, self.static, self.real = bundle, method, static, len(prompts)
        self.max_new_tokens, self.eos_ids = max_new_tokens, _generate.generate_limits(args)[1]
        self.loop = Loop(bundle, method, static, args, rounds_per_call, tiers=tiers)
        batch = self.loop.keys.shape[0]  # a mesh may have padded the batch
        self.halted = np.zeros((batch,), bool)
        self.done = np.zeros((batch,), bool)
        self.counts = np.zeros((batch,), np.int64)
        self.t0, self.compiled_before = time.perf_counter(), 0.0
        self.state = self.loop.start(args)
        if tiers:
            self.autopilot = self.plan.autopilot(self.loop, self.state)
            # a first use's measurement is not the run's time
            self.t0, self.compiled_before = time.perf_counter(), self.loop.compile_seconds
        self.seconds = 0.0

    def generated(self, i: int) -> list[int]:
        """Sequence i's tokens as the state holds them (past a stop string the reader cut its chunks at)."""
        return np.asarray(self.state.tokens)[i, : int(np.asarray(self.state.num_tokens)[i])].tolist()

    def halt(self, i: int) -> None:
        self.halted[i] = True

    def _update(self, i: int, new: list[int]) -> None:
        self.counts[i] += len(new)
        if (self.eos_ids and new and new[-1] in self.eos_ids) or self.counts[i] >= self.max_new_tokens:
            self.done[i] = True

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Each call's new tokens per prompt (the prefill's first token first). From the second call on, a call is
        sent before the last is read, so the device does not wait for the host; a sequence halted or ended on the
        host still runs in the call already sent (its tokens there are dropped, `generated` has them)."""
        try:
            # read before any call is sent: a call's first sending costs the host ~4 ms (H200), the prefill less
            first = [[int(t)] for t in np.asarray(self.state.tokens)[:, 0]]
            for i, new in enumerate(first):
                self._update(i, new)
            yield first[: self.real]
            sent = None if self._finished() else self._send()
            while sent is not None:
                following = None if self._finished() else self._send()
                window, tier, rounds = sent
                rows = self.loop.read(window)
                new = [[int(t) for t in row if t >= 0] if not (self.done[i] or self.halted[i]) else []
                       for i, row in enumerate(rows)]
                for i, tokens in enumerate(new):
                    self._update(i, tokens)
                if self.autopilot is not None:
                    running = ~(self.done | self.halted)[: self.real]
                    self.autopilot.observe(tier, rounds, [len(t) for t in new[: self.real]], running.tolist())
                if any(new[: self.real]):
                    yield new[: self.real]
                sent = following
        finally:  # also when the caller stops reading early (a stop string, a closed stream)
            self.seconds = time.perf_counter() - self.t0 - (self.loop.compile_seconds - self.compiled_before)
            if self.autopilot is not None:
                self.plan.remember(self.autopilot)

    def _send(self):
        """-> (the call's window, its tier (method="auto"), its rounds)."""
        tier = self.autopilot and self.autopilot.next()
        rounds = self.autopilot.rounds_per_call() if tier and not self.loop.pace.fixed else self.loop.pace.rounds
        self.state, window = self.loop.send(self.state, self.loop.keys, self.halted, tier=tier and tier.name,
                                            rounds=rounds)
        return window, tier, rounds

    def _finished(self) -> bool:
        return bool(np.all((self.done | self.halted)[: self.real]))

    def stats(self, tokens: list[list[int]], finish_reasons: list[str]) -> dict:
        """`generate`'s stats for this run's tokens (rounds as run on the device); method="auto" adds `settings`
        (`_auto.Autopilot.settings`) instead of `options`."""
        stats = _generate.run_stats(self.state, self.method, tokens, self.seconds, self.loop.compile_seconds,
                                    self.static, self.real, finish_reasons)
        if self.plan is not None:
            stats.pop("options", None)
            stats["settings"] = self.autopilot.settings() if self.autopilot else self.plan.settings()
        return stats


@functools.partial(jax.jit, donate_argnames=("state",))
def insert_rows(state, new, rows):
    """`state` (a batch's loop state and keys) with rows `rows [K]` replaced by `new`'s K rows (a batch prefilled
    apart; a row index past the batch drops that row); scalars (loop counters) stay the batch's."""
    return jax.tree.map(lambda big, small: big if big.ndim == 0 else big.at[rows].set(small, mode="drop"),
                        state, new)


class Slots:
    """Continuous batching over the static-shape loop: `size` rows of one set of settings, each free or held by
    a sequence; `insert` prefills prompts into free rows between calls (each its own seed, its own start: its
    tokens are those `generate` gives it alone), `step` runs a call and returns what it emitted per occupied row
    (read before the next call goes out, so a row whose sequence ended is free for the next one at once); `send`
    and `receive` are its halves, for a server that sends the next call before reading the last."""

    def __init__(self, bundle, size: int, *, method: str, max_new_tokens: int, context: int, temperature=0.0,
                 top_k=0, top_p=1.0, exact=False, rounds_per_call: int | None = None, **method_options):
        from weaver_jax import _auto

        self.plan = self.autopilot = tiers = self.nodes = None
        if method == "auto":  # the rows share each call's tier (`Run`)
            self.plan = _auto.Plan(bundle, [[0]] * size, temperature, exact, method_options)
            method, method_options, tiers, self.nodes = self.plan.method, self.plan.request, self.plan.loop_tiers, \
                self.plan.nodes
        self.bundle, self.size, self.method, self.context = bundle, size, method, context
        self.splits = _generate.split_models(bundle, method)  # the weights do not change while slots run
        self.settings = dict(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, exact=exact, method_options=method_options)
        self.static, args = self._prepare([[0]] * size, [0] * size)
        budget = dict(self.static.get("options", ())).get("budget")
        if budget is not None:  # an insert prepares a batch of one: the default budget would be one's, not ours
            self.settings["method_options"] = method_options | {"budget": budget}
        self.loop = Loop(bundle, method, self.static, args, rounds_per_call, SLOT_CALL_SECONDS, tiers=tiers)
        self.keys = self.loop.keys
        state = self.loop.start(args)
        if tiers:
            self.autopilot = self.plan.autopilot(self.loop, state)
        self.state = state._replace(done=jnp.ones_like(state.done))  # every row free
        self.occupant: list = [None] * size
        self.halted = np.ones((size,), bool)
        self._first: dict = {}  # row -> (an insert's first tokens `[K, T]`, the row's index in them) to report

    def _prepare(self, prompts, seeds, pad_to=None):
        """-> (static, args) for these prompts, with fresh caches of the slots' `context` positions."""
        s = self.settings
        _, static, args = _generate._prepare(self.bundle, prompts, s["method"], s["max_new_tokens"],
                                             s["temperature"], s["top_k"], s["top_p"], seeds, None,
                                             s["method_options"], pad_to=pad_to, exact=s["exact"],
                                             cache_size=self.context, splits=self.splits, nodes=self.nodes)
        return static, args

    def free(self) -> list[int]:
        return [i for i, o in enumerate(self.occupant) if o is None]

    def insert(self, rows: list[int], occupants: list, prompts: list[list[int]], seeds: list[int],
               pad_to: int) -> None:
        """Prefill `prompts` (one per free row of `rows`, for `occupants`) as one batch into those rows; their
        first tokens come with the next `step`. The batch is the power of two that holds them (at most the slots'
        size: one prefill program per batch and prompt bucket, compiled ahead by a server's warm-up), filled with
        copies of the first prompt whose rows are dropped: one request joining 16 rows prefills one row, not 16."""
        k = len(rows)
        batch = min(self.size, 1 << (k - 1).bit_length())
        _, args = self._prepare(prompts + prompts[:1] * (batch - k), seeds + seeds[:1] * (batch - k), pad_to=pad_to)
        new = self.loop.start(args)
        extra = new.tokens.shape[0] - k  # the padding, and a mesh's fill-up to its `data` axis
        self.state, self.keys = insert_rows((self.state, self.keys), (new, batch_keys(self.method, args)),
                                            jnp.asarray(rows + [self.size] * extra))
        for j, (row, occupant) in enumerate(zip(rows, occupants, strict=True)):
            self.occupant[row], self.halted[row] = occupant, False
            self._first[row] = (new.tokens, j)

    def can_take(self, other: Slots) -> bool:
        """Whether `other`'s rows can move into these (bigger) slots as they are: the same kind of state, each
        array the same but for its rows (method="auto" may run plain decoding outright at one batch size and its
        tiers at another)."""
        def layout(slots):
            leaves, tree = jax.tree.flatten((slots.state, slots.keys))
            return tree, [(a.shape[1:], a.dtype) for a in leaves]

        return other.size < self.size and layout(self) == layout(other)

    def take(self, other: Slots) -> None:
        """Move `other`'s sequences (`can_take`) into these slots' first rows, mid-sequence: their tokens stay
        those they would have had (a row's tokens do not depend on its batch)."""
        n = other.size
        extra = other.keys.shape[0] - n  # a mesh's fill-up of the smaller batch
        self.state, self.keys = insert_rows((self.state, self.keys), (other.state, other.keys),
                                            jnp.asarray(list(range(n)) + [self.size] * extra))
        self.occupant[:n], self.halted[:n] = other.occupant, other.halted
        self._first = dict(other._first)

    def remember(self) -> None:
        """method="auto": keep the acceptance these slots' calls saw as the next calls' prior (`_auto.Plan`)."""
        if self.autopilot is not None:
            self.plan.remember(self.autopilot)

    def release(self, row: int) -> None:
        """Row `row`'s sequence has ended (or its client has gone): the row stops and is free for the next."""
        self.occupant[row], self.halted[row] = None, True

    def step(self, leave: bool = False, tier=None) -> list[tuple[object, list[int]]]:
        """Run a call (with `leave`, one that ends once a sequence ends: requests wait for a row); -> what it
        emitted: (occupant, new tokens) per row it ran for (a row inserted since the last call opens with its
        prefill's first token). tier: method="auto"'s tier for this call instead of the autopilot's choice (a
        server's warm-up compiles every tier)."""
        return self.receive(self.send(leave, tier))

    def send(self, leave: bool = False, tier=None) -> Sent:
        """`step`'s call, sent and not read: the host may insert rows and send the next before `receive`-ing
        this one (a row released meanwhile still runs in it: its tokens go to the occupant it had when sent)."""
        firsts, self._first = self._first, {}
        opened = [(self.occupant[row], tokens, j) for row, (tokens, j) in firsts.items()]
        tier = tier or (self.autopilot and self.autopilot.next())
        # what the autopilot reads once the call is read: copies, since the next call takes the state's buffers
        rounds_before = None if self.autopilot is None else jnp.copy(self.state.rounds)
        self.state, window = self.loop.send(self.state, self.keys, self.halted, leave, tier=tier and tier.name)
        after = (None, None) if self.autopilot is None else (jnp.copy(self.state.rounds), jnp.copy(self.state.done))
        return Sent(window, list(self.occupant), opened, tier, rounds_before, *after, leave)

    def receive(self, sent: Sent) -> list[tuple[object, list[int]]]:
        """What the call `sent` emitted: (occupant, new tokens) per row it ran for, inserted rows first with their
        prefill's first token."""
        opened = [(o, [int(np.asarray(tokens)[j, 0])]) for o, tokens, j in sent.opened]
        window = self.loop.read(sent.window, adapt=not sent.leave)
        emitted = [(o, [int(t) for t in window[i] if t >= 0]) for i, o in enumerate(sent.occupants) if o is not None]
        if self.autopilot is not None and emitted:  # the rows still running after the call ran every round of it
            done = np.asarray(sent.done)
            running = [not done[i] for i, o in enumerate(sent.occupants) if o is not None]
            self.autopilot.observe(sent.tier, int(sent.rounds_after) - int(sent.rounds_before),
                                   [len(t) for _, t in emitted], running)
        return opened + emitted


class Sent(NamedTuple):
    """A `Slots` call on its way (`Slots.send`): its window and state scalars still on the device."""
    window: jax.Array
    occupants: list  # the rows' occupants when it was sent
    opened: list  # (occupant, an insert's first tokens [K, T], its index there) for rows inserted before it
    tier: object
    rounds_before: jax.Array | None  # method="auto" only: the rounds run before and after it, the rows done
    rounds_after: jax.Array | None
    done: jax.Array | None
    leave: bool


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
    """What `stream` returns: iterate for `StreamChunk`s; afterwards `tokens`, `text`, `finish_reason`, `stats`.

        s = weaver_jax.stream(bundle, ids, max_new_tokens=64, method="weaver", stop="\n\n")
        text = "".join(chunk.text for chunk in s)
        s.finish_reason, s.stats["tokens_per_second"]
    """

    def __init__(self, run: Run, text: Text):
        self._run, self._text = run, text
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stats: dict = {}

    def __iter__(self) -> Iterator[StreamChunk]:
        for new in self._run:
            chunk = self._text.add(new[0])
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
    completed it). rounds_per_call: rounds (or decode steps for "ar") per jitted call, at most
    MAX_ROUNDS_PER_CALL (default: 4 first, then as many as take about CALL_SECONDS).

        for chunk in weaver_jax.stream(bundle, ids, max_new_tokens=64, method="weaver"):
            print(chunk.text, end="", flush=True)
    """
    stop = check_stop(stop, bundle.tokenizer)
    run = Run(bundle, [prompt], method=method, max_new_tokens=max_new_tokens, rounds_per_call=rounds_per_call,
              **options)
    return TokenStream(run, Text(bundle.tokenizer, stop))


def generate_chunked(bundle, prompts, *, stop, max_new_tokens: int, method: str, **options):
    """`generate` through the chunked loop (`Run`): with stop strings (each sequence halted once its text holds
    one) or method="auto" (tiers chosen call by call)."""
    stop = check_stop(stop, bundle.tokenizer)
    run = Run(bundle, prompts, method=method, max_new_tokens=max_new_tokens, **options)
    texts = [Text(bundle.tokenizer if stop else None, stop) for _ in prompts]
    for new in run:
        for i, tokens in enumerate(new):
            if not texts[i].stopped:
                texts[i].add(tokens)
                if texts[i].stopped:
                    run.halt(i)
    tokens = [t.tokens for t in texts]
    reasons = [finish_reason(t.tokens, run.eos_ids, max_new_tokens, t.stopped) for t in texts]
    return _generate.GenerateResult(tokens, run.stats(tokens, reasons))
