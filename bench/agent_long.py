"""A long agent context (issue 47): follow-up turns and decode after ~52k tokens, segcache serve against mlx_lm.server.

    python bench/agent_long.py [--context 52000] [--turns 4] [--new 200] [--tokens 48] [--no-inproc]
                               [--mlx-blas same|wheel]

One conversation shaped as Claude Code's: a system prompt of about `--context` tokens (held-out
code) and tools, sent to `segcache serve` through the official `anthropic` client (streamed) and,
as the conversation segcache rendered it, to `mlx_lm.server`'s chat endpoint (bench/claude_code.py's
`chat_request`), each turn to one then the other. Turn 1 is cold; each later turn adds the answer
and a tool result of about `--new` tokens, as an agent's loop does. Thinking is off, so both
servers can continue from their last turn's cache (a re-rendered answer is the tokens generated).

Reported: each follow-up's time to first token at the client (medians), the cached tokens each
server reported, and the follow-ups' decode rate (`--tokens` each; tokens after the first / seconds,
at the client; medians). In process (`--no-inproc` skips it), first: mlx-lm's own model call and
cache on the same text, its cold prefill rate at 8k, 32k and `--context` tokens; then right after
each follow-up, a prefill of as many new tokens as that follow-up added after that context (states,
then the last token's logits, as mlx-lm's generate does): the figure a follow-up turn is held to
(<= 1.2x), measured in the same minute, since this machine's speed drifts by 30% between runs.

The shipped target's context is 4,096 tokens: the bench serves a copy whose config allows 131,072.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import anthropic

from agent import prepare_model  # bench/agent.py
from claude_code import chat_request  # bench/claude_code.py
from serve import MODELS, Proc, _port  # bench/serve.py

CORPUS = MODELS / "heldout_stdlib.txt"
TOOLS = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": {
    "path": {"type": "string", "description": "a file path"}, "text": {"type": "string"}}, "required": ["path"]}}
         for n, d in [("Read", "Read a file."), ("Write", "Write a file."), ("Edit", "Replace text in a file."),
                      ("Bash", "Run a shell command."), ("Grep", "Search files for a pattern.")]]


def long_model(model: Path, work: Path) -> tuple[Path, str]:
    """A copy of the bench's model (its template and parser, bench/agent.py) allowing 131,072 positions."""
    path, how = prepare_model(str(model), work, False)
    if path == Path(model):  # it has its own template: a copy for the config only
        path = work / "model"
        path.mkdir()
        for f in Path(model).iterdir():
            os.symlink(f.resolve(), path / f.name)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["max_position_embeddings"] = 1 << 17
    cfg_file.unlink()
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path, how


