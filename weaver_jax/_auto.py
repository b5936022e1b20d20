"""method="auto": the speculation settings chosen per call and adapted during it.

A call picks among a few tiers - plain decoding and speculative methods with their options - that share one loop
state (`SpecState`: the target's and drafter's caches, the root and its final normed state), so any tier's round
may follow any other's at a call boundary of the chunked loop (`_stream.Run`). Plain decoding inside that state is
the root-only round (`_speculative._step`: `ar`'s decode step, its features committed to the drafter). Every tier
draws generated token t with `fold_in(key, t)`, so switching keeps the output greedy-equal and seed-identical to
`ar`.

The choice: a tier's speed is its tokens per round (τ) over its round time. Round times come from a cost model
measured on this device per tier and batch-size bucket (`tune`, or a call's first use: its tiers timed on copies
of its prefilled state) and kept on disk. τ starts at the shipped pair's measured figure (`PRIOR_TAU`) and follows
the text: one shared factor `predictability` scales every speculative tier's τ - 1 (what the drafts earn beyond
the bonus token), an average over the chunks that drafted; a `generate` batch, whose rounds are its slowest
sequence's, goes by its slowest sequence's factor (before any has drafted: the batch's x the `spread` between
slowest and mean that earlier batches of its size showed, or a model of it in ln B: `lockstep_spread`). When no
speculative tier is predicted to beat plain decoding for the whole call, it runs `ar`'s own program (no drafter
work at all: a CPU, where every round costs several steps).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# τ of the shipped SmolLM2 pair, held-out prompts, B = 1 (BENCHMARKS summary; H200, 256 tokens): (greedy,
# sampled at T = 1) per method, Weaver's per budget. A prior only: the running acceptance takes over within a
# chunk or two, for any pair.
PRIOR_TAU = {"dflash": {16: (2.78, 1.69)},
             "weaver": {12: (3.36, 2.40), 16: (3.42, 2.47), 24: (3.70, 2.64), 32: (4.01, 2.77), 64: (4.34, 3.09)}}
DDTREE_TAU = 0.9  # DDTree's τ against Weaver's at one budget (0.86-0.92 on the full held-out protocol)
DEFAULT_TIERS = ("dflash", "weaver")  # besides plain decoding, which is always a tier
# A call's rounds: about CALL_SECONDS at its tier's round time. A call costs ~1.7 ms on an H200 besides its rounds
# (outside its loop, BENCHMARKS): calls of 8 rounds made auto 0.87x the Weaver tier it ran (B = 1, T = 1) and
# 0.84x `ar` at B = 32; at 40 ms the cost is ~4% and the choice still follows the text (a 256-token sequence is
# a handful of calls).
CALL_SECONDS = 0.04
FIRST_ROUNDS = 2  # the first calls shorter (2, 4, 8, ...): the acceptance is seen early, a call is chosen
# before the last is read
WEIGHT = 0.5  # a drafted chunk's weight in the running predictability
RELAX = 0.05  # per plain chunk, the predictability's way back to the prior: speculation is tried again
SWITCH = 1.03  # another tier replaces the running one when predicted this much faster
TIMED_ROUNDS = 8  # rounds per timed call when measuring a tier's round time
SHRINK = 8  # lockstep: a sequence's own acceptance counts as much as the batch's once it has this many rounds
# A `generate` batch of B sequences runs until its slowest ends, so its pace is its slowest sequence's predictability:
# the batch's x `spread`, 1 / (1 + slope x ln B). Before any batch of a size is seen, the slope of the nearest size
# seen, else LOCKSTEP_SLOPE (H200, the real pair, B = 32: Weaver's mean τ 3.7, its slowest sequence's 2.3 -> 0.48)
LOCKSTEP_SLOPE = 0.31


@dataclasses.dataclass(frozen=True)
class Tier:
    method: str  # "ar" or a speculative method
    request: tuple  # the options as asked for (`generate`'s names), sorted (name, value) pairs
    options: tuple  # as the round takes them (`tree_options`), sorted pairs
    nodes: int  # tree nodes, the root included

    @property
    def name(self) -> str:
        budget = dict(self.options).get("budget")
        return self.method if budget is None else f"{self.method}-{budget}"

    def prior(self, sampled: bool) -> float:
        """τ expected before any chunk of this call has run: `PRIOR_TAU`, at most the tree's depth + 1."""
        if self.method == "ar":
            return 1.0
        options = dict(self.options)
        table = PRIOR_TAU["dflash" if self.method == "dflash" else "weaver"]
        budgets = sorted(table)
        at = [table[b][int(sampled)] for b in budgets]
        tau = float(np.interp(np.log(options.get("budget", budgets[0])), np.log(budgets), at))
        tau *= DDTREE_TAU if self.method == "ddtree" else 1.0
        return min(tau, options["depth"] + 1.0)


