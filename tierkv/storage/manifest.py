"""``manifest.safetensors``: per-document metadata, named tensors and an index snapshot.

The records in the segments are the truth; the manifest caches what records cannot hold
(document metadata and arrays such as chunk summaries), a snapshot of the index that ``open``
cross-checks, and a listing of every segment's records that a clean directory opens from
(``segtable``; builds before it ignore the listing, which the crc32 covers like the rest). It
is written with safetensors (no pickle), carries a crc32 over its metadata and
tensor bytes, and is replaced atomically: temp file, fsync, rename, fsync of the directory.

The crc32's rule (``_crc``: the metadata but the crc, then each tensor) is part of the format
in every version: a manifest naming a newer version is a newer build's only if its crc32 holds
by that rule. One whose version was changed by damage (a bit flipped '1' into '5', found by the
seeded corruption campaign of ``tests/test_faults.py``) is damage, set aside and rebuilt from
the segments like any other; refused as newer, it left the directory unopenable.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import struct
import zlib
from typing import NamedTuple

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import CorruptRecordError, NewerFormatError, StorageError
from .segtable import DOCS_KEY, Listing

MANIFEST = "manifest.safetensors"
MANIFEST_TMP = MANIFEST + ".tmp"
MANIFEST_ASIDE = "manifest.corrupt-{}.safetensors"  # a damaged manifest, set aside as evidence
FORMAT = "tierkv-manifest"
VERSION = "1"
INDEX_FIELDS = ("segment", "offset", "length", "group", "start", "end", "codec", "seq", "doc")
MAX_MANIFEST = 1 << 34
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class CorruptManifestError(CorruptRecordError):
    """The manifest failed its checks (format, crc32, structure, ranges)."""


class DiskWriteError(StorageError):
    """A write or fsync to the disk tier failed (ENOSPC, EIO, ...); earlier data is intact."""


def check_array_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"array name {name!r}: 1-64 letters, digits, '_', '.', '-'")
    return name


class Manifest(NamedTuple):
    """A decoded manifest: the index columns (INDEX_FIELDS, one int per live record), the
    document names the ``doc`` column indexes, each document's metadata and arrays, and the
    listing of the segments' records (``segtable``; None when the manifest holds none)."""

    index: dict[str, list[int]]
    docs: list[str]
    meta: dict[str, dict]
    arrays: dict[str, dict[str, torch.Tensor]]
    listing: Listing | None = None


def encode_manifest(index: dict[str, list[int]], docs: list[str], meta: dict[str, dict],
                    arrays: dict[str, dict[str, torch.Tensor]],
                    listing: tuple[dict[str, torch.Tensor], list[str]] | None = None) -> bytes:
    """The bytes of a manifest. ``index`` maps each of INDEX_FIELDS to one int per record;
    ``listing``: ``segtable.list_segments``'s tensors and document names."""
    tensors = {f"index.{f}": torch.tensor(index[f], dtype=torch.int64) for f in INDEX_FIELDS}
    for i, doc in enumerate(docs):
        for name, tensor in arrays.get(doc, {}).items():
            tensors[f"docs.{i}.{name}"] = tensor.detach().cpu().contiguous()
    info = {"format": FORMAT, "version": VERSION, "docs": json.dumps(docs),
            "meta": json.dumps({d: meta[d] for d in docs if d in meta}),
            "arrays": json.dumps({d: sorted(arrays[d]) for d in docs if arrays.get(d)})}
    if listing is not None:
        tensors.update(listing[0])
        info[DOCS_KEY] = json.dumps(listing[1])
    info["crc"] = str(_crc(info, tensors))
    return st_save(tensors, metadata=info)


