"""Sealing: a layer group's window tokens, cut after its layers attended, become records in the
store and chunks of the group's index (``TieredCache._after_attention`` cuts them)."""
from __future__ import annotations

import torch

from ..storage.base import KVBlock, TierFullError
from .prefill import prompt_ranks

# Records of groups read whole every step rank above any step number: the host keeps them; the
# others rank by the last step that read or sealed them, so the host caches what decode reads.
# (What this leaves to disk: ``storage/ranking.py``.)
PINNED = 2.0 ** 60


def seal(cache, g: int) -> None:
    """Seal group ``g``'s cut window tokens as records of ``cache.record_tokens[g]`` tokens,
    ranked as the group's records are now (``TieredCache._importance``, once the index holds
    them: whether the group is read whole depends on its length), a prompt's by its attention
    (``prompt_ranks``). A store that fails (a full disk) takes the records back out of the index
    and the store: the tokens stay cut, to be put back with the pass (``recover.roll_back``)."""
    layers = cache.groups[g]
    pending = [cache._pending[i] for i in layers]
    keys = torch.stack([torch.cat([b.keys for b in blocks], dim=1) for blocks in pending])
    values = torch.stack([torch.cat([b.values for b in blocks], dim=1) for blocks in pending])
    index = cache.indexes[g]
    start, step = index.sealed, cache.record_tokens[g]
    bounds = [(s, s + step) for s in range(start, start + keys.shape[2], step)]
    mark = index.tree.mark()
    with cache.changing():
        records = index.add(bounds, keys[0], cache.leaf_tokens[g])
    try:
        hot = cache._importance(g)
        ranks = prompt_ranks(cache, g, start, len(bounds), hot, ranked=hot != PINNED)
        for key, (s, e), rank in zip(records, bounds, ranks):
            block = KVBlock(keys[:, :, s - start:e - start], values[:, :, s - start:e - start])
            cache.store.put(key, block, importance=rank)
    except BaseException as exc:
        with cache.changing():
            for key in index.truncate(mark):
                cache.store.remove(key)
        if isinstance(exc, TierFullError):  # the host full and the disk too (or none)
            raise TierFullError(f"{exc}: sealing layer group {g}'s records; the forward pass is "
                                "undone: save the cache elsewhere (save()), or reopen it with a "
                                "larger host_budget or disk_budget (TierConfig)") from exc
        raise
    cache._sealed_in_pass.setdefault(g, mark)  # a failed pass is undone to before its first seal
    for i in layers:
        cache._pending[i] = []
