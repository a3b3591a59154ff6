"""Layer-wise prefill: a layer's new tokens attend over that layer's KV only.

transformers runs a prompt through the model one layer at a time; ``TieredCache`` makes each
layer's attention exact (in query blocks, or in one causal call for a first prompt on a CPU:
``causal_attention``) and seals the layer's KV into the tiers right after, so only one layer's
KV (plus the recent windows) is on the device at once. Logits equal an ordinary prefill's up to
floating-point summation order.

Where a disk tier is configured, each layer also weighs its KV by the attention of the prompt's
last ``RECENT_QUERIES`` queries (SnapKV's observation window), and the records are sealed ranked
by it (``prompt_ranks``): the host tier keeps those the first decode steps are likely to read.
Before, a prompt's records all ranked alike and the host kept the last ones sealed. Measured with
``bench.decode``'s 8K case (device 6.25 % / host 20 % of the KV, ``tierkv``, 64 teacher-forced
steps, both caches and ``full_memory`` decoding alternate blocks of 8 steps in one process,
2026-11-27): the first step read 11.3 MB from disk against 33.9 and took 181 ms against 263;
over the 64 steps 2.72 MB a token against 3.11 and 99.4 ms a token against 103.9 (``full_memory``
114.1), top-1 agreement 0.969 either way. Ranking 32 queries over 8K tokens costs ~8-9 ms a layer.

A layer that preselects (``tierkv``'s filter layers, and those before the first) reads 40 % of
its context on the first step, chosen by its query, not by what the prompt attended: those 167
records were most of that step's 11.2 MB from disk. So the records of the candidates the
prompt's last query picks (``Policy.prompt_candidates``) rank first. Measured on the same case
(device 5 % / host 20 % of the KV; two caches, prefilled with and without, and ``full_memory``
decoding alternate blocks of 8 steps in one process, 2026-11-28, twice): the first step took
126.9 and 128.2 ms against 157.9 and 160.6 and read 5.4 MB from disk against 11.2; the other
63 steps 97.8 / 100.5 against 98.2 / 99.5 ms a token (2.62 against 2.59 MB), top-1 62 of 64
either way.
"""
from __future__ import annotations

import torch

from ..attention import causal_attention, recent_query_mass

FETCH_BATCH_BYTES = 8 << 20
RECENT_QUERIES = 32  # the prompt's last queries whose attention ranks its records for the host
RANK_LEVELS, RANK_SPAN = 32, 0.5  # their ranks: this many steps of importance, within this span


