"""A disk tier with a capped read bandwidth, to test and benchmark on a known slow disk."""
from __future__ import annotations

import threading
import time


class ThrottledDisk:
    """Wrap a DiskTier so that its reads deliver at most ``bandwidth`` bytes/s in total.

    Reads from all threads share the one budget, as they would share one device: each batch
    is booked after the previous ones and the call returns no earlier than its booked end.
    Everything else is the wrapped tier's.

    Parameters
    ----------
    disk : the DiskTier (anything with ``read_raw_many``).
    bandwidth : bytes per second, > 0.
    """

    def __init__(self, disk, bandwidth: float):
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or \
                not 0 < bandwidth < float("inf"):
            raise ValueError(f"bandwidth={bandwidth!r}: must be a positive number of bytes/s")
        self.disk = disk
        self.bandwidth = float(bandwidth)
        self._lock = threading.Lock()
        self._free_at = 0.0

    def read_raw_many(self, keys) -> list:
        start = time.perf_counter()
        raws = self.disk.read_raw_many(keys)
        nbytes = sum(len(raw.payload) for raw in raws)
        with self._lock:
            begin = max(start, self._free_at)
            self._free_at = begin + nbytes / self.bandwidth
            done_at = self._free_at
        delay = done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return raws

    def __getattr__(self, name):
        if name == "disk":  # not set yet (copy, unpickling): not the wrapped tier's
            raise AttributeError(name)
        return getattr(self.disk, name)
