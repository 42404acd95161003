"""`segcache store stats|ls|verify|gc PATH`: inspect and maintain a store directory.

Each function prints human-readable lines and returns a process exit code.
Run as ``python -m segcache.store.cli stats PATH`` too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import StoreError
KINDS = {"page": "KV pages", "ckpt": "checkpoints", "node": "index nodes"}  # written by store.prefix_cache
from .store import open_store

_HUGE = 1 << 50  # CLI handles never evict on their own: only `gc` removes records


def _open(path: str):
    if not os.path.isdir(path):
        raise StoreError(f"no prefix store at {path}: the directory does not exist")
    return open_store(path, ram_bytes=0, disk_bytes=_HUGE)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def stats(path: str) -> int:
    """Print entries and bytes of the store at path."""
    with _open(path) as s:
        st = s.stats()
        kinds: dict[str, list[int]] = {}
        for e in s.entries():
            c = kinds.setdefault(e.kind, [0, 0, 0])
            c[0] += 1
            c[1] += e.nbytes
            c[2] += e.tokens
    print(f"store   {path}")
    print(f"entries {st['entries']}   bytes {_mib(st['disk_bytes'])}")
    for kind, (n, b, t) in sorted(kinds.items()):
        label = f"{kind} ({KINDS[kind]})" if kind in KINDS else kind
        print(f"  {label:<26} {n:>8} entries {_mib(b):>12} {t:>12} tokens")
    if "page" in kinds:
        print("  (pages: tokens are stored K/V; checkpoints: tokens are the prompt length they resume)")
    return 0


def ls(path: str) -> int:
    """Print one line per entry: key prefix, tokens, bytes, kind, last use."""
    with _open(path) as s:
        rows = sorted(s.entries(), key=lambda e: e.last_use, reverse=True)
    print(f"{'key':<18} {'tokens':>8} {'bytes':>12} {'kind':<10} last use")
    for e in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_use))
        print(f"{e.key.hex()[:16]:<18} {e.tokens:>8} {e.nbytes:>12} {e.kind:<10} {when}")
    return 0


def verify(path: str) -> int:
    """Decode every record; delete bad ones. Exit code 1 if anything was wrong."""
    with _open(path) as s:
        r = s.verify()
    print(f"checked {r['checked']} records: {r['corrupt']} corrupt (deleted), {r['orphans']} orphan index entries (deleted)")
    print(f"now {r['entries']} entries, {_mib(r['bytes'])}")
    return 1 if r["corrupt"] or r["orphans"] or r["fixed_total"] else 0


def gc(path: str, max_bytes: int) -> int:
    """Evict oldest-least-useful records until the store holds at most max_bytes."""
    with _open(path) as s:
        n = s.gc(max_bytes)
        left = s.stats()["disk_bytes"]
    print(f"evicted {n} records; {_mib(left)} left (limit {_mib(max_bytes)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="segcache store", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("stats", "ls", "verify"):
        sub.add_parser(name).add_argument("path")
    g = sub.add_parser("gc")
    g.add_argument("path")
    g.add_argument("--max-bytes", type=int, required=True)
    a = p.parse_args(argv)
    try:
        if a.cmd == "gc":
            return gc(a.path, a.max_bytes)
        return {"stats": stats, "ls": ls, "verify": verify}[a.cmd](a.path)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
