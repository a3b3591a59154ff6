"""Decode-step cost at long contexts, on synthetic KV shaped like Llama-3-8B, without a model.

KV of 32 layers x 8 KV heads x head_dim 128, fp16 (128 KiB a token) is written through
``tierkv.KVStore`` as records of 64 tokens x one layer group of 4 layers (1 MiB each); the
per-chunk min/max key summaries (``tierkv.summary``) of each group's first layer stay in memory,
in fp16 like the keys (exact: a min or max of fp16 values is one of them; half the fp32 size).
Records cycle through a seeded pool of Gaussian blocks (generating 8 GiB of fresh random numbers
on two cores would dominate the run); a few "needle" chunks per group get keys aligned with the
query direction of their KV head. Device budget 1 GB and host 4 GB from 64K tokens up, scaled
with the context below that (the rest spills to disk, raw codec; the disk tier reads with O_DIRECT
when its records outgrow the machine's available memory, ``disk_reads_direct``).

A decode step, per group: LKA bound scores of every chunk for the group's query, the top chunks
within a 2 % token budget, ``KVStore.fetch`` of them (page cache dropped before the step), and
GQA attention on the CPU for each of the group's layers (``tierkv.attention.DecodeAccumulator``:
record by record, merged by log-sum-exp; its C kernel reads each fp16 record once, where
``tierkv._native`` is built, else each record is converted to fp32 while it is in the cache). As in
tierkv's pipeline, selection and fetch run ahead of the attention, which keeps the group order:
a loader thread selects and submits the step's records, ``BATCH`` at a time, to ``FETCHERS``
fetch threads, at most ``LOOKAHEAD`` batches ahead of the main thread. Side by side, each just
before each step:

* ``physical_bound_s``: the step's disk bytes / the bandwidth of plain sequential reads of a file
  of the same volume (page cache dropped; the best of one thread through the page cache and
  ``IO_THREADS`` threads with O_DIRECT): the target's bound;
* ``extent_bound_s``: the step's disk bytes / the bandwidth of plain reads of the very extents of
  a step's disk records (scattered 1 MiB reads, ``IO_THREADS`` at a time, the best of page-cache
  and O_DIRECT reads): the disk's limit for this access pattern, without any of tierkv's work;

and once, ``brute_s``: the step reading every record, through the same code. A budget that is a
share of the context reads bytes in proportion to it, so its step cannot grow sub-linearly; the
same steps with ``FIXED_SELECT`` tokens a group at every size (``fixed_budget``: 2 % of 64K)
show what the rest of the step (the bounds of every chunk, the host tier, the index) adds as the
context grows. ``growth``: from each size to the next, the ratio of step times and its exponent
in the ratio of contexts (below 1: sub-linear), for both budgets. ``step_cpu_s``: the
CPU time of the whole process during a step (every thread, user and system: selection, reads,
checks, attention); ``cpu_bound_s`` that over the cores the process may use: the step cannot be
shorter, however fast the disk. On a machine of few cores, a fast disk leaves the step bound by
the CPU (``step_over_cpu_bound`` near 1) and a slow one by the disk (``step_over_physical_bound``
near 1): the physical bound alone does not say which limit a run met.

Memory: each size runs in a fresh process. ``rss_baseline`` is that process before the store
opens (torch, the synthetic pool; ``rss_idle``: the parent, torch only); ``peak_rss_write``,
``peak_rss_step`` and ``peak_rss_brute`` are the peak resident set (Linux VmHWM, reset at the start
of each phase) of writing the KV, of the selective steps and of the brute-force step, each with
the baseline, the host tier and the summaries included; ``peak_rss_process`` is the largest.

On a machine with CUDA the device tier is the GPU: fetches land there through pinned host memory
and the attention runs there (``TIERKV_BENCH_DEVICE=cpu`` keeps it all on the CPU); the step ends
with a device synchronisation and the result goes to ``scale.gpu.json``.

    python -m bench.scale [--quick] [--tokens 65536 262144]   ->  bench/results/scale.json
"""
from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import queue
import resource
import shutil
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from bench.common import bench_device, drop_page_cache, sync, write_result
from bench.diskbw import RawReads, extent_reads
from tierkv import KVBlock, KVShape, KVStore, RecordKey, TierConfig
from tierkv.attention import DecodeAccumulator
from tierkv.config import CodecConfig
from tierkv.summary import chunk_scores, summarize

