"""Native helpers against their fallbacks: identical results, identical errors."""
import os

import numpy as np
import pytest

from tierkv.storage import native

IMPLS = ["py", "native"]


def impl(kind: str, name: str):
    if kind == "native":
        if not native.HAVE_NATIVE:
            pytest.skip("tierkv._native is not built")
        from tierkv import _native
        return getattr(_native, name)
    return getattr(native, f"{name}_py")


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("kind", IMPLS)
@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("items", [0, 1, 7, 2048, 100_003])
def test_shuffle_matches_reference_and_inverts(kind, itemsize, items):
    shuffle, unshuffle = impl(kind, "shuffle"), impl(kind, "unshuffle")
    src = random_bytes(items * itemsize, items + itemsize)
    expected = np.frombuffer(src, np.uint8).reshape(-1, itemsize).T.tobytes()
    assert shuffle(src, itemsize) == expected
    assert unshuffle(expected, itemsize) == src
    out = np.zeros(len(src), np.uint8)
    assert shuffle(src, itemsize, out) is out and out.tobytes() == expected
    back = bytearray(len(src))
    unshuffle(memoryview(expected), itemsize, back)
    assert bytes(back) == src


@pytest.mark.parametrize("kind", IMPLS)
@pytest.mark.parametrize("name", ["shuffle", "unshuffle"])
def test_shuffle_rejects_bad_arguments(kind, name):
    fn = impl(kind, name)
    with pytest.raises(ValueError, match="itemsize"):
        fn(b"abcd", 0)
    with pytest.raises(ValueError):
        fn(b"abcde", 2)
    with pytest.raises(ValueError, match="out"):
        fn(b"abcd", 2, bytearray(3))
    with pytest.raises(ValueError, match="writable"):
        fn(b"abcd", 2, b"wxyz")


@pytest.fixture
def data_file(tmp_path):
    data = random_bytes(1 << 20, 5)
    path = tmp_path / "segment"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("kind", IMPLS)
def test_pread_extents_gathers_back_to_back(kind, data_file):
    fd, data = data_file
    pread = impl(kind, "pread_extents")
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(0, 20_000, 50)]
    offsets = [int(rng.integers(0, len(data) - n)) for n in lengths]
    out = np.zeros(sum(lengths) + 11, np.uint8)
    assert pread(fd, offsets, lengths, out) == sum(lengths)
    expected = b"".join(data[o:o + n] for o, n in zip(offsets, lengths))
    assert out[:sum(lengths)].tobytes() == expected
    assert not out[sum(lengths):].any()


@pytest.mark.parametrize("kind", IMPLS)
def test_pread_extents_errors(kind, data_file):
    fd, data = data_file
    pread = impl(kind, "pread_extents")
    with pytest.raises(OSError, match="end of file"):
        pread(fd, [0, len(data) - 5], [4, 6], bytearray(10))
    with pytest.raises(ValueError, match=">= 0"):
        pread(fd, [-1], [4], bytearray(10))
    with pytest.raises(ValueError, match="lengths"):
        pread(fd, [0, 1], [4], bytearray(10))
    with pytest.raises(ValueError, match="out holds"):
        pread(fd, [0], [11], bytearray(10))
    with pytest.raises(ValueError, match="writable"):
        pread(fd, [0], [4], bytes(10))
    with pytest.raises(OSError):
        pread(12345, [0], [4], bytearray(10))


def test_public_names_pick_native_when_built():
    if native.HAVE_NATIVE:
        from tierkv import _native
        assert native.shuffle is _native.shuffle and native.pread_extents is _native.pread_extents
    else:
        assert native.shuffle is native.shuffle_py


def test_crc32_gives_zlibs_values():
    """Records are checked with ``native.crc32`` (zlib-ng's when installed) and were written with
    zlib's in earlier versions: the values must be the same, chained from any start."""
    import zlib
    data = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8)
    for part in (b"", data[:1], data[:4095], data, memoryview(data)[7:]):
        assert native.crc32(part) == zlib.crc32(part)
        assert native.crc32(part, 0xDEADBEEF) == zlib.crc32(part, 0xDEADBEEF)
