"""What every tier shares: record keys, KV blocks, byte accounting and the tier interface.

A tier maps ``RecordKey -> KVBlock``. Device and host tiers never exceed their budgets: a put
that does not fit raises ``TierFullError`` and the caller chooses what to demote; a tier never
drops data on its own.
"""
from __future__ import annotations

import operator
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Iterator, NamedTuple

import torch

_DOC_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


class StorageError(Exception):
    """Base of the storage errors."""


class TierFullError(StorageError):
    """A put would exceed the tier's budget; nothing was stored."""


class DeviceBudgetWarning(UserWarning):
    """A decode step attends fewer tokens of a layer group than its policy chose: the device
    tier does not hold them all beside the recent windows (``TieredCache.fit_to_device``).
    ``warnings.simplefilter("error", DeviceBudgetWarning)`` makes it an error instead (raised
    mid-step, which leaves that cache unable to go on)."""


class CorruptRecordError(StorageError):
    """A stored record failed its checks (magic, version, lengths, crc32, codec)."""


class NewerFormatError(StorageError):
    """A record or manifest written by a newer tierkv: this build will not read, repair or
    rewrite it (so the directory stays as the newer build left it)."""

    @classmethod
    def of(cls, what: str, version, reads) -> "NewerFormatError":
        return cls(f"{what} version {version}: this tierkv reads version {reads}; open the "
                   "directory with the tierkv that wrote it")


@dataclass(frozen=True, order=True)
class RecordKey:
    """One record: the K and V of layer group ``group`` of document ``doc``, tokens [start, end)."""

    doc: str
    group: int
    start: int
    end: int

    def __post_init__(self):
        if not isinstance(self.doc, str) or not _DOC_RE.match(self.doc):
            raise ValueError(f"doc={self.doc!r}: 1-64 characters of letters, digits, '_', '.', '-', "
                             "not starting with '.' or '-'")
        for name in ("group", "start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**40:
                raise ValueError(f"{name}={value!r}: must be an integer in [0, 2**40)")
        if self.end <= self.start:
            raise ValueError(f"token range [{self.start}, {self.end}) is empty")
        # a decode step hashes a few thousand keys (tiers, ranks, plans): once each, not per use
        object.__setattr__(self, "_hash", hash((self.doc, self.group, self.start, self.end)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return RecordKey, (self.doc, self.group, self.start, self.end)  # hashed anew on load

    @property
    def tokens(self) -> int:
        return self.end - self.start


class KVBlock(NamedTuple):
    """K and V of one record.

    keys, values : Tensor, shape (layers, kv_heads, tokens, head_dim), same dtype and device.
    """

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, device, non_blocking: bool = False) -> "KVBlock":
        return KVBlock(self.keys.to(device, non_blocking=non_blocking),
                       self.values.to(device, non_blocking=non_blocking))

    def check(self, key: RecordKey | None = None) -> "KVBlock":
        """Raise ValueError unless keys/values are 4-D, alike, and span ``key``'s tokens."""
        k, v = self.keys, self.values
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("KVBlock keys and values must be tensors")
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"KVBlock keys {tuple(k.shape)} and values {tuple(v.shape)}: "
                             "expected equal shapes (layers, kv_heads, tokens, head_dim)")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError("KVBlock keys and values differ in dtype or device")
        if k.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"KVBlock dtype {k.dtype}: must be float16, bfloat16 or float32")
        if k.layout != torch.strided or v.layout != torch.strided:
            raise ValueError(f"KVBlock keys and values must be dense tensors, not {k.layout}")
        if k.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KVBlock on {k.device}: keys and values must hold data on the CPU "
                             "or a CUDA device")
        if min(k.shape[0], k.shape[1], k.shape[3]) < 1:
            raise ValueError(f"KVBlock keys {tuple(k.shape)}: layers, kv_heads and head_dim "
                             "must be at least 1")
        if key is not None and k.shape[2] != key.tokens:
            raise ValueError(f"KVBlock holds {k.shape[2]} tokens but {key} spans {key.tokens}")
        return self


def check_put(key, block) -> None:
    """ValueError unless ``key`` is a RecordKey and ``block`` a valid KVBlock spanning it."""
    if not isinstance(key, RecordKey):
        raise ValueError(f"key={key!r}: expected a RecordKey")
    if not isinstance(block, KVBlock):
        raise ValueError(f"block of {key}: expected a KVBlock(keys, values), got "
                         f"{type(block).__name__}")
    block.check(key)


