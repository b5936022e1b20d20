"""method="auto": tiers switched at call boundaries emit `ar`'s tokens; round times measured once and kept."""

import json
import math

import pytest

import weaver_jax as wj
from weaver_jax import _auto
from weaver_jax._generate import split, target_parameters

from .test_stream import NEW, PROMPT, bundle

PROMPTS = [PROMPT, PROMPT[:3]]  # a ragged batch


@pytest.fixture
def costs(tmp_path, monkeypatch):
    """A cost file of the test's own; -> keep(round ms by tier name, sampled, batch) writes into it."""
    path = tmp_path / "auto_costs.json"
    monkeypatch.setattr(_auto, "cost_file", lambda: path)

    def keep(ms: dict, sampled: bool = False, batch: int = 2, tiers=None):
        made = tiers_of(sampled, batch, tiers)
        _auto.keep_costs(bundle(), made, {t.name: ms[t.method] / 1e3 for t in made}, sampled=sampled, exact=False,
                         batch=batch)
        return path

    return keep


def tiers_of(sampled=False, batch=2, requested=None):  # batch: len(PROMPTS)
    return _auto.tiers(bundle(), requested, sampled=sampled, batch=batch,
                       parameters=target_parameters(split(bundle().target)[1]))


@pytest.fixture
def cycling(monkeypatch):
    """Every call of method="auto" switches tier: weaver, ar, dflash, weaver, ..."""
    order = ["weaver", "ar", "dflash"]

    def next_tier(self):
        self.current = next(t for t in self.tiers if t.method == order[self.calls % len(order)])
        self.calls += 1
        return self.current

    monkeypatch.setattr(_auto.Autopilot, "next", next_tier)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_switching_tiers_every_call_emits_what_ar_emits(costs, cycling, temperature):
    """Greedy tokens equal `ar`'s and sampled ones are seed-identical to it across switches in both directions
    (plain steps between drafted rounds: the drafter's context and Weaver's root state stay in step)."""
    path = costs({"ar": 1.0, "dflash": 1.5, "weaver": 2.0}, sampled=temperature > 0)
    options = dict(max_new_tokens=NEW, temperature=temperature, seed=3)
    got = wj.generate(bundle(), PROMPTS, method="auto", **options)
    assert got.tokens == wj.generate(bundle(), PROMPTS, method="ar", **options).tokens
    settings = got.stats["settings"]
    spread = _auto.cost_key(bundle(), _auto.Tier("spread", (), (), 0), sampled=temperature > 0, exact=False, batch=2)
    start = 1 / (1 + _auto.LOCKSTEP_SLOPE * math.log(2))  # no batch of 2 seen before: the model's spread
    assert settings["spread"] == pytest.approx(start, abs=1e-3)
    assert 0.5 * start <= json.loads(path.read_text())[spread] <= 0.5 * start + 0.5  # kept for the next
    assert settings["tiers"] == ["ar", "dflash", "weaver-24"] and not settings["measured_now"]
    assert all(settings["rounds"][name] > 0 for name in settings["tiers"]), settings["rounds"]
    assert got.stats["new_tokens"] == sum(map(len, got.tokens)) and "options" not in got.stats


def test_first_use_measures_round_times_and_later_calls_read_them(costs, monkeypatch):
    path = costs({"ar": 1.0, "dflash": 1.0, "weaver": 1.0})
    path.unlink()
    options = dict(max_new_tokens=NEW, seed=3)
    first = wj.generate(bundle(), PROMPTS, method="auto", **options)
    settings = first.stats["settings"]
    assert settings["measured_now"] and settings["round_ms"]["ar"] > 0
    kept = json.loads(path.read_text())
    assert all(_auto.cost_key(bundle(), t, sampled=False, exact=False, batch=2) in kept for t in tiers_of())
    monkeypatch.setattr(_auto, "measure", lambda *a: pytest.fail("measured again"))
    again = wj.generate(bundle(), PROMPTS, method="auto", **options)
    assert again.tokens == first.tokens == wj.generate(bundle(), PROMPTS, **options).tokens
    assert not again.stats["settings"].get("measured_now")


