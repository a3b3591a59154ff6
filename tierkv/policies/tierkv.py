"""``tierkv`` (default): OmniKV filter layers choosing LeoAM adaptive chunks.

When a filter layer's own KV does not fit in the device tier's free budget, its chunks are first
preselected by their LKA upper bounds, and exact attention runs over the candidates only.
"""
from .base import register
from .omnikv import OmniKV

PRESELECT_FACTOR = 4


@register
class TierKV(OmniKV):
    """OmniKV selection over adaptive chunks, LKA preselection for filter layers on big contexts."""

    name = "tierkv"
    adaptive = True

    def preselects(self, cache, layer):
        budget = cache.store.device.budget
        return budget is not None and cache.group_bytes(layer) > budget // 4

    def preselect(self, cache, layer, q):
        if not self.preselects(cache, layer):
            return None
        index = cache.index_of(layer)
        budget = PRESELECT_FACTOR * self.budget(cache)
        return index.top_chunks(index.bound_scores(q[:, 0].cpu()), budget, self.select.sinks)
