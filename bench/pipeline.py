"""Layer-pipelined fetch (DTP) against a synchronous fetch, and the compression controller.

Real SmolLM2 KV (2K tokens with --quick, 8K without) is cut into records (layer group x chunk)
and spilled to disk. Each decode step fetches ~10 % of the tokens per group (chunks ranked by the
real last-token attention, drifting slowly across steps) and computes every layer of the group
(q/k/v projections, attention of one query over the fetched KV, o_proj, MLP). Page cache is
dropped before each measured run.

    python -m bench.pipeline [--quick]   ->  bench/results/pipeline.json
"""
from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import drop_page_cache, real_kv, write_result
from tierkv.config import CodecConfig, TierConfig
from tierkv.pipeline import CompressionController, FetchPlan, Metrics, Pipeline, ThrottledDisk
from tierkv.shapes import KVShape
from tierkv.storage.base import KVBlock, RecordKey
from tierkv.storage.store import KVStore

GROUP_LAYERS = 5      # layers per layer group (OmniKV: the layers after one filter layer)
CHUNK = 32            # tokens per record
SELECT = 0.10         # share of the tokens fetched per group and step
THROTTLE = 200e6      # bytes/s of the slow disk


def records(keys: torch.Tensor, values: torch.Tensor) -> dict[RecordKey, KVBlock]:
    """Every (group, chunk) record of the KV, keys/values (group layers, kv_heads, CHUNK, dim)."""
    out = {}
    layers, tokens = keys.shape[0], keys.shape[2]
    for g in range(math.ceil(layers / GROUP_LAYERS)):
        ls = slice(g * GROUP_LAYERS, (g + 1) * GROUP_LAYERS)
        for start in range(0, tokens, CHUNK):
            end = min(tokens, start + CHUNK)
            out[RecordKey("bench", g, start, end)] = KVBlock(
                keys[ls, :, start:end].contiguous(), values[ls, :, start:end].contiguous())
    return out


