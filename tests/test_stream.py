"""Streaming and stop strings: the same tokens as `generate`, text that never has to be taken back."""

import functools

import pytest

import weaver_jax as wj
from weaver_jax._stream import Slots, Text

PROMPT = [5, 6, 7, 8, 9, 10]
NEW = 24


@functools.cache
def bundle():  # a byte-level tokenizer over the random target's 128 ids; EOS = <|im_end|>
    return wj.testing.random_bundle(0, tokenizer=True, eos_token_ids=(1,), block_size=6)


def test_text_holds_back_split_characters_and_stop_prefixes():
    tok = wj.testing.byte_tokenizer()
    e_acute = tok.encode("é")  # two tokens: the first alone decodes to U+FFFD
    text = Text(tok, stop=["END"])
    shown = [text.add(ids).text for ids in ([*tok.encode("caf"), e_acute[0]], [e_acute[1]], tok.encode(" E"),
                                            tok.encode("x"), tok.encode(" EN"))]
    assert shown == ["caf", "é", " ", "Ex", " "]  # "E" / "EN" may begin "END": held until they cannot
    assert text.finish() == "EN" and text.text == "café Ex EN"

    text = Text(tok, stop=["b!", "!c"])
    chunk = text.add(tok.encode("aab!cdd"))  # two stop strings: the first in the text wins
    assert chunk == (tok.encode("aab!"), "aa") and text.stopped and text.tokens == tok.encode("aab!")
    assert Text(None).add([3, 4]) == ([3, 4], "")


