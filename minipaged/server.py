"""An OpenAI-compatible HTTP server over one engine: ``python -m minipaged.serve --http``.

Continuous batching exists because requests arrive at different times from different clients.
Here they do: each HTTP request is a client, and they join the engine's batch as they arrive.

- **One engine loop** (:class:`EngineLoop`, a thread of its own) owns the :class:`~minipaged.llm.LLM`.
  While any request is unfinished it steps the engine; between steps it takes in the requests and
  aborts that arrived, and hands every request its new text. Nothing else touches the engine.
- **The HTTP side** (FastAPI on uvicorn, in its own event loop) turns a request into sampling
  parameters, hands it to the loop, and streams what comes back: by server-sent events
  (``stream=true``) or as one JSON body. A client that disconnects aborts its request; its blocks
  return to the pool at the next turn of the loop.
- Endpoints, as ``vllm serve`` names them: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus text, vLLM's metric names under a
  ``minipaged:`` prefix).
- Errors are OpenAI's: a body ``{"error": {"message", "type", "param", "code"}}``, 400 for a bad
  request (bad JSON, an unknown field, a parameter the engine does not implement, a prompt too long
  for the context or the pool, ``n`` over ``max_num_seqs``), 500 for a fault inside a step, which
  fails the requests that were running and leaves the server serving.

The engine loop and the HTTP handlers share one interpreter lock. A step holds it for its Python
parts (scheduling, bookkeeping) and releases it inside torch's kernels, so the handlers run mostly
while the forward pass computes; on a small model, where the step is mostly Python, they wait.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field

from minipaged.block_math import kv_usage
from minipaged.llm import LLM, Completion
from minipaged.sequence import SamplingParams

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class APIError(Exception):
    """An error to send as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = "BadRequestError" if self.status == 400 else "InternalServerError"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status)  # fmt: skip


# --------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Body(BaseModel):
    """What both endpoints take: the sampling parameters the engine implements, in OpenAI's names."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logprobs: int | bool | None = None
    user: str | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def sampling_params(body: _Body, default_max_tokens: int) -> SamplingParams:
    """The engine's :class:`~minipaged.sequence.SamplingParams` for ``body``; an :class:`APIError` for what it lacks."""
    if body.top_p != 1.0:
        raise APIError(400, f"top_p={body.top_p} is not implemented: minipaged samples from the whole "
                            "distribution (top_p=1)", "top_p")  # fmt: skip
    if body.logprobs not in (None, False):
        raise APIError(400, "logprobs are not implemented", "logprobs")
    if getattr(body, "echo", False):
        raise APIError(400, "echo is not implemented", "echo")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max_tokens
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, seed=body.seed, n=body.n,
                              ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, stop=stop)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc)) from None


# --------------------------------------------------------------------------- the engine loop


