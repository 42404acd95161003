"""Encode and decode one record: a checksummed msgpack header and a zstd payload.

Layout of one value (all integers little-endian; see docs/format.md)::

    +-------+---------+-------+------------+------------+----------+-----+----------+
    | magic | version | flags | header_len | header_crc |  header  | seg0 | seg1 ... |
    |  4 B  |  u16    |  u16  |    u32     |    u32     | msgpack  |      |          |
    +-------+---------+-------+------------+------------+----------+-----+----------+
    '------------- preamble, 16 bytes ---------------'

``header_crc`` is CRC-32 over the first 12 preamble bytes and the header; the
header lists, per array, the CRC-32 of its stored segment, so one flipped bit
anywhere in the value is caught. The header names the key the value was written
under, so a valid value under another key (a bad restore, a misplaced write) is
a corrupt record, never served. Decoding checks the key, sizes, the caller's
expected layout and the checksums before it decompresses or allocates anything,
and every declared size is bounded by the value's real length.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import msgpack
import numpy as np
import zstandard

from ..errors import StoreError
from ..spec import Spec, conforms, describe
from .policy import safe_cost
from .record import Record

FORMAT_VERSION = 2  # 2: the header names its key and parent
MAGIC = b"SGCR"
_PREAMBLE = struct.Struct("<4sHHII")  # magic, version, flags, header_len, header_crc
PREAMBLE_SIZE = _PREAMBLE.size  # 16

ZSTD_LEVEL = 1  # level 1: ~1.4 GB/s compress, ~3-5 GB/s decompress on shuffled KV
MIN_SAVING = 0.05  # store raw unless zstd saves at least 5% of the bytes
_PROBE_BYTES = 256 << 10  # arrays larger than 4 probes are tried on a prefix first
_PARALLEL_BYTES = 4 << 20  # below this, one thread decodes faster than a pool
_MAX_HEADER = 16 << 20
_MAX_DIMS = 16
_MAX_DIM = (1 << 31) - 1  # MLX shapes are int32
_ZSTD_BLOCK = 128 << 10  # a zstd block holds <= 128 KiB and takes >= 4 bytes (RLE: 3-byte header + 1)
_STREAM_CHUNK = 1 << 20  # `check_value` decompresses in pieces this large, never the whole array

CODEC_NONE = "none"  # raw bytes of the array, C order
CODEC_ZSTD = "zstd"  # one zstd frame of the raw bytes
CODEC_ZSTD_SHUFFLE = "zstd+shuffle"  # bytes grouped by position in the element, then zstd
CODECS = (CODEC_NONE, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE)

# name -> (mlx dtype, numpy storage dtype). bfloat16 and float64 travel as uint bits
# of the same width (numpy has no bfloat16; mx.array(float64 ndarray) would narrow).
DTYPES: dict[str, tuple[Any, np.dtype]] = {
    "bool": (mx.bool_, np.dtype(np.bool_)),
    "uint8": (mx.uint8, np.dtype("<u1")),
    "uint16": (mx.uint16, np.dtype("<u2")),
    "uint32": (mx.uint32, np.dtype("<u4")),
    "uint64": (mx.uint64, np.dtype("<u8")),
    "int8": (mx.int8, np.dtype("<i1")),
    "int16": (mx.int16, np.dtype("<i2")),
    "int32": (mx.int32, np.dtype("<i4")),
    "int64": (mx.int64, np.dtype("<i8")),
    "float16": (mx.float16, np.dtype("<f2")),
    "bfloat16": (mx.bfloat16, np.dtype("<u2")),
    "float32": (mx.float32, np.dtype("<f4")),
    "float64": (mx.float64, np.dtype("<u8")),
}
_NAME_OF = {mx_dtype: name for name, (mx_dtype, _) in DTYPES.items()}
_CARRIER = {"bfloat16": mx.uint16, "float64": mx.uint64}

Expect = Spec  # array name -> (dtype name as in DTYPES, shape of int | range): segcache.spec


class CorruptRecordError(StoreError):
    """A stored value failed validation; the store drops it and treats it as a miss."""


_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread
_pool: ThreadPoolExecutor | None = None


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _map(fn, items: list, total_bytes: int) -> list:
    """Run fn over items, on two threads when the work is large (zstd, crc, numpy drop the GIL)."""
    global _pool
    if len(items) < 2 or total_bytes < _PARALLEL_BYTES or (os.cpu_count() or 1) < 2:
        return [fn(x) for x in items]
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="segcache-codec")
    return list(_pool.map(fn, items))


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Group byte k of every element together (k = 0..itemsize-1); returns a new uint8 array."""
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(data: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of `shuffle`; column writes run ~3x faster than a transpose copy."""
    planes = data.reshape(itemsize, -1)
    out = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for k in range(itemsize):
        out[:, k] = planes[k]
    return out.reshape(-1)


def _storage(a: mx.array) -> tuple[str, np.ndarray]:
    """Return (dtype name, C-contiguous numpy array of the storage dtype) for an evaluated array."""
    name = _NAME_OF.get(a.dtype)
    if name is None:
        raise StoreError(f"cannot store an array of dtype {a.dtype}; supported: {', '.join(DTYPES)}. Cast it first.")
    if name in _CARRIER:
        a = a.view(_CARRIER[name])
    return name, np.ascontiguousarray(np.asarray(a))


def _compress(job: tuple[np.ndarray, int, bool]) -> tuple[str, bytes | np.ndarray, int]:
    raw, itemsize, allow = job  # raw: flat uint8
    n = raw.nbytes
    if not allow or n < 64:
        return CODEC_NONE, raw, zlib.crc32(raw)
    codec = CODEC_ZSTD_SHUFFLE if itemsize > 1 else CODEC_ZSTD
    if n > 4 * _PROBE_BYTES:  # a prefix predicts the ratio; skip hopeless work on big arrays
        probe = raw[: _PROBE_BYTES - _PROBE_BYTES % itemsize]
        p = shuffle(probe, itemsize) if itemsize > 1 else probe
        if len(_cctx().compress(p)) > probe.nbytes * (1 - MIN_SAVING):
            return CODEC_NONE, raw, zlib.crc32(raw)
    src = shuffle(raw, itemsize) if itemsize > 1 else raw
    out = _cctx().compress(src)
    if len(out) > n * (1 - MIN_SAVING):
        return CODEC_NONE, raw, zlib.crc32(raw)
    return codec, out, zlib.crc32(out)


def encode(record: Record, *, key: bytes, compress: bool = True) -> bytes:
    """Serialize a record to one self-checking value that names the key it is stored under.

    Args:
        record: The record; its arrays are evaluated here.
        key: The store key; `decode` under any other key is a corrupt record.
        compress: Try zstd per array (kept only where it saves >= MIN_SAVING).

    Returns:
        The value bytes.

    Raises:
        StoreError: An array has an unsupported dtype, or meta is not msgpack-able.
    """
    names = list(record.arrays)
    arrays = [record.arrays[k] for k in names]
    mx.eval(arrays)
    specs, jobs = [], []
    for name, a in zip(names, arrays):
        dname, host = _storage(a)
        flat = host.reshape(-1).view(np.uint8)
        specs.append((name, dname, list(a.shape)))
        jobs.append((flat, host.dtype.itemsize, compress))
    results = _map(_compress, jobs, sum(j[0].nbytes for j in jobs))
    entries, segments = [], []
    for (name, dname, shape), (flat, _, _), (codec, seg, crc) in zip(specs, jobs, results):
        stored = seg.nbytes if isinstance(seg, np.ndarray) else len(seg)
        entries.append([name, dname, shape, codec, flat.nbytes, stored, crc])
        segments.append(seg)
    header = {
        "v": FORMAT_VERSION,
        "key": bytes(key),
        "parent": None if record.parent is None else bytes(record.parent),
        "kind": record.kind,
        "tokens": int(record.tokens),
        "cost": safe_cost(record.cost),  # a caller may have changed it since put: never write NaN/inf
        "meta": record.meta,
        "arrays": entries,
    }
    try:
        hb = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise StoreError(f"record meta is not msgpack-able ({e}); use plain str/int/float/bool/None/bytes/list/dict") from e
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(hb), 0)[:12]
    crc = zlib.crc32(hb, zlib.crc32(head))
    return b"".join([head, struct.pack("<I", crc), hb, *segments])


def _bad(msg: str) -> CorruptRecordError:
    return CorruptRecordError(f"corrupt record: {msg}; it will be dropped and recomputed")


def read_header(buf, *, key: bytes | None = None, expect: Expect | None = None) -> tuple[dict, int]:
    """Validate preamble, header checksum, sizes, key and layout; return (header, payload offset).

    Nothing is decompressed or allocated here beyond the header itself.

    Args:
        buf: The value (any buffer).
        key: The key it was read under; the header must name it. None skips the check
            (only for tools that list raw values).
        expect: Array name -> (dtype name, shape). Every array of the header must be
            listed with exactly that dtype and shape (listed arrays may be absent).

    Raises:
        CorruptRecordError: Anything about the value is inconsistent.
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < PREAMBLE_SIZE:
        raise _bad(f"{len(mv)} bytes, shorter than the {PREAMBLE_SIZE}-byte preamble")
    magic, version, flags, hlen, hcrc = _PREAMBLE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise _bad(f"magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise _bad(f"record format version {version}, this segcache reads {FORMAT_VERSION}")
    if flags != 0 or hlen > _MAX_HEADER or PREAMBLE_SIZE + hlen > len(mv):
        raise _bad(f"header length {hlen} (flags {flags}) does not fit a {len(mv)}-byte value")
    hb = mv[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen]
    if zlib.crc32(hb, zlib.crc32(mv[:12])) != hcrc:
        raise _bad("header checksum mismatch")
    try:
        h = msgpack.unpackb(hb, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise _bad(f"header is not msgpack ({e.__class__.__name__})") from None
    _check_header(h)
    if key is not None and h["key"] != key:
        raise _bad(f"value was written under key {h['key'].hex()[:16]}, read under {bytes(key).hex()[:16]}")
    payload = sum(e[5] for e in h["arrays"])
    if PREAMBLE_SIZE + hlen + payload != len(mv):
        raise _bad(f"value is {len(mv)} bytes, header declares {PREAMBLE_SIZE + hlen + payload}")
    if expect is not None:
        _check_expect(h, expect)
    return h, PREAMBLE_SIZE + hlen


def _check_expect(h: dict, expect: Expect) -> None:
    for name, dname, shape, *_ in h["arrays"]:
        want = expect.get(name)
        if want is None:
            raise _bad(f"array {name!r} is not part of the caller's layout")
        if not conforms(dname, shape, want):
            raise _bad(f"array {name!r} is {dname}{list(shape)}, the layout needs {describe(want)}")


def _check_header(h: Any) -> None:
    if not isinstance(h, dict) or h.get("v") != FORMAT_VERSION:
        raise _bad(f"header is not a version-{FORMAT_VERSION} map")
    if not isinstance(h.get("key"), bytes) or not (h.get("parent") is None or isinstance(h["parent"], bytes)):
        raise _bad("key/parent missing or of the wrong type")
    if not isinstance(h.get("kind"), str) or not isinstance(h.get("tokens"), int) or h["tokens"] < 0:
        raise _bad("kind/tokens missing or of the wrong type")
    cost = h.get("cost")
    if not isinstance(cost, float) or not math.isfinite(cost) or cost < 0 or not isinstance(h.get("meta"), dict):
        raise _bad(f"cost {cost!r} (finite seconds >= 0) or meta missing or of the wrong type")
    arrays = h.get("arrays")
    if not isinstance(arrays, list):
        raise _bad("arrays is not a list")
    seen = set()
    for e in arrays:
        if not (isinstance(e, list) and len(e) == 7):
            raise _bad("array entry is not a 7-item list")
        name, dname, shape, codec, raw, stored, crc = e
        if not isinstance(name, str) or name in seen:
            raise _bad(f"array name {name!r} invalid or repeated")
        seen.add(name)
        if dname not in DTYPES:
            raise _bad(f"unknown dtype {dname!r}")
        if codec not in CODECS:
            raise _bad(f"unknown codec {codec!r}")
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(isinstance(d, int) and 0 <= d <= _MAX_DIM for d in shape)):
            raise _bad(f"shape {shape!r} invalid")
        itemsize = DTYPES[dname][1].itemsize
        if not all(isinstance(x, int) and x >= 0 for x in (raw, stored, crc)) or crc > 0xFFFFFFFF:
            raise _bad("sizes/crc are not non-negative integers")
        if math.prod(shape) * itemsize != raw:
            raise _bad(f"shape {shape} of {dname} is {math.prod(shape) * itemsize} bytes, header says {raw}")
        if codec == CODEC_NONE and stored != raw:
            raise _bad(f"raw segment stored as {stored} bytes, expected {raw}")
        if codec != CODEC_NONE and (stored == 0 or stored > raw or raw > (stored // 4 + 1) * _ZSTD_BLOCK):
            raise _bad(f"compressed segment of {stored} bytes cannot hold {raw} raw bytes")


def _segments(h: dict, mv: memoryview, off: int) -> list[tuple[memoryview, list]]:
    out = []
    for e in h["arrays"]:
        out.append((mv[off : off + e[5]], e))
        off += e[5]
    return out


def _to_mlx(data, entry) -> mx.array:
    """The one copy: a raw segment (a view into the value, e.g. the LMDB map) into a fresh MLX array."""
    _, dname, shape, *_ = entry
    mx_dtype, np_dtype = DTYPES[dname]
    a = mx.array(np.frombuffer(data, dtype=np.uint8).view(np_dtype).reshape(shape))
    return a.view(mx_dtype) if dname in _CARRIER else a


def _inflate(job) -> np.ndarray | CorruptRecordError:
    """Check a compressed segment's CRC, decompress it (at most its bounded raw size) and unshuffle."""
    seg, entry = job
    _, dname, _, codec, raw, _, crc = entry
    if zlib.crc32(seg) != crc:
        return _bad(f"payload checksum mismatch in array {entry[0]!r}")
    if zstandard.frame_content_size(seg) != raw:  # bound the allocation before decompressing
        return _bad(f"zstd frame of array {entry[0]!r} does not declare {raw} bytes")
    try:
        out = _dctx().decompress(seg, max_output_size=raw)
    except zstandard.ZstdError as e:
        return _bad(f"zstd: {e}")
    if len(out) != raw:
        return _bad(f"array {entry[0]!r} decompressed to {len(out)} bytes, expected {raw}")
    data = np.frombuffer(out, dtype=np.uint8)
    itemsize = DTYPES[dname][1].itemsize
    return unshuffle(data, itemsize) if codec == CODEC_ZSTD_SHUFFLE and itemsize > 1 else data


def _crc(seg) -> int:
    return zlib.crc32(seg)


class _Now:
    """A finished result with the interface of a Future (the small-work path runs inline)."""

    def __init__(self, fn, arg):
        self._v = fn(arg)

    def result(self):
        return self._v


def decode_many(items: list[tuple[Any, bytes, Expect | None]]) -> list[Record | CorruptRecordError]:
    """Validate and decode several values at once.

    Every header is checked (key, layout, sizes) before any array is allocated. Raw
    segments are copied once, straight from the value into MLX, on this thread while
    a pool checks their CRC-32s (zlib drops the GIL) and inflates compressed ones.
    The returned arrays never alias the values, so these may be LMDB buffers that die
    when their transaction ends.

    Args:
        items: (value buffer, key it was read under, expected layout or None) per record.

    Returns:
        Per item, the Record or the CorruptRecordError that rejected it.
    """
    out: list[Any] = []
    parsed = []
    for buf, key, expect in items:
        try:
            h, off = read_header(buf, key=key, expect=expect)
        except CorruptRecordError as e:
            out.append(e)
            continue
        parsed.append((len(out), h, _segments(h, memoryview(buf).cast("B"), off)))
        out.append(None)
    total = sum(e[5] for _, _, segs in parsed for _, e in segs)
    global _pool
    parallel = total >= _PARALLEL_BYTES and (os.cpu_count() or 1) >= 2
    if parallel and _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="segcache-codec")
    submit = _pool.submit if parallel else _Now
    checks = []  # (record index, array name, future, what it must equal or None)
    for i, _, segs in parsed:
        for seg, e in segs:
            if e[3] == CODEC_NONE:
                checks.append((i, e, submit(_crc, seg), e[6]))
            else:
                checks.append((i, e, submit(_inflate, (seg, e)), None))
    arrays: dict[int, dict[str, mx.array]] = {i: {} for i, _, _ in parsed}
    segs_of = {(i, e[0]): seg for i, _, segs in parsed for seg, e in segs}
    for i, e, _, want in checks:  # the copies, overlapping the pool's checksums
        if want is not None:
            arrays[i][e[0]] = _to_mlx(segs_of[(i, e[0])], e)
    for i, e, fut, want in checks:
        r = fut.result()
        if want is not None:
            if r != want and not isinstance(out[i], CorruptRecordError):
                out[i] = _bad(f"payload checksum mismatch in array {e[0]!r}")
        elif isinstance(r, CorruptRecordError):
            out[i] = out[i] if isinstance(out[i], CorruptRecordError) else r
        else:
            arrays[i][e[0]] = _to_mlx(r, e)
    for i, h, _ in parsed:
        if out[i] is None:
            order = [e[0] for e in h["arrays"]]
            out[i] = Record(kind=h["kind"], tokens=h["tokens"], arrays={n: arrays[i][n] for n in order},
                            meta=h["meta"], cost=h["cost"], parent=h["parent"])
    return out


def fits(record: Record, expect: Expect | None) -> bool:
    """Whether every array of a decoded record is listed in `expect` with exactly its dtype and shape."""
    if expect is None:
        return True
    for name, a in record.arrays.items():
        want = expect.get(name)
        if want is None or not conforms(_NAME_OF.get(a.dtype, ""), a.shape, want):
            return False
    return True


def decode(buf, *, key: bytes, expect: Expect | None = None) -> Record:
    """Validate and decode one value into a Record with fresh `mx.array`s.

    Args:
        buf: The value; may be an LMDB buffer (nothing returned aliases it).
        key: The key it was read under; a value written under another key is corrupt.
        expect: Optional layout every array must match (see `read_header`).

    Raises:
        CorruptRecordError: Anything about the value is inconsistent.
    """
    r = decode_many([(buf, key, expect)])[0]
    if isinstance(r, CorruptRecordError):
        raise r
    return r


def check_value(buf, *, key: bytes | None) -> dict:
    """Validate a value completely without materializing it; returns its header.

    Checks everything `decode` checks, decompressing zstd segments in bounded
    pieces, so a value that declares gigabytes costs at most `_STREAM_CHUNK` of
    memory. `verify` uses this to clean damaged stores.
    """
    h, off = read_header(buf, key=key)
    for seg, e in _segments(h, memoryview(buf).cast("B"), off):
        if zlib.crc32(seg) != e[6]:
            raise _bad(f"payload checksum mismatch in array {e[0]!r}")
        if e[3] == CODEC_NONE:
            continue
        if zstandard.frame_content_size(seg) != e[4]:
            raise _bad(f"zstd frame of array {e[0]!r} does not declare {e[4]} bytes")
        n = 0
        try:
            with _dctx().stream_reader(seg) as reader:
                while n <= e[4]:
                    piece = reader.read(_STREAM_CHUNK)  # bounded output, whatever the ratio
                    if not piece:
                        break
                    n += len(piece)
        except zstandard.ZstdError as err:
            raise _bad(f"zstd: {err}") from None
        if n != e[4]:
            raise _bad(f"array {e[0]!r} decompresses to {n} bytes or more, expected {e[4]}")
    return h


def peek(buf, *, key: bytes | None = None) -> dict:
    """Validated header only (key, parent, kind, tokens, cost, meta, arrays); payload not checked."""
    return read_header(buf, key=key)[0]
