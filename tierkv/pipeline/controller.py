"""Dynamic compression (DTP): pick each record's codec from measured bandwidths.

Expected fetch time of a record of ``r`` raw bytes under codec c is
``r * ratio[c] / disk_bw + r / decode_bw[c] + r / copy_bw``: a slow disk favours strong
compression, a fast one favours none. With ``pipelined=True`` the read and decode terms are
combined by ``max`` instead of ``+``: when the pipeline keeps reads of one group in flight while
another group decodes, the slower stage alone sets the pace. Every rate is an exponential moving
average of what the pipeline measures, and can be seeded by ``calibrate`` / ``calibrate_disk`` or
given outright (tests, benchmarks).

A ``KVStore`` given a controller asks ``choose_for`` for the codec of every record it writes to
disk; a ``Pipeline`` over that store feeds the same controller what it measures, so later writes
(spills, rewrites) follow the disk the reads ran on.
"""
from __future__ import annotations

import threading
import time
from typing import Mapping

from tierkv.config import CODECS, LOSSY_CODECS, CodecConfig
from tierkv.storage.base import KVBlock
from tierkv.storage.codec import decode_block, encode_block, make_codec
from tierkv.workers import worker_pool


class _Ema:
    """An exponential moving average; the first sample sets it."""

    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def update(self, sample: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            self.value += self.alpha * (sample - self.value)


class CompressionController:
    """Choose the codec that minimises the expected fetch time of a record.

    Parameters
    ----------
    candidates : codecs it may choose; lossy ones (int8, int4) only for ``cold`` records.
    alpha : EMA weight of a new sample, in (0, 1].
    disk_bw : bytes/s read from disk, if known.
    decode_bw : codec -> raw bytes/s decoded, if known.
    ratio : codec -> stored bytes / raw bytes, if known.
    copy_bw : bytes/s host -> device (the same for every codec; it only shifts the estimate).
    pipelined : read and decode overlap (a Pipeline with 2+ threads and cores to spare):
        cost = max, not sum. On a few busy cores the stages compete and the sum is closer.
    margin : a candidate replaces an earlier one (earlier = cheaper to decode, less lossy:
        raw, zstd, int8, int4) only when expected faster by more than this fraction, so that
        measurement noise does not flip choices that gain nothing.
    config : zstd level and group size of the codecs it calibrates (default ``CodecConfig()``).
    """

    def __init__(self, candidates: tuple[str, ...] = ("raw", "zstd"), *, alpha: float = 0.3,
                 disk_bw: float | None = None, decode_bw: Mapping[str, float] | None = None,
                 ratio: Mapping[str, float] | None = None, copy_bw: float | None = None,
                 pipelined: bool = False, margin: float = 0.1, config: CodecConfig | None = None):
        candidates = tuple(candidates)
        if not candidates or any(c not in CODECS for c in candidates):
            raise ValueError(f"candidates={candidates!r}: must be a non-empty subset of "
                             f"{', '.join(CODECS)}")
        if config is not None and not isinstance(config, CodecConfig):
            raise ValueError(f"config={config!r}: expected a CodecConfig")
        self.config = config or CodecConfig()
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha!r}: must be in (0, 1]")
        self.candidates = candidates
        self.pipelined = bool(pipelined)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin={margin!r}: must be in [0, 1)")
        self.margin = float(margin)
        self._lock = threading.Lock()
        self._disk = _Ema(alpha, _positive("disk_bw", disk_bw))
        self._copy = _Ema(alpha, _positive("copy_bw", copy_bw))
        self._decode = {c: _Ema(alpha, _positive(f"decode_bw[{c}]", (decode_bw or {}).get(c)))
                        for c in candidates}
        self._ratio = {c: _Ema(alpha, _positive(f"ratio[{c}]", (ratio or {}).get(c)))
                       for c in candidates}

    @classmethod
    def from_config(cls, config: CodecConfig, **kwargs) -> "CompressionController":
        """A controller over ``config.candidates``, calibrating with ``config``'s settings."""
        return cls(config.candidates, config=config, **kwargs)

    # -- measurements -------------------------------------------------------------------
    def observe_read(self, stored_bytes: int, seconds: float) -> None:
        """The disk delivered ``stored_bytes`` in ``seconds`` (all readers together)."""
        if stored_bytes > 0 and seconds > 0:
            with self._lock:
                self._disk.update(stored_bytes / seconds)

    def observe_decode(self, codec: str, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        """Decoding ``stored_bytes`` of ``codec`` into ``raw_bytes`` took ``seconds``."""
        if codec not in self._decode or raw_bytes <= 0:
            return
        with self._lock:
            self._ratio[codec].update(stored_bytes / raw_bytes)
            self._decode[codec].update(raw_bytes / max(seconds, 1e-9))

    def observe_copy(self, raw_bytes: int, seconds: float) -> None:
        if raw_bytes > 0 and seconds > 0:
            with self._lock:
                self._copy.update(raw_bytes / seconds)

    def calibrate(self, sample: KVBlock, config: CodecConfig | None = None,
                  repeat: int = 3, codecs: tuple[str, ...] | None = None) -> None:
        """Seed ratio and decode speed of ``codecs`` (default: every candidate) from ``sample``
        (CPU tensors), encoded with ``config`` (default: the controller's)."""
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise ValueError(f"repeat={repeat!r}: must be a positive integer")
        codecs = self.candidates if codecs is None else tuple(codecs)
        if any(c not in self.candidates for c in codecs):
            raise ValueError(f"codecs={codecs!r}: must be among the candidates {self.candidates}")
        for name in codecs:
            codec = make_codec(name, config or self.config)
            payload = encode_block(codec, sample)
            best = float("inf")
            for _ in range(repeat):
                start = time.perf_counter()
                decode_block(codec, payload, sample.keys.dtype, tuple(sample.keys.shape))
                best = min(best, time.perf_counter() - start)
            self.observe_decode(name, sample.nbytes, len(payload), best)

    def calibrate_disk(self, disk, batches, threads: int = 2) -> None:
        """Set the disk bandwidth to what reading ``batches`` (lists of RecordKey) from ``disk``
        (anything with ``read_raw_many``) gives in total, ``threads`` batches in flight as in
        a Pipeline of that many threads; later measurements move it as usual."""
        start = time.perf_counter()
        with worker_pool(threads, "tierkv-calibrate") as pool:
            sizes = pool.map(lambda keys: sum(len(r.payload) for r in disk.read_raw_many(keys)),
                             batches)
            nbytes = sum(sizes)
        seconds = time.perf_counter() - start
        if nbytes == 0 or seconds <= 0:
            raise ValueError("calibrate_disk: the batches read no bytes")
        with self._lock:
            self._disk.value = nbytes / seconds

    def assume_disk(self, disk_bw: float) -> None:
        """Take ``disk_bw`` (bytes/s, e.g. ``storage.probe.read_bandwidth``) as the disk's speed
        until reads are measured; no effect once the disk bandwidth is known."""
        _positive("disk_bw", disk_bw)
        with self._lock:
            if self._disk.value is None:
                self._disk.value = float(disk_bw)

    # -- decisions ----------------------------------------------------------------------
    def expected_time(self, codec: str, nbytes_raw: int) -> float | None:
        """Seconds to fetch ``nbytes_raw`` raw bytes stored with ``codec``; None if unmeasured."""
        with self._lock:
            disk, copy = self._disk.value, self._copy.value
            ratio, decode = self._ratio[codec].value, self._decode[codec].value
        if disk is None or ratio is None or decode is None:
            return None
        read, unpack = nbytes_raw * ratio / disk, nbytes_raw / decode
        seconds = max(read, unpack) if self.pipelined else read + unpack
        return seconds + (nbytes_raw / copy if copy else 0.0)

    def choose(self, nbytes_raw: int, cold: bool = False) -> str:
        """The allowed codec with the least expected fetch time of ``nbytes_raw`` bytes.

        Lossy candidates are allowed only when ``cold``. Until a codec's rates are known it is
        skipped; with none known, the first allowed candidate is returned. A later candidate
        wins only by more than ``margin``.
        """
        if isinstance(nbytes_raw, bool) or not isinstance(nbytes_raw, int) or nbytes_raw <= 0:
            raise ValueError(f"nbytes_raw={nbytes_raw!r}: must be a positive integer")
        allowed = [c for c in self.candidates if cold or c not in LOSSY_CODECS]
        allowed = allowed or list(self.candidates)  # a lossy codec fixed by the config
        times = {c: self.expected_time(c, nbytes_raw) for c in allowed}
        known = [(c, t) for c, t in times.items() if t is not None]
        if not known:
            return allowed[0]
        best, best_time = known[0]
        for codec, seconds in known[1:]:
            if seconds < best_time * (1 - self.margin):
                best, best_time = codec, seconds
        return best

    def choose_for(self, block: KVBlock, cold: bool = False) -> str | None:
        """The codec to write ``block`` with (``choose`` for its size), or None while the disk
        bandwidth is unknown: with nothing to weigh a codec against, the writer's default stands.

        Candidates with no ratio or decode speed yet are first calibrated on ``block``: a codec
        no record was ever read with would otherwise never be chosen, hence never measured.
        """
        if not isinstance(block, KVBlock):
            raise ValueError(f"block={block!r}: expected a KVBlock")
        with self._lock:
            if self._disk.value is None:
                return None
            unknown = tuple(c for c in self.candidates
                            if self._ratio[c].value is None or self._decode[c].value is None)
        if unknown:
            self.calibrate(block.to("cpu"), codecs=unknown)
        return self.choose(block.nbytes, cold)

    def state(self) -> dict:
        """The current estimates (bytes/s and ratios), for reports."""
        with self._lock:
            return {"disk_bw": self._disk.value, "copy_bw": self._copy.value,
                    "decode_bw": {c: e.value for c, e in self._decode.items()},
                    "ratio": {c: e.value for c, e in self._ratio.items()}}


class ReadMeter:
    """Aggregate read bandwidth for a controller: concurrent reads share one wall clock.

    Per-call bandwidth undercounts a disk read by several threads at once; this meter sums the
    bytes of a busy period (at least one read in flight) and divides by its length, reporting a
    sample when the disk goes idle or every ``period`` seconds of continuous use. Periods of
    fewer than ``min_bytes`` are dropped: their time is mostly per-request latency, which every
    codec pays alike (the number of reads does not depend on the codec), so it must not count
    as bandwidth.
    """

    def __init__(self, controller: CompressionController, period: float = 0.25,
                 min_bytes: int = 1 << 20):
        self.controller = controller
        self.period = period
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._inflight = 0
        self._bytes = 0
        self._since = 0.0

    def begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
                self._bytes = 0
            self._inflight += 1

    def end(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self._bytes += nbytes
            now = time.perf_counter()
            if self._inflight and now - self._since < self.period:
                return
            nbytes, seconds = self._bytes, now - self._since
            self._bytes, self._since = 0, now
        if nbytes >= self.min_bytes:
            self.controller.observe_read(nbytes, seconds)


def _positive(name: str, value: float | None) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not value > 0):
        raise ValueError(f"{name}={value!r}: must be a positive number of bytes/s or a ratio")
    return None if value is None else float(value)
