"""Who may call the server, and which prefixes a request may share: its isolation domain.

A request's domain is the prefix cache's salt for its runtimes (`Runtime(cache_salt=)`):
requests in different domains share no cached prefix, so one cannot learn from
`cached_tokens` or the time to first token whether another's prompt is cached.

    domain = None                                 nothing asked: the shared domain
           = "s:" + cache_salt                    the request's `cache_salt`
           = "k:" + H(key) [+ ";s:" + cache_salt] with --prompt-cache-isolation per-key

H(key) is a hash of the API key the request authenticated with, so a key never
appears in a salt, and with per-key isolation no request can name another key's
domain (every domain it can reach starts with its own key's hash).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Optional, Sequence

MODES = ("none", "per-key")


def read_keys(keys: Sequence[str], path: Optional[str]) -> list[str]:
    """The API keys: those given, then one per line of the file at `path` (blank lines and
    lines starting with '#' skipped), without repeats.

    Raises:
        ValueError: the file cannot be read, or a key holds whitespace.
    """
    out = [k for k in keys if k]
    if path is not None:
        try:
            text = Path(path).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
        out += [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    for k in out:
        if any(c.isspace() for c in k):
            raise ValueError("an API key holds whitespace; give one key per --api-key or per line of the keys file")
    return list(dict.fromkeys(out))


def match(token: str, keys: Sequence[str]) -> Optional[str]:
    """The key `token` is, or None. Every key is compared in constant time (no early exit
    that would tell by timing how many keys were tried or how much of one matched)."""
    raw = token.encode()
    found = None
    for key in keys:
        if hmac.compare_digest(raw, key.encode()):
            found = key
    return found


def domain(key: Optional[str], cache_salt: Optional[str], per_key: bool) -> Optional[str]:
    """The prefix-cache salt of a request (see the module's docstring); None: the shared domain."""
    parts = []
    if per_key and key is not None:
        parts.append("k:" + hashlib.sha256(key.encode()).hexdigest())
    if cache_salt is not None:
        parts.append("s:" + cache_salt)
    return ";".join(parts) or None
