"""The one request pipeline of the chat surfaces (chat completions, Messages, Responses).

    surface request ──translate──> ChatTurn ──Prompter.chat──> Prompt ──> GenRequest ──> the worker
    surface response <──shape──── Text / Call pieces <──Splitter── Chunk ... Finish <──┘

Each surface is a thin translation of its request into a `ChatTurn` (template
messages, tools, template variables, sampling) and of a `Run`'s events into
its own shapes; rendering, validation, queueing and the output split are
shared (app.py `Server.start_chat`, output.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional

from .engine import Chunk, Failure, Finish, Progress, Usage
from .errors import APIError
from .metrics import cached_by_tier
from .output import Markup, Splitter, new_call_id

if TYPE_CHECKING:
    from starlette.requests import Request

    from .access import Access
    from .chat import Prompt
    from .engine import GenRequest
    from .worker import Job

POLL = 0.25  # seconds between checks that a non-streaming client is still there


@dataclass
class ChatTurn:
    """A chat request of any surface, as the pipeline needs it.

    Attributes:
        messages: template-ready message dicts (chat.template_messages).
        tools: OpenAI function tools, {"type": "function", "function": {...}}, or None.
        tool_choice: None or "auto", "none", "required", or the name of the one
            function to call.
        parallel: several calls per answer (False: the answer ends after its first call).
        template_kwargs: this request's template variables.
        max_tokens .. top_logprobs: as GenRequest (None: the server's default).
        controls: the other sampling controls the request set (`Controls` fields:
            penalties, logit_bias, XTC, response_format; absent ones take Controls' defaults).
        n: choices to generate.
        param: the request field a prompt that does not fit is blamed on.
        params: the request's own names of Controls' fields, for its 400s (Responses'
            "text.format" for "response_format", ...).
        cache_salt: the request's own prefix-cache domain (vLLM's field), or None.
    """

    messages: list[dict]
    tools: Optional[list[dict]] = None
    tool_choice: Optional[str] = None
    parallel: bool = True
    template_kwargs: dict = field(default_factory=dict)
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stops: list[str] = field(default_factory=list)
    top_logprobs: int = -1
    controls: dict = field(default_factory=dict)
    n: int = 1
    param: str = "messages"
    params: dict = field(default_factory=dict)
    cache_salt: Optional[str] = None

    def __post_init__(self) -> None:
        choice = self.tool_choice
        if choice not in (None, "auto", "none", "required") and self.tools:
            # a named function: the model sees only that one, and starts its call
            self.tools = [t for t in self.tools if t["function"]["name"] == choice]

    @property
    def calls(self) -> bool:
        """Whether the output's tool calls are parsed."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def force_call(self) -> bool:
        return self.calls and self.tool_choice not in (None, "auto")


def failed(request_id: str) -> APIError:
    """The 500 of a failed generation: the exception's text stays in the log (the worker
    logs it under the request id), out of the body."""
    return APIError(500, f"generation failed; the server log has the details under {request_id}",
                    type="server_error")


class ClientGone(Exception):
    """A non-streaming client disconnected; the job is cancelled."""


@dataclass
class Run:
    """A queued generation: its request, its job, and the queue its events arrive on."""

    gen: "GenRequest"
    job: "Job"
    events: asyncio.Queue
    turn: Optional[ChatTurn] = None
    prompt: Optional["Prompt"] = None
    markup: Markup = field(default_factory=Markup)
    access: Optional["Access"] = None  # the request's access line (its tokens, its progress lines)
    capped: bool = False  # the context, not the request's max_tokens, bounds what it generates

    def splitter(self, new_id=new_call_id) -> Splitter:
        """The output splitter for this run's turn."""
        turn = self.turn
        return Splitter(self.markup, tools=turn.tools if turn else None, calls=bool(turn and turn.calls),
                        start=self.prompt.start if self.prompt else "text", new_id=new_id,
                        limit=None if turn is None or turn.parallel else 1)

    def user_stop(self, finish: Finish) -> Optional[str]:
        """The stop string of the request's own that ended the text (not the one-call stop)."""
        stops = self.turn.stops if self.turn is not None else self.gen.stops
        return finish.stop if finish.stop in stops else None

    async def events_of(self, request: Optional["Request"] = None, progress: bool = True) -> AsyncIterator[object]:
        """The engine's events: Progress while the prompt is prefilled (unless `progress` is
        False), Chunks and a Finish per choice (the last one marked `last`), or a Failure. With `request` (a
        non-streaming client) the client is checked every POLL seconds; gone, the job is
        cancelled and ClientGone raised."""
        checked = time.monotonic()
        try:
            while True:
                if request is None:
                    event = await self.events.get()
                else:
                    try:
                        event = await asyncio.wait_for(self.events.get(), timeout=POLL)
                    except asyncio.TimeoutError:
                        event = None
                    if time.monotonic() - checked >= POLL:  # events may never pause: poll by the clock
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            raise ClientGone()
                    if event is None:
                        continue
                if self.access is not None:
                    if isinstance(event, Finish):
                        self.access.finished(event)
                    elif isinstance(event, Progress):
                        self.access.progress(event)
                if isinstance(event, Progress) and not progress:
                    continue
                yield event
                if isinstance(event, Failure) or (isinstance(event, Finish) and event.last):
                    return
        finally:
            self.job.cancel()

    async def collect(self, request: "Request", new_id=new_call_id):
        """The whole output of a request of one choice: (pieces, logprobs, finish). Raises
        APIError(500) on a failure, ClientGone when the client left."""
        return (await self.collect_all(request, new_id))[0]

    async def collect_all(self, request: "Request", new_id=new_call_id) -> list[tuple[list, list, Finish]]:
        """Every choice's whole output, by index: [(pieces, logprobs, finish)]."""
        n = self.gen.n
        splits = [self.splitter(new_id) for _ in range(n)]
        pieces: list[list] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finishes: list[Optional[Finish]] = [None] * n
        async for event in self.events_of(request, progress=False):
            if isinstance(event, Chunk):
                pieces[event.index].extend(splits[event.index].feed(event.text))
                logprobs[event.index].extend(event.logprobs)
            elif isinstance(event, Finish):
                pieces[event.index].extend(splits[event.index].close())
                finishes[event.index] = event
                if event.last:
                    if any(f is None for f in finishes):  # the engine ends every choice before the last event
                        break
                    return list(zip(pieces, logprobs, finishes))
            elif isinstance(event, Failure):
                raise failed(self.gen.id)
        raise failed(self.gen.id)


def total_usage(finishes) -> Usage:
    """A request's usage over its choices: the prompt counted once (it was prefilled once),
    the completions summed."""
    first = finishes[0].usage
    return Usage(first.prompt_tokens, sum(f.usage.completion_tokens for f in finishes), first.cached_tokens,
                 first.tier, first.drafter, sum(f.usage.drafted for f in finishes),
                 sum(f.usage.accepted for f in finishes), first.ttft)


def segcache_usage(u: Usage) -> dict:
    """The `segcache` field every response's usage carries: what served it (docs/serve.md)."""
    return {"cached_tokens_by_tier": cached_by_tier(u), "drafter": u.drafter, "draft_tokens": u.drafted,
            "accepted_tokens": u.accepted, "ttft_s": round(u.ttft, 6)}
