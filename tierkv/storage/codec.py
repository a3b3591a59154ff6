"""Codecs of KV tensors: ``encode(tensor, role) -> bytes`` / ``decode(bytes, ...) -> tensor`` pairs.

Registered by name and by a fixed numeric id (stored in disk records): raw=0, zstd=1, int8=2,
int4=3. ``raw`` and ``zstd`` are lossless (bit-exact, NaN payloads included); ``int8`` and ``int4``
are lossy (``lossy = True``): group-wise asymmetric quantisation, keys per channel (groups run along
the token axis, KIVI), values per token (groups run along head_dim).

Error bound of the quantised codecs, per element of a group with minimum ``lo`` and maximum ``hi``:
``|x - x_hat| <= scale / 2 + eps * max(|lo|, |hi|)`` with ``scale = (hi - lo) / (2**bits - 1)`` and
``eps`` the machine epsilon of the tensor's dtype (the final rounding to that dtype).
Group minima and scales are stored as fp32, so the bound holds for every finite input.

``encode_block`` / ``decode_block`` frame the K and V of one record for the disk tier; any
malformed payload raises ``CorruptRecordError``.
"""
from __future__ import annotations

import functools
import struct
import threading
from math import prod

import numpy as np
import torch
import zstandard

from tierkv.config import CodecConfig
from tierkv.storage import native
from tierkv.storage.base import CorruptRecordError, KVBlock

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROLES = ("k", "v")

_BLOCK_HEAD = struct.Struct("<BQ")  # codec id, length of the K bytes
_BLOCK_CRC = struct.Struct("<I")  # crc32 of the head, then the K bytes, then the V bytes
BLOCK_HEADER_SIZE = _BLOCK_HEAD.size + _BLOCK_CRC.size  # before a block's tensor bytes
_GROUP_HEADER = struct.Struct("<I")  # group size the quantised payload was encoded with


def _check_tensor(codec: str, t: torch.Tensor, role: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{codec} codec: expected a tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{codec} codec: dtype {t.dtype} must be float16, bfloat16 or float32")
    if t.device.type != "cpu":
        raise ValueError(f"{codec} codec: tensor is on {t.device}, expected a CPU tensor")
    if t.dim() == 0:
        raise ValueError(f"{codec} codec: a 0-d tensor has no head_dim axis")
    _check_role(codec, role)
    return t.contiguous()


def _check_role(codec: str, role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"{codec} codec: role={role!r} must be 'k' or 'v'")


# (codec, dtype, shape, role) already checked: a fetch decodes thousands of records of a few shapes
_CHECKED_TARGETS: set = set()
_CHECKED_MAX = 4096


def _check_target(codec: str, dtype, shape, role: str) -> tuple[int, ...]:
    if type(shape) is tuple:
        try:
            if (codec, dtype, shape, role) in _CHECKED_TARGETS:
                return shape
        except TypeError:  # an unhashable part: the checks below name it
            pass
    if dtype not in DTYPES:
        raise ValueError(f"{codec} codec: dtype {dtype} must be float16, bfloat16 or float32")
    shape = tuple(shape)
    if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"{codec} codec: shape {shape} must be a non-empty tuple of ints >= 0")
    _check_role(codec, role)
    if len(_CHECKED_TARGETS) >= _CHECKED_MAX:
        _CHECKED_TARGETS.clear()
    _CHECKED_TARGETS.add((codec, dtype, shape, role))
    return shape


