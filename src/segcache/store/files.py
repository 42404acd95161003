"""The files of an LMDB environment, checked and handled before and around LMDB.

LMDB maps data.mdb and its lock file: a file cut short, a damaged meta page or a
full file system would make it fault (SIGBUS) instead of failing, so the
directory and the file are checked first. It also never shrinks data.mdb, and
another process may have it mapped: `sole_user` tells when this process alone
may rewrite it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
import warnings

from ..errors import StoreError, StoreWarning

_MIN_FREE = 1 << 20  # LMDB maps its lock file: creating it on a full file system faults (SIGBUS)
_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_VERSION = 1
_META = struct.Struct("<QHHI II QQ I")  # page header, magic, version, address, mapsize, free-db md_pad (page size)
_META_TAIL = struct.Struct("<QQ")  # mm_last_pg, mm_txnid: after the two 48-byte MDB_db records
_META_TAIL_AT = 16 + 24 + 2 * 48
STORE_FILES = ("data.mdb", "lock.mdb")


def no_store(path: str, why: str) -> StoreError:
    return StoreError(f"no store at {path}: {why}")


def check_lmdb_file(data: str) -> None:
    """Raise StoreError unless data.mdb is a whole LMDB file (meta pages valid, long enough).

    LMDB maps the file and would fault (SIGBUS) on a page past its end, so this
    runs before `lmdb.open`. A 0-byte file is what LMDB itself leaves before its
    first write and is accepted.
    """
    size = os.path.getsize(data)
    if size == 0:
        return
    with open(data, "rb") as f:
        head = f.read(_META.size)
        if len(head) < _META.size:
            raise no_store(os.path.dirname(data), f"data.mdb is {size} bytes, too short for an LMDB file (cut short?)")
        psize = _META.unpack(head)[8]
        if psize < 512 or psize > (1 << 16) or psize & (psize - 1):
            raise no_store(os.path.dirname(data), f"data.mdb is not an LMDB file (page size {psize})")
        last = 0
        for pg in (0, 1):
            f.seek(pg * psize)
            page = f.read(_META_TAIL_AT + _META_TAIL.size)
            if len(page) < _META_TAIL_AT + _META_TAIL.size:
                raise no_store(os.path.dirname(data), f"data.mdb is {size} bytes, shorter than its two meta pages (cut short?)")
            _, _, _, _, magic, version, _, _, _ = _META.unpack_from(page)
            if magic != _LMDB_MAGIC or version != _LMDB_VERSION:
                raise no_store(os.path.dirname(data), f"data.mdb meta page {pg} is damaged (magic {magic:#x}, version {version})")
            last = max(last, _META_TAIL.unpack_from(page, _META_TAIL_AT)[0])
    if size < (last + 1) * psize:
        raise no_store(
            os.path.dirname(data),
            f"data.mdb is {size} bytes but its meta pages need {(last + 1) * psize}: it was cut short (a partial copy or restore?); "
            f"delete the directory (it is only a cache) or restore it whole",
        )


def prepare_dir(path: str, *, create: bool) -> bool:
    """Check (or create) the store directory before LMDB touches it; returns whether it holds a store.

    Never changes the mode of a directory it did not create. Refuses a path that is not a
    directory, a directory owned by another user, and a non-empty directory without a store.
    Warns (StoreWarning) when others may read an existing store directory.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StoreError(f"cannot use {path} as a prefix store: it exists and is not a directory")
    if not os.path.exists(path):
        if not create:
            raise no_store(path, "the directory does not exist")
        try:
            os.makedirs(path, mode=0o700)
            os.chmod(path, 0o700)  # ours: the cache may hold prompt contents, private to the user
        except OSError as e:
            raise StoreError(f"cannot create the prefix store directory {path}: {e}") from None
        _check_space(path)
        return False
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise StoreError(f"cannot use {path} as a prefix store: it is owned by uid {st.st_uid}, not by this user ({os.geteuid()}); use a directory of your own")
    try:
        names = set(os.listdir(path))
    except OSError as e:
        raise StoreError(f"cannot read the prefix store directory {path}: {e}") from None
    has_store = "data.mdb" in names
    if not has_store:
        if not create:
            raise no_store(path, "the directory holds no data.mdb")
        if names - {"lock.mdb"}:
            raise StoreError(
                f"{path} is not empty and holds no segcache store ({len(names)} entries, e.g. {sorted(names)[0]!r}); "
                f"refusing to mix a store into it. Choose an empty or new directory."
            )
    if st.st_mode & 0o077:
        warnings.warn(
            f"segcache store: {path} is accessible to other users (mode {stat.S_IMODE(st.st_mode):o}) and the store may "
            f"hold prompt contents; left as it is: run chmod 700 {path} if that is not intended",
            StoreWarning,
            stacklevel=4,
        )
    if has_store:
        data = os.path.join(path, "data.mdb")
        if not create and os.path.getsize(data) == 0:  # LMDB would initialize it: that is creating a store
            raise no_store(path, "data.mdb is empty")
        check_lmdb_file(data)
    _check_space(path)
    return has_store


def _check_space(path: str) -> None:
    try:
        st = os.statvfs(path)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < _MIN_FREE:
        raise no_store(path, f"the file system is full ({st.f_bavail * st.f_frsize} bytes free; LMDB needs {_MIN_FREE}); free space or choose another directory")


@contextlib.contextmanager
def sole_user(path: str):
    """Yields whether this process could take LMDB's exclusive lock (no other process has the
    store open); holds it until the block ends."""
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
