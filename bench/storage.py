"""Disk-tier throughput against plain file I/O of the same bytes, on real SmolLM2 KV.

    python -m bench.storage [--quick]

For each record size (64 KiB to 4 MiB) the same payloads are written and read back, side by side,
best of 3: as plain file I/O (``pwrite`` + fsync, ``preadv`` in record-size chunks) and as records
through ``DiskTier`` (raw codec; ``put`` + ``flush``, then ``get_many`` in 16 MiB batches through
the page cache, ``direct_io=False``, and again with O_DIRECT, ``direct_io=True``). The page cache
is dropped (fsync + POSIX_FADV_DONTNEED) before every read pass. Writes
``bench/results/storage.json``; ``read_ratio`` = record / raw read GB/s (target >= 0.8), through
the page cache; ``direct_speedup`` = O_DIRECT / page-cache record reads, GB/s (None where the
file system refuses O_DIRECT).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import drop_page_cache, real_kv, write_result
from tierkv.config import CodecConfig
from tierkv.storage import DiskTier, KVBlock, RecordKey

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
BATCH_BYTES = 16 << 20


def make_records(keys: torch.Tensor, values: torch.Tensor, size: int, total: int):
    """(key, block) pairs of about ``size`` bytes each, ``total`` bytes in all, cut from real KV.

    keys, values : Tensor, shape (layers, kv_heads, tokens, head_dim).
    """
    layers, _, tokens, _ = keys.shape
    per_token_layer = 2 * keys[0, :, :1].nbytes
    n_layers = max(1, min(layers, size // (per_token_layer * tokens) + 1))
    n_tokens = max(1, min(tokens, size // (per_token_layer * n_layers)))
    records = []
    for i in range(max(1, total // (per_token_layer * n_layers * n_tokens))):
        start = (i * 37) % (tokens - n_tokens + 1)
        layer = (i * 7) % (layers - n_layers + 1)
        sl = (slice(layer, layer + n_layers), slice(None), slice(start, start + n_tokens))
        key = RecordKey("bench", i, start, start + n_tokens)
        records.append((key, KVBlock(keys[sl].contiguous(), values[sl].contiguous())))
    return records


def raw_io(path: Path, chunks: list[bytes]) -> tuple[float, float]:
    """Seconds to write (with fsync) and read back (page cache dropped) ``chunks`` as one file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    offset = 0
    for chunk in chunks:
        os.pwrite(fd, chunk, offset)
        offset += len(chunk)
    os.fsync(fd)
    t_write = time.perf_counter() - t0
    os.close(fd)
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(max(len(c) for c in chunks))
    t0 = time.perf_counter()
    offset = 0
    for chunk in chunks:
        os.preadv(fd, [memoryview(buf)[:len(chunk)]], offset)
        offset += len(chunk)
    t_read = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return t_write, t_read


