"""Decode-step cost at long contexts, on synthetic KV shaped like Llama-3-8B, without a model.

KV of 32 layers x 8 KV heads x head_dim 128, fp16 (128 KiB a token) is written through
``tierkv.KVStore`` as records of 64 tokens x one layer group of 4 layers (1 MiB each); the
per-chunk min/max key summaries (``tierkv.summary``) of each group's first layer stay in memory.
Records cycle through a seeded pool of Gaussian blocks (generating 8 GiB of fresh random numbers
on two cores would dominate the run); a few "needle" chunks per group get keys aligned with the
query direction of their KV head. Device budget 1 GB and host 4 GB from 64K tokens up, scaled
with the context below that (the rest spills to disk, raw codec).

A decode step, per group: LKA bound scores of every chunk for the group's query, the top chunks
within a 2 % token budget, ``KVStore.fetch`` of them (page cache dropped before the step), and
GQA attention on the CPU for each of the group's layers over the fetched tokens. Side by side:

* ``physical_bound_s``: the step's disk bytes / the raw read bandwidth of plain file reads of the
  same volume (page cache dropped) measured in the same run;
* ``brute_s``: the same step reading every record.

    python -m bench.scale [--quick] [--tokens 65536 262144]   ->  bench/results/scale.json
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from bench.common import drop_page_cache, write_result
from tierkv import KVBlock, KVShape, KVStore, RecordKey, TierConfig
from tierkv.config import CodecConfig
from tierkv.summary import chunk_scores, summarize

SHAPE = KVShape(layers=32, kv_heads=8, head_dim=128, q_heads=32, dtype=torch.float16)
GROUP, CHUNK, SELECT = 4, 64, 0.02
NEEDLES = 4              # needle chunks per group
POOL = 64                # distinct random blocks the records cycle through
REF_TOKENS = 65536       # the context at which the budgets are 1 GB / 4 GB
DEVICE_BUDGET, HOST_BUDGET = 1e9, 4e9
BRUTE_MAX_BYTES = 16 << 30


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
        keys, values = self.pool[(chunk * 7919 + group * 31) % POOL]
        keys = keys.clone()
        if chunk in self.needles[group]:
            # a few tokens point hard along the query: q . k stands far above the noise
            keys[:, :, 8:16] += 12 * self.direction[group].view(1, SHAPE.kv_heads, 1, -1).half()
        return KVBlock(keys, values.clone())

    def query(self, group: int) -> torch.Tensor:
        """The group's decode query, shape (q_heads, head_dim), near the needle direction."""
        g = SHAPE.q_heads // SHAPE.kv_heads
        q = 4 * self.direction[group].repeat_interleave(g, dim=0)
        return q + 0.5 * torch.randn(q.shape, generator=self.gen)


def key(group: int, chunk: int) -> RecordKey:
    return RecordKey("scale", group, chunk * CHUNK, (chunk + 1) * CHUNK)