def tiers(bundle, requested, *, sampled: bool, batch: int, parameters: int) -> list[Tier]:
    """The tiers of a call: plain decoding first, then `requested` (method names, or dicts of a method and its
    options; default `DEFAULT_TIERS`, those the bundle can run) resolved with their defaults for this batch. All
    share one tree depth (the smallest default, unless given) so that they share one loop state."""
    from weaver_jax._generate import _speculative_setup

    if requested is None:
        requested = [m for m in DEFAULT_TIERS if bundle.drafter is not None and (m != "weaver" or bundle.adapter)]
    elif isinstance(requested, (str, dict)) or not all(isinstance(t, (str, dict)) for t in requested):
        raise ValueError(f"tiers must be a list of method names or dicts with a 'method', got {requested!r}")
    asked = []
    for t in requested:
        t = {"method": t} if isinstance(t, str) else dict(t)
        method = t.pop("method", None)
        if method not in ("ar", "dflash", "ddtree", "weaver"):
            raise ValueError(f"a tier's method must be 'ar', 'dflash', 'ddtree' or 'weaver', got {method!r}")
        if method != "ar":
            asked.append((method, t))
    depths = {_speculative_setup(bundle, m, o, sampled, batch, parameters)[0]["depth"] for m, o in asked}
    depth = min(depths, default=1)
    given = {o["depth"] for _, o in asked if "depth" in o}  # a depth asked for must be the one all can run
    if len(given) > 1 or (given and min(given) != depth):
        raise ValueError(f"the tiers ask for different depths {sorted(depths)}: they share one loop, give one depth")
    out = [Tier("ar", (), (("depth", depth),), 1)]
    for method, options in asked:
        options = {**options, "depth": depth}
        resolved, nodes = _speculative_setup(bundle, method, options, sampled, batch, parameters)
        if "budget" in resolved:  # pinned: a batch of another size (a server's insert) would default otherwise
            options["budget"] = resolved["budget"]
        tier = Tier(method, tuple(sorted(options.items())), tuple(sorted(resolved.items())), nodes)
        if tier.name not in {t.name for t in out}:
            out.append(tier)
    return out


def tree_nodes(bundle, method: str, options: dict, *, sampled: bool, batch: int, parameters: int) -> int:
    """The largest tree `method` with `options` verifies (0 for "ar"; method="auto": its largest tier's), its
    options checked: the room a cache needs past a sequence's tokens."""
    from weaver_jax._generate import _speculative_setup

    if method == "ar":
        return 0
    if method != "auto":
        return _speculative_setup(bundle, method, dict(options), sampled, batch, parameters)[1]
    options = dict(options)
    requested = options.pop("tiers", None)
    options.pop("remeasure", None)
    if options:
        raise TypeError(f"method 'auto' takes only the options tiers and remeasure, got {sorted(options)} (a tier "
                        "is a method's name or a dict of a method and its options: tiers=['dflash', {'method': "
                        "'weaver', 'budget': 64}])")
    return max(t.nodes for t in tiers(bundle, requested, sampled=sampled, batch=batch, parameters=parameters))


