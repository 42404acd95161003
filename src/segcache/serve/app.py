"""The Starlette app: OpenAI's and Anthropic's routes over the scheduler, with auth, CORS and a body limit.

Handlers validate and tokenize (on a tokenizer thread, never the model's),
submit a `Job`, then relay its events: as server-sent events when streaming,
as one JSON body otherwise. A client that goes away cancels its job; the
worker sees it at the next step. The chat surfaces (chat completions,
Anthropic's Messages, Responses) share one pipeline (pipeline.py):
`start_chat` renders a `ChatTurn` and queues it; each surface shapes the events.
"""

from __future__ import annotations

import asyncio
import time
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

from ..controls import Controls
from ..errors import ParamError
from ..grammar import Grammars
from . import access, anthropic, isolation, responses, schemas, shapes
from .access import AccessLog
from .chat import Prompt, Prompter
from .engine import GenRequest
from .errors import APIError
from .guard import HostPolicy, RequestGuard
from .metrics import CONTENT_TYPE, Metrics
from .pipeline import ChatTurn, ClientGone, Run
from .shapes import Shape
from .worker import Job, QueueFull, Scheduler, Worker

DEFAULT_MODEL = "default_model"
_DRAIN = 8  # bodies up to this many times the limit are read (and dropped) before the 413