def _crc(info: dict[str, str], tensors: dict[str, torch.Tensor]) -> int:
    crc = zlib.crc32(json.dumps({k: v for k, v in info.items() if k != "crc"},
                                sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        crc = zlib.crc32(f"{name}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def decode_manifest(data: bytes) -> Manifest:
    """The Manifest in ``data``; CorruptManifestError if bad."""
    if len(data) < 8 or struct.unpack_from("<Q", data)[0] > len(data) - 8:
        raise CorruptManifestError("manifest header length is absurd or the file is truncated")
    try:
        head = json.loads(data[8:8 + struct.unpack_from("<Q", data)[0]])
        info = head.get("__metadata__") or {}
        tensors = st_load(data)
    except Exception as exc:  # safetensors and json raise several types for malformed input
        raise CorruptManifestError(f"manifest is not valid safetensors: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CorruptManifestError("manifest format tag missing: not a tierkv manifest")
    _refuse_newer(info, tensors)
    if info.get("version") != VERSION:
        raise CorruptManifestError(f"manifest version {info.get('version')!r}: expected {VERSION}")
    if info.get("crc") != str(_crc(info, tensors)):
        raise CorruptManifestError("manifest crc32 mismatch")
    return _unpack(info, tensors)


def _unpack(info, tensors):
    try:
        docs, meta, names = (json.loads(info[k]) for k in ("docs", "meta", "arrays"))
        columns = {f: tensors[f"index.{f}"] for f in INDEX_FIELDS}
    except (KeyError, ValueError) as exc:
        raise CorruptManifestError(f"manifest field missing or not JSON: {exc}") from None
    if not isinstance(docs, list) or \
            not all(isinstance(d, str) and _NAME_RE.match(d) for d in docs):
        raise CorruptManifestError("manifest 'docs' is not a list of valid document names")
    if not isinstance(meta, dict) or not isinstance(names, dict):
        raise CorruptManifestError("manifest 'meta' / 'arrays' are not objects")
    lengths = {t.numel() for t in columns.values()}
    if len(lengths) > 1 or any(t.dim() != 1 or t.dtype != torch.int64 for t in columns.values()):
        raise CorruptManifestError("manifest index columns differ in length or type")
    index = {f: t.tolist() for f, t in columns.items()}
    arrays = {}
    for doc, doc_names in names.items():
        if doc not in docs or not isinstance(doc_names, list) or not all(
                isinstance(n, str) and _NAME_RE.match(n) for n in doc_names):
            raise CorruptManifestError(f"manifest arrays of unknown document {doc!r}")
        i = docs.index(doc)
        try:
            arrays[doc] = {n: tensors[f"docs.{i}.{n}"] for n in doc_names}
        except KeyError as exc:
            raise CorruptManifestError(f"manifest array {exc} missing") from None
    if any(d not in docs or not isinstance(m, dict) for d, m in meta.items()):
        raise CorruptManifestError("manifest metadata of an unknown document")
    return Manifest(index, docs, meta, arrays, Listing.decode(tensors, info))


def check_index(index: dict[str, list[int]], docs: list[str]) -> None:
    """Raise CorruptManifestError when an index row holds impossible values.

    Rows pointing at records that were since compacted or deleted are merely stale, not corrupt.
    """
    for row in range(len(index["seq"])):
        seg, off, length = index["segment"][row], index["offset"][row], index["length"][row]
        if not 0 < seg < 10**6 or not 0 <= off < 2**41 or not 0 < length <= 2**41:
            raise CorruptManifestError(f"manifest index row {row}: segment {seg} offset {off} "
                                       f"length {length} is impossible")
        if not 0 <= index["doc"][row] < len(docs) or not 0 <= index["codec"][row] < 256:
            raise CorruptManifestError(f"manifest index row {row}: doc {index['doc'][row]} or "
                                       f"codec {index['codec'][row]} is out of range")


def _names_newer(info) -> bool:
    """Whether manifest metadata ``info`` names a version newer than this build's."""
    return isinstance(info, dict) and str(info.get("version")).isdigit() \
        and int(info["version"]) > int(VERSION)


def _refuse_newer(info, tensors: dict[str, torch.Tensor]) -> None:
    """NewerFormatError when ``info`` names a newer version and its crc32 holds (module
    docstring); a newer version whose crc32 fails is left to the caller to report as damage."""
    if _names_newer(info) and info.get("crc") == str(_crc(info, tensors)):
        raise NewerFormatError.of("manifest", info["version"], VERSION)


def _open_manifest(dir_fd: int) -> int | None:
    """A read descriptor of the directory's manifest, or None when there is none."""
    try:  # O_NONBLOCK: a FIFO in its place would block the opening for ever
        fd = os.open(MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptManifestError("manifest is a symlink: refused") from None
        # Not damage (permissions, I/O): never set aside and replaced for that.
        raise StorageError(f"manifest cannot be opened: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        kind = "a directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "not a regular file"
        os.close(fd)
        raise CorruptManifestError(f"{MANIFEST} is {kind}: refused")
    return fd


def refuse_newer_manifest(dir_fd: int) -> None:
    """NewerFormatError when the directory's manifest is of a newer version: its header says
    so, and its crc32 holds (module docstring). An opening checks this before any repair;
    damage is ``read_manifest``'s to report."""
    fd = _open_manifest(dir_fd)
    if fd is None:
        return
    try:
        length = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))[0]
        head = os.pread(fd, length, 8) if 0 < length <= MAX_MANIFEST else b""
        try:
            info = json.loads(head).get("__metadata__")
        except (ValueError, AttributeError):
            return
        if not _names_newer(info):
            return  # not newer: read in full (and checked) by ``read_manifest``
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0) if size <= MAX_MANIFEST else b""
    finally:
        os.close(fd)
    with contextlib.suppress(CorruptManifestError):  # damage: ``read_manifest`` reports it
        decode_manifest(data)  # NewerFormatError when the crc32 holds


def read_manifest(dir_fd: int) -> Manifest | None:
    """The decoded manifest of a directory, or None when there is none."""
    fd = _open_manifest(dir_fd)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST:
            raise CorruptManifestError(f"manifest of {size} bytes is absurdly large")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    return decode_manifest(data)


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the directory by ``data``: temp file, fsync, rename, fsync dir."""
    tmp = name + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except OSError as exc:
        _unlink_quietly(dir_fd, tmp)
        raise DiskWriteError(f"writing {name} failed: {exc}") from exc


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
