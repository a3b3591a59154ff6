"""``leoam``: per-layer selection on the adaptive chunk tree with LKA summaries (LeoAM)."""
import torch

from ..attention import scored_decode_attention
from ..summary import bound_scores
from .base import register
from .quest import Quest


@register
class LeoAM(Quest):
    """Like ``quest``, on adaptive chunks: each layer ranks its tree's leaves by their estimated
    attention density (``GroupIndex.share_scores``: a merged leaf pays for its size), attends
    exactly over what it fetched, and folds that attention back into the tree: cold runs merge
    (IAKM), up to a quarter of the budget.

    Chunks are sealed at ``ChunkConfig.base`` tokens (8 by default, as ``quest``'s pages) and
    leaves only grow, by merging deserts: small leaves have tight bounds and are what a small
    budget can hold (see ``quest``). A merged leaf does not split back here (no keys are passed to ``adapt``).
    ``tierkv`` ranks by exact filter-layer mass and does split.
    """

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
        index = cache.index_of(layer)
        scores = self._unfetched_estimate(index, q.reshape(-1, q.shape[-1]), k, leaves, scaling,
                                          cache.layer_length(layer))
        scores[positions] = probs.sum(dim=(0, 1)).cpu()
        with cache.changing():
            index.adapt(scores, leaves, self.select.sinks, None, None, self.max_leaf(cache))
        return out

    @staticmethod
    def _unfetched_estimate(index, q, k, leaves, scaling, n):
        """Per-token mass the leaves not fetched could hold at most, from their LKA bounds and
        the softmax normaliser of what was fetched: a leaf that could matter never looks cold
        (merges follow evidence, not ignorance). Tensor, shape (n,)."""
        tree = index.tree
        kv_heads = k.shape[0]
        logits = (q.float().view(kv_heads, -1, q.shape[-1]) @ k.float().transpose(1, 2)) * scaling
        log_z = torch.logsumexp(logits, dim=-1).cpu()  # (kv, g)
        bound = bound_scores(q.cpu(), tree.kmin, tree.kmax) * scaling  # (m, kv, g)
        per_token = torch.exp((bound - log_z).clamp(max=0)).sum(dim=(1, 2))  # (m,)
        scores = torch.zeros(n)
        sizes = tree.sizes
        unfetched = torch.ones(len(sizes), dtype=torch.bool)
        unfetched[leaves] = False
        token_leaf = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        estimate = torch.where(unfetched, per_token, torch.zeros_like(per_token))
        scores[: tree.n] = estimate[token_leaf]
        return scores
