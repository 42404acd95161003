"""`bench/agent.py --claude-code`: a scripted Claude-Code-shaped session, segcache against mlx_lm.server.

    main session   turn 1 (cold) .. turn N: Claude Code's billing header first in `system`
                   (a new nonce every request), the system prompt as a cache_control block,
                   10+ tools, thinking on, tool_use / tool_result turns that grow
    fan-out        4 subagents at once: the same system prompt and tools, a task each
    subagents      4 subagents at once with a system prompt of their own (as Claude Code's Task
                   tool gives them) and the same tools: a prefix nobody computed yet, shared by all 4
    restart        the server restarts, then the main session's last request again

Sent to `segcache serve` through the official `anthropic` client (streamed); each
request then goes to `mlx_lm.server` (up at the same time) through its chat endpoint as
the conversation segcache rendered it (`anthropic.turn`: the billing header left out,
blocks as chat messages), so both servers see the same prompts, interleaved; both
restart together, and mlx_lm.server's restart turn is cold. Time to first token is measured at the client: request sent -> the first
content event (a thinking, text or tool-use block). Each repeat runs both servers
afresh; the report gives each repeat's summed TTFT ratio and restart speed-up, and
their medians: over the issue's trace (every phase but `subagents`), and with it.
"""

from __future__ import annotations

import json
import secrets
import statistics
import threading
import time

import anthropic

from segcache.serve import anthropic as surface
from segcache.serve import schemas

TASKS = [
    "The date parser rejects ISO week dates like 2024-W05-3. Find where dates are parsed and add support.",
    "test_http_reader fails on a chunked body with trailing headers. Find out why and fix it.",
    "Add a --verbose flag to the command line that logs every request, and document it.",
    "Rename the config loader's `path` argument to `source` everywhere and keep the old name working.",
]
SUBAGENT_SYSTEM = ("You are a search subagent of a coding agent. Answer the task you are given with the paths "
                   "and lines you found, briefly; do not change any file.")
SUBAGENT_TASKS = [
    "Search the repository for every call of parse_date and list the files.",
    "Read tests/test_http.py and summarize which cases cover chunked bodies.",
    "Find where the command line flags are defined and list them.",
    "Check whether README.md documents the configuration file's format.",
]


def billing_header() -> str:
    """Claude Code's first system block, with a fresh nonce (as it sends one per request)."""
    return f"x-anthropic-billing-header: cc_version=2.0.14.a1b; cc_entrypoint=cli; cch={secrets.token_hex(3)};"


def _anthropic_tools(tools: list[dict]) -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


class Session:
    """What the trace sent: each request's body (for the replay) and what came back."""

    def __init__(self, setup, tools: list[dict], tokens: int):
        self.setup, self.tools, self.tokens = setup, tools, tokens
        self.records: list[dict] = []

    def body(self, messages: list[dict], system_text: str | None = None) -> dict:
        system = [{"type": "text", "text": billing_header()},
                  {"type": "text", "text": system_text or self.setup.system, "cache_control": {"type": "ephemeral"}}]
        return {"model": "default_model", "max_tokens": self.tokens, "system": system, "tools": self.tools,
                "messages": messages, "thinking": {"type": "enabled", "budget_tokens": 1024}}

    def send(self, client, phase: str, messages: list[dict], system_text: str | None = None) -> dict:
        body = self.body(messages, system_text)
        tic, ttft = time.perf_counter(), None
        with client.messages.stream(**body) as stream:
            for ev in stream:
                if ev.type in ("content_block_start", "content_block_delta") and ttft is None:
                    ttft = time.perf_counter() - tic
            final = stream.get_final_message()
        ttft = ttft if ttft is not None else time.perf_counter() - tic
        u = final.usage
        rec = dict(phase=phase, body=body, ttft=ttft, prompt=u.input_tokens + u.cache_read_input_tokens,
                   cached=u.cache_read_input_tokens, final=final)
        print(f"  segcache       {phase:<10} prompt {rec['prompt']:>5} cached {rec['cached']:>5} "
              f"ttft {ttft * 1000:7.0f} ms  stop {final.stop_reason}", flush=True)
        return rec

    def follow(self, messages: list[dict], rec: dict, turn: int) -> list[dict]:
        """The history the agent sends next: the answer, then the tools' results (or a nudge)."""
        final = rec["final"]
        blocks = [b.model_dump(include={"type", "text", "thinking", "signature", "id", "name", "input"})
                  for b in final.content] or [{"type": "text", "text": ""}]
        out = messages + [{"role": "assistant", "content": blocks}]
        uses = [b for b in final.content if b.type == "tool_use"]
        if uses:
            results = [{"type": "tool_result", "tool_use_id": b.id,
                        "content": self.setup.execute({"name": b.name, "arguments": json.dumps(b.input)})}
                       for b in uses]
            return out + [{"role": "user", "content": results}]
        return out + [{"role": "user", "content": f"Go on: use the tools (step {turn + 1})."}]


def chat_request(body: dict) -> dict:
    """The chat completions request of the conversation segcache rendered for `body`."""
    turn = surface.turn(schemas.parse(json.dumps(body).encode(), schemas.MessagesRequest))
    messages = []
    for m in turn.messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        messages.append(m)
    return dict(model="default_model", messages=messages, tools=turn.tools, max_tokens=turn.max_tokens,
                temperature=0.0, stream=True, extra_body={"chat_template_kwargs": turn.template_kwargs})


