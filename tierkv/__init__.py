"""tierkv: long-context decoding with the KV cache on three tiers (device, host, disk)."""
from .config import ChunkConfig, CodecConfig, SelectConfig, TierConfig, parse_size
from .hf.cache import TieredCache
from .hf.model import load_model
from .shapes import KVShape
from .storage.base import (CorruptRecordError, DeviceBudgetWarning, KVBlock, RecordKey, StorageError,
                           TierFullError)
from .storage.locking import DocInUseError
from .storage.store import KVStore

__all__ = [
    "ChunkConfig", "CodecConfig", "CorruptRecordError", "DeviceBudgetWarning", "DocInUseError",
    "KVBlock", "KVShape", "KVStore", "RecordKey", "SelectConfig", "StorageError", "TierConfig",
    "TierFullError", "TieredCache", "load_model", "parse_size",
]