def bucket(batch: int) -> int:
    """The batch-size bucket a cost is kept for: the next power of two."""
    return 1 << max(batch - 1, 0).bit_length()


def cost_file() -> Path:
    from weaver_jax._load import cache_dir

    return cache_dir() / "auto_costs.json"


def cost_key(bundle, tier: Tier, *, sampled: bool, exact: bool, batch: int) -> str:
    """What a round's time depends on: the device, jax, the models' shapes and dtype, the tier, the kernels,
    sampling and exact mode, the batch bucket (not the weights' values)."""
    from weaver_jax.pallas_kernels import enabled_kernels

    device = jax.devices()[0]
    models = [repr(getattr(bundle, role).config) for role in ("target", "drafter", "adapter")
              if getattr(bundle, role, None) is not None]
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(bundle.target)[:8]})
    mesh = dict(bundle.mesh.shape) if bundle.mesh is not None else {}
    shapes = hashlib.sha256(repr((models, dtypes)).encode()).hexdigest()[:16]
    return json.dumps([device.platform, device.device_kind, jax.__version__, mesh, shapes, tier.method,
                       [list(kv) for kv in tier.options], enabled_kernels(), sampled, exact, bucket(batch)])


def predictability_key(bundle, *, sampled: bool, exact: bool) -> str:
    """Where the acceptance this device has seen with this pair is kept (beside the round times)."""
    return cost_key(bundle, Tier("predictability", (), (), 0), sampled=sampled, exact=exact, batch=1)


def lockstep_spread(bundle, kept: dict, *, sampled: bool, exact: bool, batch: int) -> float:
    """A batch's expected slowest-sequence predictability over its mean where no batch of its size was seen:
    1 / (1 + slope x ln B), the slope from the nearest batch size kept (else `LOCKSTEP_SLOPE`)."""
    slope, nearest = LOCKSTEP_SLOPE, None
    for size in (1 << k for k in range(1, 17)):
        spread = kept.get(cost_key(bundle, Tier("spread", (), (), 0), sampled=sampled, exact=exact, batch=size))
        if spread and (nearest is None or abs(np.log(size / batch)) < abs(np.log(nearest / batch))):
            nearest, slope = size, (1.0 / spread - 1.0) / np.log(size)
    return float(1.0 / (1.0 + max(slope, 0.0) * np.log(max(batch, 1))))


def read_costs() -> dict:
    path = cost_file()
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"the measured round times in {path} cannot be read ({e}): delete the file to measure "
                         "again") from e


_WRITING = threading.Lock()  # tune's threads


def write_costs(new: dict) -> None:
    """Add `new` (key -> seconds per round) to the file, atomically (another process may write it too)."""
    path = cost_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _WRITING:
        merged = read_costs() | new
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_text(json.dumps(merged, indent=0, sort_keys=True))
        os.replace(part, path)


class _Gate:
    """`tune`'s cells compile at once (a thread each), then are timed one at a time with nothing compiling beside
    them: a cell `arrive`s once its programs are compiled (or it ends, however), `timing()` waits for all, then
    holds the lock. A cell is its thread's `_local.cell` (a thread may run a second cell once its first ended)."""

    def __init__(self, cells: int):
        self.waiting, self.arrived, self.lock = cells, set(), threading.Condition()
        self.timing_lock = threading.Lock()

    def arrive(self) -> None:
        with self.lock:
            self.arrived.add(_local.cell)
            self.lock.notify_all()

    @contextlib.contextmanager
    def timing(self):
        self.arrive()
        with self.lock:
            self.lock.wait_for(lambda: len(self.arrived) >= self.waiting)
        with self.timing_lock:
            yield


_local = threading.local()  # `_local.gate`, `_local.cell`: a tune thread's _Gate and cell