def mlx_lm_ttft(client, phase: str, body: dict) -> dict:
    """One request of the trace against mlx_lm.server's chat endpoint."""
    tic, ttft = time.perf_counter(), None
    for ev in client.chat.completions.create(**chat_request(body)):
        d = ev.choices[0].delta if ev.choices else None
        got = d is not None and (d.content or d.tool_calls or getattr(d, "reasoning", None)
                                 or getattr(d, "reasoning_content", None))
        if got and ttft is None:
            ttft = time.perf_counter() - tic
    out = dict(phase=phase, ttft=ttft if ttft is not None else time.perf_counter() - tic)
    print(f"  mlx_lm.server  {phase:<10} ttft {out['ttft'] * 1000:7.0f} ms", flush=True)
    return out


def _together(fns: list) -> list:
    """Run the callables at once (threads); their results in order."""
    got = [None] * len(fns)

    def one(i):
        got[i] = fns[i]()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return [g for g in got if g is not None]


def run_pair(ours_proc, theirs_proc, setup, tools, args) -> tuple[list[dict], list[dict]]:
    """The trace, each request to segcache serve and then the same one to mlx_lm.server (both
    servers up, so the machine's load falls on both alike); both restart together."""
    def anthropic_client():
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{ours_proc.port}", api_key="none", timeout=600,
                                   max_retries=0)

    s = Session(setup, tools, args.tokens)
    ours, theirs = [], []
    procs = [p for p in (ours_proc, theirs_proc) if p is not None]
    for p in procs:
        p.start()
    try:
        messages = [{"role": "user", "content": TASKS[0]}]
        for turn in range(args.turns):
            phase = "cold" if turn == 0 else "turns"
            rec = s.send(anthropic_client(), phase, messages)
            ours.append(rec)
            if theirs_proc is not None:
                theirs.append(mlx_lm_ttft(theirs_proc.client(), phase, rec["body"]))
            last = messages
            messages = s.follow(messages, rec, turn)
        subs = [[{"role": "user", "content": t}] for t in SUBAGENT_TASKS]
        got = _together([lambda m=m: s.send(anthropic_client(), "fan-out", m) for m in subs])
        ours += got
        if theirs_proc is not None:
            theirs += _together([lambda r=r: mlx_lm_ttft(theirs_proc.client(), "fan-out", r["body"]) for r in got])
        got = _together([lambda m=m: s.send(anthropic_client(), "subagents", m, SUBAGENT_SYSTEM) for m in subs])
        ours += got
        if theirs_proc is not None:
            theirs += _together([lambda r=r: mlx_lm_ttft(theirs_proc.client(), "subagents", r["body"]) for r in got])
        for p in procs:
            p.stop()
        for p in procs:
            p.start()
        rec = s.send(anthropic_client(), "restart", last)
        ours.append(rec)
        if theirs_proc is not None:
            theirs.append(mlx_lm_ttft(theirs_proc.client(), "restart", rec["body"]))
    finally:
        for p in procs:
            p.stop()
    return ours, theirs


def report(runs: list[tuple[list[dict], list[dict]]]) -> None:
    """Per phase and in total, each repeat's TTFT sums; then the medians of the ratios."""
    sums, sums_all, restarts = [], [], []
    issue = lambda r: r["phase"] != "subagents"  # noqa: E731  (the issue's trace: all but the cold fan-out)
    for k, (ours, theirs) in enumerate(runs):
        print(f"\nrepeat {k + 1}: time to first token summed per phase (ms)")
        print(f"{'phase':<10}{'n':>3}{'segcache':>11}{'mlx_lm':>11}{'ratio':>8}")
        for ph in list(dict.fromkeys(r["phase"] for r in ours)) + ["trace", "all"]:
            a = [r["ttft"] for r in ours if ph in (r["phase"], "all") or (ph == "trace" and issue(r))]
            b = [r["ttft"] for r in theirs if ph in (r["phase"], "all") or (ph == "trace" and issue(r))]
            print(f"{ph:<10}{len(a):>3}{sum(a) * 1000:>11.0f}{sum(b) * 1000:>11.0f}{sum(a) / sum(b):>7.2f}x")
        sums.append(sum(r["ttft"] for r in ours if issue(r)) / sum(r["ttft"] for r in theirs if issue(r)))
        sums_all.append(sum(r["ttft"] for r in ours) / sum(r["ttft"] for r in theirs))
        ra = next(r["ttft"] for r in ours if r["phase"] == "restart")
        rb = next(r["ttft"] for r in theirs if r["phase"] == "restart")
        restarts.append(rb / ra)
        print(f"cache reads per request: {[r['cached'] for r in ours]}")
    print(f"\nsummed TTFT, segcache / mlx_lm.server, per repeat (trace: all but subagents): "
          f"{[f'{x:.2f}' for x in sums]}; median {statistics.median(sums):.2f}x")
    print(f"summed TTFT with the subagents phase, per repeat: {[f'{x:.2f}' for x in sums_all]}; "
          f"median {statistics.median(sums_all):.2f}x")
    print(f"turn after a restart, mlx_lm.server (cold) / segcache, per repeat: {[f'{x:.1f}' for x in restarts]}; "
          f"median {statistics.median(restarts):.1f}x faster")


def run(args, setup, tools, segcache_proc, mlx_proc) -> int:
    """The --claude-code trace, `args.repeats` times (fresh stores and servers each time)."""
    runs = []
    for k in range(args.repeats):
        print(f"\n-- repeat {k + 1} of {args.repeats}", flush=True)
        runs.append(run_pair(segcache_proc(f"store-cc-{k}"), None if args.no_mlx_lm else mlx_proc(), setup,
                             _anthropic_tools(tools), args))
    if not args.no_mlx_lm:
        report(runs)
    return 0
