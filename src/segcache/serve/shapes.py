"""Response bodies in OpenAI's shapes (completions and chat, whole and streamed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .engine import Finish


def sse(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


@dataclass
class Shape:
    """Response bodies in OpenAI's shapes, for one request."""

    id: str
    model: str
    created: int
    chat: bool

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": "segcache"}

    def _logprobs(self, entries, offset: int = 0) -> Optional[dict]:
        if not entries:
            return None
        if self.chat:
            def one(tok, lp):
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
            return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, v) for t, v in e.top])
                                for e in entries]}
        offsets, pos = [], offset
        for e in entries:
            offsets.append(pos)
            pos += len(e.token)
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries] if any(e.top for e in entries) else None,
                "text_offset": offsets}

    def chunk(self, text: str, entries, finish: Optional[str]) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        choice = {"index": 0, "finish_reason": finish, "logprobs": self._logprobs(entries)}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if text or finish is None else {}
        else:
            choice["text"] = text
        body["choices"] = [choice]
        return body

    def usage_chunk(self, usage) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = _usage(usage)
        return body

    def whole(self, text: str, entries, finish: "Finish") -> dict:
        body = self._head("chat.completion" if self.chat else "text_completion")
        choice = {"index": 0, "finish_reason": finish.reason, "logprobs": self._logprobs(entries)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body["choices"] = [choice]
        body["usage"] = _usage(finish.usage)
        return body


def _usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
