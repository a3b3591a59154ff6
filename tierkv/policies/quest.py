"""``quest``: per-layer min/max page summaries over fixed pages; the top pages per layer (Quest)."""
from .base import Policy, register


@register
class Quest(Policy):
    """Each layer scores its fixed pages by the min/max upper bound of ``q . k`` and fetches the
    best within the budget (plus the sink page). Pages never merge or split. As in Quest, the
    first ``dense_layers`` layers (diffuse attention, poor page bounds) attend densely."""

    name = "quest"
    page = 16
    dense_layers = 2

    @property
    def chunk_tokens(self) -> int:
        return self.page

    def dense(self, cache, layer):
        return layer < self.dense_layers

    def fetch(self, cache, layer, q):
        if layer < self.dense_layers:
            return None
        index = cache.index_of(layer)
        return index.top_chunks(index.bound_scores(q[:, 0]), self.budget(cache), self.select.sinks)