def measure(loop, state, tiers_: list[Tier], keys) -> dict[str, float]:
    """Seconds per round of each tier, timed on copies of `state` (a prefilled batch: the calls' own programs,
    compiled here): the time of a call of 1 + TIMED_ROUNDS rounds less one of 1, over the rounds run between
    them (a batch that ends sooner runs fewer), the median of three such pairs, each pair's calls back to back
    (on an H100 a best-of-two of each kind once timed the chain's round at 0.58x a plain step). Tiers that
    cannot win are skipped: once the cheapest drafted round costs more plain steps than any tier's prior τ (a
    drafted round costs at least the drafter's pass), nothing dearer is timed. -> {tier name: seconds} for those
    measured."""
    halted = np.zeros(keys.shape[:1], bool)
    loop.compile(state, keys, halted, [t.name for t in tiers_])
    gate = getattr(_local, "gate", None)
    with gate.timing() if gate else contextlib.nullcontext():
        return _timed_rounds(loop, state, tiers_, keys, halted)


def _timed_rounds(loop, state, tiers_: list[Tier], keys, halted) -> dict[str, float]:
    start = int(state.rounds)
    out = {}
    best_tau = max(t.prior(sampled=False) for t in tiers_)  # greedy τ is the higher

    def timed(tier, rounds):
        copy = jax.tree.map(jnp.copy, state)
        t0 = time.perf_counter()
        after, _ = loop.send(copy, keys, halted, tier=tier.name, rounds=rounds)
        ran = int(after.rounds) - start  # waits for the call
        return time.perf_counter() - t0, ran

    for tier in sorted(tiers_, key=lambda t: t.nodes):
        drafted = [v for k, v in out.items() if k != "ar" and v is not None]
        if "ar" in out and drafted and out["ar"] and min(drafted) / out["ar"] > best_tau:
            out[tier.name] = None  # cannot win here
            continue
        timed(tier, 1)  # warm
        pairs = [(timed(tier, 1), timed(tier, 1 + TIMED_ROUNDS)) for _ in range(3)]  # interleaved: drift cancels
        ones, longs = zip(*pairs, strict=True)
        rounds = min(r for _, r in longs) - max(r for _, r in ones)
        seconds = float(np.median([t_long - t_one for (t_one, _), (t_long, _) in pairs]))
        out[tier.name] = max(seconds / rounds, 1e-7) if rounds >= 2 else None
        if out["ar"] is None:  # too few rounds to time: a call this short runs plain steps, and keeps nothing
            return {}
    return out


def known_costs(bundle, tiers_: list[Tier], *, sampled: bool, exact: bool, batch: int,
                kept: dict | None = None) -> dict | None:
    """The round times kept on disk (`kept`: `read_costs()` when read already) for every tier at this batch
    ({name: seconds, or None where it cannot win}), or None when one is missing."""
    kept = read_costs() if kept is None else kept
    keys = {t.name: cost_key(bundle, t, sampled=sampled, exact=exact, batch=batch) for t in tiers_}
    return {name: kept[k] for name, k in keys.items()} if all(k in kept for k in keys.values()) else None


def keep_costs(bundle, tiers_: list[Tier], costs: dict, *, sampled: bool, exact: bool, batch: int) -> None:
    write_costs({cost_key(bundle, t, sampled=sampled, exact=exact, batch=batch): costs[t.name] for t in tiers_
                 if t.name in costs})


