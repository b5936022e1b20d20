"""An OpenAI-compatible HTTP server (`weaver-jax serve`): Starlette routes over one generation thread.

`Engine` owns the device. Requests wait in a queue; slots (`_stream.Slots`) run the waiting requests that can
share a program (the same method, options, temperature, top-p and exact mode) - up to `max_batch` - as one batch,
speculation on: requests join free rows between calls (those waiting prefilled together), get their tokens as
the rounds complete, and leave at their own `max_tokens`, stop string or EOS; a client that goes away frees its
row at the next call. Batch sizes (1, 2, 4, ...), prompt lengths and `max_tokens` are rounded up to buckets, so
a few programs serve every request (`warmup` compiles them before the first); a request's tokens do not depend
on its bucket or its neighbours (greedy output is `generate`'s for that prompt, sampled output
`generate(..., seed=[seed])`'s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator

from flax import nnx

from weaver_jax._auto import tree_nodes
from weaver_jax._generate import finish_reason, target_parameters
from weaver_jax._stream import Slots, Text, check_stop

MAX_TOKENS_DEFAULT = 256
METHODS = ("auto", "ar", "dflash", "ddtree", "weaver")


class RequestError(ValueError):
    """A request the server refuses (HTTP `status`), with the parameter it is about."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass
