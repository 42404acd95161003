"""What stands between the network and the routes: connections, hosts, origins, content types, 500s, logs.

    socket ── Connections (uvicorn's h11 protocol, subclassed)
                 at most --max-connections open: past it the oldest idle one is closed,
                 or, with none idle, the newcomer gets a 503
                 a request must arrive whole within --request-timeout s of its start
                 (plus 1 s per 16 KiB of body), else 408 and closed
           ── RequestGuard (ASGI middleware, outermost: every route by construction)
                 Host: a name this server answers to (DNS rebinding)           else 403
                 Origin / Sec-Fetch-Site: same origin or --allowed-origins    else 403
                 POST bodies: Content-Type application/json                    else 415
                 an unexpected exception: a 500 without its text; the log keeps it
           ── CORS, auth, routes

`raise_open_files` lifts the descriptor limit at start, and `Repeats` lets one
of a kind of warning through per interval with a count of the rest, so a flood
of one error cannot fill the disk.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from typing import Iterable, Optional

import h11
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import APIError

log = logging.getLogger("segcache.serve")

MIN_BODY_RATE = 16 << 10  # bytes/s: past the request timeout, a body earns 1 s per this many bytes
RESERVED_FILES = 128  # descriptors kept for everything but connections (store, model files, logs, Redis)
_OPEN_MAX = 10240  # macOS refuses a soft limit above OPEN_MAX when the hard limit is "unlimited"


# -- descriptors ------------------------------------------------------------------------


def raise_open_files() -> int:
    """Raise the soft limit on open descriptors to the hard limit, where the system allows.

    Imports mlx-lm on the way: `mlx_lm.utils` sets the limits to (2048, 4096) when
    it is imported, which lowers a higher hard limit for good (an unprivileged
    process cannot raise it again) and fails outright under a hard limit below 4096.
    Its call is skipped here, so the process keeps the hard limit it was given.

    Returns:
        The soft limit now in force (0 where the platform has no such limit).
    """
    try:
        import resource
    except ImportError:  # Windows
        return 0
    real = resource.setrlimit

    def keep_hard(which, limits):
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    if "mlx_lm.utils" not in sys.modules:
        resource.setrlimit = keep_hard
        try:
            import mlx_lm.utils  # noqa: F401
        finally:
            resource.setrlimit = real
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = [hard] if hard != resource.RLIM_INFINITY else []
    for target in wanted + [_OPEN_MAX]:
        if target <= soft:
            break
        try:
            real(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections(open_files: int, backlog: int) -> int:
    """Connections to allow for a soft descriptor limit.

    asyncio accepts up to `backlog` connections in one go before any of them is
    seen (and refused), so those are kept free too, with `RESERVED_FILES`.
    """
    if open_files <= 0:
        return 1024
    return max(16, open_files - backlog - RESERVED_FILES)


# -- connections --------------------------------------------------------------------------


def _raw_response(status: int, reason: str, err: APIError, extra: str = "") -> bytes:
    body = json.dumps(err.body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n")
    return head.encode() + body


def connection_protocol(request_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol with a request timeout and a connection limit (a class per server).

    Args:
        request_timeout: seconds a client has to send a whole request from its
            first byte (or from connecting), plus 1 s per `MIN_BODY_RATE` bytes of body.
        max_connections: connections open at most.
    """
    return type("GuardedH11Protocol", (_Guarded,), {
        "timeout": float(request_timeout), "limit": int(max_connections), "idle": OrderedDict(),
    })