class Autopilot:
    """The tier of each call: the fastest predicted, τ / round time, with τ = 1 + (prior - 1) x predictability
    for a drafting tier and 1 for plain decoding; `observe` each call's tokens. -> `settings()` for the stats.
    lockstep: a batch that ends with its last sequence (`generate`'s, not the server's slots): its rounds are
    those of its slowest sequence, so the predictability that sets the pace is the least of its sequences'
    (measured on an H200 at B = 32: Weaver's mean τ 3.7, its slowest sequence's 2.3, and 0.87x `ar`); before
    its sequences have drafted, the batch's predictability x `spread` (what earlier batches of this size saw: their
    slowest sequence's predictability over their mean's)."""

    def __init__(self, tiers_: list[Tier], costs: dict[str, float], sampled: bool, measured: bool,
                 predictability: float = 1.0, lockstep: bool = False, spread: float = 1.0):
        if costs.get("ar") is None:  # nothing measured (a call too short to time): plain steps
            costs = {"ar": 1.0}
        self.tiers = [t for t in tiers_ if costs.get(t.name) is not None]
        self.costs, self.sampled, self.measured = costs, sampled, measured
        self.prior = self.predictability = predictability  # the calls before this one's (1: the prior τ as is)
        self.seen = [0.0, 0]  # drafted chunks' predictability x rounds, rounds
        self.lockstep, self.sequences, self.running = lockstep, None, None  # lockstep: `seen` per sequence [B, 2]
        self.spread = spread if lockstep else 1.0
        self.calls = 0
        self.current = max(self.tiers, key=self.speed)
        self.start = self.current
        self.switches: list[dict] = []
        self.rounds = {t.name: 0 for t in self.tiers}

    def pace(self) -> float:
        """The predictability that sets the pace: the batch's, or in lockstep its slowest running sequence's
        (each sequence's drafted chunks so far, shrunk toward the batch's by SHRINK rounds: a short run of bad
        luck is not a slow sequence)."""
        if not self.lockstep:
            return self.predictability
        if self.sequences is None:
            return self.predictability * self.spread
        if not self.running.any():
            return self.predictability
        return self._slowest(self.running, self.predictability)

    def _slowest(self, rows, center: float) -> float:
        seen, rounds = self.sequences[rows].T
        return float(np.min((seen + SHRINK * center) / (rounds + SHRINK)))

    def tau(self, tier: Tier) -> float:
        return 1.0 + (tier.prior(self.sampled) - 1.0) * self.pace()

    def speed(self, tier: Tier) -> float:
        """Predicted tokens per second per sequence."""
        return self.tau(tier) / self.costs[tier.name]

    def plain_wins(self) -> bool:
        """Whether plain decoding is predicted fastest before anything has run: then the call runs `ar`'s program."""
        return self.current.method == "ar"

    def next(self) -> Tier:
        """The tier of the next call (counted: a switch records the call it happens at)."""
        best = max(self.tiers, key=self.speed)
        if best is not self.current and self.speed(best) > SWITCH * self.speed(self.current):
            self.switches.append({"call": self.calls, "from": self.current.name, "to": best.name,
                                  "predicted_tau": round(self.tau(best), 3)})
            self.current = best
        self.calls += 1
        return self.current

    def rounds_per_call(self) -> int:
        """The rounds of the call `next` just chose: FIRST_ROUNDS, doubling up to about CALL_SECONDS' worth."""
        from weaver_jax._generate import MAX_ROUNDS_PER_CALL

        full = int(np.clip(CALL_SECONDS / self.costs[self.current.name], 1, MAX_ROUNDS_PER_CALL))
        return min(full, FIRST_ROUNDS << max(self.calls - 1, 0))

    def observe(self, tier: Tier, rounds: int, new_tokens: list[int], running: list[bool]) -> None:
        """A call of `tier` ran `rounds` rounds; the sequences still `running` after it emitted `new_tokens` each
        (sequences that ended in it ran fewer rounds and are left out)."""
        # a call that ended with its last sequence ran as many rounds as that one emitted tokens at most
        self.rounds[tier.name] += rounds if any(running) else min(rounds, max(new_tokens, default=0))
        counted = [n for n, r in zip(new_tokens, running, strict=True) if r]
        self.running = np.asarray(running, bool)
        if tier.method == "ar":
            self.predictability += RELAX * (self.prior - self.predictability)
        elif counted and rounds:
            def ratio(tau):
                return np.maximum(0.0, (tau - 1.0) / max(tier.prior(self.sampled) - 1.0, 1e-3))

            batch = float(ratio(sum(counted) / (rounds * len(counted))))
            self.predictability += WEIGHT * (batch - self.predictability)
            self.seen[0] += batch * rounds
            self.seen[1] += rounds
            if self.lockstep:
                if self.sequences is None:
                    self.sequences = np.zeros((len(running), 2))
                self.sequences[self.running] += np.stack(
                    [ratio(np.asarray(new_tokens)[self.running] / rounds) * rounds,
                     np.full(self.running.sum(), rounds)], -1)

    def learned(self) -> float | None:
        """The prior for this device's next call: halfway from this call's to what its drafted chunks saw."""
        return None if not self.seen[1] else 0.5 * self.prior + 0.5 * self.seen[0] / self.seen[1]

    def learned_spread(self) -> float | None:
        """Lockstep: the next batch's `spread`, halfway from this one's to what its sequences showed (the slowest
        one's predictability over the batch's, every sequence that drafted counted)."""
        if not self.lockstep or self.sequences is None or not self.seen[0]:
            return None
        mean = self.seen[0] / self.seen[1]
        slowest = self._slowest(self.sequences[:, 1] > 0, mean)
        return 0.5 * self.spread + 0.5 * float(np.clip(slowest / mean, 0.0, 1.0))

    def settings(self) -> dict:
        return {"method": "auto", "tiers": [t.name for t in self.tiers], "start": self.start.name,
                "switches": self.switches, "rounds": dict(self.rounds), "calls": self.calls,
                "round_ms": {k: None if v is None else round(v * 1e3, 4) for k, v in self.costs.items()},
                "measured_now": self.measured, "predictability": round(self.predictability, 3),
                **({"slowest_predictability": round(self.pace(), 3), "spread": round(self.spread, 3)}
                   if self.lockstep else {})}