def record_io(path: Path, records) -> tuple[float, float, float, float]:
    """Seconds to put + flush, then (page cache dropped before each pass) to read_raw_many and to
    get_many the records through the page cache (``direct_io=False``, what ``"auto"`` does while
    the records fit in available memory, as here), and to get_many them with O_DIRECT."""
    keys = [k for k, _ in records]
    per_batch = max(1, BATCH_BYTES // records[0][1].nbytes)
    batches = [keys[i:i + per_batch] for i in range(0, len(keys), per_batch)]
    with DiskTier(path, codec=CodecConfig("raw"), segment_size="256MiB") as tier:
        t0 = time.perf_counter()
        for key, block in records:
            tier.put(key, block)
        tier.flush()
        t_write = time.perf_counter() - t0
    timings = []
    for direct, read in ((False, "read_raw_many"), (False, "get_many"), (True, "get_many")):
        with DiskTier(path, codec=CodecConfig("raw"), direct_io=direct) as tier:
            for seg in path.glob("seg-*.tkv"):
                drop_page_cache(seg)
            t0 = time.perf_counter()
            for batch in batches:
                getattr(tier, read)(batch)
            timings.append(time.perf_counter() - t0)
            if direct and not tier.reads_direct():
                timings[-1] = None  # the file system refused O_DIRECT
    shutil.rmtree(path)
    return t_write, *timings


def bench_size(workdir: Path, keys, values, size: int, total: int, repeat: int) -> dict:
    """Best of ``repeat`` alternating raw / record runs at one record size."""
    records = make_records(keys, values, size, total)
    nbytes = sum(b.nbytes for _, b in records)
    chunks = [b.keys.numpy().tobytes() + b.values.numpy().tobytes() for _, b in records]
    raw, rec = [], []
    for _ in range(repeat):
        raw.append(raw_io(workdir / f"raw-{size}.bin", chunks))
        rec.append(record_io(workdir / f"tier-{size}", records))
    raw_w, raw_r = (min(t) for t in zip(*raw))
    rec_w, rec_raw_r, rec_r = (min(t) for t in zip(*[r[:3] for r in rec]))
    direct = [r[3] for r in rec if r[3] is not None]
    rec_direct_r = min(direct) if direct else None
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    return {"record_bytes": nbytes // len(records), "records": len(records),
            "raw_write_gbps": gbps(raw_w), "raw_read_gbps": gbps(raw_r),
            "record_write_gbps": gbps(rec_w), "record_read_gbps": gbps(rec_r),
            "record_read_raw_gbps": gbps(rec_raw_r),
            "record_read_direct_gbps": rec_direct_r and gbps(rec_direct_r),
            "direct_speedup": rec_direct_r and rec_r / rec_direct_r,
            "write_ratio": raw_w / rec_w, "read_ratio": raw_r / rec_r}


def summarise(per_size: dict) -> dict:
    """Overall figures: the mean over sizes of each GB/s and each ratio."""
    fields = ("raw_read_gbps", "raw_write_gbps", "record_read_gbps", "record_write_gbps",
              "record_read_direct_gbps", "direct_speedup", "read_ratio", "write_ratio")
    return {f: None if any(s[f] is None for s in per_size.values())
            else sum(s[f] for s in per_size.values()) / len(per_size) for f in fields}


def extra_sections(keys, values, quick: bool) -> dict:
    """The ``codecs`` and ``native`` sections from bench/codecs.py, when it is there."""
    try:
        from bench.codecs import bench_codecs, bench_native
    except ImportError:
        return {}
    return {"codecs": bench_codecs(keys, values),
            "native": bench_native(nbytes=(32 if quick else 128) << 20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, 32 MiB per size")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens, total, repeat = (512, 32 << 20, 3) if args.quick else (2048, 256 << 20, 3)
    keys, values = (t.to(torch.float16) for t in real_kv(tokens)[:2])
    workdir = Path(tempfile.mkdtemp(prefix="tierkv-bench-"))
    try:
        per_size = {str(size): bench_size(workdir, keys, values, size, total, repeat)
                    for size in SIZES}
    finally:
        shutil.rmtree(workdir)
    print(f"{'record':>10} {'raw w':>8} {'rec w':>8} {'raw r':>8} {'rec r':>8} {'r ratio':>8} "
          f"{'direct r':>8}")
    for size, s in per_size.items():
        print(f"{s['record_bytes']:>10} {s['raw_write_gbps']:8.2f} {s['record_write_gbps']:8.2f} "
              f"{s['raw_read_gbps']:8.2f} {s['record_read_gbps']:8.2f} {s['read_ratio']:8.2f} "
              f"{s['record_read_direct_gbps'] or 0:8.2f}")
    result = {"tokens": tokens, "dtype": "float16", "sizes": per_size, **summarise(per_size),
              **extra_sections(keys, values, args.quick)}
    print({k: v and round(v, 3) for k, v in summarise(per_size).items()})
    print(f"wrote {write_result('storage', result, args.quick)}")


if __name__ == "__main__":
    main()