class Tier(ABC):
    """A budgeted map ``RecordKey -> KVBlock`` with byte accounting.

    Subclasses implement ``_store``, ``_load``, ``_drop`` and ``_close``; accounting, locking,
    budget checks and the batched variants live here, written once.
    """

    name = "tier"

    def __init__(self, budget: int | None):
        self.budget = budget
        self._sizes: dict[RecordKey, int] = {}
        self._reserved: dict[str, int] = {}
        self._used = 0
        self.peak = 0
        self._lock = threading.RLock()
        self._closed = False

    # -- what a tier adds -------------------------------------------------------------
    @abstractmethod
    def _store(self, key: RecordKey, block: KVBlock) -> int:
        """Store ``block``; return the bytes it occupies in this tier."""

    @abstractmethod
    def _load(self, key: RecordKey) -> KVBlock:
        """Return the block stored under ``key`` (known present)."""

    @abstractmethod
    def _drop(self, key: RecordKey) -> None:
        """Forget ``key`` (known present)."""

    def _close(self) -> None:
        """Release resources; called once."""

    def stored_size(self, block: KVBlock) -> int:
        """Bytes ``block`` would occupy here (the budget check); raw size by default."""
        return block.nbytes

    # -- the interface ----------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self._used

    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self._used + nbytes <= self.budget

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[RecordKey]:
        with self._lock:
            return iter(list(self._sizes))

    def keys(self) -> list[RecordKey]:
        with self._lock:
            return list(self._sizes)

    def contains(self, key: RecordKey) -> bool:
        return key in self._sizes

    __contains__ = contains

    def size_of(self, key: RecordKey) -> int:
        return self._sizes[key]

    def put(self, key: RecordKey, block: KVBlock) -> None:
        """Store ``block`` under ``key``, replacing an existing record.

        Raises TierFullError (nothing stored) when it does not fit the budget.
        """
        check_put(key, block)
        need = self.stored_size(block)
        with self._lock:
            self._check_open()
            old = self._sizes.get(key, 0)
            if self.budget is not None and self._used - old + need > self.budget:
                raise TierFullError(f"{self.name}: {key} needs {need} B, "
                                    f"{self.budget - self._used + old} B free of {self.budget}")
            stored = self._store(key, block)
            self._used += stored - old
            self._sizes[key] = stored
            self.peak = max(self.peak, self._used)

    def reserve(self, tag: str, nbytes: int) -> None:
        """Account ``nbytes`` held outside records under ``tag`` (windows, step buffers).

        Replaces the previous amount under ``tag``; 0 releases it. Raises TierFullError, changing
        nothing, when the budget would be exceeded.
        """
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            nbytes = -1
        if nbytes < 0:
            raise ValueError(f"reserve({tag!r}, ...): expected a whole byte count >= 0")
        with self._lock:
            old = self._reserved.get(tag, 0)
            if nbytes > old and self.budget is not None and self._used - old + nbytes > self.budget:
                raise TierFullError(f"{self.name}: {tag} needs {nbytes} B, "
                                    f"{self.budget - self._used + old} B free of {self.budget}")
            self._used += nbytes - old
            if nbytes:
                self._reserved[tag] = nbytes
            else:
                self._reserved.pop(tag, None)
            self.peak = max(self.peak, self._used)

    @property
    def reserved(self) -> int:
        return sum(self._reserved.values())

    def reserved_for(self, tag: str) -> int:
        """Bytes currently reserved under ``tag`` (0 when none)."""
        return self._reserved.get(tag, 0)

    def get(self, key: RecordKey) -> KVBlock:
        """The block under ``key``; KeyError when absent."""
        with self._lock:
            self._check_open()
            if key not in self._sizes:
                raise KeyError(key)
        return self._load(key)

    def remove(self, key: RecordKey) -> int:
        """Forget ``key``; return the bytes freed (0 when absent)."""
        with self._lock:
            self._check_open()
            size = self._sizes.pop(key, None)
            if size is None:
                return 0
            self._drop(key)
            self._used -= size
            return size

    def put_many(self, items: Iterable[tuple[RecordKey, KVBlock]]) -> None:
        for key, block in items:
            self.put(key, block)

    def get_many(self, keys: Iterable[RecordKey]) -> list[KVBlock]:
        return [self.get(key) for key in keys]

    def remove_many(self, keys: Iterable[RecordKey]) -> int:
        return sum(self.remove(key) for key in keys)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{self.name} tier is closed")
