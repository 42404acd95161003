"""What a chat surface (anthropic.py, responses.py) asks of the server, and nothing more.

The surfaces translate their requests into a `ChatTurn` and shape a `Run`'s events; the
server (app.py `Server`) renders, checks and queues, and streams. Handing the surfaces this
protocol instead of `Server` keeps app.py the one module that knows the routes: app.py imports
the surfaces, the surfaces import only what is below app.py.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional, Protocol

from starlette.responses import Response

from .chat import Prompt
from .pipeline import ChatTurn, Run


class ChatService(Protocol):
    """The server as a chat surface sees it."""

    @property
    def served_name(self) -> str:
        """The model id responses carry."""

    @property
    def keep_volatile_system(self) -> bool:
        """Whether a client's volatile first system block (Claude Code's billing header) is rendered."""

    @property
    def strict_fields(self) -> bool:
        """Whether unknown fields and a hosted service's hints are refused (--strict-fields)."""

    @property
    def tokenizer(self):
        """The model's tokenizer (mlx-lm's TokenizerWrapper)."""

    def grammars(self):
        """The model's structured-output compiler (segcache.grammar.Grammars), shared with the engine."""

    async def check_format(self, controls, params: dict) -> None:
        """Compile `controls.response_format` off the event loop: a 400 naming `params`' field
        unless it can be honoured."""

    def check_model(self, name: Optional[str]) -> None:
        """Raise a 404 `APIError` unless `name` is None or a name this server serves."""

    async def render(self, turn: ChatTurn) -> Prompt:
        """The turn's prompt, rendered and tokenized (off the event loop)."""

    async def start_chat(self, turn: ChatTurn, kind: str, key: Optional[str]) -> Run:
        """Render `turn`, check its prompt and controls, and queue its generation; `key` is the API
        key the request authenticated with (its isolation domain). Raises `APIError`."""

    def stream(self, body: AsyncIterator[str], run: Run, headers: Optional[dict] = None) -> Response:
        """`body`'s server-sent events as the response; the run's job is cancelled when it ends
        early (the client went away)."""
