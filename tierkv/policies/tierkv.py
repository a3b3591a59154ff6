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

    def prefetch_filter(self, cache, layer, q):
        index = cache.index_of(layer)
        free = cache.store.device.free
        if free is None or cache.group_bytes(layer) <= free // 2:
            return None
        budget = PRESELECT_FACTOR * self.budget(cache)
        return index.top_chunks(index.bound_scores(q[:, 0]), budget, self.select.sinks)
