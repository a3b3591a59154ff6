"""``leoam``: per-layer selection on the adaptive chunk tree with LKA summaries (LeoAM)."""
import torch

from ..attention import scored_decode_attention
from .base import keys_lookup, register
from .quest import Quest


@register
class LeoAM(Quest):
    """Like ``quest``, on adaptive chunks: each layer ranks its tree's leaves by their LKA bound,
    attends exactly over what it fetched, and folds that attention back into the tree (cold runs
    merge, leaves whose mass concentrates split: IAKM)."""

    name = "leoam"
    adaptive = True

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        self._chosen: dict[int, torch.Tensor] = {}

    @property
    def chunk_tokens(self) -> int:
        return self.chunks.base

    def fetch(self, cache, layer, q):
        leaves = super().fetch(cache, layer, q)
        if leaves is not None:
            self._chosen[layer] = leaves
        return leaves

    def attend(self, cache, layer, q, k, v, positions, scaling):
        leaves = self._chosen.pop(layer, None)
        if leaves is None:
            return super().attend(cache, layer, q, k, v, positions, scaling)
        out, probs = scored_decode_attention(q, k, v, scaling)
        scores = torch.zeros(cache.layer_length(layer))
        scores[positions] = probs.sum(dim=(0, 1))
        cache.index_of(layer).adapt(scores, leaves, self.select.sinks, keys_lookup(k, positions))
        return out
