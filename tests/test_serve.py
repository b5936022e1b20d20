"""The OpenAI-compatible server: responses are `generate`'s text, streamed or not; bad requests are 400s."""

import concurrent.futures
import contextlib
import functools
import itertools
import json
import threading
import time

import numpy as np
import openai
import pytest
import uvicorn
from starlette.testclient import TestClient

import weaver_jax as wj
from weaver_jax import _auto, _generate
from weaver_jax._serve import Server
from weaver_jax._stream import Slots, insert_rows

MESSAGES = [{"role": "user", "content": "hi there"}]


@functools.cache
def bundle():
    return wj.testing.random_bundle(0, tokenizer=True, eos_token_ids=(1,), block_size=6)


def expected(prompt_ids, max_tokens, method="weaver"):
    """`generate`'s text and tokens for max_tokens <= 16 (one program: the first tokens of 16 are those of fewer)."""
    b = bundle()
    tokens = wj.generate(b, [prompt_ids], method=method, max_new_tokens=16).tokens[0][:max_tokens]
    return b.tokenizer.decode(tokens, skip_special_tokens=True), tokens


def sse(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_chat_and_completions_are_generates_text_streamed_or_not():
    b = bundle()
    client = TestClient(Server(b, model_name="tiny", method="weaver").app)  # (auto: the batching test's)
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]

    prompt = b.tokenizer.apply_chat_template(MESSAGES)
    text, tokens = expected(prompt, 12)
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    out = client.post("/v1/chat/completions", json=request).json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"] == {"role": "assistant",
                                                                                  "content": text}
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                            "total_tokens": len(prompt) + len(tokens)}
    assert out["choices"][0]["finish_reason"] == ("stop" if tokens[-1] == 1 else "length")

    events = sse(client.post("/v1/chat/completions", json=request | {
        "stream": True, "stream_options": {"include_usage": True}}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == text
    assert events[-2]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == out["usage"]

    # a plain completion, speculation off for this request: plain decoding's text (lossless: the same)
    text, tokens = expected(b.tokenizer.encode("abc"), 9, method="ar")
    out = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 9, "temperature": 0,
                                               "speculative": False}).json()
    assert out["choices"][0]["text"] == text and out["usage"]["completion_tokens"] == len(tokens)
    events = sse(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 9, "temperature": 0,
                                                      "method": "ar", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == text


@pytest.mark.parametrize("pipeline", [False, True])
def test_requests_share_the_batch_and_a_free_slot_takes_the_next_one(monkeypatch, tmp_path, pipeline):
    """At most two slots, three requests: the first runs alone, the slots grow to two rows (the first carried
    over mid-sequence) when the others arrive, each ends at its own limit or stop string, and the third takes the
    slot the short one frees while the first runs on; every reply is `generate`'s, whether each call is read
    before the next is sent or after (pipeline: rows freed and filled a call later)."""
    b = bundle()
    other = [{"role": "user", "content": "tell me more"}]
    prompt = b.tokenizer.apply_chat_template(MESSAGES)
    full, _ = expected(prompt, 16, "dflash")
    want = [expected(prompt, 2, "dflash")[0], expected(b.tokenizer.apply_chat_template(other), 6, "dflash")[0]]
    # method="auto" over plain steps and the chain, switching at every call: the slots' rows share each call's tier
    monkeypatch.setattr(_auto.Autopilot, "next", lambda self: self.tiers[next(calls) % len(self.tiers)])
    calls = itertools.count()
    monkeypatch.setattr(_auto, "cost_file", lambda: tmp_path / "auto_costs.json")
    parameters = _generate.target_parameters(_generate.split(b.target)[1])
    for size in (1, 2):  # round times where the chain pays (else plain decoding would run outright)
        tiers = _auto.tiers(b, ["dflash"], sampled=False, batch=size, parameters=parameters)
        _auto.keep_costs(b, tiers, {"ar": 1.0, "dflash": 1.0}, sampled=False, exact=False, batch=size)
    server = Server(b, method="auto", tiers=["dflash"], max_batch=2, start=False, warmup=(0.0,),
                    pipeline=pipeline)  # started once the first request waits
    programs = len(_generate._COMPILED), insert_rows._cache_size()  # nothing compiles after the warm-up
    first_call, arrived = threading.Event(), threading.Event()
    receive = Slots.receive

    def held(self, *args, **kwargs):  # the first call read waits for the other requests: they arrive meanwhile
        out = receive(self, *args, **kwargs)
        first_call.set()
        arrived.wait()
        return out

    monkeypatch.setattr(Slots, "receive", held)
    client = TestClient(server.app)
    stop = next(c for c in full[4:] if c != "\ufffd")
    requests = [{"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stop": stop},
                {"messages": MESSAGES, "max_tokens": 2, "temperature": 0},
                {"messages": other, "max_tokens": 6, "temperature": 0}]
    replies = [None] * 3

    def post(i):
        replies[i] = client.post("/v1/chat/completions", json=requests[i]).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
    threads[0].start()
    while server.engine.pending.qsize() < 1:
        threading.Event().wait(0.01)
    server.engine.start()
    first_call.wait()
    for i, t in enumerate(threads[1:]):
        t.start()
        while server.engine.pending.qsize() < i + 1:  # queued in this order
            threading.Event().wait(0.01)
    arrived.set()
    for t in threads:
        t.join()
    content = [r["choices"][0]["message"]["content"] for r in replies]
    assert content == [full[: full.index(stop)], *want]
    assert replies[0]["choices"][0]["finish_reason"] == "stop"
    # pipelined, the second call went out before the first was read: the others join at the third
    expected_sizes = [1, 1, 2] if pipeline else [1, 2]
    assert server.engine.batch_sizes[: len(expected_sizes)] == expected_sizes
    assert server.engine.slots.size == 2
    assert (len(_generate._COMPILED), insert_rows._cache_size()) == programs  # the growth's inserts too
    assert all(server.engine.slots.autopilot.rounds.values())  # both tiers ran


@contextlib.contextmanager
def loopback(app):
    """The app served by uvicorn on a free loopback port: -> an official openai client for it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    finally:
        server.should_exit = True
        thread.join()


def test_the_official_openai_client_against_a_loopback_server():
    b = bundle()
    with loopback(Server(b, model_name="tiny", method="ar").app) as client:  # the protocol: plain decoding will do
        assert [m.id for m in client.models.list()] == ["tiny"]
        text = expected(b.tokenizer.apply_chat_template(MESSAGES), 8, "ar")[0]
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == text and reply.usage.completion_tokens <= 8
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda _: client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=8, temperature=0).choices[0].message.content, range(4)))
        assert texts == [text] * 4
        # sampled: the request's own seed decides, as generate(..., seed=[seed]) for that prompt alone
        b_ids = b.tokenizer.apply_chat_template(MESSAGES)
        want = wj.generate(b, [b_ids], method="ar", max_new_tokens=8, temperature=1.0, seed=[7]).tokens[0]
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                               seed=7)
        assert reply.choices[0].message.content == b.tokenizer.decode(want, skip_special_tokens=True)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0)


def test_a_client_gone_mid_stream_frees_its_row_and_the_server_serves_on():
    b = bundle()
    endless = wj.Bundle(b.target, b.tokenizer, eos_token_ids=(), name="tiny")  # only max_tokens ends a sequence
    server = Server(endless, method="ar")
    with loopback(server.app) as client:
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=480, temperature=0,
                                                stream=True)
        chunks = iter(stream)
        while not next(chunks).choices[0].delta.content:  # until a token has come: the sequence runs
            pass
        stream.close()
        deadline = time.monotonic() + 60
        while any(o is not None for o in server.engine.slots.occupant):
            assert time.monotonic() < deadline, "the row of a client that went away was never freed"
            time.sleep(0.01)
        assert int(np.max(np.asarray(server.engine.slots.state.num_tokens))) < 480  # ended early
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4


@pytest.mark.parametrize("body, param, message", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages", "must be a string"),
    ({"messages": MESSAGES, "n": 2}, "n", "only n = 1"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "positive integer"),
    ({"messages": MESSAGES, "temperature": 3}, "temperature", "in [0.0, 2.0]"),
    ({"messages": MESSAGES, "method": "beam"}, "method", "must be one of"),
    ({"messages": MESSAGES, "stop": [""]}, "stop", "non-empty strings"),

    ({"messages": MESSAGES, "method": "weaver", "budget": 0}, None, "budget must be an integer >= 1"),
])
def test_bad_requests_are_400s_that_name_the_problem(body, param, message):
    client = TestClient(Server(bundle(), start=False).app)
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    assert client.post("/v1/completions", content=b"{nope").status_code == 400


def test_the_server_refuses_what_it_cannot_serve_with_the_right_status():
    server = Server(bundle(), model_name="tiny", max_queue=1, api_key="sesame", start=False)
    client = TestClient(server.app)
    key = {"Authorization": "Bearer sesame"}
    body = {"messages": MESSAGES, "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 401
    assert client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer x"}).status_code == 401
    reply = client.post("/v1/chat/completions", json=body | {"model": "gpt-9"}, headers=key)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
    reply = client.post("/v1/chat/completions", json=body | {"max_tokens": 10**6}, headers=key)
    assert reply.status_code == 413 and "context" in reply.json()["error"]["message"]
    server.engine.pending.put_nowait("a request that waits")  # the queue is full (the engine is not running)
    reply = client.post("/v1/chat/completions", json=body, headers=key)
    assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