class _Guarded(H11Protocol):
    """uvicorn's H11Protocol that times out incomplete requests and bounds the connections.

    uvicorn times out only idle keep-alive connections: one that sends part of
    its headers (or nothing) stays open forever. Here every request runs on a
    clock from its first byte (a fresh connection from its start); the timer is
    cancelled once h11 has the whole request (client state DONE).

    `idle` (shared by the server's connections, oldest first): connections with
    no request in progress, fresh, half-sent headers, or kept alive between
    requests. At the limit, a newcomer closes the oldest of them; a connection
    whose request is being read or answered is never closed for a newcomer.
    """

    timeout: float
    limit: int
    idle: "OrderedDict[_Guarded, None]"

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._timer: Optional[object] = None
        self._start = 0.0
        self._body_bytes = 0
        super().connection_made(transport)
        if len(self.connections) > self.limit and not self._evict():
            log.warning("%d connections open, none idle: refused a connection with 503 (--max-connections)",
                        len(self.connections) - 1)
            err = APIError(503, f"the server holds {self.limit} connections, all busy; retry shortly",
                           code="too_many_connections", type="server_error")
            transport.write(_raw_response(503, "Service Unavailable", err, "retry-after: 1\r\n"))
            transport.close()
            return
        self.idle[self] = None
        self._arm()

    def _evict(self) -> bool:
        for other in self.idle:
            if other is not self:
                del self.idle[other]
                log.warning("%d connections open (--max-connections): closed the longest idle one",
                            len(self.connections) - 1)
                other._close(None)
                return True
        return False

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)
        self._update(fresh=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._update(fresh=False)

    def connection_lost(self, exc) -> None:
        self._cancel()
        self.idle.pop(self, None)
        super().connection_lost(exc)

    def _update(self, fresh: bool) -> None:
        state = self.conn.their_state
        if state is h11.IDLE:
            self.idle.setdefault(self, None)
        else:
            self.idle.pop(self, None)
        arriving = state is h11.SEND_BODY or (state is h11.IDLE and (fresh or bool(self.conn.trailing_data[0])))
        if arriving:
            if self._timer is None:
                self._arm()
        elif state is not h11.IDLE:  # the whole request is in (or the connection is done)
            self._cancel()

    def _arm(self) -> None:
        self._start = self.loop.time()
        self._body_bytes = 0
        self._timer = self.loop.call_later(self.timeout, self._expire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            # a body paced by us (the app not reading yet) or arriving at the minimum rate is not late
            left = self._start + self.timeout + self._body_bytes / MIN_BODY_RATE - self.loop.time()
            if self.flow.read_paused or left > 0:
                self._timer = self.loop.call_later(max(left, 1.0), self._expire)
                return
        elif state is not h11.IDLE:
            return
        log.warning("closed a connection that sent no whole request within %g s (--request-timeout)",
                    self.timeout)
        self._close(APIError(408, f"no whole request arrived within {self.timeout:g} s; send the request "
                                  "at once", code="request_timeout"))

    def _close(self, err: Optional[APIError]) -> None:
        self._cancel()
        self.idle.pop(self, None)
        if self.transport.is_closing():
            return
        if err is not None and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (
                self.cycle is None or not self.cycle.response_started):
            self.transport.write(_raw_response(err.status, "Request Timeout", err))
        self.transport.close()


# -- hosts, origins, content types ------------------------------------------------------


_LOCAL_NAMES = ("localhost",)
_ALL_INTERFACES = ("", "0.0.0.0", "::")


def _host_name(value: str) -> str:
    """The name in a Host header or an origin's netloc: no port, no brackets, lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[1:end] if end > 0 else v
    name, sep, port = v.rpartition(":")
    if sep and ":" not in name and (port.isdigit() or not port):
        v = name
    return v.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which `Host` names requests may carry.

    DNS rebinding points a name the attacker owns at this machine, so the
    browser sends that name as `Host`. Allowed: any IP literal (no rebinding
    goes through one), `localhost` and `*.localhost`, the `--host` name, this
    machine's name when bound to every interface, and `--allowed-hosts`
    entries: `name`, `.suffix` or `*.suffix` (a name under it), `*` (any).
    """

    def __init__(self, bind_host: str, allowed: Iterable[str] = ()):
        self.any = False
        self.names = set(_LOCAL_NAMES)
        self.suffixes = [".localhost"]
        bind = _host_name(bind_host)
        if bind in _ALL_INTERFACES:
            self.names.add(socket.gethostname().lower())
        elif not _is_ip(bind):
            self.names.add(bind)
        for entry in allowed:
            e = entry.strip().lower()
            if e == "*":
                self.any = True
            elif e.startswith("*.") or e.startswith("."):
                self.suffixes.append(e[e.index("."):])
            elif e:
                self.names.add(_host_name(e))

    def allows(self, host: Optional[str]) -> bool:
        if self.any or host is None:  # HTTP/1.0 may omit Host; browsers always send it
            return True
        name = _host_name(host)
        return _is_ip(name) or name in self.names or any(name.endswith(s) for s in self.suffixes)


class RequestGuard:
    """ASGI middleware: Host, Origin and Content-Type checks, and 500s that keep their text in the log.

    Args:
        app: the ASGI app it wraps.
        hosts: the `HostPolicy`.
        origins: `--allowed-origins` ("*" allows any).
    """

    def __init__(self, app, hosts: HostPolicy, origins: Iterable[str] = ()):
        self.app = app
        self.hosts = hosts
        self.origins = {o.strip().lower().rstrip("/") for o in origins if o.strip()}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await JSONResponse(refusal.body(), status_code=refusal.status)(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except ClientDisconnect:  # the client left (or was timed out) while sending: nobody to answer
            return
        except Exception:
            ref = uuid.uuid4().hex[:12]
            log.exception("%s %s: internal error %s", scope.get("method"), scope.get("path"), ref)
            if not started:
                err = APIError(500, f"internal error; the server log has the details under {ref}",
                               type="server_error")
                await JSONResponse(err.body(), status_code=500)(scope, receive, send)

    def refusal(self, scope) -> Optional[APIError]:
        """The error a request gets before reaching the routes, or None."""
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        host = headers.get("host")
        if not self.hosts.allows(host):
            return APIError(403, f"Host '{host}' is not a name this server answers to (a web page may be "
                                 "reaching it through DNS rebinding); if you reach it by this name, start the "
                                 "server with --allowed-hosts naming it", code="host_not_allowed",
                            type="permission_error")
        origin = headers.get("origin")
        site = headers.get("sec-fetch-site", "").lower()
        if (origin is not None or site in ("cross-site", "same-site")) and not self._origin_ok(origin, host):
            shown = origin if origin is not None else f"(none; Sec-Fetch-Site: {site})"
            return APIError(403, f"Origin {shown} is not allowed: browsers may call this server only from "
                                 "the origins --allowed-origins names", code="origin_not_allowed",
                            type="permission_error")
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"the body must be JSON with 'Content-Type: application/json' "
                                     f"(got {kind or 'no Content-Type'})", param="body",
                                code="unsupported_media_type")
        return None

    def _origin_ok(self, origin: Optional[str], host: Optional[str]) -> bool:
        if "*" in self.origins:
            return True
        if origin is None:
            return False
        o = origin.strip().lower().rstrip("/")
        if o in self.origins:
            return True
        # same origin: a page this server itself served (only a rebinding page could, and Host stops those)
        netloc = o.partition("://")[2]
        return bool(netloc) and host is not None and netloc == host.strip().lower()


# -- logs -------------------------------------------------------------------------------


class Repeats(logging.Filter):
    """Lets the first warning or error of a kind through per interval and counts the rest.

    A kind is the logger, the level, the message template and the exception
    type. The next one let through after the interval carries the count of
    those held back ("[412 more like this in the last 10 s]").

    Args:
        interval: seconds between two records of one kind.
        clock: a monotonic clock (tests pass their own).
    """

    MAX_KINDS = 4096

    def __init__(self, interval: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.interval = interval
        self.clock = clock
        self._kinds: dict = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        key = (record.name, record.levelno, str(record.msg), exc)
        now = self.clock()
        with self._lock:
            seen = self._kinds.get(key)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return False
            if len(self._kinds) >= self.MAX_KINDS:
                self._kinds.clear()
            self._kinds[key] = [now, 0]
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} [{seen[1]} more like this in the last {now - seen[0]:.0f} s]"
        return True


def install_repeats(interval: float = 10.0) -> Repeats:
    """Put one `Repeats` filter on every handler of the root logger (all loggers propagate there)."""
    flt = Repeats(interval)
    for handler in logging.getLogger().handlers:
        handler.addFilter(flt)
    return flt
