"""Prompts: token ids of a completion or a chat, and the chat's message boundaries.

A chat is rendered with the tokenizer's chat template (or --chat-template). A
model without one gets the plain template of mlx_lm.server (its `convert_chat`
with the default role mapping), so both servers feed such a model the same
tokens:

    ASSISTANT's RULE: {system}\\n      one line per message, in order
    USER: {user}\\n
    ASSISTANT: {assistant}\\n
    ASSISTANT:                          the generation prompt (trailing space stripped)

Boundaries are positions in the prompt's ids: the end of the leading system
messages and the start of the last user message. The prefill checkpoints
them, so a new conversation with a known system prompt, or an edit of the
last question, resumes there even on a hybrid model. A boundary is the
longest common prefix of the prompt's ids and the ids of the text before it,
so a tokenizer that merges across the boundary only moves it earlier.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .errors import APIError

PLAIN_ROLES = {
    "system": "ASSISTANT's RULE: ",
    "developer": "ASSISTANT's RULE: ",
    "user": "USER: ",
    "assistant": "ASSISTANT: ",
    "tool": "",
}
_SYSTEM = ("system", "developer")


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Prompter:
    """Turns request prompts into token ids.

    Args:
        tokenizer: the model's mlx-lm `TokenizerWrapper`.
        chat_template: a Jinja chat template overriding the tokenizer's (or None).
    """

    def __init__(self, tokenizer, chat_template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.templated = chat_template is not None or bool(getattr(tokenizer, "has_chat_template", False))

    def encode(self, text: str) -> list[int]:
        """Text as mlx_lm.generate encodes a prompt: special tokens unless it starts with BOS."""
        bos = self.tokenizer.bos_token
        return list(self.tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))

    def completion(self, prompt) -> list[int]:
        """Ids of a completions prompt: text, [text] or token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if prompt and isinstance(prompt[0], str):
            return self.encode(prompt[0])
        return list(prompt)

    def chat(self, messages) -> tuple[list[int], list[int]]:
        """Ids of a chat with the generation prompt, and its boundary positions."""
        dicts = [{"role": m.role, "content": m.text()} for m in messages]
        if self.templated:
            render = self._template
        else:
            render = _plain
        ids = self._ids(render(dicts, True))
        cuts = []
        n_sys = next((i for i, m in enumerate(dicts) if m["role"] not in _SYSTEM), len(dicts))
        if 0 < n_sys < len(dicts):
            before = dicts[:n_sys] + ([{"role": "user", "content": ""}] if self.templated else [])
            cuts.append(self._boundary(render, before, ids))
        last_user = max((i for i, m in enumerate(dicts) if m["role"] == "user"), default=0)
        if last_user > n_sys:
            cuts.append(self._boundary(render, dicts[:last_user], ids))
        return ids, sorted({c for c in cuts if 0 < c < len(ids)})

    def _ids(self, text: str) -> list[int]:
        if self.templated:  # a template writes its own special tokens
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self.encode(text)

    def _boundary(self, render, before: list[dict], ids: list[int]) -> int:
        try:
            text = render(before, False)
        except Exception:  # a template may refuse a partial conversation: no checkpoint then
            return 0
        return _common(self._ids(text), ids)

    def _template(self, dicts: list[dict], generation_prompt: bool) -> str:
        kwargs = {"chat_template": self.chat_template} if self.chat_template is not None else {}
        try:
            return self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template raising on these messages (jinja's raise_exception)
            if not generation_prompt:
                raise
            raise APIError(400, f"'messages': the chat template refused them: {exc}", param="messages") from None


def _plain(dicts: list[dict], generation_prompt: bool) -> str:
    text = "".join(f"{PLAIN_ROLES.get(m['role'], '')}{m['content']}\n" for m in dicts)
    if generation_prompt:
        return (text + PLAIN_ROLES["assistant"]).rstrip()
    return text
