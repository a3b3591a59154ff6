"""Per-document metadata of a disk tier and its round trip through the manifest.

Each document's entry remembers the store ``seq`` when it was set, so metadata set before a
``delete_doc`` (whose tombstone has a higher seq) is not resurrected by an older manifest.
Saving merges with the manifest on disk: the documents this tier did not change are written as
the manifest lists them (set, replaced or deleted by another process), and so does ``reload``.
"""
from __future__ import annotations

import json
import os

import torch

from .manifest import INDEX_FIELDS, MANIFEST, MANIFEST_ASIDE, MANIFEST_TMP, \
    CorruptManifestError, check_array_name, check_index, encode_manifest, read_manifest, write_atomic
from .segtable import Listing, list_segments


def _saveable(doc: str, name: str, tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` that the manifest can hold, or ValueError naming what is wrong:
    checked when the metadata is set, so a tensor no manifest can hold never fails every later
    save (and with it the other documents' metadata)."""
    check_array_name(name)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"array {name!r} of {doc!r} is not a tensor")
    if tensor.layout != torch.strided or tensor.is_meta:
        raise ValueError(f"array {name!r} of {doc!r}: a dense tensor with data expected, got "
                         f"layout {tensor.layout} on {tensor.device}")
    try:  # a dtype the manifest cannot hold fails on one element as on all of them
        copy = tensor.detach().to("cpu", copy=True).contiguous()
        encode_manifest({f: [] for f in INDEX_FIELDS}, [doc], {}, {doc: {name: copy.reshape(-1)[:1]}})
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"array {name!r} of {doc!r} ({tensor.dtype}, shape "
                         f"{tuple(tensor.shape)}) cannot be saved: {exc}") from None
    return copy


class DocMeta:
    """JSON metadata and named tensors per document, saved in ``manifest.safetensors``."""

    def __init__(self, files):
        self._files = files
        self._entries: dict[str, dict] = {}
        self._arrays: dict[str, dict[str, torch.Tensor]] = {}
        self._dirty: set[str] = set()
        self.vouches = False  # the last load found a manifest listing exactly the live records
        self._peeked = None  # what ``listing`` read, for the ``load`` after it

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    def docs(self) -> list[str]:
        return list(self._entries)

    def set(self, doc: str, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        try:
            meta = json.loads(json.dumps(meta, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta of {doc!r} is not JSON-serialisable: {exc}") from None
        if not isinstance(meta, dict) or not isinstance(arrays, dict):
            raise ValueError(f"meta of {doc!r} must be a dict and arrays a dict of tensors")
        copies = {name: _saveable(doc, name, tensor) for name, tensor in arrays.items()}
        self._entries[doc] = {"seq": self._files.index.max_seq, "meta": meta}
        self._arrays[doc] = copies
        self._dirty.add(doc)

    def get(self, doc: str) -> tuple[dict, dict[str, torch.Tensor]]:
        if doc not in self._entries:
            raise KeyError(doc)
        meta = json.loads(json.dumps(self._entries[doc]["meta"]))
        return meta, {n: t.clone() for n, t in self._arrays.get(doc, {}).items()}

    def state(self, doc: str):
        """``doc``'s entry as it is now (None: it has none), for ``restore``."""
        if doc not in self._entries:
            return None
        return dict(self._entries[doc]), dict(self._arrays.get(doc, {}))

    def restore(self, doc: str, state) -> None:
        """Put back what ``state`` took (saved by the next ``save``)."""
        if state is None:
            self.drop(doc)
            return
        self._entries[doc], self._arrays[doc] = state
        self._dirty.add(doc)

    def drop(self, doc: str) -> None:
        self._entries.pop(doc, None)
        self._arrays.pop(doc, None)
        self._dirty.add(doc)

    # -- the manifest (callers hold the directory lock) ------------------------------------
    def listing(self) -> Listing | None:
        """The manifest's listing of the segments' records (None: it has none, or none can be
        read); the manifest read is kept for the ``load`` that follows."""
        try:
            manifest = self._read()
        except CorruptManifestError as exc:
            self._peeked = exc
            return None
        self._peeked = manifest
        return None if manifest is None else manifest.listing

    def load(self) -> str:
        """Take in the manifest's documents; a description of what was found.

        A temp file left by a writer that died mid-replace is removed first. ``vouches`` tells
        whether the manifest's index lists exactly the records the directory's index holds.
        """
        self.vouches = False
        if not self._files.read_only:
            try:
                os.unlink(MANIFEST_TMP, dir_fd=self._files.dir_fd)
            except FileNotFoundError:
                pass
        peeked, self._peeked = self._peeked, None
        try:
            if isinstance(peeked, CorruptManifestError):
                raise peeked
            manifest = self._read() if peeked is None else peeked
        except CorruptManifestError as exc:
            if self._files.read_only:
                return f"corrupt: {exc}; left in place (read-only), records are intact"
            return f"corrupt: {exc}; moved aside to {self._set_aside()}, records are intact"
        if manifest is None:
            return "missing"
        self._adopt(manifest.meta, manifest.arrays)
        stale = self._stale_rows(manifest.index, manifest.docs)
        self.vouches = not stale and len(manifest.index["seq"]) == len(self._files.index.live)
        return "ok" if not stale else f"ok; {stale} index rows stale (the records win)"

    def _read(self):
        manifest = read_manifest(self._files.dir_fd)
        if manifest is None:
            return None
        check_index(manifest.index, manifest.docs)
        for doc, entry in manifest.meta.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("seq"), int)
                    and isinstance(entry.get("meta"), dict)):
                raise CorruptManifestError(f"manifest metadata of {doc!r} is malformed")
        return manifest

    def reload(self) -> None:
        """Take in what other processes saved since: the documents this tier did not change
        become as the manifest on disk lists them (kept as they are if it cannot be read)."""
        try:
            on_disk = self._read()
        except CorruptManifestError:
            return
        if on_disk is not None:
            self._merge(on_disk.meta, on_disk.arrays)

    def _merge(self, entries: dict, arrays: dict) -> None:
        """The manifest's ``entries`` for the documents this tier did not change: one it does
        not list, or that a later doc tombstone deleted, was deleted by another process."""
        tombs = self._files.index.doc_tombs
        for doc in [d for d in self._entries if d not in self._dirty]:
            if doc not in entries or self._entries[doc]["seq"] < tombs.get(doc, 0):
                del self._entries[doc]
                self._arrays.pop(doc, None)
        self._adopt(entries, arrays)

    def _adopt(self, entries: dict, arrays: dict) -> None:
        tombs = self._files.index.doc_tombs
        for doc, entry in entries.items():
            if doc not in self._dirty and entry["seq"] >= tombs.get(doc, 0):
                self._entries[doc] = entry
                self._arrays[doc] = arrays.get(doc, {})

    def _stale_rows(self, index: dict, docs: list[str]) -> int:
        fields = ("segment", "offset", "length", "group", "start", "end", "codec")
        found = {(key.doc, loc.header.seq): (loc.segment, loc.offset, loc.length, key.group,
                                             key.start, key.end, loc.header.codec)
                 for key, loc in self._files.index.live.items()}
        rows = zip(index["doc"], index["seq"], *(index[f] for f in fields))
        return sum(found.get((docs[d], seq)) != tuple(row) for d, seq, *row in rows)

    def _set_aside(self) -> str:
        n = 1
        while True:
            name = MANIFEST_ASIDE.format(n)
            try:
                os.stat(name, dir_fd=self._files.dir_fd, follow_symlinks=False)
                n += 1
            except FileNotFoundError:
                break
        try:
            os.rename(MANIFEST, name, src_dir_fd=self._files.dir_fd, dst_dir_fd=self._files.dir_fd)
        except OSError as exc:
            return f"(not moved: {exc})"
        return name

    def save(self) -> None:
        """Merge with the manifest on disk and replace it atomically."""
        try:
            on_disk = self._read()
        except CorruptManifestError:
            on_disk = None
        if on_disk is not None:
            self._merge(on_disk.meta, on_disk.arrays)
        live = self._files.index.live
        docs = sorted(set(self._entries) | {k.doc for k in live})
        slot = {d: i for i, d in enumerate(docs)}
        index = {f: [] for f in INDEX_FIELDS}
        for key, loc in live.items():
            h = loc.header
            for name, value in zip(INDEX_FIELDS, (loc.segment, loc.offset, loc.length, key.group,
                                                  key.start, key.end, h.codec, h.seq,
                                                  slot[key.doc])):
                index[name].append(value)
        write_atomic(self._files.dir_fd, MANIFEST,
                     encode_manifest(index, docs, self._entries, self._arrays,
                                     list_segments(self._files)))
        self._dirty.clear()
