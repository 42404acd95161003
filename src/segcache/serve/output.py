"""The model's output, split into reasoning, answer text and tool calls, as it streams.

    "<think>read it first</think>Let me look.<tool_call>{"name": "read_file", ...}</tool_call>"
     └─ reasoning ──────────────┘└─ text ─────┘└─ a call, parsed by mlx-lm's parser ─────────┘

A stream transformer over the engine's text events, shared by the chat,
Messages and Responses surfaces: `feed` each text segment, then `close`. The
markers are the tokenizer's (mlx-lm's `TokenizerWrapper`: `think_start` /
`think_end`, `tool_call_start` / `tool_call_end`) and are never returned.
Text that might be the start of a marker is held back until the next segment
decides it, so the result does not depend on how the text was segmented.
The text between a call's markers goes to mlx-lm's own parser for the
tokenizer (`tokenizer.tool_parser`); markup it cannot parse is returned as
answer text (with a warning in the log), never dropped.

The states and their exits are mlx_lm.server's:

    text      --think_start--> reasoning      --tool_call_start--> tool
    reasoning --think_end----> text           --tool_call_start--> tool
    tool      --tool_call_end--> text         (an empty end: the call runs to the end)
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

log = logging.getLogger("segcache.serve")

TEXT, REASONING, TOOL = "text", "reasoning", "tool"


@dataclass(frozen=True)
class Markup:
    """A tokenizer's output markers and tool-call parser.

    Attributes:
        think: (start, end) of a reasoning block, or None (no reasoning channel).
        tool: (start, end) of a tool call, or None (no tool calling); `end` may be "".
        parse: mlx-lm's `parse_tool_call(text, tools)` for the tokenizer's format.
    """

    think: Optional[tuple[str, str]] = None
    tool: Optional[tuple[str, str]] = None
    parse: Optional[Callable] = None

    @classmethod
    def of(cls, tokenizer) -> "Markup":
        """The markup an mlx-lm `TokenizerWrapper` declares (none for other tokenizers)."""
        think = tool = None
        if getattr(tokenizer, "has_thinking", False):
            think = (tokenizer.think_start, tokenizer.think_end)
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_parser is not None:
            tool = (tokenizer.tool_call_start, tokenizer.tool_call_end or "")
        return cls(think, tool, tokenizer.tool_parser if tool else None)


@dataclass(frozen=True)
class Text:
    """Answer text, or reasoning text when `reasoning`."""

    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class Call:
    """One parsed tool call: `arguments` is JSON text (an object, as OpenAI sends it)."""

    index: int
    id: str
    name: str
    arguments: str


Piece = Union[Text, Call]


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


class Splitter:
    """Splits a stream of output text into `Text` and `Call` pieces.

    Args:
        markup: the tokenizer's markers and parser.
        tools: the request's tools (OpenAI function tools), handed to the parser
            (some formats type arguments by the tools' schemas).
        calls: parse tool calls; False leaves their markup in the text
            (`tool_choice: "none"`, or no tools in the request).
        start: the state the output starts in: TEXT, REASONING (the prompt
            ends inside a reasoning block) or TOOL (the prompt ends with the
            tool-call start marker: a forced call).
        new_id: makes a call id when the format carries none.
        limit: calls returned at most (parallel_tool_calls false: 1); the server also
            ends the answer at the first call's end marker, so this matters only for a
            format without one (mistral), whose text may hold several calls.

    Invariant: `_held` is the longest suffix of the text seen in the current
    state that is a proper prefix of one of that state's exit markers.
    """

    def __init__(self, markup: Markup, *, tools: Optional[list] = None, calls: bool = True, start: str = TEXT,
                 new_id: Callable[[], str] = new_call_id, limit: Optional[int] = None):
        self.markup = markup
        self.limit = limit
        self.tools = tools
        self.new_id = new_id
        exits: dict[str, list[tuple[str, str]]] = {TEXT: [], REASONING: [], TOOL: []}
        if markup.think is not None:
            exits[TEXT].append((markup.think[0], REASONING))
            exits[REASONING].append((markup.think[1], TEXT))
        if calls and markup.tool is not None:
            exits[TEXT].append((markup.tool[0], TOOL))
            exits[REASONING].append((markup.tool[0], TOOL))
            if markup.tool[1]:
                exits[TOOL].append((markup.tool[1], TEXT))
        self._exits = exits
        if start == TOOL and not (calls and markup.tool is not None):
            raise ValueError("a forced tool call needs tool calling on")
        self.state = start
        self.calls = 0  # calls parsed so far
        self._held = ""
        self._body: list[str] = []  # the current call's text

    def feed(self, segment: str) -> list[Piece]:
        """The pieces `segment` completes (text that might start a marker is held back)."""
        out: list[Piece] = []
        text = self._held + segment
        while True:
            hit = self._first_exit(text)
            if hit is None:
                break
            at, marker, nxt = hit
            self._emit(text[:at], out)
            if self.state == TOOL:
                self._end_call(marker, out)
            self.state = nxt
            text = text[at + len(marker):]
        keep = self._partial(text)
        self._held = text[len(text) - keep:] if keep else ""
        self._emit(text[: len(text) - keep], out)
        return out

    def close(self) -> list[Piece]:
        """The pieces left at the end of the output: held text, an unfinished call."""
        out: list[Piece] = []
        self._emit(self._held, out)
        self._held = ""
        if self.state == TOOL:
            self._end_call("", out)
            self.state = TEXT
        return out

    def _first_exit(self, text: str):
        best = None
        for marker, nxt in self._exits[self.state]:
            at = text.find(marker)
            if at >= 0 and (best is None or (at, -len(marker)) < (best[0], -len(best[1]))):
                best = (at, marker, nxt)
        return best

    def _partial(self, text: str) -> int:
        keep = 0
        for marker, _ in self._exits[self.state]:
            for n in range(min(len(marker) - 1, len(text)), keep, -1):
                if text.endswith(marker[:n]):
                    keep = n
                    break
        return keep

    def _emit(self, text: str, out: list) -> None:
        if not text:
            return
        if self.state == TOOL:
            self._body.append(text)
        elif out and isinstance(out[-1], Text) and out[-1].reasoning == (self.state == REASONING):
            out[-1] = Text(out[-1].text + text, out[-1].reasoning)
        else:
            out.append(Text(text, self.state == REASONING))

    def _end_call(self, end: str, out: list) -> None:
        body, self._body = "".join(self._body), []
        calls = self._parse(body)
        if calls is None:
            # Not a call we can read: the client gets the markup as text, never nothing.
            self.state = TEXT
            self._emit(self.markup.tool[0] + body + end, out)
            return
        for name, arguments, cid in calls:
            if self.limit is not None and self.calls >= self.limit:
                log.info("a call beyond parallel_tool_calls' limit of %d was left out: %s", self.limit, name)
                continue
            out.append(Call(self.calls, cid or self.new_id(), name, arguments))
            self.calls += 1

    def _parse(self, body: str) -> Optional[list[tuple[str, str, Optional[str]]]]:
        try:
            parsed = self.markup.parse(body, self.tools)
        except Exception as exc:  # parsers raise ValueError, JSONDecodeError, and worse on odd text
            log.warning("tool call markup did not parse (%s: %s); returned as text: %.200r",
                        type(exc).__name__, exc, body)
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = []
        for item in items:
            call = _call(item)
            if call is None:
                log.warning("tool call markup parsed to %.200r, not a call; returned as text", item)
                return None
            calls.append(call)
        return calls or None


def _call(item) -> Optional[tuple[str, str, Optional[str]]]:
    """(name, arguments JSON, id or None) of a parser's dict, or None if it is not a call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    if set(item) - {"name", "arguments", "id"}:
        return None  # e.g. {"name": ..., "parameters": ...}: not the shape the format promises
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # some formats carry the JSON text itself
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    cid = item.get("id") if isinstance(item.get("id"), str) else None
    return item["name"], json.dumps(arguments, ensure_ascii=False), cid


def split_all(markup: Markup, segments: Sequence[str], **kwargs) -> list[Piece]:
    """Every piece of a whole output, merged: for tests and non-streamed answers."""
    s = Splitter(markup, **kwargs)
    out: list[Piece] = []
    for seg in segments:
        out.extend(s.feed(seg))
    out.extend(s.close())
    merged: list[Piece] = []
    for p in out:
        if merged and isinstance(p, Text) and isinstance(merged[-1], Text) and merged[-1].reasoning == p.reasoning:
            merged[-1] = Text(merged[-1].text + p.text, p.reasoning)
        else:
            merged.append(p)
    return merged
