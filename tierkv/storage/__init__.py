"""The storage tiers: device, host and disk, the on-disk format, and the store over all three."""
from .base import CorruptRecordError, KVBlock, RecordKey, StorageError, Tier, TierFullError
from .device import DeviceTier
from .disk import DiskTier, RawRecord
from .host import HostTier
from .locking import DocInUseError
from .manifest import CorruptManifestError, DiskWriteError
from .store import KVStore

__all__ = ["CorruptManifestError", "CorruptRecordError", "DeviceTier", "DiskTier", "DiskWriteError",
           "DocInUseError", "HostTier", "KVBlock", "KVStore", "RawRecord", "RecordKey", "StorageError", "Tier",
           "TierFullError"]