def _as_bytes_view(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor's memory (no copy, any dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


@functools.lru_cache(maxsize=None)
def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(dtype, shape) -> int:
    return prod(shape) * _itemsize(dtype)


class Codec:
    """A named, numbered encode/decode pair.

    ``encode(t, role)`` : t Tensor, shape (..., tokens, head_dim), fp16/bf16/fp32 on CPU;
    role "k" or "v". Returns bytes.
    ``decode(data, dtype, shape, role)`` returns a Tensor of that dtype and shape, or raises
    CorruptRecordError when ``data`` cannot be what ``encode`` wrote for them. The tensor may
    share the memory of a writable, suitably aligned ``data`` (``raw``): callers hand it buffers
    nobody else writes to.
    """

    name = "codec"
    id = -1
    lossy = False

    def __init__(self, config: CodecConfig):
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RawCodec(Codec):
    """The tensor's bytes as they are (bf16 included, no float conversion)."""

    name, id = "raw", 0

    def encode(self, t: torch.Tensor, role: str) -> bytes:
        return _as_bytes_view(_check_tensor(self.name, t, role)).tobytes()

    def decode(self, data, dtype, shape, role: str) -> torch.Tensor:
        shape = _check_target(self.name, dtype, shape, role)
        src = np.frombuffer(data, np.uint8)
        if src.size != _nbytes(dtype, shape):
            raise CorruptRecordError(f"raw codec: {src.size} bytes for {dtype} {shape}, "
                                     f"expected {_nbytes(dtype, shape)}")
        if src.flags.writeable and src.ctypes.data % _itemsize(dtype) == 0:
            # A private read buffer (the disk tier reads every batch into a fresh one): the
            # tensor is a view of it, no copy. Read-only bytes are copied.
            return torch.from_numpy(src).view(dtype).view(shape)
        out = torch.empty(shape, dtype=dtype)
        _as_bytes_view(out)[:] = src
        return out


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True,
                                                write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


class ZstdCodec(Codec):
    """Byte-shuffled floats (all first bytes, then all second bytes...) in one zstd frame.

    The frame carries its content size and a checksum; decode verifies both.
    """

    name, id = "zstd", 1

    def encode(self, t: torch.Tensor, role: str) -> bytes:
        t = _check_tensor(self.name, t, role)
        shuffled = native.shuffle(_as_bytes_view(t), t.element_size())
        return _compressor(self.config.zstd_level).compress(shuffled)

    def decode(self, data, dtype, shape, role: str) -> torch.Tensor:
        shape = _check_target(self.name, dtype, shape, role)
        expected = _nbytes(dtype, shape)
        try:
            size = zstandard.frame_content_size(data)
            if size != expected:
                raise CorruptRecordError(f"zstd codec: frame holds {size} bytes, expected "
                                         f"{expected} for {dtype} {shape}")
            raw = _decompressor().decompress(data, max_output_size=expected,
                                             allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptRecordError(f"zstd codec: {exc}") from exc
        if len(raw) != expected:
            raise CorruptRecordError(f"zstd codec: {len(raw)} bytes out, expected {expected}")
        out = torch.empty(shape, dtype=dtype)
        native.unshuffle(raw, out.element_size(), _as_bytes_view(out))
        return out


def _grouping(shape: tuple[int, ...], role: str) -> tuple[int, int, int]:
    """(n, length, c): the tensor seen as (n, length, c) with groups running along ``length``.

    Keys: (rest, tokens, head_dim), groups of tokens per channel. Values: (rest*tokens, head_dim,
    1), groups of channels per token.
    """
    if role == "v":
        return prod(shape[:-1]), shape[-1], 1
    tokens = shape[-2] if len(shape) > 1 else 1
    return prod(shape[:-2]), tokens, shape[-1]


class _QuantCodec(Codec):
    """Group-wise asymmetric quantisation to ``bits`` bits: ``x_hat = lo + code * scale``.

    Payload: group size (u32), codes (int4: two per byte, low nibble first), group minima (fp32),
    group scales (fp32); minima and scales have shape (n, groups, c), see ``_grouping``.
    """

    bits = 8
    lossy = True

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def encode(self, t: torch.Tensor, role: str) -> bytes:
        t = _check_tensor(self.name, t, role)
        n, length, c = _grouping(tuple(t.shape), role)
        group = max(1, min(self.config.group_size, length))
        codes, lo, scale = self._quantise(t.reshape(n, length, c).float(), group)
        return b"".join((_GROUP_HEADER.pack(self.config.group_size), self._pack(codes),
                         lo.numpy().tobytes(), scale.numpy().tobytes()))

    def _quantise(self, x: torch.Tensor, group: int):
        n, length, c = x.shape
        groups = -(-length // group)
        pad = groups * group - length
        if pad:  # repeat the last element: the group's min and max stay those of real data
            x = torch.cat([x, x[:, -1:].expand(n, pad, c)], 1)
        grouped = x.view(n, groups, group, c)
        lo, hi = grouped.amin(2), grouped.amax(2)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise ValueError(f"{self.name} codec: input holds NaN or inf; use a lossless codec")
        work = torch.float64 if torch.isinf(hi - lo).any() else torch.float32
        scale = ((hi.double() - lo.double()) / self.levels).float()
        divisor = torch.where(scale > 0, scale, 1).to(work)  # a constant group codes to 0
        codes = (grouped.to(work) - lo.to(work)[:, :, None]) / divisor[:, :, None]
        codes = codes.round_().clamp_(0, self.levels).to(torch.uint8)
        return codes.view(n, groups * group, c)[:, :length].reshape(-1), lo, scale

    def decode(self, data, dtype, shape, role: str) -> torch.Tensor:
        shape = _check_target(self.name, dtype, shape, role)
        n, length, c = _grouping(shape, role)
        src = memoryview(data).cast("B")
        if len(src) < _GROUP_HEADER.size:
            raise CorruptRecordError(f"{self.name} codec: {len(src)} bytes, no header")
        (group_size,) = _GROUP_HEADER.unpack_from(src)
        if not 1 <= group_size <= 1 << 20:
            raise CorruptRecordError(f"{self.name} codec: group size {group_size} out of range")
        group = max(1, min(group_size, length))
        groups = -(-length // group)
        code_bytes = self._packed_size(n * length * c)
        meta = n * groups * c * 4
        if len(src) != _GROUP_HEADER.size + code_bytes + 2 * meta:
            raise CorruptRecordError(f"{self.name} codec: {len(src)} bytes for {dtype} {shape}, "
                                     f"expected {_GROUP_HEADER.size + code_bytes + 2 * meta}")
        body = np.frombuffer(src, np.uint8, offset=_GROUP_HEADER.size)
        codes = self._unpack(body[:code_bytes], n * length * c).view(n, length, c)
        lo = torch.from_numpy(body[code_bytes:code_bytes + meta].view(np.float32).copy())
        scale = torch.from_numpy(body[code_bytes + meta:].view(np.float32).copy())
        if not (torch.isfinite(lo).all() and torch.isfinite(scale).all() and (scale >= 0).all()):
            raise CorruptRecordError(f"{self.name} codec: non-finite or negative group scales")
        x = self._dequantise(codes, lo.view(n, groups, c), scale.view(n, groups, c), group)
        return x.to(dtype).reshape(shape)

    def _dequantise(self, codes, lo, scale, group: int) -> torch.Tensor:
        n, length, c = codes.shape
        groups = lo.shape[1]
        pad = groups * group - length
        if pad:
            codes = torch.cat([codes, codes.new_zeros(n, pad, c)], 1)
        work = torch.float64 if torch.isinf(scale * self.levels).any() else torch.float32
        grouped = codes.view(n, groups, group, c).to(work)
        x = torch.addcmul(lo.to(work)[:, :, None], grouped, scale.to(work)[:, :, None])
        return x.view(n, groups * group, c)[:, :length]

    def _packed_size(self, count: int) -> int:
        return count

    def _pack(self, codes: torch.Tensor) -> bytes:
        return codes.numpy().tobytes()

    def _unpack(self, packed: np.ndarray, count: int) -> torch.Tensor:
        return torch.from_numpy(packed.copy())


class Int8Codec(_QuantCodec):
    """8-bit group-wise quantisation (lossy): about 1.06-1.13 bytes per element."""

    name, id, bits = "int8", 2, 8


class Int4Codec(_QuantCodec):
    """4-bit group-wise quantisation (lossy), two codes per byte, low nibble first."""

    name, id, bits = "int4", 3, 4

    def _packed_size(self, count: int) -> int:
        return (count + 1) // 2

    def _pack(self, codes: torch.Tensor) -> bytes:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        pairs = codes.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()

    def _unpack(self, packed: np.ndarray, count: int) -> torch.Tensor:
        p = torch.from_numpy(packed.copy())
        return torch.stack((p & 0xF, p >> 4), 1).view(-1)[:count]


CODECS: dict[str, type[Codec]] = {cls.name: cls for cls in (RawCodec, ZstdCodec, Int8Codec,
                                                              Int4Codec)}
_BY_ID = {cls.id: cls for cls in CODECS.values()}


def make_codec(name: str, config: CodecConfig | None = None) -> Codec:
    """The codec registered as ``name`` ("raw", "zstd", "int8", "int4"); ValueError otherwise.

    ``config`` supplies zstd_level and group_size (defaults: ``CodecConfig()``).
    """
    if name not in CODECS:
        raise ValueError(f"codec {name!r}: unknown, expected one of {', '.join(CODECS)}")
    return CODECS[name](config or CodecConfig())


def codec_by_id(codec_id: int, config: CodecConfig | None = None) -> Codec:
    """The codec with numeric id ``codec_id`` (as stored on disk); ValueError when unknown."""
    return _codec_class(codec_id)(config or CodecConfig())


def codec_name_by_id(codec_id: int) -> str:
    """The name of the codec with numeric id ``codec_id``; ValueError when unknown."""
    return _codec_class(codec_id).name


def _codec_class(codec_id: int) -> type[Codec]:
    if codec_id not in _BY_ID:
        raise ValueError(f"codec id {codec_id!r}: unknown, expected one of "
                         f"{', '.join(f'{i} ({c.name})' for i, c in _BY_ID.items())}")
    return _BY_ID[codec_id]


def encode_block(codec: Codec, block: KVBlock) -> bytes:
    """One record's payload: header (codec id, K length, crc32), then K bytes, then V bytes.

    block : KVBlock, keys and values of shape (layers, kv_heads, tokens, head_dim) on CPU.
    """
    block.check()
    k = codec.encode(block.keys, "k")
    v = codec.encode(block.values, "v")
    head = _BLOCK_HEAD.pack(codec.id, len(k))
    crc = native.crc32(v, native.crc32(k, native.crc32(head)))
    return b"".join((head, _BLOCK_CRC.pack(crc), k, v))


def decode_block(codec: Codec, payload, dtype, shape, verified: bool = False) -> KVBlock:
    """The KVBlock in ``payload`` (as written by ``encode_block`` with ``codec``).

    shape : (layers, kv_heads, tokens, head_dim), the shape of keys and of values.
    verified : the caller already checked these exact bytes with a checksum of its own (the disk
        record's crc32 covers the payload), so the block's crc32 pass is skipped.
    Raises CorruptRecordError on any malformed payload.
    """
    if len(tuple(shape)) != 4:
        raise ValueError(f"decode_block: shape {tuple(shape)} must be (layers, kv_heads, tokens, "
                         "head_dim)")
    view = memoryview(payload).cast("B")
    if len(view) < BLOCK_HEADER_SIZE:
        raise CorruptRecordError(f"block payload of {len(view)} bytes is shorter than its header")
    codec_id, k_len = _BLOCK_HEAD.unpack_from(view)
    (crc,) = _BLOCK_CRC.unpack_from(view, _BLOCK_HEAD.size)
    body = view[BLOCK_HEADER_SIZE:]
    if not verified and native.crc32(body, native.crc32(view[:_BLOCK_HEAD.size])) != crc:
        raise CorruptRecordError("block payload: crc32 mismatch")
    if codec_id != codec.id:
        raise CorruptRecordError(f"block payload written by codec id {codec_id}, read as "
                                 f"{codec.name} (id {codec.id})")
    if k_len > len(body):
        raise CorruptRecordError(f"block payload: K length {k_len} exceeds its {len(body)} bytes")
    return KVBlock(codec.decode(body[:k_len], dtype, shape, "k"),
                   codec.decode(body[k_len:], dtype, shape, "v"))