def system_text(tokens: int, chars_per_token: float) -> str:
    corpus = CORPUS.read_text()
    n = int(tokens * chars_per_token)
    return (corpus * (1 + n // len(corpus)))[:n]


def body(system: str, messages: list, tokens: int) -> dict:
    return {"model": "default_model", "max_tokens": tokens, "system": [{"type": "text", "text": system,
            "cache_control": {"type": "ephemeral"}}], "tools": TOOLS, "messages": messages,
            "thinking": {"type": "disabled"}}


def send_segcache(client, req: dict) -> dict:
    """One streamed request: ttft, decode rate (tokens after the first / seconds), usage, answer blocks."""
    tic, stamps = time.perf_counter(), []
    with client.messages.stream(**req) as stream:
        for ev in stream:
            if ev.type in ("content_block_start", "content_block_delta"):
                stamps.append(time.perf_counter())
        final = stream.get_final_message()
    u = final.usage
    return dict(ttft=(stamps[0] if stamps else time.perf_counter()) - tic, rate=_rate(stamps, u.output_tokens),
                prompt=u.input_tokens + u.cache_read_input_tokens, cached=u.cache_read_input_tokens,
                blocks=[b.model_dump(include={"type", "text", "id", "name", "input"}) for b in final.content])


def send_mlx(client, req: dict) -> dict:
    tic, stamps, cached, n = time.perf_counter(), [], -1, 0
    kwargs = chat_request(req)
    kwargs["stream_options"] = {"include_usage": True}
    for ev in client.chat.completions.create(**kwargs):
        d = ev.choices[0].delta if ev.choices else None
        if d is not None and (d.content or d.tool_calls):
            stamps.append(time.perf_counter())
        if ev.usage is not None:
            n = ev.usage.completion_tokens
            details = ev.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else -1
    return dict(ttft=(stamps[0] if stamps else time.perf_counter()) - tic, rate=_rate(stamps, n), cached=cached)


def _rate(stamps: list, tokens: int) -> float:
    """Tokens after the first per second, from the chunks' arrival times (a chunk may hold several)."""
    if len(stamps) < 2 or tokens < 2:
        return float("nan")
    return (tokens - 1) / (stamps[-1] - stamps[0])


def tool_result(k: int, new: int, chars_per_token: float) -> list:
    corpus = CORPUS.read_text()
    start = (k * 7919) % (len(corpus) - 4000)
    return [{"type": "tool_result", "tool_use_id": f"toolu_{k}",
             "content": corpus[start : start + int(new * chars_per_token)]}]


def run_servers(args, model: Path, work: Path, cpt: float, ref: "InProcess | None" = None) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    mlx_env = dict(env)
    libs = glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0")
    if args.mlx_blas == "same" and libs and sys.platform.startswith("linux"):
        mlx_env.update(LD_PRELOAD=libs[0], OPENBLAS_THREAD_TIMEOUT="4")
    port = _port()
    ours = Proc("segcache", [sys.executable, "-m", "segcache.cli", "serve", "--model", str(model), "--port",
                             str(port), "--prompt-cache-dir", str(work / "store"), "--log-level", "INFO"],
                env, port, work / "segcache.log")
    port = _port()
    theirs = Proc("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                                    "--log-level", "WARNING"], mlx_env, port, work / "mlx_lm.log")
    system = system_text(args.context, cpt)
    for p in (ours, theirs):
        p.start()
    try:
        a = anthropic.Anthropic(base_url=f"http://127.0.0.1:{ours.port}", api_key="none", timeout=1800, max_retries=0)
        m = theirs.client()
        messages = [{"role": "user", "content": "Read the code above and list what it does, briefly."}]
        seg, mlx = [], []
        for k in range(args.turns):
            req = body(system, messages, args.tokens if k else 8)  # the follow-ups measure decode too
            s = send_segcache(a, req)
            t = send_mlx(m, req)
            seg.append(s)
            mlx.append(t)
            line = ""
            if ref is not None and k:  # the same count of new tokens after that context, in process, now
                s["ref"] = ref.follow_up(s["prompt"] - seg[-2]["prompt"])
                line = f"; in process {s['ref'] * 1000:.0f} ms"
            print(f"turn {k + 1}: prompt {s['prompt']} tokens; ttft segcache {s['ttft'] * 1000:.0f} ms (cached "
                  f"{s['cached']}), mlx_lm.server {t['ttft'] * 1000:.0f} ms (cached {t['cached']}){line}", flush=True)
            messages = messages + [{"role": "assistant", "content": s["blocks"] or [{"type": "text", "text": "."}]},
                                   {"role": "user", "content": tool_result(k, args.new, cpt)}]
        fs = statistics.median(r["ttft"] for r in seg[1:])
        fm = statistics.median(r["ttft"] for r in mlx[1:])
        print(f"\nfollow-up TTFT (turns 2..{args.turns}), medians: segcache {fs * 1000:.0f} ms, "
              f"mlx_lm.server {fm * 1000:.0f} ms: {fs / fm:.2f}x")
        if ref is not None:
            r = statistics.median(x["ref"] for x in seg[1:])
            print(f"in process, the follow-ups' new tokens after {ref.context} tokens (median): {r * 1000:.0f} ms; "
                  f"segcache serve's follow-up TTFT (at the client) against it: {fs / r:.2f}x")
        print(f"cold TTFT: segcache {seg[0]['ttft']:.1f} s, mlx_lm.server {mlx[0]['ttft']:.1f} s")
        ds = statistics.median(r["rate"] for r in seg[1:])
        dm = statistics.median(r["rate"] for r in mlx[1:])
        print(f"decode after {seg[1]['prompt']}..{seg[-1]['prompt']} tokens ({args.tokens} tokens a turn, medians): "
              f"segcache {ds:.1f} tok/s, mlx_lm.server {dm:.1f} tok/s: {ds / dm:.2f}x")
    finally:
        for p in (ours, theirs):
            p.stop()


class InProcess:
    """mlx-lm's own model call and cache on the bench's text: cold prefill rates to `context` tokens,
    then prefills of a follow-up's new tokens after that context (each from a copy of it)."""

    def __init__(self, model: Path, cpt: float, context: int):
        import mlx_lm

        self.lm, tok = mlx_lm.load(str(model))
        self.ids = tok.encode(system_text(int(1.3 * context) + 8000, cpt))  # chars per token vary
        assert len(self.ids) >= context + 2000, len(self.ids)
        self.context, self.samples = context, 0
        self.cache = None

    def prefill(self) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache, pos, marks = make_prompt_cache(self.lm), 0, {}
        tic = time.perf_counter()
        for stop in sorted({s for s in (8000, 32000) if s < self.context} | {self.context}):
            while pos < stop:
                end = min(pos + 2048, stop)
                self.lm(mx.array([self.ids[pos:end]]), cache=cache)
                mx.eval([c.state for c in cache])
                pos = end
            marks[pos] = time.perf_counter() - tic
        self.cache = cache
        print("in process, mlx-lm's model call: cold prefill " + ", ".join(
            f"{n} tokens in {s:.1f} s ({n / s:.0f} tok/s)" for n, s in marks.items()), flush=True)

    def follow_up(self, new: int) -> float:
        """Seconds of a `new`-token prefill after the context (states, then the last token's logits,
        as mlx-lm's generate does)."""
        import mlx.core as mx

        c = copy.deepcopy(self.cache)  # each from the same context
        at = self.context + (self.samples % 4) * 400
        self.samples += 1
        chunk = self.ids[at : at + new]
        t = time.perf_counter()
        self.lm(mx.array([chunk[:-1]]), cache=c)
        mx.eval([x.state for x in c])
        mx.eval(self.lm(mx.array([chunk[-1:]]), cache=c))
        return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODELS / "target"))
    ap.add_argument("--context", type=int, default=52000, help="system prompt tokens, about (default 52000)")
    ap.add_argument("--turns", type=int, default=4, help="turns; the first is cold (default 4)")
    ap.add_argument("--new", type=int, default=200, help="tokens a follow-up adds, about (default 200)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens each follow-up decodes (default 48)")
    ap.add_argument("--mlx-blas", choices=["same", "wheel"], default="same")
    ap.add_argument("--no-servers", action="store_true")
    ap.add_argument("--no-inproc", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="segcache-agent-long-"))
    model, how = long_model(Path(args.model), work)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(model)
    sample = CORPUS.read_text()[:20000]
    cpt = len(sample) / len(tok.encode(sample))
    text = system_text(args.context, cpt)
    cpt = len(text) / len(tok.encode(text))  # the corpus repeated reads otherwise: the system prompt is --context
    print(f"model {args.model} with {how}, 131,072 positions; ~{args.context} tokens of context; logs in {work}")
    ref = None
    if not args.no_inproc:  # first, so that each follow-up is compared with a prefill measured just after it
        ref = InProcess(model, cpt, args.context)
        ref.prefill()
    if not args.no_servers:
        run_servers(args, model, work, cpt, ref)
    elif ref is not None:
        times = [ref.follow_up(args.new) for _ in range(3)]
        print(f"a {args.new}-token prefill after {args.context} tokens: median "
              f"{statistics.median(times) * 1000:.0f} ms of {[round(t * 1000) for t in times]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