@dataclass
class Settings:
    """What the app needs to know, fixed at startup.

    Attributes:
        names: model names a request may give (served names, the model's path, "default_model").
        served_name: the id responses carry (the first of `served_names`).
        served_names: the ids /v1/models lists, in order (--served-model-name; empty: served_name).
        strict_max_tokens: a max_tokens beyond what the context leaves is a 400 (else capped).
        context_length: prompt + completion tokens the model takes (None: unknown).
        vocab_size: token ids a prompt may hold are < this.
        max_tokens, temperature, top_p, top_k, min_p: defaults for requests that leave them out.
        api_keys: one of them required as a Bearer token on every route but /health (empty: open).
        isolation: "per-key": each API key is a prefix-cache isolation domain of its own
            (`isolation.domain`); "none": requests share prefixes unless they send `cache_salt`.
        allowed_origins: origins browsers may call from (CORS; empty: none but the server's own).
        bind_host: the address bound (--host); its name is one `Host` may carry.
        allowed_hosts: more names `Host` may carry (see `guard.HostPolicy`).
        max_body_bytes: larger request bodies get a 413.
        ram_bytes, disk_bytes: the prefix store's budgets (reported by /stats).
        adapters: the adapter path(s) a request's `adapters` may name: the one the
            server applies (--adapter-path, as given and resolved); empty: none.
        keep_volatile_system: render a first system block holding Claude Code's billing
            header (a nonce per request) instead of leaving it out (anthropic.system_blocks).
        strict_fields: refuse unknown request fields and a hosted service's hints (400s)
            instead of accepting and ignoring them (schemas.parse).
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
    api_keys: tuple = ()
    isolation: str = "none"
    allowed_origins: list = field(default_factory=list)
    bind_host: str = "127.0.0.1"
    allowed_hosts: list = field(default_factory=list)
    max_body_bytes: int = 8 << 20
    ram_bytes: int = 0  # the store's budgets, for /stats
    disk_bytes: int = 0
    adapters: set = field(default_factory=set)
    keep_volatile_system: bool = False  # --keep-volatile-system: render Claude Code's billing header block
    served_names: list = field(default_factory=list)  # --served-model-name, in order (empty: served_name)
    strict_max_tokens: bool = False  # --strict-max-tokens: a max_tokens beyond the context is a 400
    strict_fields: bool = False  # --strict-fields: unknown fields and service hints are 400s


class Server:
    """The routes and what they share: settings, the prompter, the scheduler, the worker. The chat
    surfaces (anthropic.py, responses.py) are handed it as a `ChatService` (service.py)."""

    def __init__(self, settings: Settings, prompter: Prompter, scheduler: Scheduler, worker: Worker, store=None):
        self.settings = settings
        self.store = store
        self.prompter = prompter
        self.scheduler = scheduler
        self.worker = worker
        self.created = int(time.time())
        self.metrics = Metrics(scheduler, store)
        # One thread: HF tokenizers are not meant to be driven from many at once.
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="segcache-tokenize")

    # -- guards ---------------------------------------------------------------------

    def _authorize(self, request: Request) -> Optional[str]:
        """The API key the request authenticated with (None when the server has none)."""
        keys = self.settings.api_keys
        if not keys:
            return None
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, token = "bearer", request.headers["x-api-key"]
        key = isolation.match(token.strip(), keys) if scheme.lower() == "bearer" else None
        if key is None:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return key

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

    @property
    def served_name(self) -> str:
        return self.settings.served_name

    @property
    def keep_volatile_system(self) -> bool:
        return self.settings.keep_volatile_system

    @property
    def strict_fields(self) -> bool:
        return self.settings.strict_fields

    @property
    def tokenizer(self):
        return self.prompter.tokenizer

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.settings.names:
            served = ", ".join(f"'{n}'" for n in self.settings.served_names or [self.settings.served_name])
            raise APIError(404, f"model '{name}' is not served here; this server serves {served} (or send "
                                f"'default_model'); to accept '{name}' too, start it with --served-model-name",
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
        if ctx is not None and len(ids) >= ctx:
            raise APIError(400, f"'{param}' is {len(ids)} tokens; the model's context is {ctx} tokens, "
                                "including the completion: shorten it", param=param,
                           code="context_length_exceeded")
        if s.strict_max_tokens and ctx is not None and max_tokens is not None and len(ids) + max_tokens > ctx:
            raise APIError(400, f"'max_tokens' is {max_tokens}; the prompt is {len(ids)} tokens and the model's "
                                f"context {ctx}, so at most {ctx - len(ids)} can be generated (this server runs "
                                "with --strict-max-tokens)", param="max_tokens", code="invalid_value")
        limit = max_tokens if max_tokens is not None else s.max_tokens
        return min(limit, ctx - len(ids)) if ctx is not None else limit

    def _controls(self, sampling: dict, params: dict) -> Controls:
        """The request's `Controls`: the fields it set (None: absent) over the server's defaults
        (--temp, --top-p, --top-k, --min-p) and mlx_lm.server's; 400 naming a field that cannot
        be honoured (`params`: the request's own names of Controls' fields)."""
        s = self.settings
        given = {k: v for k, v in sampling.items() if v is not None}
        controls = Controls(**{"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                               **given})
        try:
            controls.check(s.vocab_size)
        except ParamError as exc:
            raise self._param_error(exc, params) from None
        vocab = s.vocab_size
        if not 0 <= controls.top_k < vocab:  # mlx-lm's sampler would fail on the model thread, as a 500
            whose = "'top_k'" if "top_k" in given else "the server's --top-k"
            raise APIError(400, f"{whose} is {controls.top_k}; it takes 0 (off) or 1..{vocab - 1} (the vocabulary "
                                f"has {vocab} tokens)", param="top_k", code="invalid_value")
        return controls

    @staticmethod
    def _param_error(exc: ParamError, params: dict) -> APIError:
        param = exc.param
        for ours, theirs in sorted(params.items(), key=lambda kv: -len(kv[0])):  # the longest name first
            if param == ours or param.startswith(ours + "."):
                param = theirs + param[len(ours):]
                break
        message = str(exc).replace(f"'{exc.param}'", f"'{param}'")
        if f"'{param}'" not in message:
            message = f"'{param}': {message}"
        return APIError(400, message, param=param, code="invalid_value")

    def grammars(self):
        """The model's structured-output compiler, shared with the engine (built on the first
        structured request: a tokenizer-sized trie, once)."""
        engine = self.scheduler.engine
        if engine.grammars is None:
            engine.grammars = Grammars(self.prompter.tokenizer, engine.vocab_size)
        return engine.grammars

    async def check_format(self, controls: Controls, params: dict) -> None:
        """Compile the response_format on the tokenizer thread, so a schema that cannot be
        honoured is a 400 before the request is queued (the engine's compile is then a copy)."""
        fmt = controls.response_format
        if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
            return
        loop = asyncio.get_running_loop()
        try:
            grammars = await loop.run_in_executor(self._tokenize, self.grammars)
            await loop.run_in_executor(self._tokenize, grammars.compile, fmt)
        except ParamError as exc:
            raise self._param_error(exc, params) from None

    # -- routes -----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        ok = self.worker.alive
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "segcache"}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        names = self.settings.served_names or [self.settings.served_name]
        return JSONResponse({"object": "list", "data": [self._model(n) for n in names]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: a name this server serves (any a request may give)."""
        self._authorize(request)
        name = request.path_params["model_id"]
        self.check_model(name)
        return JSONResponse(self._model(name))

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

    async def metrics_text(self, request: Request) -> Response:
        """The Prometheus text format (serve/metrics.py); behind the API key when one is set."""
        self._authorize(request)
        await asyncio.get_running_loop().run_in_executor(None, self.metrics.read_state)  # the store's lock
        return Response(self.metrics.scrape(), media_type=CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        key = self._authorize(request)
        req = schemas.parse(await self._body(request), schemas.CompletionRequest,
                            strict=self.settings.strict_fields)
        self.check_model(req.model)
        self._check_adapter(req.adapters)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._tokenize, self.prompter.completion, req.prompt)
        sampling = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                        **req.controls())
        controls = self._controls(sampling, {})
        await self.check_format(controls, {})
        run = self._submit(self._gen("cmpl", ids, [], req.limit(), "prompt", controls, req.stops(),
                                     req.top_logprobs(), key, req.cache_salt, req.n or 1))
        shape = Shape(run.gen.id, self.settings.served_name, self.created, False)
        if req.stream:
            return self.stream(shapes.completion_stream(run, shape, req.include_usage()), run)
        try:
            return JSONResponse(await shapes.completion_whole(run, shape, request))
        except ClientGone:
            return Response(status_code=499)

    async def chat_completions(self, request: Request) -> Response:
        key = self._authorize(request)
        req = schemas.parse(await self._body(request), schemas.ChatRequest, strict=self.settings.strict_fields)
        self.check_model(req.model)
        self._check_adapter(req.adapters)
        run = await self.start_chat(shapes.chat_turn(req), "chatcmpl", key)
        shape = Shape(run.gen.id, self.settings.served_name, self.created, True)
        if req.stream:
            return self.stream(shapes.chat_stream(run, shape, req.include_usage()), run)
        try:
            return JSONResponse(await shapes.chat_whole(run, shape, request))
        except ClientGone:
            return Response(status_code=499)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API (serve/anthropic.py); errors in Anthropic's shape."""
        try:
            key = self._authorize(request)
            return await anthropic.messages(self, request, await self._body(request), key)
        except APIError as exc:
            return anthropic.error_response(exc)

    async def count_tokens(self, request: Request) -> Response:
        try:
            self._authorize(request)
            return await anthropic.count_tokens(self, request, await self._body(request))
        except APIError as exc:
            return anthropic.error_response(exc)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, stateless (serve/responses.py)."""
        key = self._authorize(request)
        return await responses.create(self, request, await self._body(request), key)

    # -- the one pipeline every surface shares --------------------------------------------------

    async def render(self, turn: ChatTurn) -> Prompt:
        """The turn's prompt, rendered and tokenized on the tokenizer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize, self.prompter.chat, turn.messages, turn.tools,
                                          turn.template_kwargs, turn.force_call, turn.param)

    async def start_chat(self, turn: ChatTurn, kind: str, key: Optional[str]) -> Run:
        """Render `turn`, validate its prompt and controls and queue its generation (`key`: the
        API key the request authenticated with, for its isolation domain)."""
        sampling = dict(temperature=turn.temperature, top_p=turn.top_p, top_k=turn.top_k, min_p=turn.min_p,
                        seed=turn.seed, **turn.controls)
        controls = self._controls(sampling, turn.params)
        prompt = await self.render(turn)
        await self.check_format(controls, turn.params)
        stops = list(turn.stops)
        end = self.prompter.markup.tool[1] if self.prompter.markup.tool else ""
        if turn.calls and not turn.parallel and end:
            stops.append(end)  # one call at most: the text ends where the first call does
        gen = self._gen(kind, prompt.ids, prompt.checkpoints, turn.max_tokens, turn.param, controls, stops,
                        turn.top_logprobs, key, turn.cache_salt, turn.n)
        run = self._submit(gen, turn, prompt)
        run.capped = gen.max_tokens < (turn.max_tokens if turn.max_tokens is not None else self.settings.max_tokens)
        return run

    def _gen(self, kind, ids, cuts, limit, param, controls: Controls, stops, top, key, cache_salt,
             n: int = 1) -> GenRequest:
        s = self.settings
        return GenRequest(
            id=access.response_id(kind), ids=ids, checkpoints=cuts, max_tokens=self._check_ids(ids, param, limit),
            temperature=controls.temperature, top_p=controls.top_p, top_k=controls.top_k, min_p=controls.min_p,
            seed=controls.seed, stops=stops, top_logprobs=top, n=n, controls=controls,
            cache_salt=isolation.domain(key, cache_salt, s.isolation == "per-key"),
        )

    def _submit(self, gen: GenRequest, turn: Optional[ChatTurn] = None, prompt: Optional[Prompt] = None) -> Run:
        loop = asyncio.get_running_loop()
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
        return Run(gen, job, events, turn, prompt, self.prompter.markup, access.current())

    def stream(self, body, run: Run, headers: Optional[dict] = None) -> Response:
        async def guarded():
            try:
                async for event in body:
                    yield event
            finally:
                run.job.cancel()  # no-op once finished; a client gone stops the job at its next step

        return StreamingResponse(guarded(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **(headers or {})})


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _server_error(request: Request, exc: Exception) -> Response:
    # RequestGuard answers (and logs) the exceptions of the routes; this is the last resort
    err = APIError(500, "internal error (the server log has the details)", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def build_app(server: Server, lifespan=None) -> Starlette:
    """The ASGI app over `server`'s routes."""
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/", server.health, methods=["GET"]),  # Claude Code checks the base URL with a HEAD first
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/stats", server.stats, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/chat/completions", server.chat_completions, methods=["POST"]),  # as mlx_lm.server
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
    ]
    middleware = []
    if server.settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=server.settings.allowed_origins,
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type", "x-api-key",
                                                    "anthropic-version", "anthropic-beta", "x-request-id"],
                                     expose_headers=["request-id", "x-request-id"]))
    s = server.settings
    # outermost: Host, Origin and Content-Type are checked before anything (CORS, auth, routes) runs
    middleware.insert(0, Middleware(RequestGuard, hosts=HostPolicy(s.bind_host, s.allowed_hosts),
                                    origins=s.allowed_origins))
    # outside everything: every request gets its id headers and one access line, whoever answers it
    middleware.insert(0, Middleware(AccessLog, metrics=server.metrics,
                                    routes=frozenset(r.path for r in routes if "{" not in r.path)))
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers, lifespan=lifespan)
