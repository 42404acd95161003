"""`segcache store stats|ls|verify|gc PATH`: inspect and maintain a store directory.

Each function prints human-readable lines and returns a process exit code.
None of them creates anything: on a directory that holds no store they print
"no store at PATH" and exit 1. Any other store failure is one line on stderr
and exit 1; a bad argument exits 2. Run as ``python -m segcache.store.cli stats PATH`` too.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import StoreError
from .store import open_store

KINDS = {"page": "KV pages", "ckpt": "checkpoints", "node": "index nodes",  # written by store.prefix_cache
         "dpage": "drafter pages", "dckpt": "drafter checkpoints"}  # store.drafter_records

_HUGE = 1 << 50  # CLI handles never evict on their own: only `gc` removes records


def _open(path: str, remote: str | None = None):
    return open_store(path, ram_bytes=0, disk_bytes=_HUGE, create=False, remote=remote, remote_timeout=2.0)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def stats(path: str, remote: str | None = None) -> int:
    """Print entries and bytes of the store at path (and, with a remote, its memory and policy)."""
    with _open(path, remote) as s:
        info = s.remote_info() if remote else None
        st = s.stats()
        kinds: dict[str, list[int]] = {}
        for e in s.entries():
            c = kinds.setdefault(e.kind, [0, 0, 0])
            c[0] += 1
            c[1] += e.nbytes
            c[2] += e.tokens
    print(f"store   {path}")
    print(f"entries {st['entries']}   bytes {_mib(st['disk_bytes'])}   data.mdb {_mib(st['disk_file_bytes'])}   "
          f"unresumable {st['disk_unresumable_bytes']} bytes")
    for kind, (n, b, t) in sorted(kinds.items()):
        label = f"{kind} ({KINDS[kind]})" if kind in KINDS else kind
        print(f"  {label:<26} {n:>8} entries {_mib(b):>12} {t:>12} tokens")
    if "page" in kinds:
        print("  (pages: tokens are stored K/V, 0 where only a checkpoint resumes; checkpoints: the prompt length they resume;\n"
              "   unresumable: records no checkpoint or chain of pages can resume from, 0 after any eviction)")
    print("remote  " + "   ".join(f"{k[7:]} {st[k]}" for k in ("remote_reads", "remote_writes", "remote_errors", "remote_dropped", "remote_backlog", "remote_corrupt"))
          + ("" if remote else "   (counters of this handle; pass --remote URL to probe a remote)"))
    if info is not None:
        print("  " + "   ".join(f"{k} {v}" for k, v in info.items()))
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
    """Decode every record; delete bad ones and the ones nothing can resume from. Exit code 1 if a
    record or the index was damaged."""
    with _open(path) as s:
        r = s.verify()
    print(f"checked {r['checked']} records: {r['corrupt']} corrupt (deleted), {r['orphans']} orphan index entries (deleted), "
          f"{r['unresumable']} unresumable ({r['unresumable_bytes']} bytes, deleted)")
    print(f"now {r['entries']} entries, {_mib(r['bytes'])}, unresumable 0 bytes")
    return 1 if r["corrupt"] or r["orphans"] or r["fixed_total"] else 0  # unresumable records are waste, not damage


def gc(path: str, max_bytes: int) -> int:
    """Evict oldest-least-useful records until the store (its file too, when no other
    process has it open) holds at most max_bytes."""
    with _open(path) as s:
        n = s.gc(max_bytes, file=True)
        st = s.stats()
    print(f"evicted {n} records; {_mib(st['disk_bytes'])} left (limit {_mib(max_bytes)}); "
          f"data.mdb {_mib(st['disk_file_bytes'])}")
    return 0


def _bytes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative; give the bytes the store may keep (0 empties it)")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="segcache store", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    helps = {"stats": "entries and bytes per kind", "ls": "one line per entry", "verify": "check every record, delete bad ones (exit 1 if any)"}
    for name, text in helps.items():
        sub.add_parser(name, help=text, description=text).add_argument("path", help="store directory")
    sub.choices["stats"].add_argument("--remote", metavar="URL", help="also probe this Redis/Valkey (keys, memory, eviction policy)")
    g = sub.add_parser("gc", help="evict what nothing resumes from, then whole units, until the store holds at most --max-bytes")
    g.add_argument("path", help="store directory")
    g.add_argument("--max-bytes", type=_bytes, required=True, help="bytes the store may keep, >= 0")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "gc":
            return gc(a.path, a.max_bytes)
        if a.cmd == "stats":
            return stats(a.path, a.remote)
        return {"ls": ls, "verify": verify}[a.cmd](a.path)
    except StoreError as e:
        print(f"segcache store {a.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