def fill(store: KVStore, kv: SyntheticKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write every record; the per-group summaries (kmin, kmax), shape (chunks, kv_heads, dim)."""
    summaries = []
    for g in range(kv.groups):
        lo, hi = [], []
        for c in range(kv.chunks):
            block = kv.block(g, c)
            kmin, kmax = summarize(block.keys[0])
            lo.append(kmin), hi.append(kmax)
            store.put(key(g, c), block)
        summaries.append((torch.stack(lo), torch.stack(hi)))
    store.disk.flush()
    return summaries


def drop_store_cache(store: KVStore) -> None:
    for seg in Path(store.disk.path).glob("seg-*.tkv"):
        drop_page_cache(seg)


def attend(q: torch.Tensor, block: KVBlock) -> None:
    """GQA attention of one query over each layer of ``block``."""
    for layer in range(block.keys.shape[0]):
        F.scaled_dot_product_attention(q.unsqueeze(0).unsqueeze(2),
                                       block.keys[layer].unsqueeze(0).float(),
                                       block.values[layer].unsqueeze(0).float(), enable_gqa=True)


def step(store: KVStore, kv: SyntheticKV, summaries, chosen_of) -> dict:
    """One decode step over all groups; ``chosen_of(g, q, kmin, kmax)`` names the chunks."""
    drop_store_cache(store)
    read0, rss = store.disk.bytes_read, 0
    hits, fetch_s = 0, 0.0
    start = time.perf_counter()
    for g, (kmin, kmax) in enumerate(summaries):
        q = kv.query(g)
        chosen = chosen_of(q, kmin, kmax)
        t0 = time.perf_counter()
        blocks = store.fetch([key(g, c) for c in chosen], "cpu")
        fetch_s += time.perf_counter() - t0
        block = KVBlock(torch.cat([b.keys for b in blocks], 2), torch.cat([b.values for b in blocks], 2))
        attend(q, block)
        rss = max(rss, psutil.Process().memory_info().rss)
        hits += len(set(chosen) & set(kv.needles[g]))
        del blocks, block
    seconds = time.perf_counter() - start
    return {"s": seconds, "fetch_s": fetch_s, "disk_bytes": store.disk.bytes_read - read0, "rss": rss,
            "recall": hits / (NEEDLES * len(summaries))}


def top_chunks(select_tokens: int):
    def chosen_of(q, kmin, kmax):
        scores = chunk_scores(q, kmin, kmax)[1]
        return sorted(scores.topk(max(1, select_tokens // CHUNK)).indices.tolist())
    return chosen_of


def raw_read_gbps(path: Path, nbytes: int, chunk: int = 1 << 20) -> float:
    """GB/s of plain sequential reads of a ``nbytes`` file (written, fsynced, cache dropped)."""
    nbytes = max(chunk, nbytes // chunk * chunk)
    data = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(nbytes // chunk):
            f.write(data)
    drop_page_cache(path)
    buf = bytearray(chunk)
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    for offset in range(0, nbytes, chunk):
        os.preadv(fd, [buf], offset)
    seconds = time.perf_counter() - start
    os.close(fd)
    path.unlink()
    return nbytes / seconds / 1e9


def bench_size(root: Path, tokens: int, steps: int) -> dict:
    scale = min(1.0, tokens / REF_TOKENS)  # 1 GB / 4 GB from 64K tokens up
    device, host = int(DEVICE_BUDGET * scale), int(HOST_BUDGET * scale)
    config = TierConfig(device_budget=device, host_budget=host, disk_dir=root / f"kv-{tokens}",
                        device="cpu", codec=CodecConfig("raw"))
    kv = SyntheticKV(tokens)
    t0 = time.perf_counter()
    with KVStore(SHAPE, config) as store:
        summaries = fill(store, kv)
        write_s = time.perf_counter() - t0
        tiers = store.stats()
        select_tokens = int(SELECT * tokens)
        step(store, kv, summaries, top_chunks(select_tokens))          # warm-up
        runs = [step(store, kv, summaries, top_chunks(select_tokens)) for _ in range(steps)]
        per_step = {k: sum(r[k] for r in runs) / len(runs) for k in ("s", "fetch_s", "disk_bytes", "recall")}
        gbps = raw_read_gbps(root / "raw.bin", int(per_step["disk_bytes"]))
        kv_bytes = SHAPE.kv_bytes(tokens)
        brute = None
        if tiers["disk_bytes"] <= BRUTE_MAX_BYTES:
            brute = step(store, kv, summaries, lambda q, lo, hi: list(range(kv.chunks)))
    shutil.rmtree(root / f"kv-{tokens}", ignore_errors=True)
    bound = per_step["disk_bytes"] / (gbps * 1e9)
    return {"tokens": tokens, "kv_bytes": kv_bytes, "device_budget": device, "host_budget": host,
            "disk_bytes": tiers["disk_bytes"], "host_bytes": tiers["host_bytes"],
            "select_tokens_per_group": select_tokens // CHUNK * CHUNK, "write_s": write_s,
            "steps": steps, "step_s": per_step["s"], "step_fetch_s": per_step["fetch_s"],
            "fetch_over_physical_bound": per_step["fetch_s"] / bound if bound else None,
            "brute_fetch_s": brute and brute["fetch_s"], "disk_bytes_per_step": per_step["disk_bytes"],
            "fetched_bytes_per_group": select_tokens // CHUNK * CHUNK * SHAPE.token_bytes(GROUP),
            "needle_recall": per_step["recall"], "peak_rss_step": max(r["rss"] for r in runs),
            "raw_read_gbps": gbps, "physical_bound_s": bound,
            "step_over_physical_bound": per_step["s"] / bound if bound else None,
            "brute_s": brute and brute["s"], "brute_disk_bytes": brute and brute["disk_bytes"],
            "brute_over_step": brute and brute["s"] / per_step["s"],
            "brute_skipped": None if brute else f"disk part {tiers['disk_bytes']} B > {BRUTE_MAX_BYTES} B"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16K tokens only, 2 steps")
    parser.add_argument("--tokens", type=int, nargs="+", help="context sizes (default 65536)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the disk tier's reader threads get the other core
    sizes = args.tokens or ([16384] if args.quick else [65536])
    steps = 2 if args.quick else 4
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-scale-"))
    try:
        results = {str(t): bench_size(root, t, steps) for t in sorted(sizes)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    not_run = {str(t): f"{SHAPE.kv_bytes(t) / 1e9:.0f} GB of KV: not run in this invocation"
               for t in (65536, 262144, 1 << 20) if str(t) not in results}
    print(f"{'tokens':>8} {'step ms':>8} {'fetch ms':>8} {'disk MB/step':>12} {'bound ms':>9} {'step/bound':>10} "
          f"{'brute/step':>10} {'recall':>6} {'rss GB':>7}")
    for r in results.values():
        brute = r["brute_over_step"]
        print(f"{r['tokens']:>8} {r['step_s'] * 1e3:8.1f} {r['step_fetch_s'] * 1e3:8.1f} "
              f"{r['disk_bytes_per_step'] / 1e6:12.1f} "
              f"{r['physical_bound_s'] * 1e3:9.1f} {r['step_over_physical_bound'] or 0:10.2f} "
              f"{'-' if brute is None else f'{brute:.1f}':>10} {r['needle_recall']:6.2f} "
              f"{r['peak_rss_step'] / 1e9:7.2f}")
    result = {"config": {"layers": SHAPE.layers, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
                         "dtype": "float16", "group_layers": GROUP, "chunk": CHUNK, "select": SELECT,
                         "needles_per_group": NEEDLES, "quick": args.quick, "threads": torch.get_num_threads()},
              "sizes": results, "not_run": not_run,
              "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(write_result("scale", result))
    return result


if __name__ == "__main__":
    main()