@dataclass
class Job:
    """One HTTP request's prompts, in the engine loop: what it queued and the events it hands back."""

    prompts: list[str]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_ids: list[list[int]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    done: bool = False

    def put(self, kind: str, item=None) -> None:
        """Hand the request an event from the engine thread: accepted, rejected, delta, done or error."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, item))
        except RuntimeError:  # the request's event loop is gone (the server is stopping)
            pass


class EngineLoop:
    """The one thread that steps the engine; requests and aborts reach it through a queue.

    Args:
        llm: the front end (its engine, tokenizer and detokenizers); only this loop touches it after start.
        registry: where the latency histograms are registered (None: a fresh one).
        thread: run in a thread of its own, started now; False: the caller runs :meth:`run` itself. On the
            process's main thread the engine steps faster: torch's OpenMP threads stay awake between
            the operations of a step for the main thread only (SmolLM2 on 2 cores: 46 against 71 ms a
            token), so the command line runs the engine there and the HTTP server in a thread.
    """

    def __init__(self, llm: LLM, registry: CollectorRegistry | None = None, thread: bool = True):
        self.llm = llm
        self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("minipaged:time_to_first_token_seconds", "Time to first token.",
                              registry=self.registry, buckets=LATENCY_BUCKETS)  # fmt: skip
        self.tpot = Histogram("minipaged:request_time_per_output_token_seconds",
                              "Time per output token after the first, per request.",
                              registry=self.registry, buckets=LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram("minipaged:e2e_request_latency_seconds", "End-to-end request latency.",
                             registry=self.registry, buckets=LATENCY_BUCKETS)  # fmt: skip
        self._inbox: list[tuple[str, Job]] = []
        self._jobs: list[Job] = []
        self._watchers: list = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self.run, name="minipaged-engine", daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    def submit(self, job: Job) -> None:
        self._send("add", job)

    def abort(self, job: Job) -> None:
        self._send("abort", job)

    def stop(self) -> None:
        """End :meth:`run` at its next turn (and wait for the loop's own thread, if it has one)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def watch(self, fn: Callable[[object], None]) -> Callable[[], None]:
        """Call ``fn(engine)`` after every step, on the loop's thread, between two steps; returns the unsubscribe.

        Between steps the engine's state is whole (no step is half done), so ``fn`` may read it, but it must not
        change it, and it delays the next step by its own time. An ``fn`` that raises is unsubscribed, with a
        warning: serving goes on.
        """
        self._watchers.append(fn)
        return lambda: self._watchers.remove(fn) if fn in self._watchers else None

    def _send(self, kind: str, job: Job) -> None:
        with self._wake:
            self._inbox.append((kind, job))
            self._wake.notify()

    def run(self) -> None:
        """Step while anything is unfinished, take requests and aborts between steps; until :meth:`stop`."""
        engine = self.llm.engine
        while True:
            with self._wake:
                while not (self._inbox or engine.has_unfinished() or self._stopped):
                    self._wake.wait()
                if self._stopped:
                    return
                todo, self._inbox = self._inbox, []
            for kind, job in todo:
                self._add(job) if kind == "add" else self._drop(job)
            if engine.has_unfinished():
                try:
                    engine.step()
                except Exception as exc:  # the step was undone: fail what was running, keep serving
                    self._fail_running(exc)
                self._notify_watchers(engine)
            self._deliver()

    def _notify_watchers(self, engine) -> None:
        for fn in list(self._watchers):
            try:
                fn(engine)
            except Exception as exc:  # a watcher's fault never stops serving
                self._watchers.remove(fn)
                warnings.warn(f"engine watcher {fn!r} raised {type(exc).__name__}: {exc}; it is unsubscribed",
                              RuntimeWarning, stacklevel=2)  # fmt: skip

    def _add(self, job: Job) -> None:
        try:
            job.prompt_ids, job.completions = self.llm.queue(job.prompts, job.params)
        except (TypeError, ValueError) as exc:  # a prompt too long for the context or the pool, n too large
            job.put("rejected", exc)
            return
        self._jobs.append(job)
        job.put("accepted")

    def _drop(self, job: Job) -> None:
        """A client left: abort what its request still runs (its blocks return now)."""
        if job in self._jobs:
            self._jobs.remove(job)
            self.llm.abort_unfinished(job.completions)

    def _fail_running(self, exc: Exception) -> None:
        running = set(map(id, self.llm.engine.scheduler.running))
        for job in [j for j in self._jobs if any(id(c.seq) in running for c in j.completions)]:
            self._jobs.remove(job)
            self.llm.abort_unfinished(job.completions)
            job.put("error", f"the engine failed a step this request was in: {type(exc).__name__}: {exc}")

    def _deliver(self) -> None:
        for job in list(self._jobs):
            for c in job.completions:
                news = self.llm.news(c)
                if news is not None:
                    job.put("delta", news)
                    if news.output is not None:
                        self._observe(c)
            if all(c.detokenizer.finished for c in job.completions):
                self._jobs.remove(job)
                job.done = True
                job.put("done")

    def _observe(self, c: Completion) -> None:
        seq = c.seq
        if seq.first_token_time is None or seq.finish_time is None:
            return  # aborted before its first token
        self.ttft.observe(seq.first_token_time - seq.arrival_time)
        self.e2e.observe(seq.finish_time - seq.arrival_time)
        if seq.num_output_tokens > 1:
            self.tpot.observe((seq.finish_time - seq.first_token_time) / (seq.num_output_tokens - 1))


class EngineCollector:
    """``/metrics``' engine gauges and counters, read when Prometheus scrapes (vLLM's names, ``minipaged:``)."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def collect(self):
        engine = self.llm.engine
        yield GaugeMetricFamily("minipaged:num_requests_running", "Requests running on the engine.",
                                value=len(engine.scheduler.running))  # fmt: skip
        yield GaugeMetricFamily("minipaged:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=len(engine.scheduler.waiting))  # fmt: skip
        yield GaugeMetricFamily("minipaged:kv_cache_usage_perc", "KV cache usage (1 = full).",
                                value=kv_usage(engine.cache.allocator.num_used, engine.config.num_blocks))  # fmt: skip
        yield CounterMetricFamily("minipaged:num_preemptions", "Preemptions.", value=engine.metrics.num_preemptions)
        stats = engine.metrics.prefix_cache
        yield CounterMetricFamily("minipaged:prefix_cache_queries", "Prefix cache: tokens queried.",
                                  value=stats.queries if stats else 0)  # fmt: skip
        yield CounterMetricFamily("minipaged:prefix_cache_hits", "Prefix cache: tokens hit.",
                                  value=stats.hits if stats else 0)  # fmt: skip


# --------------------------------------------------------------------------- the HTTP side


def create_app(llm: LLM, model_name: str, engine_thread: bool = True) -> FastAPI:
    """The FastAPI application serving ``llm`` under ``model_name``; ``app.state.engine_loop`` steps its engine.

    Args:
        llm: the front end to serve (build it with a :class:`~minipaged.clock.WallClock`: latencies are real).
        model_name: the model's id in ``/v1/models`` and in every response.
        engine_thread: start the engine loop in a thread of its own now; False: the caller runs it
            (``app.state.engine_loop.run()``), as :func:`run_server` does on the main thread.
    """
    registry = CollectorRegistry()
    registry.register(EngineCollector(llm))
    engine_loop = EngineLoop(llm, registry, thread=engine_thread)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine_loop.stop()  # the server is shutting down: the engine's thread ends with it

    app = FastAPI(title="minipaged", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(400, f"{param or 'body'}: {first.get('msg')}", param).response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "minipaged",
                                            "max_model_len": llm.engine.model.config.max_position_embeddings}]}

    _add_generation_routes(app, llm, engine_loop, model_name)
    return app


def _add_generation_routes(app: FastAPI, llm: LLM, engine_loop: EngineLoop, model_name: str) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``: the request to sampling parameters, to the loop, back."""
    mc, config = llm.engine.model.config, llm.engine.config

    def default_max_tokens(prompt_tokens: int) -> int:  # what is left of the context and of the pool
        room = min(mc.max_position_embeddings, config.num_blocks * config.block_size) - prompt_tokens
        return max(1, room)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts:
            raise APIError(400, "prompt must hold at least one prompt", "prompt")
        params = sampling_params(body, 16)  # OpenAI's default for completions
        job = await _submit(engine_loop, prompts, params)
        shape = _Shape("text_completion", f"cmpl-{uuid.uuid4().hex}", model_name, chat=False)
        return await _respond(engine_loop, job, shape, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        conversation = [m.model_dump() for m in body.messages]
        try:
            prompt = llm.apply_chat_template(conversation)
        except (TypeError, ValueError) as exc:  # no template (NoChatTemplate), or it refused (ChatTemplateError)
            raise APIError(400, str(exc), "messages") from None
        params = sampling_params(body, default_max_tokens(len(llm.tokenizer.encode(prompt))))
        job = await _submit(engine_loop, [prompt], params)
        shape = _Shape("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", model_name, chat=True)
        return await _respond(engine_loop, job, shape, body, request)


async def _submit(engine_loop: EngineLoop, prompts: list[str], params: SamplingParams) -> Job:
    """Hand the prompts to the engine loop and wait until it queued them (or refused them: a 400)."""
    job = Job(prompts, params, asyncio.get_running_loop())
    engine_loop.submit(job)
    kind, item = await job.events.get()
    if kind == "rejected":
        raise APIError(400, str(item), "prompt" if "prompt" in str(item) else None)
    return job


@dataclass
class _Shape:
    """How a response and its chunks look: the object name, the id, the model, chat or text."""

    object: str
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, choices: list, chunk: bool, usage=None) -> dict:
        kind = self.object + ".chunk" if chunk and self.chat else self.object
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return body | ({"usage": usage} if usage is not None else {})

    def choice(self, index: int, text: str, finish_reason, chunk: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if chunk else "message"
        content = {"role": "assistant", "content": text} if first or not chunk else {"content": text}
        return {"index": index, key: content, "logprobs": None, "finish_reason": finish_reason}


def _usage(job: Job) -> dict:
    prompt = sum(len(ids) for ids in job.prompt_ids)
    completion = sum(len(c.detokenizer.token_ids) for c in job.completions)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _respond(engine_loop: EngineLoop, job: Job, shape: _Shape, body: _Body, request: Request):
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(_events(engine_loop, job, shape, include_usage))
    texts, finals = {}, {}
    try:
        while True:
            waiting = asyncio.ensure_future(job.events.get())
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=0.25)
                if not waiting.done() and await request.is_disconnected():
                    waiting.cancel()
                    return Response(status_code=499)  # the client left; the finally aborts its request
            kind, item = waiting.result()
            if kind == "error":
                return APIError(500, item).response()
            if kind == "done":
                break
            index, delta, output = item
            texts[index] = texts.get(index, "") + delta
            finals[index] = output or finals.get(index)
    finally:
        if not job.done:
            engine_loop.abort(job)
    choices = [shape.choice(i, texts.get(i, ""), finals[i].finish_reason, chunk=False) for i in sorted(finals)]
    return JSONResponse(shape.envelope(choices, chunk=False, usage=_usage(job)))


async def _events(engine_loop: EngineLoop, job: Job, shape: _Shape, include_usage: bool):
    """The server-sent events of a streamed response; a client that leaves aborts the request (``finally``)."""
    started = set()
    try:
        while True:
            kind, item = await job.events.get()
            if kind == "error":
                yield format_sse_event(data_str=json.dumps({"error": {"message": item, "type": "InternalServerError",
                                                                      "param": None, "code": 500}}))  # fmt: skip
                break
            if kind == "done":
                if include_usage:
                    yield format_sse_event(data_str=json.dumps(shape.envelope([], chunk=True, usage=_usage(job))))
                break
            index, delta, output = item
            first = index not in started
            started.add(index)
            reason = output.finish_reason if output is not None else None
            choice = shape.choice(index, delta, reason, chunk=True, first=first)
            yield format_sse_event(data_str=json.dumps(shape.envelope([choice], chunk=True)))
        yield format_sse_event(data_str="[DONE]")
    finally:
        if not job.done:
            engine_loop.abort(job)


# --------------------------------------------------------------------------- running it


class ServerThread:
    """The server in a thread of its own (a notebook's event loop is already running), on 127.0.0.1.

    Its engine loop runs in a thread too, where torch steps slower than on the main thread (see
    :class:`EngineLoop`): right for notebooks and tests; ``python -m minipaged.serve --http`` serves faster.

    Args:
        llm: the front end to serve.
        model_name: its id in the API.
        port: the port (0: a free one; :attr:`port` then holds it).
    """

    def __init__(self, llm: LLM, model_name: str, port: int = 0, host: str = "127.0.0.1"):
        self.app = create_app(llm, model_name)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="minipaged-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and stop the engine loop (the lifespan's shutdown)."""
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_server(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until interrupted (Ctrl-C): the command line's ``--http``.

    The engine loop runs on this (the main) thread, where torch steps fastest (see :class:`EngineLoop`),
    and uvicorn in a thread of its own.
    """
    app = create_app(llm, model_name, engine_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    http = threading.Thread(target=server.run, name="minipaged-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise OSError(f"the server could not listen on {host}:{port} (is the port taken?)")
        time.sleep(0.05)
    try:
        app.state.engine_loop.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join()
