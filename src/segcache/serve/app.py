"""The Starlette app: OpenAI's routes over the scheduler, with auth, CORS and a body limit.

Handlers validate and tokenize (on a tokenizer thread, never the model's),
submit a `Job`, then relay its events: as SSE chunks ending `data: [DONE]`
when streaming, as one JSON body otherwise. A client that goes away cancels
its job; the worker sees it at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import schemas
from .chat import Prompter
from .engine import Chunk, Failure, Finish, GenRequest
from .errors import APIError
from .shapes import Shape, sse
from .worker import Job, QueueFull, Scheduler, Worker

DEFAULT_MODEL = "default_model"
_POLL = 0.25  # seconds between checks that a non-streaming client is still there
_DRAIN = 8  # bodies up to this many times the limit are read (and dropped) before the 413


@dataclass
class Settings:
    """What the app needs to know, fixed at startup.

    Attributes:
        names: model names a request may give (served name, its path, "default_model").
        served_name: the id /v1/models lists and responses carry.
        context_length: prompt + completion tokens the model takes (None: unknown).
        vocab_size: token ids a prompt may hold are < this.
        max_tokens, temperature, top_p, top_k, min_p: defaults for requests that leave them out.
        api_key: required as a Bearer token on every route but /health (None: open).
        allowed_origins: CORS origins (empty: no CORS headers at all).
        max_body_bytes: larger request bodies get a 413.
        ram_bytes, disk_bytes: the prefix store's budgets (reported by /stats).
        adapters: the adapter path(s) a request's `adapters` may name: the one the
            server applies (--adapter-path, as given and resolved); empty: none.
    """

    served_name: str
    names: set
    vocab_size: int
    context_length: Optional[int] = None
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    api_key: Optional[str] = None
    allowed_origins: list = field(default_factory=list)
    max_body_bytes: int = 8 << 20
    ram_bytes: int = 0  # the store's budgets, for /stats
    disk_bytes: int = 0
    adapters: set = field(default_factory=set)


class Server:
    """The routes and what they share: settings, the prompter, the scheduler, the worker."""

    def __init__(self, settings: Settings, prompter: Prompter, scheduler: Scheduler, worker: Worker, store=None):
        self.settings = settings
        self.store = store
        self.prompter = prompter
        self.scheduler = scheduler
        self.worker = worker
        self.created = int(time.time())
        # One thread: HF tokenizers are not meant to be driven from many at once.
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="segcache-tokenize")

    # -- guards ---------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        too_big = APIError(413, f"the request body is over {limit} bytes", param="body", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > _DRAIN * limit:
            raise too_big  # not worth reading: the client may see a reset instead of the 413
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > _DRAIN * limit:
                raise too_big
        if size > limit:  # read to the end (and dropped), so the client reads its 413
            raise too_big
        return b"".join(chunks)

    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.settings.names:
            raise APIError(404, f"model '{name}' is not served here; this server serves "
                                f"'{self.settings.served_name}' (or send 'default_model')",
                           param="model", code="model_not_found")

    def _check_adapter(self, adapter: Optional[str]) -> None:
        # mlx_lm.server reloads the model for another adapter; here one adapter is applied per server
        if adapter is None or adapter in self.settings.adapters:
            return
        served = next(iter(sorted(self.settings.adapters)), None)
        now = f"the adapter at '{served}' (--adapter-path)" if served else "no adapter"
        raise APIError(400, f"'adapters': this server applies {now} to every request and cannot switch "
                            f"adapters per request; leave 'adapters' out, or run a segcache serve with "
                            f"--adapter-path {adapter}", param="adapters")

    def _check_ids(self, ids: list[int], param: str, max_tokens: Optional[int]) -> int:
        """Validate prompt ids; returns the tokens to generate at most."""
        s = self.settings
        if not ids:
            raise APIError(400, f"'{param}' encodes to no tokens; give some text", param=param)
        bad = next((t for t in ids if not 0 <= t < s.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"'{param}' holds token id {bad}, outside the vocabulary 0..{s.vocab_size - 1}",
                           param=param)
        ctx = s.context_length
        if ctx is not None and max_tokens is not None and max_tokens > ctx:
            raise APIError(400, f"'max_tokens' is {max_tokens}, more than the model's context of {ctx} tokens",
                           param="max_tokens", code="invalid_value")
        if ctx is not None and len(ids) >= ctx:
            raise APIError(400, f"'{param}' is {len(ids)} tokens; the model's context is {ctx} tokens, "
                                "including the completion: shorten it", param=param,
                           code="context_length_exceeded")
        limit = max_tokens if max_tokens is not None else s.max_tokens
        return min(limit, ctx - len(ids)) if ctx is not None else limit

    # -- routes -----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        data = [{"id": self.settings.served_name, "object": "model", "created": self.created,
                 "owned_by": "segcache"}]
        return JSONResponse({"object": "list", "data": data})

    async def stats(self, request: Request) -> Response:
        """The queue and the prefix store: counters, sizes and budgets (segcache's own route)."""
        self._authorize(request)
        body = {"pending": self.scheduler.pending(), "max_queue": self.scheduler.max_queue,
                "max_running": self.scheduler.max_running, "store": None}
        store = self.store
        if store is not None and not store.closed:
            # off the loop: the store's lock may be held by the worker's flush
            st = await asyncio.get_running_loop().run_in_executor(None, store.stats)
            st.update(ram_budget=self.settings.ram_bytes, disk_budget=self.settings.disk_bytes)
            body["store"] = st
        return JSONResponse(body)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, schemas.CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, schemas.ChatRequest)

    async def _generate(self, request: Request, kind) -> Response:
        self._authorize(request)
        req = schemas.parse(await self._body(request), kind)
        self._check_model(req.model)
        self._check_adapter(req.adapters)
        chat = kind is schemas.ChatRequest
        loop = asyncio.get_running_loop()
        if chat:
            ids, cuts = await loop.run_in_executor(self._tokenize, self.prompter.chat, req.messages)
            top = req.top_alternatives()
        else:
            ids, cuts = await loop.run_in_executor(self._tokenize, self.prompter.completion, req.prompt), []
            top = req.top_logprobs()
        max_tokens = self._check_ids(ids, "messages" if chat else "prompt", req.limit())
        s = self.settings
        gen = GenRequest(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", ids=ids, checkpoints=cuts,
            max_tokens=max_tokens,
            temperature=s.temperature if req.temperature is None else req.temperature,
            top_p=s.top_p if req.top_p is None else req.top_p,
            top_k=s.top_k if req.top_k is None else req.top_k, min_p=s.min_p if req.min_p is None else req.min_p,
            seed=req.seed, stops=req.stops(), top_logprobs=top,
        )
        events: asyncio.Queue = asyncio.Queue()

        def deliver(event) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                pass

        job = Job(gen, deliver)
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry shortly", code="rate_limit_exceeded",
                           type="rate_limit_error", headers={"Retry-After": "1"}) from None
        shape = Shape(gen.id, s.served_name, self.created, chat)
        if req.stream:
            return StreamingResponse(self._sse(job, events, shape, req.include_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._whole(request, job, events, shape)

    async def _sse(self, job: Job, events: asyncio.Queue, shape: Shape, usage: bool):
        try:
            while True:
                event = await events.get()
                if isinstance(event, Chunk):
                    if event.text or event.logprobs:
                        yield sse(shape.chunk(event.text, event.logprobs, None))
                elif isinstance(event, Finish):
                    yield sse(shape.chunk("", [], event.reason))
                    if usage:
                        yield sse(shape.usage_chunk(event.usage))
                    yield "data: [DONE]\n\n"
                    return
                elif isinstance(event, Failure):
                    yield sse(APIError(500, event.message, type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancel()  # no-op once finished; a client gone stops the job at its next step

    async def _whole(self, request: Request, job: Job, events: asyncio.Queue, shape: Shape) -> Response:
        text, logprobs = [], []
        checked = time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=_POLL)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= _POLL:  # events may never pause: poll by the clock
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)
                if event is None:
                    continue
                if isinstance(event, Chunk):
                    text.append(event.text)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, Finish):
                    return JSONResponse(shape.whole("".join(text), logprobs, event))
                elif isinstance(event, Failure):
                    raise APIError(500, event.message, type="server_error")
        finally:
            job.cancel()


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> Response:
    err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def build_app(server: Server, lifespan=None) -> Starlette:
    """The ASGI app over `server`'s routes."""
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/stats", server.stats, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/chat/completions", server.chat_completions, methods=["POST"]),  # as mlx_lm.server
    ]
    middleware = []
    if server.settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=server.settings.allowed_origins,
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