class Job:
    """One request's generation: what to run and, as it runs, its events (`("text", str, n_tokens)`,
    then `("end", finish_reason, completion_tokens)`, or `("error", message, 0)`)."""

    prompt: list[int]
    max_tokens: int
    settings: tuple  # what a batch must share: (method, options, temperature, top_p, exact)
    seed: int
    stop: tuple[str, ...]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: bool = False

    @staticmethod
    def settings_of(method: str, options: dict, temperature: float, top_p: float = 1.0, exact: bool = False):
        return method, tuple(sorted(options.items())), float(temperature), float(top_p), bool(exact)

    def send(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


def _bucket(n: int, smallest: int) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


class Engine:
    """The generation thread: `submit` queues a job (`queue.Full` past `max_queue` waiting); the thread keeps
    slots of one set of settings running and moves waiting jobs of those settings into free slots between calls.
    The slots are as many as the jobs waiting when they were made (a power of two, at most `max_batch`, since an
    empty row costs a round as much as a full one) and grow, their sequences carried over, when more jobs of
    their settings wait than rows are free (clients arrive apart); jobs of other settings wait until the slots
    drain, and the next slots fit them. `batch_sizes` records the rows in use per call. pipeline: each call is
    sent before the last is read, so the device runs while the host emits text and prepares inserts; a row that
    frees in a call is known only after the next was sent, and takes a waiting request one call later."""

    def __init__(self, bundle, *, max_batch: int = 8, max_queue: int = 64, context: int | None = None,
                 pipeline: bool = False, start: bool = True):
        self.bundle, self.max_batch, self.pipeline = bundle, max_batch, pipeline
        self.parameters = target_parameters(nnx.split(bundle.target)[1])  # for the default tree budgets
        self.context = context or min(bundle.config.max_seq_len, 8192)
        self.pending: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.batch_sizes: list[int] = []
        self.slots: Slots | None = None  # the newest slots (the generation thread's)
        if start:
            self.start()

    def start(self) -> None:
        threading.Thread(target=self._loop, daemon=True, name="weaver-jax-engine").start()

    def submit(self, job: Job) -> Job:
        self.pending.put_nowait(job)
        return job

    def _loop(self) -> None:
        slots, waiting, texts, sent = None, [], {}, None
        while True:
            busy = slots is not None and any(o is not None for o in slots.occupant)
            if not busy and not waiting:
                if sent is not None:  # the last call of rows all released since: nothing in it to emit
                    sent[0].receive(sent[1])
                    sent = None
                waiting.append(self.pending.get())
            while not self.pending.empty():
                waiting.append(self.pending.get_nowait())
            for job in [j for j in waiting if j.cancelled]:
                waiting.remove(job)
            try:
                alike = [j for j in waiting if j.settings == waiting[0].settings]
                if not busy and waiting and (slots is None or not self._fits(slots, waiting[0])
                                             or len(alike) > slots.size < self.max_batch):
                    if slots is not None:  # method="auto": what its calls saw is the next slots' prior
                        slots.remember()
                    slots = self.slots = self._slots(waiting[0], alike)
                    if not self._fits(slots, waiting[0]):  # not even alone: say so rather than wait forever
                        waiting.pop(0).send("error", "the prompt and max_tokens do not fit the server's context "
                                                     f"of {self.context} tokens", 0)
                        continue
                if slots is None:  # every waiting job was cancelled before it started
                    continue
                fitting = [j for j in waiting if self._fits(slots, j)]
                if len(fitting) > len(slots.free()) and slots.size < self.max_batch and slots.growable:
                    slots = self.slots = self._grown(slots, len(fitting) - len(slots.free()))
                joining = [j for j in fitting if self._fits(slots, j)][: len(slots.free())]
                if joining:  # prefilled together: one call, not one per job
                    pad = min(max(_bucket(len(j.prompt), 64) for j in joining), self._room(slots))
                    slots.insert(slots.free()[: len(joining)], joining, [j.prompt for j in joining],
                                 [j.seed for j in joining], pad)
                for job in joining:
                    waiting.remove(job)
                    texts[id(job)] = Text(self.bundle.tokenizer, job.stop)
                self.batch_sizes.append(sum(o is not None for o in slots.occupant))
                queued = any(self._fits(slots, j) for j in waiting)  # a row that frees is taken at once
                before, sent = sent, (slots, slots.send(leave=queued))
                if not self.pipeline:  # read each call before the next goes out
                    before, sent = sent, None
                if before is not None:
                    for job, tokens in before[0].receive(before[1]):
                        if id(job) in texts and self._emit(job, tokens, texts[id(job)]):
                            del texts[id(job)]
                            slots.release(slots.occupant.index(job))  # its row, wherever growth moved it
            except Exception as e:  # a failure must not stop the server: the clients it concerns hear why
                for job in ([o for o in slots.occupant if o is not None] if slots else []) + waiting:
                    job.send("error", f"{type(e).__name__}: {e}", 0)
                slots, waiting, texts, sent = None, [], {}, None

    def warm_up(self, settings: tuple) -> None:
        """Compile what requests with `settings` run: slots of every size the engine makes (powers of two up to
        `max_batch`) for prompts up to 64 tokens and max_tokens up to MAX_TOKENS_DEFAULT, inserts and calls."""
        size, smaller = 1, []
        while True:
            jobs = [Job([0], MAX_TOKENS_DEFAULT, settings, 0, (), None) for _ in range(size)]
            slots = self._slots(jobs[0], jobs)
            if slots.autopilot and slots.autopilot.measured:  # method="auto" timed its tiers: now it may choose
                slots = self._slots(jobs[0], jobs)  # plain decoding outright, as the requests' slots will
            for other in smaller:  # growing from any smaller size (`_grown`)
                if slots.can_take(other):
                    slots.take(other)
            smaller.append(slots)
            # requests join as a power of two of rows (`Slots.insert`), at most the slots' size: each one here
            for batch in [size] + [1 << i for i in reversed(range((size - 1).bit_length()))]:
                slots.insert(list(range(batch)), jobs[:batch], [j.prompt for j in jobs[:batch]], [0] * batch, 64)
            for tier in slots.autopilot.tiers if slots.autopilot else [None]:  # method="auto": each tier's calls
                slots.step(tier=tier)
                slots.step(tier=tier)  # on a mesh XLA may return the state sharded otherwise: compiled here too
            if size >= self.max_batch:
                return
            size = min(2 * size, self.max_batch)

    def _emit(self, job: Job, tokens: list[int], text: Text) -> bool:
        """Send a job its new text; -> whether it has ended (its max_tokens, a stop string, EOS, its client gone)."""
        chunk = text.add(tokens[: job.max_tokens - len(text.tokens)])
        if chunk.text:
            job.send("text", chunk.text, len(chunk.tokens))
        eos = self.bundle.eos_token_ids
        full = len(text.tokens) >= job.max_tokens or (text.tokens and text.tokens[-1] in eos)
        if not (text.stopped or full or job.cancelled):
            return False
        tail = text.finish()
        if tail:
            job.send("text", tail, 0)
        job.send("end", finish_reason(text.tokens, eos, job.max_tokens, text.stopped), len(text.tokens))
        return True

    @staticmethod
    def _room(slots: Slots) -> int:
        """The prompt positions a row of `slots` has beside its new tokens and a tree."""
        return slots.context - slots.settings["max_new_tokens"] - slots.nodes

    def _fits(self, slots: Slots, job: Job) -> bool:
        return (job.settings == slots.key and job.max_tokens <= slots.settings["max_new_tokens"]
                and len(job.prompt) <= self._room(slots))

    def _slots(self, first: Job, alike: list[Job]) -> Slots:
        """Slots for `first`'s settings, sized for the jobs like it that wait: the cache holds what they need
        (rounded up to a power of two, within the server's context), since every round reads all of it."""
        size = min(self.max_batch, _bucket(len(alike), 1))  # every row costs a round's compute, used or not
        new = _bucket(max(j.max_tokens for j in alike), MAX_TOKENS_DEFAULT)
        nodes = self._nodes(first.settings, size)
        longest = max(_bucket(len(j.prompt), 64) for j in alike)
        new = min(new, max(first.max_tokens, self.context - longest - nodes))  # the context bounds the bucket
        return self._make(first.settings, size, new, min(self.context, _bucket(longest + new + nodes, 256)), nodes)

    def _grown(self, slots: Slots, more: int) -> Slots:
        """`slots` with rows for `more` sequences besides its own (a power of two, at most max_batch), those
        running carried over mid-sequence; or `slots` itself where the bigger slots' tree leaves a running prompt
        no room, or their state differs (method="auto" choosing plain decoding at one batch size, not the other):
        then those slots run on as they are until they drain (`growable`), as requests arriving apart would."""
        size = min(self.max_batch, _bucket(slots.size + more, 1))
        held = max((len(j.prompt) for j in slots.occupant if j is not None), default=0)
        nodes = self._nodes(slots.key, size)
        if self._room(slots) + slots.nodes - nodes < held:
            return slots
        bigger = self._make(slots.key, size, slots.settings["max_new_tokens"], slots.context, nodes)
        if not bigger.can_take(slots):
            slots.growable = False  # making the bigger slots again would cost a prefill (and auto's plan) per call
            return slots
        slots.remember()
        bigger.take(slots)
        return bigger

    def _nodes(self, settings: tuple, size: int) -> int:
        method, options, temperature, _, _ = settings
        return tree_nodes(self.bundle, method, dict(options), sampled=temperature > 0, batch=size,
                          parameters=self.parameters)

    def _make(self, settings: tuple, size: int, new: int, context: int, nodes: int) -> Slots:
        method, options, temperature, top_p, exact = settings
        slots = Slots(self.bundle, size, method=method, max_new_tokens=new, context=context,
                      temperature=temperature, top_p=top_p, exact=exact, **dict(options))
        slots.key, slots.nodes, slots.growable = settings, nodes, True
        return slots


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] needs a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or text parts", "messages")
        out.append({"role": m["role"], "content": content})
    return out


