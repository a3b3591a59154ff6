"""What ``tierkv generate`` measures while it answers, and the table it prints at the end."""
from __future__ import annotations

import sys
import time

from transformers import TextStreamer

TIERS = ("device", "host", "disk")


class TimedStreamer(TextStreamer):
    """Prints the answer to stdout as it is generated; notes when each token came and how many
    bytes the disk tier had read by the first one."""

    def __init__(self, tokenizer, cache):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.cache = cache
        self.times: list[float] = []
        self.disk_read_at_first = 0

    def put(self, value):
        if not self.next_tokens_are_prompt:
            self.times.append(time.perf_counter())
            if len(self.times) == 1:
                self.disk_read_at_first = self.cache.stats()["disk_bytes_read"]
        super().put(value)

    def figures(self, started: float) -> dict:
        """First-token latency since ``started``, decode speed and disk bytes per decoded token."""
        n = len(self.times)
        out = {"new_tokens": n, "first_token_s": self.times[0] - started if n else None}
        if n > 1:
            read = self.cache.stats()["disk_bytes_read"] - self.disk_read_at_first
            out["decode_tok_s"] = (n - 1) / max(self.times[-1] - self.times[0], 1e-9)
            out["disk_read_per_token"] = read / (n - 1)
        return out


def human_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units)."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"


def run_rows(f: dict) -> list[tuple[str, str]]:
    """Rows about the document and the answer, from the figures ``generate`` collected."""
    doc = f["document_tokens"]
    if "prefill_s" in f:
        rows = [("prefill", f"{doc} tokens in {f['prefill_s']:.1f} s "
                            f"({doc / max(f['prefill_s'], 1e-9):.0f} tok/s)")]
    else:
        rows = [("reopen", f"{doc} tokens in {f['reopen_s']:.2f} s (no prefill)")]
    if f["first_token_s"] is not None:
        rows.append(("first token", f"{f['first_token_s']:.2f} s (question: "
                                    f"{f['question_tokens']} tokens)"))
    if "decode_tok_s" in f:
        rows.append(("decode", f"{f['new_tokens'] - 1} tokens at {f['decode_tok_s']:.2f} tok/s"))
        rows.append(("disk read / token", human_bytes(f["disk_read_per_token"])))
    return rows


def kv_rows(cache) -> list[tuple[str, str]]:
    """Rows about where the KV is (``cache.stats()``) and the fetch pipeline (``cache.metrics``)."""
    stats = cache.stats()
    select = cache.select
    rows = [("selection", f"{cache.policy.name}, budget {select.budget}, {select.fetch_unit} units")]
    rows += [(f"KV on {tier}", f"{human_bytes(stats.get(f'{tier}_bytes', 0))} "
                               f"({stats.get(f'{tier}_records', 0)} records)") for tier in TIERS]
    rows.append(("device peak", human_bytes(stats["device_peak_bytes"])))
    if stats["trimmed_fetches"]:
        rows.append(("cut to the device", f"{stats['trimmed_fetches']} fetches, "
                                          f"{stats['trimmed_tokens']} tokens short of the budget"))
    total = cache.metrics.summary()["total"]
    rows.append(("stall fraction", f"{total['stall_frac']:.3f}"))
    rows.append(("cache hit rate", f"{total['cache_hit_rate']:.3f}"))
    return rows


def print_table(rows: list[tuple[str, str]], file=None) -> None:
    """Two aligned columns, to stderr (stdout holds only the answer)."""
    file = file or sys.stderr
    width = max(len(name) for name, _ in rows)
    print(file=file)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}", file=file)
