"""Layer-wise prefill: a layer's new tokens attend, in query blocks, over that layer's KV only.

transformers runs a prompt through the model one layer at a time; ``TieredCache`` makes each
layer's attention exact and query-blocked, and seals the layer's KV into the tiers right after,
so only one layer's KV (plus the recent windows) is on the device at once. Logits equal an
ordinary prefill's up to floating-point summation order.
"""
from __future__ import annotations

import torch

from ..attention import causal_attention

FETCH_BATCH_BYTES = 8 << 20


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