def make_plans(keys, queries, steps: int, seed: int = 0) -> list[FetchPlan]:
    """Per step and group: the top chunks by the group's first layer's real attention mass,
    perturbed by a slow random walk so the selection drifts across steps."""
    gen = torch.Generator().manual_seed(seed)
    layers, kv_heads, tokens, dim = keys.shape
    groups = math.ceil(layers / GROUP_LAYERS)
    base, walk = [], []
    for g in range(groups):
        layer = g * GROUP_LAYERS
        k = keys[layer].repeat_interleave(queries.shape[1] // kv_heads, dim=0)
        mass = torch.softmax((queries[layer].unsqueeze(1) @ k.transpose(1, 2)).squeeze(1)
                             / math.sqrt(dim), dim=-1).sum(0)
        base.append(F.pad(mass, (0, -tokens % CHUNK)).view(-1, CHUNK).sum(1))
        walk.append(torch.zeros_like(base[-1]))
    top = max(1, round(SELECT * tokens / CHUNK))
    plans = []
    for _ in range(steps):
        entries, importance = [], {}
        for g in range(groups):
            walk[g] += 0.3 * torch.randn(walk[g].shape, generator=gen)
            score = base[g] * walk[g].exp()
            chunks = sorted(score.topk(top).indices.tolist())
            group_keys = [RecordKey("bench", g, c * CHUNK, min(tokens, (c + 1) * CHUNK))
                          for c in chunks]
            importance.update({key: float(score[c]) for key, c in zip(group_keys, chunks)})
            entries.append((g, group_keys))
        plans.append(FetchPlan(entries, importance))
    return plans


class GroupCompute:
    """The decode compute of one layer group: per layer, the projections of the new token,
    attention of its (real) query over the fetched KV, o_proj and the MLP."""

    def __init__(self, model, queries: torch.Tensor):
        self.model, self.queries = model, queries
        gen = torch.Generator().manual_seed(1)
        self.hidden = torch.randn(1, 1, model.config.hidden_size, generator=gen)

    @torch.no_grad()
    def __call__(self, group: int, block: KVBlock) -> None:
        hidden = self.hidden
        for j in range(block.keys.shape[0]):
            index = group * GROUP_LAYERS + j
            layer = self.model.model.layers[index]
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = self.queries[index].unsqueeze(0).unsqueeze(2)                # (1, q_heads, 1, dim)
            out = F.scaled_dot_product_attention(q, block.keys[j].unsqueeze(0),
                                                 block.values[j].unsqueeze(0), enable_gqa=True)
            hidden = hidden + attn.o_proj(out.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def decode(plans, fetch, compute, metrics: Metrics) -> None:
    """The consumer loop (swap for a real decode): per step, fetch the plan, then for each
    group in order wait for its KV and compute it."""
    for plan in plans:
        metrics.step_begin()
        wait = fetch(plan)
        for group in plan.group_ids():
            compute(group, wait(group))
        metrics.step_end()


def sync_fetch(store: KVStore, metrics: Metrics):
    """``fetch`` for ``decode`` that reads each group synchronously when it is needed."""
    def fetch(plan: FetchPlan):
        keys = {g.group: g.keys for g in plan.groups}

        def wait(group):
            start = time.perf_counter()
            blocks = store.fetch(keys[group], store.device.device)
            block = KVBlock(torch.cat([b.keys for b in blocks], 2),
                            torch.cat([b.values for b in blocks], 2))
            metrics.record_fetch(time.perf_counter() - start)   # all of it exposed: no overlap
            metrics.record_stall(time.perf_counter() - start)
            return block
        return wait
    return fetch


def open_store(root: Path, name: str, shape: KVShape, device_budget: int,
               lossy: bool = False) -> KVStore:
    config = TierConfig(device_budget=device_budget, host_budget="1MB", disk_dir=root / name,
                        device="cpu", io_threads=2, codec=CodecConfig(allow_lossy=lossy))
    return KVStore(shape, config)


def drop_cache(store: KVStore) -> None:
    for path in Path(store.disk.path).glob("seg-*"):
        drop_page_cache(path)


def spill(store: KVStore, recs: dict, codec_of) -> None:
    for key, block in recs.items():
        store.disk.put(key, block, codec=codec_of(key, block))
    store.disk.flush()


def stall_case(root, shape, recs, plans, compute, budget: int, codec_of) -> dict:
    """stall_frac of the pipeline (with and without its device cache) and of a sync fetch."""
    groups = len(plans[0])
    store = open_store(root, "stall", shape, budget)
    spill(store, recs, codec_of)
    decode(plans[:1], sync_fetch(store, Metrics()), compute, Metrics())   # warm-up
    sync = Metrics()
    drop_cache(store)
    decode(plans, sync_fetch(store, sync), compute, sync)
    piped = Metrics()
    drop_cache(store)
    with Pipeline(store, "cpu", threads=2, metrics=piped, groups=groups) as pipe:
        decode(plans, lambda plan: pipe.submit(plan).wait, compute, piped)
    device_used = store.device.used
    store.close()
    nocache = Metrics()
    store = open_store(root, "stall", shape, 0)
    drop_cache(store)
    with Pipeline(store, "cpu", threads=2, metrics=nocache, groups=groups) as pipe:
        decode(plans, lambda plan: pipe.submit(plan).wait, compute, nocache)
    store.close()
    out = {"stall_frac": piped.summary()["total"]["stall_frac"],
           "sync_stall_frac": sync.summary()["total"]["stall_frac"],
           "stall_frac_no_cache": nocache.summary()["total"]["stall_frac"],
           "device_cache_bytes": device_used,
           "pipeline": piped.summary()["total"], "pipeline_no_cache": nocache.summary()["total"],
           "sync": sync.summary()["total"]}
    out["table"] = piped.format_table()
    return out


def fetch_time(store: KVStore, plans, wrap, controller=None) -> float:
    """Wall time to fetch every group of every plan back to back (page cache dropped)."""
    drop_cache(store)
    start = time.perf_counter()
    with Pipeline(store, "cpu", threads=2, groups=len(plans[0]), disk=wrap(store.disk),
                  controller=controller) as pipe:
        for plan in plans:
            handle = pipe.submit(plan)
            for group in plan.group_ids():
                handle.wait(group)
    return time.perf_counter() - start


def best_times(stores: dict, plans, wrap, repeat: int = 7) -> dict:
    """Best of ``repeat`` fetch times per store, the stores interleaved so that load from
    other processes falls on all of them alike."""
    best = dict.fromkeys(stores, float("inf"))
    for _ in range(repeat):
        for name, store in stores.items():
            best[name] = min(best[name], fetch_time(store, plans, wrap))
    return best


def codec_case(root, shape, recs, plans, candidates, cold: bool) -> dict:
    """Per disk (throttled, unthrottled): the controller's choice and the fetch time of the
    chosen mix against every fixed candidate codec."""
    used = {k: recs[k] for plan in plans for k in plan.keys()}
    fixed = {}
    for codec in candidates:
        fixed[codec] = open_store(root, f"{'cold' if cold else 'lossless'}-{codec}", shape, 0, cold)
        spill(fixed[codec], used, lambda key, block, c=codec: c)
    disks = {"throttled_200MBps": lambda disk: ThrottledDisk(disk, THROTTLE),
             "unthrottled": lambda disk: disk}
    out = {}
    for name, wrap in disks.items():
        ctl = CompressionController(candidates)  # serial cost: few busy cores barely overlap
        ctl.calibrate(next(iter(used.values())), CodecConfig(allow_lossy=cold))
        # one pass per codec feeds the controller its decode speed inside the pipeline; the
        # disk is then calibrated alone: on a few shared cores, reads timed while other threads
        # decode include CPU waits that are not the disk's
        for store in fixed.values():
            fetch_time(store, plans, wrap, controller=ctl)
        drop_cache(fixed[candidates[0]])
        batches = [g.keys for p in plans for g in p.groups]
        ctl.calibrate_disk(wrap(fixed[candidates[0]].disk), batches)
        choice = {key: ctl.choose(block.nbytes, cold=cold) for key, block in used.items()}
        mix = open_store(root, f"mix-{cold}-{name}", shape, 0, cold)
        spill(mix, used, lambda key, block: choice[key])
        times = best_times({**fixed, "chosen_mix": mix}, plans, wrap)
        mix.close()
        mix_counts = {c: sum(1 for v in choice.values() if v == c) for c in candidates}
        best_fixed = min(times[c] for c in candidates)
        out[name] = {"chosen": {c: n for c, n in mix_counts.items() if n},
                     "controller": ctl.state(),
                     "fetch_s": {k: round(v, 4) for k, v in times.items()},
                     "fastest_or_tied": times["chosen_mix"] <= 1.1 * best_fixed}
    for store in fixed.values():
        store.close()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2K tokens, fewer steps")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the fetch threads get the other core
    tokens, steps = (2048, 8) if args.quick else (8192, 16)
    keys, values, queries, model, _ = real_kv(tokens)
    shape = KVShape.from_config(model.config, dtype=keys.dtype)
    recs = records(keys, values)
    plans = make_plans(keys, queries, steps)
    kv_bytes = keys.nbytes + values.nbytes
    budget = int(0.05 * kv_bytes)
    compute = GroupCompute(model, queries)
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-pipeline-"))
    try:
        lossless = codec_case(root, shape, recs, plans, ("raw", "zstd"), cold=False)
        cold = codec_case(root, shape, recs, plans, ("raw", "zstd", "int8", "int4"), cold=True)
        chosen = lossless["unthrottled"]["chosen"]
        stall = stall_case(root, shape, recs, plans, compute, budget,
                           lambda key, block: max(chosen, key=chosen.get))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"config": {"tokens": tokens, "steps": steps, "layers": shape.layers,
                         "group_layers": GROUP_LAYERS, "chunk": CHUNK, "select": SELECT,
                         "kv_bytes": kv_bytes, "device_budget": budget,
                         "device_budget_frac": round(budget / kv_bytes, 4), "threads": 2},
              "stall": stall, "codec_choice": {"lossless": lossless, "cold_lossy_allowed": cold}}
    print(stall.pop("table"))
    print(f"stall_frac {stall['stall_frac']:.3f} (no cache {stall['stall_frac_no_cache']:.3f}) "
          f"vs sync {stall['sync_stall_frac']:.3f}")
    for case, disks in result["codec_choice"].items():
        for disk, r in disks.items():
            print(f"{case:>20} {disk:>18}: chose {r['chosen']} fetch_s {r['fetch_s']}")
    print(write_result("pipeline", result))
    return result


if __name__ == "__main__":
    main()