class Plan:
    """method="auto" for one batch: its tiers and their round times (kept on disk, else measured by `autopilot` on
    the prefilled state), and whether plain decoding is predicted fastest outright, in which case the call runs
    `ar`'s own programs (`method` "ar", `loop_tiers` None). Otherwise `method` and `request` are the prefill's (a
    Weaver tier's when there is one: it keeps the root's state) and `nodes` the largest tree. lockstep: a batch
    whose rounds are its slowest sequence's (`generate`'s of more than one prompt: `Autopilot`)."""

    def __init__(self, bundle, prompts, temperature, exact: bool, options: dict, lockstep: bool = False):
        from weaver_jax._generate import split, target_parameters

        self.bundle, self.exact, self.batch, self.lockstep = bundle, exact, len(prompts), lockstep
        self.options = options
        self.sampled = float(temperature) > 0
        parameters = target_parameters(split(bundle.target)[1])
        tree_nodes(bundle, "auto", options, sampled=self.sampled, batch=self.batch, parameters=parameters)  # checks
        self.tiers = tiers(bundle, options.get("tiers"), sampled=self.sampled, batch=self.batch,
                           parameters=parameters)
        kept = read_costs()  # the round times and the acceptance seen before
        if len(self.tiers) == 1:
            self.costs = {"ar": 1.0}
        else:
            self.costs = None if options.get("remeasure") else known_costs(
                bundle, self.tiers, sampled=self.sampled, exact=exact, batch=self.batch, kept=kept)
        self.learned = predictability_key(bundle, sampled=self.sampled, exact=exact)
        self.predictability = kept.get(self.learned, 1.0)
        self.spread_key = cost_key(bundle, Tier("spread", (), (), 0), sampled=self.sampled, exact=exact,
                                   batch=self.batch)
        self.spread = kept.get(self.spread_key) or lockstep_spread(bundle, kept, sampled=self.sampled, exact=exact,
                                                                   batch=self.batch)  # used in lockstep only
        plain = self.costs is not None and Autopilot(self.tiers, self.costs, self.sampled, False,
                                                     self.predictability, lockstep, self.spread).plain_wins()
        if plain:
            self.method, self.request, self.loop_tiers, self.nodes = "ar", {}, None, None
        else:
            first = next((t for t in self.tiers if t.method == "weaver"), self.tiers[-1])
            self.method, self.request, self.loop_tiers = first.method, dict(first.request), self.tiers
            self.nodes = max(t.nodes for t in self.tiers)

    def autopilot(self, loop, state) -> Autopilot:
        """The call's `Autopilot`, its tiers' round times measured first on copies of `state` where none are kept
        (and kept for the next call, in this process and others)."""
        costs, measured = self.costs, self.costs is None
        if measured:
            costs = measure(loop, state, self.tiers, loop.keys)
            if costs:
                keep_costs(self.bundle, self.tiers, costs, sampled=self.sampled, exact=self.exact, batch=self.batch)
                self.costs = costs
        return Autopilot(self.tiers, costs, self.sampled, measured, self.predictability, self.lockstep, self.spread)

    def remember(self, autopilot: Autopilot) -> None:
        """Keep what the call's drafted chunks saw as the next calls' prior (a device and text where drafts earn
        less than the shipped pair's τ soon runs plain decoding outright), and in lockstep the spread between its
        slowest sequence and its mean for the next batch of its size."""
        learned, spread = autopilot.learned(), autopilot.learned_spread()
        kept = {}
        if learned is not None:
            self.predictability = kept[self.learned] = round(learned, 4)
        if spread is not None:
            self.spread = kept[self.spread_key] = round(spread, 4)
        if kept:
            write_costs(kept)

    def settings(self) -> dict:
        """The stats' `settings` when plain decoding ran outright."""
        return {"method": "auto", "tiers": [t.name for t in self.tiers], "start": "ar", "switches": [],
                "plain_program": True, "predictability": round(self.predictability, 3),
                **({"spread": round(self.spread, 3)} if self.lockstep else {}),
                "round_ms": {k: None if v is None else round(v * 1e3, 4) for k, v in self.costs.items()}}


