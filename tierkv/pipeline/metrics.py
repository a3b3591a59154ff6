"""What the pipeline did: bytes per tier, stall, overlap, cache hits and codec mix, per step."""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

SOURCES = ("cache", "device", "host", "disk")
STAGES = ("read", "decode", "copy")


@dataclass
class StepStats:
    """Counters of one decode step (or of all steps, summed)."""

    bytes: Counter = field(default_factory=Counter)      # raw bytes delivered, by source
    records: Counter = field(default_factory=Counter)    # records delivered, by source
    codecs: Counter = field(default_factory=Counter)     # disk records read, by codec
    stage_s: Counter = field(default_factory=Counter)    # busy seconds by stage
    disk_stored_bytes: int = 0
    fetch_s: float = 0.0     # summed wall time of the group fetches
    stall_s: float = 0.0     # time the consumer spent blocked in wait() or fetch_now()
    step_s: float = 0.0

    def add(self, other: "StepStats") -> None:
        for name in ("bytes", "records", "codecs", "stage_s"):
            getattr(self, name).update(getattr(other, name))
        self.disk_stored_bytes += other.disk_stored_bytes
        self.fetch_s += other.fetch_s
        self.stall_s += other.stall_s
        self.step_s += other.step_s

    def as_dict(self) -> dict:
        hits, total = self.records["cache"], sum(self.records.values())
        return {
            "bytes": {s: int(self.bytes[s]) for s in SOURCES},
            "records": {s: int(self.records[s]) for s in SOURCES},
            "disk_stored_bytes": int(self.disk_stored_bytes),
            "codec_mix": dict(sorted(self.codecs.items())),
            "stage_s": {s: round(self.stage_s[s], 6) for s in STAGES},
            "fetch_s": round(self.fetch_s, 6),
            "stall_s": round(self.stall_s, 6),
            "step_s": round(self.step_s, 6),
            "stall_frac": _ratio(self.stall_s, self.step_s),
            "overlap_frac": _overlap(self.stall_s, self.fetch_s),
            "cache_hit_rate": _ratio(hits, total),
        }


class Metrics:
    """Thread-safe pipeline counters, per step and in total.

    The consumer brackets each decode step with ``step_begin()`` / ``step_end()``; the pipeline
    records into the open step. Records made outside a step (a late, cancelled group) count
    towards the next step, and the totals always include them.
    ``overlap_frac`` is the share of fetch time hidden behind compute: ``1 - stall / fetch``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._steps: list[StepStats] = []
        self._current = StepStats()
        self._started: float | None = None   # perf_counter() of step_begin; None between steps

    def step_begin(self) -> None:
        with self._lock:
            self._close_step()
            self._started = time.perf_counter()

    def step_end(self) -> None:
        with self._lock:
            self._close_step()

    def record_delivery(self, source: str, nbytes: int) -> None:
        """One record of ``nbytes`` raw bytes delivered from ``source`` (see SOURCES)."""
        self.record_deliveries((source,), (nbytes,))

    def record_deliveries(self, sources, nbytes) -> None:
        """Records delivered: ``sources`` and ``nbytes``, one per record; all or none counted."""
        records, total = Counter(), Counter()
        for source, size in zip(sources, nbytes):
            records[source] += 1
            total[source] += size
        bad = next((s for s in records if s not in SOURCES), None)
        if bad is not None:
            raise ValueError(f"source={bad!r}: must be one of {', '.join(SOURCES)}")
        with self._lock:
            self._current.bytes.update(total)
            self._current.records.update(records)

    def record_disk(self, codec: str, stored_bytes: int) -> None:
        with self._lock:
            self._current.codecs[codec] += 1
            self._current.disk_stored_bytes += stored_bytes

    def record_stage(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: must be one of {', '.join(STAGES)}")
        with self._lock:
            self._current.stage_s[stage] += seconds

    def record_fetch(self, seconds: float) -> None:
        with self._lock:
            self._current.fetch_s += seconds

    def record_stall(self, seconds: float) -> None:
        with self._lock:
            self._current.stall_s += seconds

    @property
    def steps(self) -> int:
        return len(self._steps)

    def step(self, index: int = -1) -> dict:
        """The counters of one finished step (default: the last)."""
        with self._lock:
            return self._steps[index].as_dict()

    def summary(self) -> dict:
        """Totals (finished steps and what was recorded since), the number of finished steps
        and their stall fractions."""
        with self._lock:
            total = StepStats()
            for step in self._steps + [self._current]:
                total.add(step)
            return {"steps": len(self._steps), "total": total.as_dict(),
                    "stall_frac_per_step": [_ratio(s.stall_s, s.step_s) for s in self._steps]}

    def format_table(self) -> str:
        """A plain-text table of the totals."""
        total = self.summary()["total"]
        rows = [(f"bytes[{s}]", f"{total['bytes'][s] / 1e6:.2f} MB") for s in SOURCES]
        rows += [("disk stored", f"{total['disk_stored_bytes'] / 1e6:.2f} MB"),
                 ("codec mix", ", ".join(f"{k}={v}" for k, v in total["codec_mix"].items()) or "-"),
                 ("cache hit rate", f"{total['cache_hit_rate']:.3f}"),
                 ("step time", f"{total['step_s'] * 1e3:.1f} ms"),
                 ("stall time", f"{total['stall_s'] * 1e3:.1f} ms"),
                 ("stall frac", f"{total['stall_frac']:.3f}"),
                 ("overlap frac", f"{total['overlap_frac']:.3f}")]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def _close_step(self) -> None:
        if self._started is not None:
            self._current.step_s = time.perf_counter() - self._started
            self._steps.append(self._current)
            self._current = StepStats()
            self._started = None


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole > 0 else 0.0


def _overlap(stall: float, fetch: float) -> float:
    return round(min(1.0, max(0.0, 1.0 - stall / fetch)), 6) if fetch > 0 else 0.0
