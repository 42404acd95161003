import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import struct
import zlib

import mlx.core as mx
import msgpack
import numpy as np
import pytest

from segcache.store import Record
from segcache.store.codec import DTYPES, PREAMBLE_SIZE, CorruptRecordError, decode, encode, read_header

K = b"the-key"  # every value names the key it is stored under
SHAPES = [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 300)]


def bits(a: mx.array) -> np.ndarray:
    carrier = {mx.bfloat16: mx.uint16, mx.float64: mx.uint64}.get(a.dtype)
    return np.asarray(a.view(carrier) if carrier is not None else a)


def assert_same(a: mx.array, b: mx.array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bits(a).tobytes() == bits(b).tobytes()


def sample(dtype, shape, seed=0):
    mx.random.seed(seed)
    if dtype == mx.bool_:
        return mx.random.normal(shape) > 0
    x = mx.random.normal(shape) * 100
    return x.astype(dtype)


@pytest.mark.parametrize("compress", [True, False])
def test_every_dtype_and_shape_round_trips_bit_identical(compress):
    arrays = {f"{name}{shape}": sample(d, shape) for name, (d, _) in DTYPES.items() for shape in SHAPES}
    arrays["nan_inf"] = mx.array([float("nan"), float("inf"), -0.0, 1e-40], dtype=mx.float32)
    rec = Record("kv", 7, arrays, {"a": [1, "x", None], "b": b"\x00", "c": {"d": 1.5}}, cost=0.25)
    out = decode(encode(rec, key=K, compress=compress), key=K)
    assert (out.kind, out.tokens, out.meta, out.cost) == ("kv", 7, rec.meta, 0.25)
    assert list(out.arrays) == list(arrays)
    for k, a in arrays.items():
        assert_same(a, out.arrays[k])


def test_kv_like_bf16_is_compressed_with_shuffle_and_random_bytes_are_not():
    kv = (mx.random.normal((4, 512, 64)) * mx.exp(mx.random.normal((1, 1, 64)))).astype(mx.bfloat16)
    noise = mx.array(np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32))  # every byte uniform
    h, _ = read_header(encode(Record("kv", 1, {"kv": kv, "noise": noise}), key=K), key=K)
    codecs = {e[0]: e[3] for e in h["arrays"]}
    assert codecs == {"kv": "zstd+shuffle", "noise": "none"}


def test_non_contiguous_and_lazy_arrays_round_trip():
    base = mx.arange(60, dtype=mx.float32).reshape(6, 10)
    arrays = {"t": base.T, "s": base[::2, 1::3], "lazy": base * 2 + 1}
    out = decode(encode(Record("x", 0, arrays), key=K), key=K)
    for k, a in arrays.items():
        assert_same(a, out.arrays[k])


def _value():
    rec = Record("kv", 3, {"k": sample(mx.bfloat16, (2, 64, 16)), "v": sample(mx.float32, (2, 64, 16), 1)}, {"p": 1})
    return encode(rec, key=K)


@pytest.mark.parametrize("compress", [True, False])
def test_any_flipped_byte_is_detected(compress):
    rec = Record("kv", 3, {"k": sample(mx.bfloat16, (2, 32, 8)), "v": sample(mx.float32, (2, 16, 8), 1)}, {"p": 1})
    v = encode(rec, key=K, compress=compress)
    rng = np.random.default_rng(0)
    positions = list(range(0, 64)) + list(rng.integers(0, len(v), 200)) + [len(v) - 1]
    for pos in positions:
        for mask in (0x01, 0x80):
            bad = bytearray(v)
            bad[pos] ^= mask
            with pytest.raises(CorruptRecordError):
                decode(bytes(bad), key=K)


def test_truncation_and_extension_are_detected():
    v = _value()
    for n in (0, 1, 15, 16, 40, len(v) // 2, len(v) - 1):
        with pytest.raises(CorruptRecordError):
            decode(v[:n], key=K)
    with pytest.raises(CorruptRecordError):
        decode(v + b"\x00", key=K)


def _rewrite_header(v: bytes, edit, fix_crc: bool) -> bytes:
    magic, ver, flags, hlen, crc = struct.unpack_from("<4sHHII", v)
    h = msgpack.unpackb(v[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen], raw=False)
    edit(h)
    hb = msgpack.packb(h, use_bin_type=True)
    head = struct.pack("<4sHHI", magic, ver, flags, len(hb))
    if fix_crc:
        crc = zlib.crc32(hb, zlib.crc32(head))
    return head + struct.pack("<I", crc) + hb + v[PREAMBLE_SIZE + hlen :]


EDITS = {
    "shape": lambda h: h["arrays"][0].__setitem__(2, [2, 16, 64]),  # same size, other shape
    "shape_size": lambda h: h["arrays"][0].__setitem__(2, [2, 64, 17]),
    "dtype": lambda h: h["arrays"][0].__setitem__(1, "float16"),  # same width
    "dtype_unknown": lambda h: h["arrays"][0].__setitem__(1, "float8"),
    "codec": lambda h: h["arrays"][1].__setitem__(3, "lz4"),
    "raw_size": lambda h: h["arrays"][1].__setitem__(4, 10**12),
    "stored_size": lambda h: h["arrays"][1].__setitem__(5, 3),
    "version": lambda h: h.__setitem__("v", 1),
    "tokens": lambda h: h.__setitem__("tokens", 4),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_rewritten_header_is_detected(name):
    v = _value()
    with pytest.raises(CorruptRecordError):
        decode(_rewrite_header(v, EDITS[name], fix_crc=False), key=K)
    if name in ("shape", "dtype", "tokens"):
        return  # consistent rewrites with a recomputed checksum are not corruption, they are a forgery
    with pytest.raises(CorruptRecordError):
        decode(_rewrite_header(v, EDITS[name], fix_crc=True), key=K)


def test_garbage_values_are_rejected():
    rng = np.random.default_rng(1)
    for n in (0, 5, 16, 100, 5000):
        with pytest.raises(CorruptRecordError):
            decode(b"SGCR" + rng.bytes(n), key=K)


def test_unsupported_dtype_and_meta_raise_typed_errors():
    with pytest.raises(segcache.errors.StoreError):
        encode(Record("x", 0, {"c": mx.array([1 + 2j])}), key=K)
    with pytest.raises(segcache.errors.StoreError):
        encode(Record("x", 0, {}, {"f": object()}), key=K)