def test_plain_decoding_runs_outright_when_drafting_cannot_pay(costs):
    """Round times that no acceptance repays: `ar`'s own program, for `generate` and `stream` alike."""
    costs({"ar": 1.0, "dflash": 30.0, "weaver": 40.0}, batch=1)
    got = wj.generate(bundle(), [PROMPT], method="auto", max_new_tokens=NEW)
    assert got.stats["settings"]["plain_program"] and "mean_accepted_length" not in got.stats
    assert got.tokens == wj.generate(bundle(), [PROMPT], max_new_tokens=NEW).tokens
    s = wj.stream(bundle(), PROMPT, method="auto", max_new_tokens=NEW)
    assert [t for c in s for t in c.tokens] == got.tokens[0] and s.stats["settings"]["start"] == "ar"


def test_tune_measures_every_cell_at_once_and_keeps_the_times(costs, monkeypatch, capsys):  # costs: its own file
    """`weaver-jax tune`: the cells compile beside each other and are timed one at a time; what it keeps is what
    a later call reads instead of measuring; the command prints each cell's times and compile seconds."""
    from weaver_jax import cli

    rows = _auto.tune(bundle(), batch_sizes=(1, 2), temperatures=(0.0,), prompt_tokens=8, tiers=["dflash"])
    assert [(r["batch"], r["temperature"]) for r in rows] == [(1, 0.0), (2, 0.0)]
    for row in rows:
        assert set(row["round_ms"]) == {"ar", "dflash"} and row["round_ms"]["ar"] > 0
        made = tiers_of(batch=row["batch"], requested=["dflash"])
        kept = _auto.known_costs(bundle(), made, sampled=False, exact=False, batch=row["batch"])
        assert kept == {k: None if v is None else pytest.approx(v / 1e3, rel=1e-3, abs=1e-7)
                        for k, v in row["round_ms"].items()}
        assert set(row["compile_seconds"]) == {"prefill", "slowest_tier"}
        assert 0 <= row["compile_seconds"]["slowest_tier"] <= row["seconds"]
    monkeypatch.setattr(wj, "load", lambda *args, **kwargs: bundle())
    monkeypatch.setattr(_auto, "tune", lambda *args, **kwargs: rows)
    assert cli.main(["tune", "--batch", "1", "2", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "B = 2, T = 0: ms per round ar " in out and "compiling the prefill " in out


def test_the_autopilot_follows_acceptance_and_tries_drafting_again():
    ar, dflash, weaver = tiers_of(batch=1)
    pilot = _auto.Autopilot([ar, dflash, weaver], {"ar": 1e-3, "dflash": 1.6e-3, "weaver-24": 2e-3}, False, False)
    rounds = []
    for _ in range(5):
        assert pilot.next() is weaver  # the prior: τ 3.7 / 2.0 beats 2.78 / 1.6 and 1 / 1
        rounds.append(pilot.rounds_per_call())
    assert rounds == [2, 4, 8, 16, _auto.CALL_SECONDS // 2e-3]  # doubling up to a call of about CALL_SECONDS
    for _ in range(2):  # two chunks at τ 1.125 (the sequence that ended is left out)
        pilot.observe(weaver, 8, [9, 30], [True, False])
    assert pilot.next() is ar and pilot.switches[-1] == {"call": 5, "from": "weaver-24", "to": "ar",
                                                          "predicted_tau": 1.0}
    calls = 0
    while pilot.next() is ar:  # plain chunks say nothing of the drafts: the prior comes back, drafting is retried
        pilot.observe(ar, 8, [8], [True])
        calls += 1
    assert 0 < calls < 100 and pilot.current is not ar
    for _ in range(4):  # the text turns predictable: the larger tree pays
        pilot.observe(pilot.current, 8, [8 * 5], [True])
        pilot.next()
    assert pilot.current is weaver and pilot.learned() > 1.0
    settings = pilot.settings()
    assert settings["start"] == "weaver-24" and settings["rounds"]["ar"] == 8 * calls


def test_in_lockstep_the_slowest_sequence_sets_the_pace():
    """Two sequences, one accepting most of each tree and one nothing: slots (rows replaced as they end) keep
    drafting on the batch's mean; a `generate` batch, whose rounds are its slowest sequence's, turns to `ar`."""
    ar, dflash, weaver = tiers_of(batch=1)
    for lockstep, pace in ((False, weaver), (True, ar)):
        pilot = _auto.Autopilot([ar, dflash, weaver], {"ar": 1.0, "dflash": 1.6, "weaver-24": 2.0}, False, False,
                                lockstep=lockstep)
        pilot.next()
        for _ in range(3):
            pilot.observe(weaver, 8, [8 * 6, 8], [True, True])
            pilot.next()
        assert pilot.current is pace, lockstep
    assert pilot.settings()["slowest_predictability"] < 0.25 < pilot.settings()["predictability"]
    pilot.observe(ar, 8, [8, 8], [True, False])  # the slow one has ended: the fast one sets the pace
    assert pilot.next() is weaver
    spread = pilot.learned_spread()  # what the next batch of this size starts from: halfway to what this saw
    assert spread == pytest.approx(0.5 + 0.5 * (8 * 0.926 / 32) / 0.926, abs=1e-3)  # slowest 0 over 24 rounds
    for lockstep, given, start in ((True, spread, weaver), (True, 0.2, ar), (False, 0.2, weaver)):
        later = _auto.Autopilot([ar, dflash, weaver], {"ar": 1.0, "dflash": 1.6, "weaver-24": 2.0}, False, False,
                                lockstep=lockstep, spread=given)  # slots (not lockstep): rows are replaced
        assert later.next() is start and later.pace() == pytest.approx(given if lockstep else 1.0)


def test_a_batch_size_not_seen_takes_the_slope_of_the_nearest_seen(costs):
    """A lockstep batch's spread before any batch of its size ran: 1 / (1 + slope x ln B), the slope the model's
    or that of the nearest size kept."""
    costs({"ar": 1.0, "dflash": 1.5, "weaver": 2.0})

    def spread(batch):
        return _auto.lockstep_spread(bundle(), _auto.read_costs(), sampled=False, exact=False, batch=batch)

    def key(batch):
        return _auto.cost_key(bundle(), _auto.Tier("spread", (), (), 0), sampled=False, exact=False, batch=batch)

    assert spread(1) == 1.0 and spread(32) == pytest.approx(1 / (1 + _auto.LOCKSTEP_SLOPE * math.log(32)))
    _auto.write_costs({key(8): 0.5, key(64): 0.2})  # slopes 1 / ln 8 and 4 / ln 64
    assert spread(16) == pytest.approx(1 / (1 + math.log(16) / math.log(8)))
    assert spread(48) == pytest.approx(1 / (1 + 4 * math.log(48) / math.log(64)))
    assert spread(8) == pytest.approx(0.5)


def test_auto_options_are_checked():
    b = bundle()
    with pytest.raises(TypeError, match="method 'auto' takes only the options tiers"):
        wj.generate(b, [PROMPT], method="auto", max_new_tokens=4, budget=8)
    with pytest.raises(ValueError, match="tiers must be a list"):
        wj.generate(b, [PROMPT], method="auto", max_new_tokens=4, tiers="weaver")
    with pytest.raises(ValueError, match="a tier's method must be"):
        wj.generate(b, [PROMPT], method="auto", max_new_tokens=4, tiers=[{"method": "beam"}])
    with pytest.raises(ValueError, match="different depths"):
        wj.generate(b, [PROMPT], method="auto", max_new_tokens=4, tiers=[{"method": "dflash", "depth": 2},
                                                                          {"method": "weaver", "depth": 3}])
    plain = wj.testing.random_bundle(0, drafter=False)  # nothing to draft with: plain decoding, nothing measured
    got = wj.generate(plain, [PROMPT], method="auto", max_new_tokens=4)
    assert got.stats["settings"]["tiers"] == ["ar"] and got.stats["settings"]["plain_program"]
