"""Each request's id, its one access line, and its prefill progress in the log.

    client ──> AccessLog (outermost) ──> guard, CORS, routes ──> ... ──> response
                 │ Access in a context variable; a handler that queues a generation names
                 │ the request by the response's own id (`response_id`)
                 └ on the response's start: `request-id` / `x-request-id` headers;
                   when the body ended: one line, every status, and the metrics' counters

The id a client reads in a body (`chatcmpl-…`, `cmpl-…`, `msg_…`, `resp_…`) is
the id in the log and in the `request-id` header; a request that never got that
far (a 4xx) is `req_…`. A client's `x-request-id` (printable, up to 128
characters) becomes the id's tail, so its own id finds the log lines.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .engine import Finish, Progress
    from .metrics import Metrics

log = logging.getLogger("segcache.serve")

PROGRESS_EVERY = 1.0  # seconds between two progress lines of one prefill (the first one always goes out)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# each kind of response: its id's prefix (as the APIs spell them)
PREFIXES = {"chatcmpl": "chatcmpl-", "cmpl": "cmpl-", "msg": "msg_", "resp": "resp_", "req": "req_"}


@dataclass
class Access:
    """One request as the access line tells it.

    Attributes:
        id: the request's id (the response's, once a handler names it).
        client_id: the client's x-request-id, when it sent a usable one.
        prompt, cached, generated: tokens (None: not known, the request generated nothing).
        tier: where the cached tokens came from.
    """

    method: str
    path: str
    client_id: Optional[str] = None
    metrics: Optional["Metrics"] = None
    started: float = field(default_factory=time.perf_counter)
    id: Optional[str] = None
    prompt: Optional[int] = None
    cached: Optional[int] = None
    generated: Optional[int] = None
    tier: str = "-"
    _progress_at: Optional[float] = field(default=None, init=False, repr=False)  # the last progress line

    def name(self, kind: str) -> str:
        """The id of this request's response of `kind` ("chatcmpl", "msg", ...); it names the request."""
        tail = self.client_id or (uuid.uuid4().hex if kind in ("chatcmpl", "cmpl") else uuid.uuid4().hex[:24])
        self.id = PREFIXES[kind] + tail
        return self.id

    def finished(self, finish: "Finish") -> None:
        """A choice ended: count its tokens (the prompt once per request)."""
        u = finish.usage
        self.prompt, self.cached, self.tier = u.prompt_tokens, u.cached_tokens, u.tier
        self.generated = (self.generated or 0) + u.completion_tokens
        if self.metrics is not None:
            self.metrics.finished(u, first=finish.index == 0, seconds=time.perf_counter() - self.started)

    def progress(self, p: "Progress") -> None:
        """Log the prefill's progress: the first news, then at most one line per PROGRESS_EVERY."""
        now = time.perf_counter()
        if self._progress_at is not None and now - self._progress_at < PROGRESS_EVERY:
            return
        self._progress_at = now
        log.info("%s: prompt processing progress: %d/%d", self.id, p.processed, p.total)

    def line(self, status: int) -> str:
        def n(v):
            return "-" if v is None else str(v)

        tokens = f"prompt {n(self.prompt)} cached {n(self.cached)} generated {n(self.generated)}"
        return (f"{self.method} {self.path} {status} {self.id} {tokens} "
                f"{time.perf_counter() - self.started:.3f}s")


_current: contextvars.ContextVar[Optional[Access]] = contextvars.ContextVar("segcache_access", default=None)


def current() -> Optional[Access]:
    """The request being served on this task (None outside the AccessLog middleware)."""
    return _current.get()


def response_id(kind: str) -> str:
    """The id of the current request's response of `kind`, which names the request from now on."""
    acc = current()
    if acc is None:  # outside a served request (a test calling a handler): a fresh id
        return Access("-", "-").name(kind)
    return acc.name(kind)


class AccessLog:
    """ASGI middleware: the request's `Access`, its id headers, and its one line when the body ended.

    Args:
        app: the app inside.
        metrics: counts each request by route and status (None: no metrics).
        routes: the paths counted under their own name (others count as "other").
    """

    def __init__(self, app, metrics: Optional["Metrics"] = None, routes: frozenset = frozenset()):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        acc = Access(scope.get("method", "-"), scope.get("path", "-"),
                     given if _CLIENT_ID.fullmatch(given) else None, self.metrics)
        token = _current.set(acc)
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if acc.id is None:
                    acc.name("req")
                rid = acc.id.encode("latin-1")
                message = dict(message, headers=[*message.get("headers", []), (b"request-id", rid),
                                                 (b"x-request-id", rid)])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
            if acc.id is None:
                acc.name("req")
            log.info("%s", acc.line(status))
            if self.metrics is not None:
                path = acc.path if acc.path in self.routes else "other"
                self.metrics.request(path, status)
