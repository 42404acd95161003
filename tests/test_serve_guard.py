"""`segcache serve`'s guards (issue 24, items 2, 3 and 5): every bad input a 400 naming its field
and no internal text, half-sent requests timed out, the connections bounded, the descriptor limit
raised, repeated errors logged once per interval, and Host / Origin / Content-Type checked."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import asyncio
import json
import logging
import re
import resource
import selectors
import socket
import subprocess
import sys
import time

import httpx
import mlx_lm
import pytest

from serve_util import TARGET, Server

TIMEOUT = 5.0  # --request-timeout of the module's server
WAIT = 15.0  # seconds past a timeout to wait for what it closes (two cores, other jobs running)
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def ref():
    return mlx_lm.load(str(TARGET))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard")
    # room for the 3,000 half-sent connections below, so the timeout closes them, not the limit
    srv = Server(d / "store", "--request-timeout", TIMEOUT, "--max-connections", 3500,
                 "--allowed-origins", "http://ok.example",
                 "--allowed-hosts", "llm.example,.corp.example", log_path=d / "serve.log")
    try:
        yield srv.start()
    finally:
        srv.stop()


def _greedy_ok(server, ref) -> None:
    r = server.post("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 4}))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == mlx_lm.generate(*ref, prompt=ref[1].encode(PROMPT), max_tokens=4)


# -- item 2: 400s naming the field, no exception text ---------------------------------------

INTERNAL = re.compile(r"\b\w*(Error|Exception)\b|Traceback|\.py\b|incompatible function")
DEEP = b"[" * 100_000 + b"]" * 100_000
CHAT = "/v1/chat/completions"
BAD = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": 1, "top_k": 5000}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 1, "top_k": 10**9}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "top_k": 2**70}, "top_k"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_k": 1536}, "top_k"),
    ("/v1/completions", {"prompt": PROMPT, "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 1, "seed": 2**80}, "seed"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udc00"]}', "prompt.0"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud83d"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt"),  # a surrogate encoded as UTF-8 bytes
    ("/v1/completions", DEEP, "body"),
    (CHAT, b'{"messages": ' + DEEP + b"}", "body"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": NaN}', "body"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_get_a_400_naming_the_field_and_no_internal_text(server, ref, path, body, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = server.post(path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert not INTERNAL.search(err["message"]), err["message"]
    # sampled requests after it, with and without a seed, are served (a bad one poisoned them before)
    for seed in (None, 3):
        extra = {} if seed is None else {"seed": seed}
        r = server.post("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 1,
                                                       **extra}))
        assert r.status_code == 200, r.text
    _greedy_ok(server, ref)


def _stub_app(tmp_path, fail):
    """The real app over a scheduler whose engine raises `fail` (no model: a stub tokenizer)."""
    from segcache.serve.app import Server as App, Settings, build_app
    from segcache.serve.chat import Prompter
    from segcache.serve.worker import Scheduler, Worker

    class Tok:
        bos_token = None
        has_chat_template = False

        def encode(self, text, add_special_tokens=True):
            return [1 + ord(c) % 100 for c in text]

    class Engine:
        def warm_up(self):
            pass

        def flush(self):
            pass

        def generate(self, req):
            raise fail
            yield  # a generator, as the real engine's

    scheduler = Scheduler(Engine())
    worker = Worker(scheduler)
    worker.start()
    app = App(Settings(served_name="stub", names={"stub"}, vocab_size=128), Prompter(Tok()), scheduler, worker)
    return build_app(app), worker


def test_a_500_carries_no_exception_text_and_the_log_keeps_it(tmp_path, caplog):
    secret = "secret-internal-detail-4831"
    app, worker = _stub_app(tmp_path, RuntimeError(secret))

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            body = {"prompt": "hello", "max_tokens": 2}
            whole = await client.post("/v1/completions", json=body)
            streamed = await client.post("/v1/completions", json=dict(body, stream=True))
            return whole, streamed

    caplog.set_level(logging.INFO)
    try:
        whole, streamed = asyncio.run(run())
    finally:
        worker.stop(10)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
    assert streamed.status_code == 200 and events and "error" in events[-1]
    for text in (whole.text, streamed.text):
        assert secret not in text and not INTERNAL.search(text), text
    assert caplog.text.count(secret) >= 2  # the worker logged both, with the traceback


def test_an_exception_in_a_route_is_a_bare_500_and_logged(caplog):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from segcache.serve.guard import HostPolicy, RequestGuard

    async def boom(request):
        raise ValueError("secret-route-detail")

    # as build_app places it: inside Starlette's last-resort handler, outside everything else
    app = Starlette(routes=[Route("/x", boom)], middleware=[Middleware(RequestGuard, hosts=HostPolicy("127.0.0.1"))])

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get("/x")

    caplog.set_level(logging.INFO)
    r = asyncio.run(run())
    assert r.status_code == 500 and "secret" not in r.text and r.json()["error"]["type"] == "server_error"
    assert "secret-route-detail" in caplog.text and "Traceback" in caplog.text


# -- item 5: Host, Origin, Content-Type -------------------------------------------------------


def _post(server, headers, content=b'{"prompt": "def f(x):", "max_tokens": 2}', path="/v1/completions"):
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def _requests_served(server) -> int:
    return sum(1 for line in server.log().splitlines() if re.search(r" cmpl-\w+: prompt ", line))


def test_a_foreign_page_cannot_drive_the_server(server):
    port = server.port
    before = _requests_served(server)
    # the probe: text/plain (no CORS preflight), a foreign Origin and Host
    foreign = {"Content-Type": "text/plain", "Origin": "http://evil.example", "Host": f"evil.example:{port}"}
    r = _post(server, foreign)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    # DNS rebinding: the page's own origin, a name this server does not answer to
    rebound = {"Content-Type": "application/json", "Origin": f"http://evil.example:{port}",
               "Host": f"evil.example:{port}"}
    assert _post(server, rebound).status_code == 403
    # a cross-origin page on this host name, JSON or not
    for kind in ("application/json", "text/plain"):
        r = _post(server, {"Content-Type": kind, "Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert _post(server, {"Content-Type": "application/json", "Origin": "null"}).status_code == 403
    # a no-cors request carries no Origin, but says it is cross-site
    r = httpx.get(server.url + "/v1/models", headers={"Sec-Fetch-Site": "cross-site"}, timeout=10)
    assert r.status_code == 403
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=pre, timeout=10)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # non-JSON bodies (what a form or a no-preflight fetch can send)
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": kind} if kind else {}
        r = _post(server, headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
    assert _requests_served(server) == before  # none of them reached the model


def test_the_servers_own_names_and_allowed_origins_are_served(server):
    port = server.port
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", f"[::1]:{port}",
             f"app.localhost:{port}", f"llm.example:{port}", f"a.corp.example:{port}", "10.1.2.3"]
    for host in hosts:
        r = _post(server, {"Content-Type": "application/json", "Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in (f"corp.example:{port}", f"llm.example.evil.example:{port}", f"localhost.evil:{port}"):
        assert _post(server, {"Content-Type": "application/json", "Host": host}).status_code == 403, host
    ok = {"Content-Type": "application/json; charset=utf-8", "Origin": "http://ok.example"}
    r = _post(server, ok)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    same = {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    assert _post(server, same).status_code == 200
    pre = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(server.url + "/v1/completions", headers=pre, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    assert httpx.get(server.url + "/health", headers={"Sec-Fetch-Site": "none"}, timeout=10).status_code == 200


def test_host_policy_names():
    from segcache.serve.guard import HostPolicy

    loopback = HostPolicy("127.0.0.1")
    for host in ("127.0.0.1:8080", "[::1]:8080", "localhost", "Localhost:1", "x.localhost", "192.168.1.5", None):
        assert loopback.allows(host), host
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.1.nip.io", "my-box"):
        assert not loopback.allows(host), host
    named = HostPolicy("my-box.lan", ["models.example", "*.corp.example"])
    for host in ("my-box.lan:8080", "models.example", "a.b.corp.example"):
        assert named.allows(host), host
    assert not named.allows("corp.example") and not named.allows("models.example.evil")
    assert HostPolicy("127.0.0.1", ["*"]).allows("anything.example")
    assert HostPolicy("0.0.0.0").allows(socket.gethostname())


# -- item 3: half-sent requests, connection limit, descriptors, log flood ---------------------


def _raise_own_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else n, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= n, "this test needs as many descriptors"


def _half_sent(port: int, n: int, head: bytes) -> list:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(head)
        s.setblocking(False)
        socks.append((s, time.monotonic()))
    return socks


def _closed_at(socks: list, deadline: float) -> dict:
    """{index: (monotonic time the server closed it, bytes it sent)} for each socket closed by `deadline`."""
    sel = selectors.DefaultSelector()
    for i, (s, _) in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    closed, got = {}, {}
    try:
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                i = key.data
                try:
                    data = key.fileobj.recv(65536)
                except (ConnectionResetError, BrokenPipeError):
                    data = b""
                except BlockingIOError:
                    continue
                if data:
                    got[i] = got.get(i, b"") + data
                    continue
                closed[i] = (time.monotonic(), got.get(i, b""))
                sel.unregister(key.fileobj)
    finally:
        sel.close()
    return closed


def test_half_sent_requests_are_closed_and_real_ones_served_meanwhile(server):
    n = 3000
    _raise_own_limit(n + 200)
    log_before = len(server.log())
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Slow: "
    socks = _half_sent(server.port, n, head)
    quiet = _half_sent(server.port, 1, b"")  # and one that sends nothing at all, held as long
    try:
        opened = time.monotonic()
        # the first request waits behind the 3,000 in the listen queue (today it never got in)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        served = 0
        # while the 3,000 are held, real requests are answered within 2 s each
        while served == 0 or time.monotonic() - opened < TIMEOUT - 1:
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=2).status_code == 200
            r = server.post("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}))
            assert r.status_code == 200 and time.monotonic() - t < 2.0
            served += 1
        closed = _closed_at(socks, opened + TIMEOUT + WAIT)
        assert len(closed) == n, f"{n - len(closed)} half-sent connections still open"
        late = [(when - start) for i, (when, _) in closed.items() for start in [socks[i][1]]]
        assert min(late) >= TIMEOUT - 0.2  # closed by the timeout (not early, by the connection limit)
        assert sum(b"408 Request Timeout" in data for _, data in closed.values()) > n // 2
        # the connection that sent nothing at all is closed too, by the timeout
        closed = _closed_at(quiet, opened + TIMEOUT + WAIT)
        assert len(closed) == 1 and closed[0][0] - quiet[0][1] >= TIMEOUT - 0.2
    finally:
        for s, _ in socks + quiet:
            s.close()
    grown = server.log()[log_before:]
    assert "Too many open files" not in grown
    # one line per interval for the 3,001 timeouts, not one each; the served requests' own
    # lines (as many as this machine fitted in the window) are not the timeouts' noise
    noise = "\n".join(line for line in grown.splitlines()
                      if " INFO cmpl-" not in line and not re.search(r" INFO (GET|POST) /", line))
    assert grown.count("--request-timeout") <= 3 and len(noise) < 2000, noise[-2000:]


def test_connection_limit_closes_the_longest_idle_then_refuses_with_503(tmp_path):
    limit = 12
    srv = Server(tmp_path / "store", "--max-connections", limit, "--request-timeout", 4,
                 log_path=tmp_path / "serve.log").start()
    try:
        idle = _half_sent(srv.port, limit, b"")
        time.sleep(0.2)  # let the server see them open, in order
        r = srv.post("/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2}))
        assert r.status_code == 200, r.text  # it made room by closing the longest idle connection
        closed = _closed_at(idle[:1], time.monotonic() + 3)
        assert 0 in closed and closed[0][1] == b""  # closed for the newcomer, not timed out (a 408)
        for s, _ in idle:
            s.close()
        # requests whose body is being read are never closed for a newcomer
        body_head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n")
        busy = []
        for s, t in _half_sent(srv.port, limit, body_head):
            s.setblocking(True)
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 100")  # the app is reading its body
            busy.append((s, t))
        t = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in reply.lower(), reply
        assert b"too_many_connections" in reply and time.monotonic() - t < 2.0
        # and those bodies that never come are timed out in turn (a 408), freeing the slots
        for s, _ in busy:
            s.setblocking(False)
        closed = _closed_at(busy, time.monotonic() + 4 + WAIT)
        assert len(closed) == limit and all(b" 408 " in data for _, data in closed.values())
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()


def test_the_descriptor_limit_is_raised_to_the_hard_limit_despite_mlx_lm():
    # under a hard limit below 4096, mlx-lm's import fails outright; above, it would lower it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = 3000 if hard == resource.RLIM_INFINITY or hard > 3000 else hard
    low = min(soft, hard, 512)
    code = ("import resource, sys\n"
            "from segcache.serve.guard import raise_open_files\n"
            "n = raise_open_files()\n"
            "assert 'mlx_lm.utils' in sys.modules\n"
            "print(n, *resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    assert out.returncode == 0, out.stderr
    n, new_soft, new_hard = (int(x) for x in out.stdout.split())
    assert n == new_soft == new_hard == hard


def test_repeated_warnings_are_logged_once_per_interval_with_a_count():
    from segcache.serve.guard import Repeats

    now = [0.0]
    flt = Repeats(interval=10, clock=lambda: now[0])
    lg = logging.getLogger("segcache.test.repeats")

    def rec(msg, level=logging.ERROR, exc=None):
        return lg.makeRecord(lg.name, level, __file__, 1, msg, ("x",), (type(exc), exc, None) if exc else None)

    kept = [r for r in (rec("accept failed: %s", exc=OSError(24, "Too many open files")) for _ in range(5000))
            if flt.filter(r)]
    assert len(kept) == 1
    assert all(flt.filter(rec(f"info {i}", logging.INFO)) for i in range(10))  # INFO is never held back
    assert flt.filter(rec("another kind: %s"))
    now[0] = 10.5
    r = rec("accept failed: %s", exc=OSError(24, "Too many open files"))
    assert flt.filter(r) and "[4999 more like this in the last 10 s]" in r.getMessage()
    r = rec("accept failed: %s", exc=OSError(24, "Too many open files"))
    assert not flt.filter(r)
