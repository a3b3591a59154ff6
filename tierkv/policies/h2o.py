"""``h2o``: heavy hitters by accumulated attention + the recent window, within the budget. Lossy.

Per KV head, a token once evicted never returns (H2O's greedy eviction); evicted tokens stay in
storage, the policy just never attends to them again.
"""
import torch

from ..attention import scored_decode_attention
from .base import Policy, layers_of, on_device, per_layer, register


@register
class H2O(Policy):
    """Keep, per KV head, the tokens with the most accumulated attention plus the window."""

    name = "h2o"
    lossy = True
    wants_prefill_mass = True

    def __init__(self, layers, select, chunks, profile):
        super().__init__(layers, select, chunks, profile)
        self._acc: dict[int, torch.Tensor] = {}
        self._evicted: dict[int, torch.Tensor] = {}
        self._marked: tuple[dict, dict] = ({}, {})  # both as the last forward pass began

    def state(self):
        return {**per_layer("acc", self._acc), **per_layer("evicted", self._evicted)}

    def load_state(self, arrays):
        self._acc, self._evicted = layers_of("acc", arrays), layers_of("evicted", arrays)

    def mark(self):  # a pass replaces the tensors it grows, never writes the ones it found
        self._marked = dict(self._acc), dict(self._evicted)

    def roll_back(self, cache, tokens):
        self._acc, self._evicted = (dict(kept) for kept in self._marked)

    def crop(self, cache, tokens):  # what the cut pass evicted of the window again: kept
        self._acc = {layer: acc[:, :tokens] for layer, acc in self._acc.items()}
        self._evicted = {layer: gone[:, :tokens].clone() for layer, gone in self._evicted.items()}
        for gone in self._evicted.values():
            gone[:, max(0, tokens - self.select.window):] = False

    def observe_prefill(self, cache, layer, mass):
        acc = self._grow(cache, self._acc.get(layer), mass.shape[1])
        self._acc[layer] = acc + mass.float().cpu()
        self._evict(cache, layer)

    def attend(self, cache, layer, q, k, v, positions, scaling):
        n = cache.layer_length(layer)
        acc = self._acc[layer] = self._grow(cache, self._acc.get(layer), n)
        evicted = self._evicted[layer] = self._grow(cache, self._evicted.get(layer), n, torch.bool)
        allowed = on_device(~evicted[:, positions], q)
        out, probs = scored_decode_attention(q, k, v, scaling, allowed.unsqueeze(1).unsqueeze(2))
        acc[:, positions] += probs.sum(1).cpu()
        self._evict(cache, layer)
        return out

    def _evict(self, cache, layer):
        acc = self._acc[layer]
        n = acc.shape[1]
        evicted = self._evicted[layer] = self._grow(cache, self._evicted.get(layer), n, torch.bool)
        heavy = self.budget(cache)
        old = n - self.select.window
        if old <= heavy:
            return
        score = acc[:, :old].masked_fill(evicted[:, :old], float("-inf"))
        keep = torch.topk(score, heavy, dim=1).indices
        drop = torch.ones_like(evicted[:, :old]).scatter_(1, keep, False)
        evicted[:, :old] |= drop

    @staticmethod
    def _grow(cache, t, n, dtype=torch.float32):
        """``t`` (kv_heads, <= n) padded with zeros / False to (kv_heads, n)."""
        have = 0 if t is None else t.shape[1]
        if have >= n:
            return t
        pad = torch.zeros(cache.shape.kv_heads, n - have, dtype=dtype)
        return pad if t is None else torch.cat([t, pad], dim=1)
