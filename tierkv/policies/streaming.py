"""``streaming``: attention sinks + the recent window (StreamingLLM). Lossy."""
import torch

from ..hf.attention import scored_decode_attention
from .base import Policy, register


@register
class Streaming(Policy):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens; drop the middle."""

    name = "streaming"
    lossy = True

    def fetch(self, cache, layer, q):
        index = cache.index_of(layer)
        return torch.nonzero(index.starts < self.select.sinks).flatten()

    def attend(self, cache, layer, q, k, v, positions, scaling):
        n = cache.layer_length(layer)
        allowed = (positions < self.select.sinks) | (positions >= n - self.select.window)
        return scored_decode_attention(q, k, v, scaling, allowed.view(1, 1, 1, -1))[0]
