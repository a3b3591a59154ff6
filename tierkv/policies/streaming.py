"""``streaming``: attention sinks + the recent window (StreamingLLM). Lossy."""
import torch

from ..attention import scored_decode_attention
from .base import Policy, on_device, register


@register
class Streaming(Policy):
    """Keep the first ``sinks`` tokens and the most recent tokens, as many as the budget allows
    (at least the ``window``); drop the middle."""

    name = "streaming"
    lossy = True

    def fetch(self, cache, layer, q):
        index = cache.index_of(layer)
        n = cache.layer_length(layer)
        recent = max(self.select.window, self.select.tokens(n) - self.select.sinks)
        ends = index.tree.bounds[1:]
        sink = index.starts < self.select.sinks
        leaves = torch.nonzero(sink | (ends > n - recent)).flatten()
        sizes = index.tree.sizes[leaves]
        tokens = int(sizes.sum())
        fit = cache.fit_to_device(cache.group_of[layer], tokens)
        if fit < tokens:  # the sinks, then the most recent leaves the device tier holds
            sink = sink[leaves]
            room = fit - int(sizes[sink].sum())
            recent_first = (sizes * ~sink).flip(0).cumsum(0).flip(0)
            leaves = leaves[sink | (~sink & (recent_first <= room))]
        return leaves

    def dense(self, cache, layer):
        return False

    def attend(self, cache, layer, q, k, v, positions, scaling):
        n = cache.layer_length(layer)
        recent = max(self.select.window, self.select.tokens(n) - self.select.sinks)
        allowed = (positions < self.select.sinks) | (positions >= n - recent)
        return scored_decode_attention(q, k, v, scaling, on_device(allowed.view(1, 1, 1, -1), q))[0]