SHAPE = KVShape(layers=32, kv_heads=8, head_dim=128, q_heads=32, dtype=torch.float16)
GROUP, CHUNK, SELECT = 4, 64, 0.02
REF_TOKENS = 65536       # the context at which the budgets are 1 GB / 4 GB
FIXED_SELECT = int(SELECT * REF_TOKENS) // CHUNK * CHUNK  # 2 % of 64K held fixed: 1,280 tokens
MIN_TOKENS = 4096
NEEDLES = 4              # needle chunks per group
POOL = 64                # distinct random blocks the records cycle through
DEVICE_BUDGET, HOST_BUDGET = 1e9, 4e9
BATCH = 16               # records per KVStore.fetch: the unit of prefetch
LOOKAHEAD = 3            # batches submitted but not yet attended, at most (besides the current)
FETCHERS = 2             # batches fetched at once
IO_THREADS = 8           # the disk tier's readers (default 4): scattered 1 MiB reads gain from depth
BRUTE_MAX_BYTES = 48 << 30  # reading every record: ~1.5 min a step at 30 GB here
SCALING = SHAPE.head_dim ** -0.5
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class SyntheticKV:
    """Seeded records and queries: Gaussian keys/values plus needle chunks along a query
    direction per KV head."""

    def __init__(self, tokens: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        shape = (GROUP, SHAPE.kv_heads, CHUNK, SHAPE.head_dim)
        self.pool = [(torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half())
                     for _ in range(POOL)]
        self.chunks = tokens // CHUNK
        self.groups = SHAPE.layers // GROUP
        self.direction = F.normalize(torch.randn(self.groups, SHAPE.kv_heads, SHAPE.head_dim,
                                                 generator=gen), dim=-1)
        self.needles = [sorted(torch.randperm(self.chunks, generator=gen)[:NEEDLES].tolist())
                        for _ in range(self.groups)]
        self.gen = gen

    def block(self, group: int, chunk: int) -> KVBlock:
        """The record of ``chunk``: pool tensors as they are (the store copies what it keeps),
        a needle chunk's keys copied and changed."""
        keys, values = self.pool[(chunk * 7919 + group * 31) % POOL]
        if chunk in self.needles[group]:
            # a few tokens point hard along the query: q . k stands far above the noise
            keys = keys.clone()
            keys[:, :, 8:16] += 12 * self.direction[group].view(1, SHAPE.kv_heads, 1, -1).half()
        return KVBlock(keys, values)

    def query(self, group: int) -> torch.Tensor:
        """The group's decode query, shape (q_heads, head_dim), near the needle direction."""
        g = SHAPE.q_heads // SHAPE.kv_heads
        q = 4 * self.direction[group].repeat_interleave(g, dim=0)
        return q + 0.5 * torch.randn(q.shape, generator=self.gen)


def key(group: int, chunk: int) -> RecordKey:
    return RecordKey("scale", group, chunk * CHUNK, (chunk + 1) * CHUNK)


def fill(store: KVStore, kv: SyntheticKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write every record; the per-group summaries (kmin, kmax), shape (chunks, kv_heads, dim),
    in the keys' dtype."""
    summaries = []
    for g in range(kv.groups):
        kmin, kmax = (torch.empty(kv.chunks, SHAPE.kv_heads, SHAPE.head_dim, dtype=SHAPE.dtype)
                      for _ in range(2))
        for c in range(kv.chunks):
            block = kv.block(g, c)
            kmin[c], kmax[c] = summarize(block.keys[0])
            store.put(key(g, c), block)
        summaries.append((kmin, kmax))
    store.disk.flush()
    return summaries


def drop_store_cache(store: KVStore) -> None:
    for seg in Path(store.disk.path).glob("seg-*.tkv"):
        drop_page_cache(seg)


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: VmHWM is reset through /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    """Peak resident bytes since ``reset_peak_rss`` (Linux), else since the process began."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Timeline:
    """Busy spans of one kind of work, from any thread; ``seconds``: the time at least one ran."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []

    def timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.spans.append((t0, time.perf_counter()))

    @property
    def seconds(self) -> float:
        total, end = 0.0, -math.inf
        for t0, t1 in sorted(self.spans):
            total += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        return total


class Workers:
    """The loader and fetch threads of the steps, kept from step to step: a fresh thread pays
    torch's per-thread set-up (~10 ms here) on its first operation."""

    def __init__(self):
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="scale-load")
        self.fetchers = ThreadPoolExecutor(FETCHERS, thread_name_prefix="scale-fetch")

    def close(self) -> None:
        self.loader.shutdown()
        self.fetchers.shutdown()


def load(store: KVStore, kv: SyntheticKV, summaries, chosen_of, fetchers, out: queue.Queue,
         work: dict[str, Timeline], cancel: threading.Event) -> list[RecordKey]:
    """The loader: select each group's chunks and submit the step's records to ``fetchers``, in
    order, ``BATCH`` at a time (a batch may span groups); each batch goes into ``out`` as (future
    of its blocks, its (group, query, chosen, chunk) entries), then None. The keys submitted."""
    submitted, pending = [], []
    try:
        for g, (kmin, kmax) in enumerate(summaries):
            q = kv.query(g)
            chosen = work["select"].timed(chosen_of, q, kmin, kmax)
            pending += [(g, q, chosen, c) for c in chosen]
            while not cancel.is_set() and (len(pending) >= BATCH or
                                           (pending and g == len(summaries) - 1)):
                batch, pending = pending[:BATCH], pending[BATCH:]
                keys = [key(group, c) for group, _, _, c in batch]
                out.put((fetchers.submit(work["fetch"].timed, store.fetch, keys,
                                         store.device.device), batch))
                submitted += keys
    finally:
        out.put(None)
    return submitted


def attend(items: queue.Queue, kv: SyntheticKV, work: dict[str, Timeline]) -> int:
    """The main thread's part of a step: each group's GQA attention over its fetched records,
    as they arrive; the needle chunks among the chosen ones."""
    hits, acc = 0, None
    while (item := work["stall"].timed(items.get)) is not None:
        future, batch = item
        blocks = work["stall"].timed(future.result)
        t0 = time.perf_counter()
        for (g, q, chosen, chunk), block in zip(batch, blocks):
            if acc is None:
                acc = DecodeAccumulator(q.expand(GROUP, *q.shape).to(block.keys.device), SCALING)
            acc.add(block.keys, block.values)  # a record at a time: its fp32 copies stay in cache
            if chunk == chosen[-1]:
                acc.result()
                acc = None
                hits += len(set(chosen) & set(kv.needles[g]))
        work["attend"].spans.append((t0, time.perf_counter()))
        del item, future, blocks
    return hits


def step(store: KVStore, kv: SyntheticKV, summaries, chosen_of, workers: Workers) -> dict:
    """One decode step over all groups; ``chosen_of(q, kmin, kmax)`` names the chunks.

    Times: ``s`` the step; ``select_s`` and ``fetch_s`` the time any selection / any
    ``KVStore.fetch`` ran; ``attend_s`` the main thread's attention; ``stall_s`` its waits.
    ``keys``: the records read.
    """
    drop_store_cache(store)
    read0, cpu0 = store.disk.bytes_read, _cpu_seconds()
    work = {name: Timeline() for name in ("select", "fetch", "attend", "stall")}
    items, cancel = queue.Queue(LOOKAHEAD), threading.Event()
    start = time.perf_counter()
    job = workers.loader.submit(load, store, kv, summaries, chosen_of, workers.fetchers, items,
                                work, cancel)
    try:
        hits = attend(items, kv, work)
    except BaseException:
        cancel.set()
        while not job.done():  # unblock the loader
            with contextlib.suppress(queue.Empty):
                items.get(timeout=0.1)
        raise
    keys = job.result()
    sync(store.device.device)
    seconds = time.perf_counter() - start
    return {"s": seconds, **{f"{name}_s": t.seconds for name, t in work.items()}, "keys": keys,
            "cpu_s": _cpu_seconds() - cpu0,
            "disk_bytes": store.disk.bytes_read - read0, "recall": hits / (NEEDLES * len(summaries))}


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def top_chunks(select_tokens: int):
    def chosen_of(q, kmin, kmax):
        scores = chunk_scores(q, kmin, kmax)[1]
        return sorted(scores.topk(max(1, select_tokens // CHUNK)).indices.tolist())
    return chosen_of


def extent_gbps(store: KVStore, keys: list[RecordKey], threads: int) -> float:
    """GB/s of plain reads of the disk records of ``keys`` (their exact file extents in disk
    order, ``threads`` at a time, page cache dropped): the disk's bandwidth for the step's access
    pattern, with none of tierkv's work. The best of reads through the page cache and O_DIRECT
    reads (of the whole 4 KiB blocks around each extent)."""
    live = store.disk._files.index.live  # record locations: private to the disk tier
    locs = sorted((live[k] for k in keys if store.where(k) == "disk"),
                  key=lambda loc: (loc.segment, loc.offset))
    return max(extent_reads(store.disk.path, locs, threads, direct) for direct in (False, True))


def measured_steps(store: KVStore, kv: SyntheticKV, summaries, root: Path, select_tokens: int,
                   steps: int, threads: int) -> tuple[list[dict], float, float]:
    """A warm-up step, then ``steps`` steps, each just after a sequential raw read of the same
    volume and a plain read of the warm-up step's extents (``extent_gbps``); the steps' results
    and the mean sequential and extent bandwidths (GB/s)."""
    chosen_of = top_chunks(select_tokens)
    workers = Workers()
    try:
        warm = step(store, kv, summaries, chosen_of, workers)
        raw = RawReads(root / "raw.bin", warm["disk_bytes"], threads)
        try:
            runs, seq, extents = [], [], []
            for _ in range(steps):
                seq.append(raw.gbps())
                extents.append(extent_gbps(store, warm["keys"], threads))
                runs.append(step(store, kv, summaries, chosen_of, workers))
        finally:
            raw.path.unlink()
    finally:
        workers.close()
    return runs, sum(seq) / steps, sum(extents) / steps


def brute_step(store: KVStore, kv: SyntheticKV, summaries) -> dict:
    """The step reading every record, through the same code."""
    workers = Workers()
    try:
        return step(store, kv, summaries, lambda q, lo, hi: list(range(kv.chunks)), workers)
    finally:
        workers.close()


def bench_size(root: Path, tokens: int, steps: int) -> dict:
    scale = min(1.0, tokens / REF_TOKENS)  # 1 GB / 4 GB from 64K tokens up
    device, host = int(DEVICE_BUDGET * scale), int(HOST_BUDGET * scale)
    config = TierConfig(device_budget=device, host_budget=host, disk_dir=root / f"kv-{tokens}",
                        device=str(bench_device()), codec=CodecConfig("raw"), io_threads=IO_THREADS)
    kv = SyntheticKV(tokens)
    select_tokens = int(SELECT * tokens)
    rss = {"baseline": psutil.Process().memory_info().rss}
    reset_peak_rss()
    t0 = time.perf_counter()
    with KVStore(SHAPE, config) as store:
        summaries = fill(store, kv)
        write_s, rss["write"] = time.perf_counter() - t0, peak_rss()
        tiers = store.stats()
        reset_peak_rss()
        runs, gbps, extent = measured_steps(store, kv, summaries, root, select_tokens, steps,
                                            config.io_threads)
        fixed = runs, gbps, extent  # the same steps where 2 % of the context is 1,280 tokens
        if FIXED_SELECT // CHUNK != select_tokens // CHUNK:
            fixed = measured_steps(store, kv, summaries, root, FIXED_SELECT, steps,
                                   config.io_threads)
        fixed = step_figures(*fixed)
        direct = store.disk.reads_direct()
        rss["step"] = peak_rss()
        brute = None
        if tiers["disk_bytes"] <= BRUTE_MAX_BYTES:
            reset_peak_rss()
            brute = brute_step(store, kv, summaries)
            rss["brute"] = peak_rss()
    shutil.rmtree(root / f"kv-{tokens}", ignore_errors=True)
    return {"tokens": tokens, "kv_bytes": SHAPE.kv_bytes(tokens), "device_budget": device,
            "host_budget": host, "disk_bytes": tiers["disk_bytes"], "host_bytes": tiers["host_bytes"],
            "disk_reads_direct": direct,
            "select_tokens_per_group": select_tokens // CHUNK * CHUNK,
            "fetched_bytes_per_group": select_tokens // CHUNK * CHUNK * SHAPE.token_bytes(GROUP),
            "write_s": write_s, "steps": steps, "rss_baseline": rss["baseline"],
            "peak_rss_write": rss["write"], "peak_rss_step": rss["step"],
            "peak_rss_brute": rss.get("brute"), "peak_rss_process": max(rss.values()),
            **step_figures(runs, gbps, extent),
            **brute_figures(brute, runs, tiers["disk_bytes"]),
            "fixed_budget": {"select_tokens_per_group": FIXED_SELECT,
                             **{k: fixed[k] for k in FIXED_FIGURES}}}


FIXED_FIGURES = ("step_s", "step_fetch_s", "step_select_s", "disk_bytes_per_step",
                 "needle_recall", "step_over_physical_bound")


def growth(results: dict[str, dict]) -> list[dict]:
    """How the step grows from each size to the next: the ratio of step times, and its exponent
    in the ratio of contexts (``log(step ratio) / log(tokens ratio)``; below 1 the step grows
    sub-linearly), with the 2 % budget (whose bytes grow with the context) and the fixed one."""
    sizes = sorted(results.values(), key=lambda r: r["tokens"])
    out = []
    for a, b in zip(sizes, sizes[1:]):
        tokens = b["tokens"] / a["tokens"]
        row = {"from": a["tokens"], "to": b["tokens"], "tokens_ratio": tokens}
        for name, fa, fb in (("step", a, b), ("fixed_step", a["fixed_budget"], b["fixed_budget"])):
            ratio = fb["step_s"] / fa["step_s"]
            row[f"{name}_ratio"], row[f"{name}_exponent"] = ratio, math.log(ratio) / math.log(tokens)
        out.append(row)
    return out


def step_figures(runs: list[dict], gbps: float, extent: float) -> dict:
    """The steps' mean times and disk bytes against the sequential and extent bounds."""
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "keys"}
    bound, extent_bound = (mean["disk_bytes"] / (rate * 1e9) for rate in (gbps, extent))
    cpu_bound = mean["cpu_s"] / CPUS
    return {"step_s": mean["s"], "step_fetch_s": mean["fetch_s"], "step_cpu_s": mean["cpu_s"],
            "cpu_bound_s": cpu_bound, "step_over_cpu_bound": mean["s"] / cpu_bound,
            "step_select_s": mean["select_s"], "step_attend_s": mean["attend_s"],
            "step_stall_s": mean["stall_s"], "disk_bytes_per_step": mean["disk_bytes"],
            "needle_recall": mean["recall"], "raw_read_gbps": gbps, "physical_bound_s": bound,
            "step_over_physical_bound": mean["s"] / bound if bound else None,
            "fetch_over_physical_bound": mean["fetch_s"] / bound if bound else None,
            "extent_read_gbps": extent, "extent_bound_s": extent_bound,
            "step_over_extent_bound": mean["s"] / extent_bound if extent_bound else None,
            "fetch_over_extent_bound": mean["fetch_s"] / extent_bound if extent_bound else None}


def brute_figures(brute: dict | None, runs: list[dict], disk_bytes: int) -> dict:
    if brute is None:
        return {"brute_s": None, "brute_fetch_s": None, "brute_disk_bytes": None,
                "brute_over_step": None,
                "brute_skipped": f"disk part {disk_bytes} B > {BRUTE_MAX_BYTES} B"}
    step_s = sum(r["s"] for r in runs) / len(runs)
    return {"brute_s": brute["s"], "brute_fetch_s": brute["fetch_s"],
            "brute_disk_bytes": brute["disk_bytes"], "brute_over_step": brute["s"] / step_s,
            "brute_skipped": None}


def setup() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the loader and the disk tier's reader threads get the other core


def run_size(root: Path, tokens: int, steps: int) -> dict:
    """``bench_size`` in a fresh process: a size's memory figures start from an idle process,
    not from what the previous size left in the allocator (~0.3 GB)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=setup) as pool:
        return pool.submit(bench_size, root, tokens, steps).result()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16K tokens only, 2 steps")
    parser.add_argument("--tokens", type=int, nargs="+", help="context sizes (default 65536)")
    args = parser.parse_args(argv)
    for t in args.tokens or ():
        if t < MIN_TOKENS or t % CHUNK:
            parser.error(f"--tokens {t}: a context is a multiple of {CHUNK} tokens, at least "
                         f"{MIN_TOKENS} (its 2 % budget must hold a {CHUNK}-token chunk)")
    setup()
    sizes = args.tokens or ([16384] if args.quick else [65536])
    steps = 2 if args.quick else 4
    idle = psutil.Process().memory_info().rss
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-scale-"))
    try:
        results = {str(t): run_size(root, t, steps) for t in sorted(sizes)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    not_run = {str(t): f"{SHAPE.kv_bytes(t) / 1e9:.0f} GB of KV: not run in this invocation"
               for t in (65536, 262144, 1 << 20) if str(t) not in results}
    print(f"{'tokens':>8} {'step ms':>8} {'fetch ms':>8} {'disk MB/step':>12} {'bound ms':>9} "
          f"{'step/bound':>10} {'step/extent':>11} {'step/cpu':>8} {'brute/step':>10} {'recall':>6} "
          f"{'rss GB':>7}")
    for r in results.values():
        brute = r["brute_over_step"]
        print(f"{r['tokens']:>8} {r['step_s'] * 1e3:8.1f} {r['step_fetch_s'] * 1e3:8.1f} "
              f"{r['disk_bytes_per_step'] / 1e6:12.1f} {r['physical_bound_s'] * 1e3:9.1f} "
              f"{r['step_over_physical_bound'] or 0:10.2f} {r['step_over_extent_bound'] or 0:11.2f} "
              f"{r['step_over_cpu_bound']:8.2f} "
              f"{'-' if brute is None else f'{brute:.1f}':>10} {r['needle_recall']:6.2f} "
              f"{r['peak_rss_step'] / 1e9:7.2f}")
    grows = growth(results)
    for g in grows:
        print(f"{g['from']} -> {g['to']} tokens (x{g['tokens_ratio']:.0f}): step x{g['step_ratio']:.2f} "
              f"(exponent {g['step_exponent']:.2f}) with the {SELECT:.0%} budget, "
              f"x{g['fixed_step_ratio']:.2f} ({g['fixed_step_exponent']:.2f}) with {FIXED_SELECT} tokens")
    result = {"config": {"layers": SHAPE.layers, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
                         "dtype": "float16", "group_layers": GROUP, "chunk": CHUNK, "select": SELECT,
                         "fixed_select_tokens": FIXED_SELECT,
                         "needles_per_group": NEEDLES, "batch_records": BATCH, "lookahead": LOOKAHEAD,
                         "fetchers": FETCHERS, "io_threads": IO_THREADS,
                         "quick": args.quick, "threads": torch.get_num_threads()},
              "sizes": results, "growth": grows, "not_run": not_run, "rss_idle": idle}
    print(write_result("scale", result, args.quick))
    return result


if __name__ == "__main__":
    main()
