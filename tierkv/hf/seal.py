"""Sealing: a layer group's window tokens, cut after its layers attended, become records in the
store and chunks of the group's index (``TieredCache._after_attention`` cuts them)."""
from __future__ import annotations

import torch

from ..storage.base import KVBlock
from .prefill import prompt_ranks


def seal(cache, g: int, hot: float, ranked: bool) -> None:
    """Seal group ``g``'s cut window tokens as records of ``cache.record_tokens[g]`` tokens,
    ranked ``hot`` (a prompt's by its attention, ``prompt_ranks``, when ``ranked``).

    A decode step's records are stored before the index names them: a store that fails (a full
    disk) leaves them cut, put back with the step (``recover.roll_back``). A prompt's records
    rank by the index's new leaves, so its index names them first, and a store that fails then
    leaves a cache that refuses to go on (``recover.changing``)."""
    layers = cache.groups[g]
    pending = [cache._pending[i] for i in layers]
    keys = torch.stack([torch.cat([b.keys for b in blocks], dim=1) for blocks in pending])
    values = torch.stack([torch.cat([b.values for b in blocks], dim=1) for blocks in pending])
    index = cache.indexes[g]
    start, step = index.sealed, cache.record_tokens[g]
    bounds = [(s, s + step) for s in range(start, start + keys.shape[2], step)]
    blocks = [KVBlock(keys[:, :, s - start:e - start], values[:, :, s - start:e - start])
              for s, e in bounds]
    if any(i in cache.prompt_mass for i in layers):
        with cache.changing():
            records = index.add(bounds, keys[0], cache.leaf_tokens[g])
            ranks = prompt_ranks(cache, g, start, len(bounds), hot, ranked)
            for key, block, rank in zip(records, blocks, ranks):
                cache.store.put(key, block, importance=rank)
    else:
        records = index.record_keys(bounds)
        stored = 0
        try:
            for key, block in zip(records, blocks):
                cache.store.put(key, block, importance=hot)
                stored += 1
        except BaseException:
            for key in records[:stored]:
                cache.store.remove(key)
            raise
        with cache.changing():
            index.add(bounds, keys[0], cache.leaf_tokens[g])
    for i in layers:
        cache._pending[i] = []