class Server:
    """The routes over an `Engine`: `app` is the ASGI application."""

    def __init__(self, bundle, *, model_name: str | None = None, method: str = "auto", max_batch: int = 8,
                 max_queue: int = 64, context: int | None = None, api_key: str | None = None, start: bool = True,
                 warmup: tuple[float, ...] = (), pipeline: bool = False, **method_options):
        """warmup: temperatures whose programs for `method` are compiled before the server starts (every batch
        size, prompts up to 64 tokens, max_tokens up to 256): no request meeting those waits for a compiler
        (seconds each). Other settings compile on their first request. pipeline: the engine sends each call
        before reading the last (the device never waits on the host's inserts and text; a freed row takes the
        next request a call later) instead of reading each first (`Engine`)."""
        if bundle.tokenizer is None:
            raise ValueError("serving needs the bundle's tokenizer (bundle.tokenizer is None)")
        _require("starlette")
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.bundle, self.model_name = bundle, model_name or bundle.name or "weaver-jax"
        self.method, self.method_options = method, method_options
        self.api_key = api_key
        self.engine = Engine(bundle, max_batch=max_batch, max_queue=max_queue, context=context, pipeline=pipeline,
                             start=False)
        for temperature in warmup:
            self.engine.warm_up(Job.settings_of(method, method_options, temperature))
        if start:
            self.engine.start()
        self.app = Starlette(routes=[
            Route("/health", self.health), Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"])])

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "weaver_jax"}]})

    async def chat_completions(self, request):
        return await self._complete(request, chat=True)

    async def completions(self, request):
        return await self._complete(request, chat=False)

    def _job(self, body: dict, chat: bool) -> Job:
        tokenizer = self.bundle.tokenizer
        if body.get("model", self.model_name) != self.model_name:
            raise RequestError(f"the model {body['model']!r} does not exist here; this server has "
                               f"{self.model_name!r}", "model", status=404)
        if chat:
            prompt = tokenizer.apply_chat_template(_messages(body))
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1:
                text = text[0]
            if not isinstance(text, str) or not text:
                raise RequestError("'prompt' must be a non-empty string", "prompt")
            prompt = tokenizer.encode(text)
        if body.get("n", 1) != 1:
            raise RequestError("only n = 1 is supported", "n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", MAX_TOKENS_DEFAULT))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        for name, value, low, high in (("temperature", temperature, 0.0, 2.0), ("top_p", top_p, 0.0, 1.0)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise RequestError(f"{name} must be a number in [{low}, {high}], got {value!r}", name)
        if top_p == 0:
            raise RequestError("top_p must be > 0", "top_p")
        seed = body.get("seed")
        if seed is None:
            seed = uuid.uuid4().int % (1 << 31)
        elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 32:
            raise RequestError(f"seed must be an integer in [0, 2**32), got {seed!r}", "seed")
        method = self.method if body.get("speculative", True) else "ar"
        method = body.get("method", method)
        if method not in METHODS:
            raise RequestError(f"method must be one of {list(METHODS)}, got {method!r}", "method")
        options = {} if method in ("ar", "dflash") else dict(self.method_options if method == self.method else {})
        if "budget" in body and method in ("ddtree", "weaver"):
            options["budget"] = body["budget"]
        try:
            stop = check_stop(body.get("stop"), tokenizer)
        except ValueError as e:
            raise RequestError(str(e), "stop") from None
        if len(prompt) + max_tokens > self.engine.context:
            raise RequestError(f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) exceed the "
                               f"server's context of {self.engine.context} tokens", "max_tokens", status=413)
        # the method's options are checked now, not in the generation thread
        tree_nodes(self.bundle, method, options, sampled=temperature > 0, batch=1, parameters=self.engine.parameters)
        settings = Job.settings_of(method, options, temperature, top_p, body.get("exact", False))
        return Job(prompt, max_tokens, settings, seed, stop, asyncio.get_running_loop())

    async def _complete(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return _error("a valid API key is required: 'Authorization: Bearer <key>'", None, status=401,
                          kind="authentication_error")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            job = self._job(body, chat)
        except json.JSONDecodeError as e:
            return _error(f"the request body is not JSON: {e}", None)
        except RequestError as e:
            return _error(str(e), e.param, status=e.status)
        except (ValueError, TypeError) as e:
            return _error(str(e), None)
        try:
            self.engine.submit(job)
        except queue.Full:
            return _error(f"the server is busy ({self.engine.pending.maxsize} requests wait): try again later", None,
                          status=429, kind="rate_limit_error")
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = dict(id=ident, object="chat.completion" if chat else "text_completion", created=int(time.time()),
                    model=self.model_name)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._events(job, head, chat, usage), media_type="text/event-stream")
        text, reason, count = [], None, 0
        while True:
            kind, value, n = await job.events.get()
            if kind == "error":
                return _error(value, None, status=500, kind="server_error")
            if kind == "text":
                text.append(value)
            else:
                reason, count = value, n
                break
        text = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        return JSONResponse(head | {"choices": [choice | {"finish_reason": reason}],
                                    "usage": _usage(job, count)})

    async def _events(self, job: Job, head: dict, chat: bool, usage: bool) -> AsyncIterator[str]:
        head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}

        def event(choice: dict | None, **extra) -> str:
            return "data: " + json.dumps(head | {"choices": [choice] if choice else []} | extra) + "\n\n"

        def piece(text: str, reason: str | None = None) -> dict:
            content = {"delta": {"content": text} if text or reason is None else {}} if chat else {"text": text}
            return {"index": 0, **content, "finish_reason": reason}

        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            while True:
                kind, value, n = await job.events.get()
                if kind == "error":
                    yield "data: " + json.dumps({"error": {"message": value, "type": "server_error"}}) + "\n\n"
                    break
                if kind == "text":
                    yield event(piece(value))
                    continue
                yield event(piece("", value))
                if usage:
                    yield event(None, usage=_usage(job, n))
                break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): the sequence stops at the next chunk
            job.cancelled = True


def _usage(job: Job, completion_tokens: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": completion_tokens,
            "total_tokens": len(job.prompt) + completion_tokens}


def _error(message: str, param: str | None, status: int = 400, kind: str = "invalid_request_error"):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _require(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"serving needs {module} (Starlette and uvicorn): pip install 'weaver-jax[serve]'")


def serve(bundle, *, host: str = "127.0.0.1", port: int = 8000, **server_options) -> None:
    """Run the server until interrupted (uvicorn)."""
    _require("uvicorn")
    import uvicorn

    t0 = time.perf_counter()
    if server_options.get("warmup"):
        print(f"compiling for temperatures {list(server_options['warmup'])}, batch sizes up to "
              f"{server_options.get('max_batch', 8)} (--warmup) ...", file=sys.stderr, flush=True)
    server = Server(bundle, **server_options)
    print(f"ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    uvicorn.run(server.app, host=host, port=port, log_level="info")