@pytest.mark.parametrize("method, temperature", [("ar", 0.0), ("dflash", 1.0), ("ddtree", 0.0), ("weaver", 1.0)])
def test_stream_and_stop_strings_emit_what_generate_emits(method, temperature):
    """Every method: the chunks' tokens concatenate to `generate`'s and their text to its decoded text; a stop
    string taken from that text ends `stream` and `generate` alike, with the token that completes it (the
    chunked loop of `stream`: the same programs for both)."""
    b, options = bundle(), dict(method=method, max_new_tokens=NEW, temperature=temperature, seed=3)
    want = wj.generate(b, [PROMPT], **options)
    s = wj.stream(b, PROMPT, **options)
    chunks = list(s)
    text = b.tokenizer.decode(want.tokens[0], skip_special_tokens=True)
    assert [t for c in chunks for t in c.tokens] == s.tokens == want.tokens[0]
    assert "".join(c.text for c in chunks) == s.text == text
    assert (s.finish_reason, s.stats["new_tokens"]) == (want.stats["finish_reasons"][0], len(want.tokens[0]))
    assert len(chunks) > 2  # rounds a few at a time

    stop = next(c for c in text[len(text) // 2:] if c != "\ufffd")  # a character the text holds
    decode = functools.partial(b.tokenizer.decode, skip_special_tokens=True)
    ends = next(n for n in range(1, len(s.tokens) + 1) if stop in decode(s.tokens[:n]))
    s = wj.stream(b, PROMPT, stop=[stop], **options)
    assert ("".join(c.text for c in s), s.tokens, s.finish_reason) == (text[: text.index(stop)],
                                                                        want.tokens[0][:ends], "stop")
    stopped = wj.generate(b, [PROMPT], stop=stop, **options)
    assert (stopped.tokens, stopped.stats["finish_reasons"]) == ([s.tokens], ["stop"])


def test_a_stream_sends_each_call_before_reading_the_last():
    """The device does not wait on the host between calls: a call goes out before the one before it is read (on a
    GPU a call returns once queued, `_generate.ASYNC_LOOP`); the one sent while the sequence was ending is read
    and emits nothing."""
    b, options = bundle(), dict(max_new_tokens=6, eos_token_id=[])
    s = wj.stream(b, PROMPT, rounds_per_call=1, **options)
    loop, events = s._run.loop, []
    for name in ("send", "read"):
        call = getattr(loop, name)
        setattr(loop, name, lambda *a, call=call, name=name, **k: events.append(name) or call(*a, **k))
    assert [t for c in s for t in c.tokens] == wj.generate(b, [PROMPT], **options).tokens[0]
    assert events == ["send"] + ["send", "read"] * 5 + ["read"]


def test_a_stop_string_ends_its_own_sequence_of_a_batch():
    b = bundle()
    prompts, options = [PROMPT, PROMPT[:3]], dict(max_new_tokens=NEW, seed=1)
    full = wj.generate(b, prompts, **options).tokens
    first = b.tokenizer.decode(full[0], skip_special_tokens=True)
    stop = next(c for c in first[len(first) // 2:] if c != "\ufffd" and c not in b.tokenizer.decode(full[1]))
    stopped = wj.generate(b, prompts, stop=stop, **options)
    assert stopped.tokens[1] == full[1] and stopped.tokens[0] == full[0][: len(stopped.tokens[0])]
    assert stop in b.tokenizer.decode(stopped.tokens[0]) and stop not in b.tokenizer.decode(stopped.tokens[0][:-1])
    assert stopped.stats["finish_reasons"][0] == "stop"


def test_slots_prefill_joining_sequences_together_and_each_emits_what_it_would_alone():
    """Three sampled sequences join rows 3, 0 and 2 of four in one insert (a batch of four with a dropped
    row): each emits `generate`'s tokens for it alone, with its own seed."""
    b, seeds = bundle(), [11, 12, 13]
    prompts = [PROMPT, PROMPT[:2], [9, 8, 7, 6, 5, 4, 3]]
    options = dict(method="ar", max_new_tokens=8, temperature=1.0)
    slots = Slots(b, 4, context=128, **options)
    slots.insert([3, 0, 2], ["a", "b", "c"], prompts, seeds, pad_to=32)
    got = {"a": [], "b": [], "c": []}
    for _ in range(10):  # each call runs a round at least: 8 tokens (or EOS) each, and more calls than needed
        for occupant, tokens in slots.step():
            got[occupant] += tokens
    for name, prompt, seed in zip("abc", prompts, seeds, strict=True):
        assert got[name] == wj.generate(b, [prompt], seed=[seed], **options).tokens[0], name


def test_a_slots_call_that_leaves_ends_when_a_sequence_ends():
    """`step(leave=True)` (requests wait for a row) ends the call at the round where a sequence ends: the row
    that joined a call later has one new token, not the call's three; the calls after it continue what
    `generate` gives each - also across the slots growing from two rows to four mid-sequence (`take`) and a
    sequence joining them as a batch of one."""
    b, options = bundle(), dict(method="ar", max_new_tokens=8, temperature=1.0)
    slots = Slots(b, 2, context=128, rounds_per_call=3, **options)
    got = {"a": [], "b": []}

    def step(leave=False):
        new = {name: [] for name in got}
        for occupant, tokens in slots.step(leave):
            new[occupant] += tokens
        for name, tokens in new.items():
            got[name] += tokens
        return {name: len(tokens) for name, tokens in new.items()}

    slots.insert([0], ["a"], [PROMPT], [11], pad_to=32)
    assert step() == {"a": 4, "b": 0}  # the prefill's token and three
    bigger = Slots(b, 4, context=128, rounds_per_call=3, **options)
    assert bigger.can_take(slots) and not slots.can_take(bigger)
    bigger.take(slots)
    slots = bigger
    slots.insert([2], ["b"], [PROMPT[:2]], [12], pad_to=32)
    assert slots._first[2][0].shape[0] == 1  # one joining sequence prefills one row, not the slots' four
    assert step() == {"a": 3, "b": 4}
    assert step(leave=True) == {"a": 1, "b": 1}  # "a" has its 8
    while step()["b"]:
        pass
    for name, prompt, seed in (("a", PROMPT, 11), ("b", PROMPT[:2], 12)):
        assert got[name] == wj.generate(b, [prompt], seed=[seed], **options).tokens[0], name


def test_stream_errors_name_the_problem():
    b = bundle()
    with pytest.raises(ValueError, match="stop strings need the bundle's tokenizer"):
        wj.stream(wj.testing.random_bundle(0), PROMPT, max_new_tokens=4, stop="x")
    with pytest.raises(ValueError, match="stop must be a string or a list of non-empty strings"):
        wj.generate(b, [PROMPT], max_new_tokens=4, stop=[""])
    with pytest.raises(ValueError, match="rounds_per_call must be an integer in"):
        list(wj.stream(b, PROMPT, max_new_tokens=4, rounds_per_call=0))
    with pytest.raises(ValueError, match="caches of 128 slots cannot hold prompts of 32 tokens, 120 new ones"):
        Slots(b, 2, method="ar", max_new_tokens=120, context=128)
