"""Codecs: registry, lossless bit-exactness, the quantisation error bound, corrupt payloads."""
import random

import pytest
import torch

from tierkv.config import CodecConfig
from tierkv.storage.base import CorruptRecordError, KVBlock
from tierkv.storage.codec import (CODECS, codec_by_id, codec_name_by_id, decode_block, encode_block,
                                  make_codec)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
LOSSY = {"int8": 8, "int4": 4}
SHAPES = [(2, 3, 100, 64), (1, 2, 16, 64), (1, 1, 1, 32), (3, 65, 8), (5, 24), (64,)]


def random_bits(dtype, shape, seed=0) -> torch.Tensor:
    """Every bit pattern, NaN payloads and infinities included."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64)
    return ints.to(BITS[dtype]).view(dtype)


def lossy(name: str, group_size: int = 64):
    return make_codec(name, CodecConfig(codec=name, allow_lossy=True, group_size=group_size))


def bound(x: torch.Tensor, role: str, bits: int, group_size: int) -> torch.Tensor:
    """The stated bound per element: scale/2 + eps*max(|lo|,|hi|) (+ the dtype's tiny)."""
    xd = x.double()
    if role == "v":
        xd = xd.reshape(-1, x.shape[-1], 1)
    else:
        xd = xd.reshape(-1, x.shape[-2] if x.dim() > 1 else 1, x.shape[-1])
    group = max(1, min(group_size, xd.shape[1]))
    out = torch.empty_like(xd)
    info = torch.finfo(x.dtype)
    for s in range(0, xd.shape[1], group):
        seg = xd[:, s:s + group]
        lo, hi = seg.amin(1, keepdim=True), seg.amax(1, keepdim=True)
        mag = torch.maximum(lo.abs(), hi.abs())
        limit = (hi - lo) / (2 * (2**bits - 1)) * (1 + 1e-6) + info.eps * mag + info.tiny
        out[:, s:s + group] = limit.expand_as(seg)
    return out.reshape(x.shape)


def check_bound(x, y, role, bits, group_size):
    assert y.dtype == x.dtype and y.shape == x.shape
    err = (x.double() - y.double()).abs()
    assert bool((err <= bound(x, role, bits, group_size)).all()), float(err.max())


def test_registry_ids_and_flags():
    assert {n: c.id for n, c in CODECS.items()} == {"raw": 0, "zstd": 1, "int8": 2, "int4": 3}
    for name, cls in CODECS.items():
        assert codec_by_id(cls.id).name == name == make_codec(name).name
        assert make_codec(name).lossy == (name in LOSSY)


@pytest.mark.parametrize("call", [lambda: make_codec("lz4"), lambda: codec_by_id(7)])
def test_unknown_codec_is_named(call):
    with pytest.raises(ValueError, match="lz4|7"):
        call()


@pytest.mark.parametrize("name", list(CODECS))
def test_bad_inputs_raise_value_error(name):
    codec = make_codec(name)
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(torch.zeros(4, 8, dtype=torch.int32), "k")
    with pytest.raises(ValueError, match="role"):
        codec.encode(torch.zeros(4, 8), "q")
    with pytest.raises(ValueError, match="0-d"):
        codec.encode(torch.tensor(1.0), "k")
    with pytest.raises(ValueError, match="shape"):
        codec.decode(b"", torch.float16, (-1, 8), "k")
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(b"", torch.int8, (4, 8), "k")
    # a target decoded once is remembered as checked; other roles and shapes are still checked
    x = torch.randn(SHAPES[0])
    codec.decode(codec.encode(x, "k"), x.dtype, tuple(x.shape), "k")
    with pytest.raises(ValueError, match="role"):
        codec.decode(b"", x.dtype, tuple(x.shape), "q")
    with pytest.raises(ValueError, match="shape"):
        codec.decode(b"", x.dtype, ([4], 8), "k")


def test_codec_name_by_id():
    assert [codec_name_by_id(c.id) for c in CODECS.values()] == list(CODECS)
    with pytest.raises(ValueError, match="7"):
        codec_name_by_id(7)


@pytest.mark.parametrize("name", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("shape", SHAPES)
def test_lossless_round_trip_is_bit_exact(name, dtype, role, shape):
    codec = make_codec(name, CodecConfig(zstd_level=1))
    for x in (random_bits(dtype, shape), torch.randn(shape).to(dtype)):
        y = codec.decode(codec.encode(x, role), dtype, shape, role)
        assert y.dtype == dtype and torch.equal(y.view(BITS[dtype]), x.view(BITS[dtype]))


def test_non_contiguous_input_is_encoded_as_its_values():
    x = torch.randn(2, 64, 8).transpose(1, 2)
    codec = make_codec("zstd")
    assert torch.equal(codec.decode(codec.encode(x, "k"), x.dtype, x.shape, "k"), x)


@pytest.mark.parametrize("name", list(LOSSY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", [8, 64, 128])
def test_quantised_within_bound_on_random_data(name, dtype, role, shape, group_size):
    codec = lossy(name, group_size)
    x = (torch.randn(shape) * torch.rand(shape[-1]) * 10 + 3).to(dtype)
    y = codec.decode(codec.encode(x, role), dtype, shape, role)
    check_bound(x, y, role, LOSSY[name], group_size)


def adversarial(dtype):
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    yield torch.full((1, 2, 70, 16), 1.5)  # constant groups: exact
    yield torch.zeros(1, 1, 3, 8)
    huge = torch.randn(1, 2, 67, 16).sign() * big  # +-max: the range overflows the dtype
    yield huge
    yield torch.cat([huge, torch.randn(1, 2, 67, 16) * 1e-3], 2)
    yield torch.randn(1, 2, 65, 16) * tiny  # subnormal ranges
    yield torch.arange(16 * 129, dtype=torch.float32).reshape(1, 1, 129, 16) - 1000


@pytest.mark.parametrize("name", list(LOSSY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("role", ["k", "v"])
def test_quantised_within_bound_on_adversarial_data(name, dtype, role):
    codec = lossy(name)
    for x in adversarial(dtype):
        x = x.to(dtype)
        y = codec.decode(codec.encode(x, role), dtype, x.shape, role)
        assert torch.isfinite(y).all()
        check_bound(x, y, role, LOSSY[name], 64)


@pytest.mark.parametrize("name", list(LOSSY))
def test_constant_groups_are_exact(name):
    x = torch.full((1, 1, 100, 64), -2.25, dtype=torch.bfloat16)
    codec = lossy(name)
    for role in "kv":
        assert torch.equal(codec.decode(codec.encode(x, role), x.dtype, x.shape, role), x)


@pytest.mark.parametrize("name", list(LOSSY))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantised_refuses_non_finite_input(name, bad):
    x = torch.zeros(1, 1, 4, 8)
    x[0, 0, 1, 2] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        lossy(name).encode(x, "k")


@pytest.mark.parametrize("name", list(LOSSY))
def test_quantised_stores_fewer_bytes(name):
    x = torch.randn(2, 3, 64, 64, dtype=torch.float16)
    stored = len(lossy(name).encode(x, "k"))
    assert stored < x.nbytes * (0.6 if name == "int8" else 0.35)


@pytest.mark.parametrize("name", list(CODECS))
def test_wrong_length_raises_corrupt(name):
    codec = lossy(name) if name in LOSSY else make_codec(name)
    x = torch.randn(1, 2, 30, 16, dtype=torch.float16)
    data = codec.encode(x, "k")
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(CorruptRecordError):
            codec.decode(bad, x.dtype, x.shape, "k")
    with pytest.raises(CorruptRecordError):
        codec.decode(data, x.dtype, (1, 2, 31, 16), "k")


def test_zstd_frame_checksum_catches_flips():
    codec = make_codec("zstd")
    x = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    data = codec.encode(x, "v")
    rng = random.Random(1)
    for _ in range(200):
        bad = bytearray(data)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        try:
            y = codec.decode(bytes(bad), x.dtype, x.shape, "v")
        except CorruptRecordError:
            continue
        assert torch.equal(y, x)  # a flip in an unused frame bit is harmless


def block(dtype=torch.float16, tokens=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return KVBlock(torch.randn(2, 3, tokens, 16, generator=g).to(dtype),
                   torch.randn(2, 3, tokens, 16, generator=g).to(dtype))


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_round_trip(name, dtype):
    codec = lossy(name) if name in LOSSY else make_codec(name)
    b = block(dtype)
    out = decode_block(codec, encode_block(codec, b), dtype, b.keys.shape)
    for x, y, role in ((b.keys, out.keys, "k"), (b.values, out.values, "v")):
        if name in LOSSY:
            check_bound(x, y, role, LOSSY[name], 64)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", list(CODECS))
def test_corrupt_block_never_decodes(name):
    codec = lossy(name) if name in LOSSY else make_codec(name)
    b = block(tokens=24)
    payload = encode_block(codec, b)
    rng = random.Random(hash(name) % 1000)
    for trial in range(300):
        bad = bytearray(payload)
        if trial % 3 == 0:
            bad = bad[:rng.randrange(len(bad))]
        elif trial % 3 == 1:
            for _ in range(rng.randint(1, 4)):
                bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        else:
            bad += bytes(rng.randint(1, 9))
        with pytest.raises(CorruptRecordError):
            decode_block(codec, bytes(bad), b.keys.dtype, b.keys.shape)


def test_block_read_with_the_wrong_codec_raises():
    payload = encode_block(make_codec("raw"), block())
    with pytest.raises(CorruptRecordError, match="codec id 0"):
        decode_block(make_codec("zstd"), payload, torch.float16, (2, 3, 40, 16))
    with pytest.raises(ValueError, match="shape"):
        decode_block(make_codec("raw"), payload, torch.float16, (3, 40, 16))


def test_raw_decode_views_private_buffers_and_copies_the_rest():
    """A writable, aligned buffer (a disk read's own) is decoded without a copy; read-only or
    misaligned bytes are copied; every result equals the original."""
    import numpy as np

    codec = make_codec("raw", CodecConfig())
    t = torch.randn(2, 3, 8, 16)
    data = codec.encode(t, "k")
    buf = np.frombuffer(bytearray(len(data) + 1), np.uint8)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    shared = codec.decode(memoryview(buf[:len(data)]), t.dtype, tuple(t.shape), "k")
    assert torch.equal(shared, t) and shared.data_ptr() == buf.ctypes.data
    copied = codec.decode(data, t.dtype, tuple(t.shape), "k")  # bytes: read-only
    assert torch.equal(copied, t)
    odd = np.frombuffer(bytearray(len(data) + 1), np.uint8)[1:]   # misaligned for fp32
    odd[:] = np.frombuffer(data, np.uint8)
    moved = codec.decode(memoryview(odd), t.dtype, tuple(t.shape), "k")
    assert torch.equal(moved, t) and moved.data_ptr() != odd.ctypes.data