def tune(bundle, *, batch_sizes=(1, 8), temperatures=(0.0, 1.0), prompt_tokens: int = 64, exact: bool = False,
         tiers=None) -> list[dict]:
    """Measure and keep every tier's round time on this device for these batch sizes and temperatures (what a
    call's first use does for its own), on prompts of random token ids: -> one row per (batch, temperature) with
    the round times in ms, the tier predicted fastest at the prior τ, the seconds from the start until its
    times were kept (every cell's programs compile at once, then each is timed alone) and the seconds its
    prefill's and its slowest tier's compiles took (`compile_seconds`: what to cut where tuning is slow)."""
    from weaver_jax._stream import Run

    rng = np.random.default_rng(0)
    cells = [(batch, temperature, rng.integers(0, bundle.target.config.vocab_size, (batch, prompt_tokens)).tolist())
             for batch in batch_sizes for temperature in temperatures]
    gate, t0 = _Gate(len(cells)), time.perf_counter()

    def one(index):  # each cell compiles beside the others; the timing waits for every compile (`_Gate`)
        batch, temperature, prompts = cells[index]
        _local.gate, _local.cell = gate, index
        try:
            run = Run(bundle, prompts, method="auto", max_new_tokens=256, temperature=temperature,
                      eos_token_id=[], exact=exact, remeasure=True, **({} if tiers is None else {"tiers": tiers}))
        finally:
            gate.arrive()
            _local.gate = None
        settings = run.autopilot.settings() if run.autopilot else run.plan.settings()
        prefill, *tiers_ = (p.compile_seconds for p in run.loop.programs)
        return {"batch": batch, "temperature": temperature, "round_ms": settings["round_ms"],
                "fastest": settings["start"], "seconds": round(time.perf_counter() - t0, 1),
                "compile_seconds": {"prefill": round(prefill, 1), "slowest_tier": round(max(tiers_), 1)}}

    with concurrent.futures.ThreadPoolExecutor(len(cells)) as pool:
        return list(pool.map(one, range(len(cells))))
