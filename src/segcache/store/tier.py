"""The one interface every tier of the prefix store answers (RAM, LMDB, remote).

As SGLang's `HiCacheStorage` gives each storage backend get / batch get / set /
exists, each tier here holds decoded `Record`s under opaque keys and answers:

    get(key, expect) / get_many(keys, expects)   the records, None where absent
    put(key, record)                             store (RAM: now; disk: one transaction;
                                                 remote: queued for its writer thread)
    delete(key) -> bool                          whether it was there (remote: queued, False)
    stats() -> dict                              its counters, each named "<tier>_<what>"

`expect` is the layout a record's arrays must have (`codec.Expect`); a record
that does not fit it is damaged (dropped by the tier, counted in its
"<tier>_corrupt", never served). `PrefixStore` walks the tiers in `ORDER` and
adds what each one's stats say; it reaches into no tier's private state.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .codec import Expect
from .record import Record

ORDER = ("ram", "disk", "remote")  # fastest first: the order a read asks them in


class Tier(Protocol):
    name: str  # one of ORDER

    def get(self, key: bytes, expect: Expect | None = None) -> Record | None: ...

    def get_many(self, keys: Sequence[bytes], expects: Sequence[Expect | None] | None = None) -> list[Record | None]: ...

    def put(self, key: bytes, record: Record) -> None: ...

    def delete(self, key: bytes) -> bool: ...

    def stats(self) -> dict[str, int]: ...


def joined(names) -> str:
    """Tier names in `ORDER`, joined with "+" ("ram+disk"); "-" for none."""
    names = set(names)
    return "+".join(n for n in ORDER if n in names) or "-"
