"""The disk tier: records in append-only segment files, metadata in a safetensors manifest.

Durability: ``put`` returns once the record is written to the OS (``pwritev``), so it survives the
death of the process; ``flush()`` (and ``close()``) fsync the segment and the directory and
replace the manifest, which makes everything so far survive a power loss too.

Two processes may share a directory: see ``tierkv.storage.locking``. Each appends under the
exclusive directory lock after taking in what the other appended; a read that misses (or finds
its segment compacted away) rescans and retries once.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
import torch

from ..config import CodecConfig, check_direct_io, parse_size
from ..workers import worker_pool
from .base import CorruptRecordError, KVBlock, RecordKey, Tier, TierFullError, check_put
from .codec import BLOCK_HEADER_SIZE, Codec, codec_by_id, codec_name_by_id, decode_block, \
    encode_block, make_codec
from .diskmeta import DocMeta
from .diskread import DIRECT_AVAILABLE, DirectIOUnsupported, RawRecord, read_batch
from .locking import DocHold
from .manifest import refuse_newer_manifest
from .native import crc32
from .segfiles import SegmentDir
from .segtable import listable
from .segment import HEADER, KIND_DATA, KIND_DOC_TOMBSTONE, KIND_KEY_TOMBSTONE, PAD_ALIGN, \
    pack_record, payload_pad, segment_name


class DiskTier(Tier):
    """KV records in segment files under ``path``.

    Parameters
    ----------
    path : directory (created if missing) holding ``seg-NNNNNN.tkv``, ``manifest.safetensors``
        and ``tierkv.lock``.
    codec : default codec ("auto" means "zstd") and its settings.
    segment_size : bytes after which a new segment file is started (int or "256MiB").
    io_threads : threads reading records in ``read_raw_many``.
    budget : bytes of live records allowed (None: unbounded).
    read_only : look without changing anything: the directory must exist; a tail past the last
        valid record is reported, not cut; a damaged manifest is reported, not set aside; no
        lock file is created; writes raise StorageError (``tierkv inspect``).
    direct_io : "auto" (default), True or False: whether reads bypass the page cache with
        O_DIRECT (``diskread._read_direct``). "auto" does so while the tier's records outgrow the
        memory the machine has available (the page cache could not keep them; O_DIRECT then
        saves its copy and its readahead past each record), and reads through the page cache
        otherwise (records written or read a moment ago come from RAM). After the file system
        refuses O_DIRECT once, every read goes through the page cache. ``reads_direct()`` says
        which the next read does.

    ``open_report`` says what opening found: records, segments, bytes dropped and why. Opening
    takes the records of a segment unchanged since the manifest was written (its size and
    modification time) from the manifest's listing, reading nothing of it (``listed`` counts
    those segments: all of them in a directory closed cleanly, but for one holding damage),
    and reads only the record headers of the others; when the manifest does not list exactly
    the records found that way (a writer died after appending), it reads and crc-checks every
    record of those others. Every read checks its record's crc either way.
    """

    name = "disk"

    def __init__(self, path, *, codec: CodecConfig = CodecConfig(),
                 segment_size: int | str = "256MiB", io_threads: int = 4, budget=None,
                 read_only: bool = False, direct_io: bool | str = "auto"):
        super().__init__(None if budget is None else parse_size(budget, "budget"))
        if not isinstance(path, (str, Path)) or str(path) == "":
            raise ValueError(f"path={path!r}: expected a directory path")
        if Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"disk tier directory {str(path)!r} exists and is not a directory")
        if not isinstance(codec, CodecConfig):
            raise ValueError(f"codec={codec!r}: expected a CodecConfig")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) \
                or not 1 <= io_threads <= 256:
            raise ValueError(f"io_threads={io_threads!r}: must be an integer in [1, 256]")
        check_direct_io(direct_io)
        size = parse_size(segment_size, "segment_size")
        if not 4096 <= size <= 2**40:
            raise ValueError(f"segment_size={size}: must be in [4KiB, 1TiB]")
        self.path = Path(path)
        self.codec_config = codec
        self._decoders: dict[int, Codec] = {}
        self.bytes_read = 0
        self._files = SegmentDir(self.path, size, read_only=read_only)
        self._pool = worker_pool(io_threads, "tierkv-disk")
        self._io_threads = io_threads
        self.direct_io = direct_io
        self._direct_ok = DIRECT_AVAILABLE  # False for good once the file system refuses
        self._available: tuple[float, int] | None = None  # (when, bytes) of available memory
        self._meta = DocMeta(self._files)
        self._holds: dict[str, DocHold] = {}
        self._generation = -1
        self.open_report = self._open()
        self._open_generation = self._files.generation
        # a manifest that did not list a segment it could list is written again at close
        self._unlisted = any(n not in self._files.listed and listable(info)
                             for n, info in self._files.index.segments.items())

    def _open(self) -> dict:
        with self._files.lock.exclusive():
            try:  # a newer manifest refuses the directory before anything is repaired
                refuse_newer_manifest(self._files.dir_fd)
            except CorruptRecordError:
                pass  # a symlink: DocMeta.load reports it and sets it aside
            listing = self._meta.listing()
            self._files.refresh(headers_only=True, listing=listing)
            manifest = self._meta.load()
            checked = "headers (the manifest agrees)"
            if self._files.unverified and not self._meta.vouches:
                checked = "every record but those of the segments the manifest lists as they are"
                # headers alone are trusted only as far as the manifest agrees; the segments it
                # lists as they are now (a writer that died after appending changed only others)
                self._files.verify(listing)
                if manifest.startswith("ok"):  # adopted against the unverified index: again
                    self._meta = DocMeta(self._files)
                    manifest = self._meta.load()
            self._sync_accounting()
        files = self._files
        return {"records": len(self._sizes), "segments": len(files.index.segments),
                "dropped": list(files.problems), "truncated": dict(files.truncated), "kept": dict(files.kept),
                "foreign": dict(files.foreign), "refused": dict(files.refused),
                "manifest": manifest, "listed": len(files.listed),
                "checked": checked if files.unverified else "every record"}

    def _sync_accounting(self) -> None:
        """Re-derive sizes from the index after it changed under us (refresh, compaction)."""
        with self._lock:
            if self._generation != self._files.generation:
                self._sizes = {k: loc.length for k, loc in self._files.index.live.items()}
                self._used = sum(self._sizes.values()) + self.reserved
                self._generation = self._files.generation

    # -- writing ------------------------------------------------------------------------
    def put(self, key: RecordKey, block: KVBlock, codec: str | None = None) -> None:
        """Append ``block`` as the record of ``key`` encoded with ``codec`` (default: config).

        Raises TierFullError when over budget, DiskWriteError when the write fails (nothing
        stored, earlier records intact).
        """
        check_put(key, block)
        enc = self._codec(codec)
        cpu = block.to("cpu")
        payload = encode_block(enc, cpu)
        crc = crc32(payload)
        need = HEADER.size + PAD_ALIGN - 1 + len(payload)  # at most: the pad depends on where
        with self._lock:
            self._check_open()
            old = self._sizes.get(key, 0)
            if self.budget is not None and self._used - old + need > self.budget:
                raise TierFullError(f"disk: {key} needs {need} B, {self.budget - self._used + old} "
                                    f"B free of {self.budget}")
            # the block's tensor bytes on a PAD_ALIGN boundary of the file: an O_DIRECT read
            # puts them there in memory, where the raw codec decodes them as a view
            self._append(lambda seq, offset: pack_record(
                KIND_DATA, key, seq, payload, payload_crc=crc, codec=enc.id,
                dtype=cpu.keys.dtype, shape=tuple(cpu.keys.shape), raw_len=cpu.nbytes,
                pad=0 if offset is None else payload_pad(offset, BLOCK_HEADER_SIZE)))

    def _append(self, make_record) -> None:
        _, record, gone, live = self._files.append(make_record)
        self._sync_accounting()
        for key in gone:
            self._used -= self._sizes.pop(key, 0)
        if live is not None:
            self._used += record.header.length - self._sizes.get(live, 0)
            self._sizes[live] = record.header.length
            self.peak = max(self.peak, self._used)

    def _codec(self, name: str | None):
        name = name or self.codec_config.codec
        name = "zstd" if name == "auto" else name
        codec = make_codec(name, self.codec_config)
        if codec.lossy and not self.codec_config.allow_lossy:
            raise ValueError(f"codec={name!r} is lossy: the disk tier's CodecConfig has "
                             "allow_lossy=False")
        return codec

    def _store(self, key: RecordKey, block: KVBlock) -> int:
        self.put(key, block)
        return self._sizes[key]

    def remove(self, key: RecordKey) -> int:
        """Forget ``key`` (a tombstone record makes it stay forgotten); the bytes freed."""
        with self._lock:
            self._check_open()
            if key not in self._sizes:
                return 0
            size = self._sizes[key]
            self._drop(key)
            return size

    def _drop(self, key: RecordKey) -> None:
        self._append(lambda seq, offset: pack_record(KIND_KEY_TOMBSTONE, key, seq))

    def delete_doc(self, doc: str) -> tuple[int, int]:
        """Forget every record and the metadata of ``doc``; reclaim the space.

        Returns (segments deleted, segments compacted).
        """
        key = RecordKey(doc, 0, 0, 1)
        with self._lock:
            self._check_open()
            hold = None if doc in self._holds else DocHold(self._files.dir_fd, doc, self.path)
            try:
                self._append(lambda seq, offset: pack_record(KIND_DOC_TOMBSTONE, key, seq))
                self._meta.drop(doc)
                self.flush()  # the manifest forgets it before reclaiming may drop the tombstone
                return self.reclaim()
            finally:
                if hold is not None:
                    hold.release()

    def hold_doc(self, doc: str) -> None:
        """Claim ``doc`` for this tier until ``release_doc`` or ``close``, so that no other
        cache, in this or another process, writes it meanwhile (``DocHold``). DocInUseError
        when it is held already, by this tier or any other; ``delete_doc`` of a document
        another tier holds raises it too."""
        RecordKey(doc, 0, 0, 1)
        self._files._check_writable()
        with self._lock:
            self._check_open()
            self._holds[doc] = DocHold(self._files.dir_fd, doc, self.path)

    def release_doc(self, doc: str) -> None:
        """End this tier's claim on ``doc`` (if any)."""
        with self._lock:
            hold = self._holds.pop(doc, None)
            if hold is not None:
                hold.release()

    def reclaim(self, max_dead: float = 0.5) -> tuple[int, int]:
        """Delete dead segments, compact those more than ``max_dead`` dead (crash-safe).

        Returns (segments deleted, segments compacted). ``delete_doc`` calls it.
        """
        if isinstance(max_dead, bool) or not isinstance(max_dead, (int, float)) or \
                not 0 <= max_dead <= 1:
            raise ValueError(f"max_dead={max_dead!r}: expected the share of a segment's bytes "
                             "that are dead, from 0 to 1")
        with self._lock:
            self._check_open()
            result = self._files.reclaim(max_dead)
            self._sync_accounting()
            return result

    def refresh(self) -> bool:
        """Take in records other processes appended or compacted, and the documents they saved
        or deleted; True if any record changed."""
        with self._lock:
            self._check_open()
            with self._files.lock.exclusive():
                changed = self._files.refresh()
                self._meta.reload()
            self._sync_accounting()
            return changed

    def flush(self) -> None:
        """fsync the segments and the directory, then replace the manifest atomically."""
        with self._lock:
            self._check_open()
            with self._files.lock.exclusive():
                try:
                    self._files.sync()
                finally:  # a sync that rewrote a segment another writer appended to took it in
                    self._sync_accounting()
                self._meta.save()

    # -- reading ------------------------------------------------------------------------
    def get(self, key: RecordKey) -> KVBlock:
        """The block of ``key`` on the CPU; KeyError when absent, CorruptRecordError when bad."""
        return self.get_many([key])[0]

    def _load(self, key: RecordKey) -> KVBlock:
        return self.get(key)

    def get_many(self, keys) -> list[KVBlock]:
        """The blocks of ``keys`` (CPU), read and decoded by the I/O threads, in key order."""
        return self._read_retrying(list(keys), self.decode)

    def decode(self, raw: RawRecord) -> KVBlock:
        """The KVBlock of a RawRecord (CorruptRecordError when its payload is malformed)."""
        codec = self._decoders.get(raw.codec)
        if codec is None:
            try:
                codec = codec_by_id(raw.codec, self.codec_config)
            except ValueError as exc:
                raise CorruptRecordError(f"record {raw.key}: {exc}") from None
            self._decoders[raw.codec] = codec  # codecs keep no per-call state
        return decode_block(codec, raw.payload, raw.dtype, raw.shape, verified=True)

    def read_raw_many(self, keys) -> list[RawRecord]:
        """Read and crc-check the records of ``keys`` with the I/O threads, in key order.

        Raises KeyError for an absent key, CorruptRecordError for a record that fails checks.
        """
        return self._read_retrying(list(keys), None)

    def _read_retrying(self, keys: list[RecordKey], decode) -> list:
        try:
            return self._read(keys, decode)
        except (KeyError, FileNotFoundError):  # another process added or compacted: rescan
            self._files.refresh()
            self._sync_accounting()
            return self._read(keys, decode)

    def _read(self, keys: list[RecordKey], decode) -> list:
        self._check_open()
        with self._lock:
            locs = [self._files.index.live[k] for k in keys]
        direct = self.reads_direct()
        if direct:
            try:
                out = read_batch(self._files, keys, locs, self._pool, self._io_threads, decode,
                                 direct=True)
            except DirectIOUnsupported:
                direct = self._direct_ok = False
        if not direct:
            out = read_batch(self._files, keys, locs, self._pool, self._io_threads, decode)
        self.bytes_read += sum(loc.length for loc in locs)
        return out

    def reads_direct(self) -> bool:
        """Whether the next read bypasses the page cache (``direct_io``)."""
        if not self._direct_ok or self.direct_io is False:
            return False
        if self.direct_io is True:
            return True
        now = time.monotonic()
        if self._available is None or now - self._available[0] > 1.0:  # meminfo once a second
            self._available = (now, psutil.virtual_memory().available)
        return self.used > self._available[1]

    async def aget(self, key: RecordKey) -> KVBlock:
        """``get`` on a worker thread, for asyncio applications."""
        return await asyncio.to_thread(self.get, key)

    async def aput(self, key: RecordKey, block: KVBlock, codec: str | None = None) -> None:
        """``put`` on a worker thread, for asyncio applications."""
        await asyncio.to_thread(self.put, key, block, codec)

    # -- metadata and health ------------------------------------------------------------
    def docs(self) -> list[str]:
        """Documents with live records or metadata, sorted."""
        with self._lock:
            return sorted({k.doc for k in self._sizes} | set(self._meta.docs()))

    def saved_docs(self) -> list[str]:
        """Documents with saved metadata (``set_doc_meta``), sorted."""
        with self._lock:
            return sorted(self._meta.docs())

    def set_doc_meta(self, doc: str, meta: dict, arrays: dict[str, torch.Tensor]) -> None:
        """Attach JSON ``meta`` and named tensors to ``doc`` (saved by ``flush``)."""
        RecordKey(doc, 0, 0, 1)
        self._files._check_writable()
        with self._lock:
            self._meta.set(doc, meta, arrays)

    def doc_meta_state(self, doc: str):
        """``doc``'s metadata as it is now (None: it has none), for ``restore_doc_meta`` to put
        back when what replaces it cannot be flushed."""
        with self._lock:
            return self._meta.state(doc)

    def restore_doc_meta(self, doc: str, state) -> None:
        """Put back the metadata ``doc_meta_state`` took (saved by the next ``flush``)."""
        with self._lock:
            self._meta.restore(doc, state)

    def doc_meta(self, doc: str) -> tuple[dict, dict[str, torch.Tensor]]:
        """Copies of the metadata and tensors of ``doc``; KeyError when it has none."""
        return self._meta.get(doc)

    def record_shapes(self) -> dict[tuple[int, int, int, torch.dtype], set[str]]:
        """(layers, kv_heads, head_dim, dtype) of the live records -> the documents holding
        records of that shape."""
        shapes: dict[tuple, set[str]] = {}
        with self._lock:
            for key, loc in self._files.index.live.items():
                h = loc.header
                shapes.setdefault((h.layers, h.kv_heads, h.head_dim, h.torch_dtype), set()).add(key.doc)
        return shapes

    def codec_of(self, key: RecordKey) -> str:
        """Name of the codec the record of ``key`` is stored with."""
        with self._lock:
            return codec_name_by_id(self._files.index.live[key].header.codec)

    def check(self) -> list[dict]:
        """Read and verify every live record: one dict (key, segment, offset, ok, error) each."""
        report = []
        for key in self.keys():
            loc = self._files.index.live.get(key)
            if loc is None:
                continue
            entry = {"key": key, "segment": segment_name(loc.segment), "offset": loc.offset,
                     "ok": True, "error": None}
            try:
                self.get(key)
            except (CorruptRecordError, KeyError) as exc:
                entry.update(ok=False, error=str(exc))
            report.append(entry)
        return report

    def _changed(self) -> bool:
        """Whether closing has anything to make durable: this tier wrote, metadata changed,
        the index changed under us, the manifest did not match the records at open, or it did
        not list every segment (written before listings, or a segment changed since)."""
        return bool(self._files.bytes_written or self._meta.dirty or not self._meta.vouches
                    or self._files.generation != self._open_generation or self._unlisted)

    @property
    def bytes_written(self) -> int:
        return self._files.bytes_written

    def _close(self) -> None:
        try:
            with self._files.lock.exclusive():
                if self._changed() and not self._files.read_only:
                    self._files.sync()
                    self._meta.save()
        finally:
            for doc in list(self._holds):
                self.release_doc(doc)
            self._pool.shutdown()
            self._files.close()