def prefill_attention(cache, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of ``layer``'s new tokens over all of its KV.

    q : Tensor, shape (q_heads, t, head_dim), the new tokens' queries (after RoPE).
    Returns Tensor, shape (q_heads, t, head_dim).
    """
    wk, wv = cache._window[layer]
    old_k, old_v = sealed_layer_kv(cache, layer)
    k = torch.cat([old_k, wk], dim=1) if old_k.shape[1] else wk
    v = torch.cat([old_v, wv], dim=1) if old_v.shape[1] else wv
    cache.reserve(f"prefill:{layer}", old_k.nbytes + old_v.nbytes)
    try:
        out, mass = causal_attention(q, k, v, scaling, cache.prefill_block,
                                     column_mass=cache.policy.wants_prefill_mass)
        if cache.store.disk is not None:
            cache.prompt_mass[layer] = recent_query_mass(q, k, scaling, RECENT_QUERIES).cpu()
            cache.prompt_query[layer] = q[:, -1].cpu()
    finally:
        cache.store.device.reserve(f"prefill:{layer}", 0)
    if mass is not None:
        cache.policy.observe_prefill(cache, layer, mass)
    return out


def sealed_layer_kv(cache, layer: int):
    """All sealed K and V of one layer, shape (kv_heads, sealed, head_dim) each, on the device.

    Records hold a whole layer group: they are read once per forward into host memory (a few
    at a time) and each layer of the group copies only its own slice to the device, so no more
    than one layer's KV is on the device and no record is read twice.
    """
    g, slot = cache.group_of[layer], cache.slot_of[layer]
    blocks = _group_blocks(cache, g)
    if not blocks:
        empty = torch.zeros(cache.shape.kv_heads, 0, cache.shape.head_dim, dtype=cache.shape.dtype,
                            device=cache.device)
        return empty, empty
    k = torch.cat([b.keys[slot] for b in blocks], dim=1).to(cache.device)
    v = torch.cat([b.values[slot] for b in blocks], dim=1).to(cache.device)
    if layer == cache.groups[g][-1]:
        cache.prefill_blocks = None
    return k, v


def _group_blocks(cache, g: int):
    """The sealed records of group ``g`` on the host, read once per forward; the next group's
    are read in the background meanwhile (a new turn over a saved or long document is mostly
    reading)."""
    keys = tuple(cache.indexes[g].fetch(None).keys)
    held = cache.prefill_blocks
    if held is not None and held[0] == (g, keys):
        return held[1]
    ahead, cache.prefill_ahead = cache.prefill_ahead, None
    if ahead is not None and ahead[0] == (g, keys):
        blocks = ahead[1].result()
    else:
        if ahead is not None:
            ahead[1].cancel()
        blocks = _read_group(cache, g, keys)
    cache.prefill_blocks = ((g, keys), blocks)
    if g + 1 < len(cache.groups):
        following = tuple(cache.indexes[g + 1].fetch(None).keys)
        if following:
            cache.prefill_ahead = ((g + 1, following),
                                   cache.reader.submit(_read_group, cache, g + 1, following))
    return blocks


def _read_group(cache, g: int, keys) -> list:
    per_record = max(1, cache.shape.token_bytes(len(cache.groups[g])) * cache.record_tokens[g])
    step = max(1, FETCH_BATCH_BYTES // per_record)
    return [b for i in range(0, len(keys), step) for b in cache.store.fetch(keys[i:i + step], "cpu")]


def prompt_ranks(cache, g: int, start: int, count: int, hot: float, ranked: bool) -> list[float]:
    """Importance of the ``count`` records group ``g`` seals now from position ``start``.

    After a prompt, each record ranks by the attention its group's layers paid it from the
    prompt's last ``RECENT_QUERIES`` queries: ``hot`` plus up to ``RANK_SPAN``, in
    ``RANK_LEVELS`` steps (below the next decode step's reads, which rank ``hot + 1``). The
    store keeps the higher ranked on the host when it spills, so the first decode steps find
    what they read there, not on disk. Otherwise (a decode step's seal, or not ``ranked``) all
    rank ``hot``.
    """
    masses = [cache.prompt_mass.pop(layer, None) for layer in cache.groups[g]]
    query = [cache.prompt_query.pop(layer, None) for layer in cache.groups[g]][0]
    step = cache.record_tokens[g]
    end = start + count * step
    if not ranked or not count or any(m is None or m.numel() < end for m in masses):
        return [hot] * count
    mass = torch.stack([m[start:end] for m in masses]).sum(dim=0).view(count, -1).sum(dim=1)
    order = mass.argsort().argsort()  # 0: the record paid the least attention
    level = -(-(order + 1) * RANK_LEVELS // count)  # 1 .. RANK_LEVELS, the top record's last
    wanted = None if query is None else cache.policy.prompt_candidates(cache, cache.groups[g][0],
                                                                       query)
    if wanted is not None:  # what the layer would fetch were the prompt's last query a step's
        starts = torch.tensor([key.start for key in cache.indexes[g].fetch(wanted).keys],
                              dtype=torch.long)
        starts = starts[(starts >= start) & (starts < end)]
        level[(starts - start) // step] = RANK_LEVELS
    return (hot + level * (RANK_SPAN / RANK_LEVELS)).tolist()
