"""``TieredCache``: a transformers ``Cache`` whose KV lives on the device, host and disk tiers.

The cache installs one attention function (through ``AttentionInterface``) bound to itself on
the model, and removes it on ``close()``. ``update()`` only appends the new keys and values to
the layer's recent window; the attention function does the work:

- several new tokens (prefill, a new turn): exact causal attention in query blocks over the
  layer's whole context (``prefill.py``);
- one new token (decode): the policy names the chunks to fetch, the cache brings them up (once
  per layer group and step) and the policy attends over them plus the window.

After a layer attends, its window beyond the last ``window`` tokens is cut into chunks; when the
last layer of a group has done so, the group's chunks are sealed into the store as one record each.
"""
from __future__ import annotations

import itertools

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin

from ..config import ChunkConfig, SelectConfig, TierConfig
from ..policies import Policy, make_policy
from ..shapes import KVShape
from ..storage.base import KVBlock
from ..storage.store import KVStore
from .attention import decode_attention
from .groups import GroupIndex
from .prefill import prefill_attention
from .profile import load_profile

_ids = itertools.count()


class TieredLayer(CacheLayerMixin):
    """transformers' per-layer view of a ``TieredCache`` (lengths; the data lives in the tiers)."""

    def __init__(self, cache: "TieredCache", layer: int):
        super().__init__()
        self.cache, self.layer = cache, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.cache.append(self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.layer_length(self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


class TieredCache(Cache):
    """A KV cache on three tiers for one sequence (batch size 1).

    Parameters
    ----------
    model : a loaded transformers decoder-only model (Llama, Qwen2, Mistral families).
    config : TierConfig -- budgets and places of the tiers.
    policy : name of a policy (``tierkv`` by default; see ``tierkv.policies.REGISTRY``).
    select, chunks : SelectConfig and ChunkConfig (defaults when omitted).
    doc : the document id under which records are stored.
    profile : the model's calibration profile (filter layers, retrieval heads); by default the
        profile shipped for the model, when there is one.
    prefill_block : query block size of the layer-wise prefill.
    """

    def __init__(self, model, config: TierConfig | None = None, policy: str = "tierkv", *,
                 select: SelectConfig | None = None, chunks: ChunkConfig | None = None,
                 doc: str | None = None, profile: dict | None = None, prefill_block: int = 512):
        config = config or TierConfig()
        self.shape = KVShape.from_config(model.config, dtype=model.dtype)
        super().__init__(layers=[TieredLayer(self, i) for i in range(self.shape.layers)])
        if not isinstance(prefill_block, int) or prefill_block < 1:
            raise ValueError(f"prefill_block={prefill_block!r}: must be a positive integer")
        self.config, self.prefill_block = config, prefill_block
        self.select, self.chunks = select or SelectConfig(), chunks or ChunkConfig()
        self.doc = doc or f"doc{next(_ids)}"
        self.profile = profile if profile is not None else load_profile(model)
        self.policy: Policy = make_policy(policy, self.shape.layers, self.select, self.chunks, self.profile)
        self.groups = self.policy.groups()
        self.group_of = {layer: g for g, group in enumerate(self.groups) for layer in group}
        self.slot_of = {layer: i for group in self.groups for i, layer in enumerate(group)}
        self.indexes = [GroupIndex(self.doc, g, self.shape.kv_heads, self.shape.head_dim)
                        for g in range(len(self.groups))]
        self.store = KVStore(self.shape, config)
        self.device = self.store.device.device
        empty = torch.zeros(self.shape.kv_heads, 0, self.shape.head_dim, dtype=self.shape.dtype)
        layers = range(self.shape.layers)
        self._window = [(empty.to(self.device), empty.to(self.device)) for _ in layers]
        self._pending: list[list[KVBlock]] = [[] for _ in layers]
        self._fresh = [False] * self.shape.layers
        self._step: dict = {}
        self._model = model
        self._install(model)

    # -- transformers' side ------------------------------------------------------------
    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append new K/V, shape (1, kv_heads, t, head_dim), to ``layer``'s recent window."""
        if key_states.shape[0] != 1:
            raise ValueError(f"TieredCache holds one sequence; got batch size {key_states.shape[0]}")
        k, v = self._window[layer]
        k = torch.cat([k, key_states[0].to(self.device, k.dtype)], dim=1)
        v = torch.cat([v, value_states[0].to(self.device, v.dtype)], dim=1)
        self._window[layer] = (k, v)
        self.store.device.reserve(f"window:{layer}", k.nbytes + v.nbytes)
        self._fresh[layer] = True
        return key_states, value_states

    def layer_length(self, layer: int) -> int:
        pending = sum(b.keys.shape[2] for b in self._pending[layer])
        return self.indexes[self.group_of[layer]].sealed + pending + self._window[layer][0].shape[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer_length(layer_idx)

    @property
    def is_compileable(self) -> bool:
        return False

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = module.layer_idx
        if not self._fresh[layer]:
            raise RuntimeError(f"layer {layer} attends through a TieredCache that did not receive its "
                               "keys: pass past_key_values=cache, or close() the cache first")
        self._fresh[layer] = False
        q = query[0]
        scaling = module.scaling if scaling is None else scaling
        if q.shape[1] > 1 or self.layer_length(layer) == q.shape[1]:
            out = prefill_attention(self, layer, q, scaling)
        else:
            out = self._decode(layer, q, scaling)
        self._after_attention(layer)
        return out.transpose(0, 1).unsqueeze(0), None

    # -- decode -------------------------------------------------------------------------
    def _decode(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        if layer == 0:
            self._new_step()
        chunks = self.policy.fetch(self, layer, q)
        block, positions = self.fetched(layer, chunks)
        wk, wv = self._window[layer]
        slot = self.slot_of[layer]
        k = torch.cat([block.keys[slot], wk], dim=1)
        v = torch.cat([block.values[slot], wv], dim=1)
        start = self.indexes[self.group_of[layer]].sealed
        positions = torch.cat([positions, torch.arange(start, start + wk.shape[1])])
        return self.policy.attend(self, layer, q, k, v, positions, scaling)

    def _new_step(self) -> None:
        for kind, group in self._step:
            if kind == "fetch":
                self.store.device.reserve(f"fetch:{group}", 0)
        self._step = {}

    def fetched(self, layer: int, chunks: torch.Tensor | None):
        """The group's chunks (all when None) on the device, once per step: (KVBlock, positions)."""
        g = self.group_of[layer]
        tag = ("fetch", g, None if chunks is None else tuple(chunks.tolist()))
        hit = self._step.get(("fetch", g))
        if hit is not None and hit[0] == tag:
            return hit[1], hit[2]
        index = self.indexes[g]
        keys = index.records(chunks)
        block = self._gather(keys, len(self.groups[g]))
        self.store.device.reserve(f"fetch:{g}", block.nbytes)
        result = (block, index.positions(chunks))
        self._step[("fetch", g)] = (tag, *result)
        return result

    def _gather(self, keys, n_layers: int) -> KVBlock:
        if not keys:
            empty = torch.zeros(n_layers, self.shape.kv_heads, 0, self.shape.head_dim,
                                dtype=self.shape.dtype, device=self.device)
            return KVBlock(empty, empty)
        blocks = self.store.fetch(keys, self.device)
        if len(blocks) == 1:
            return blocks[0]
        return KVBlock(torch.cat([b.keys for b in blocks], dim=2), torch.cat([b.values for b in blocks], dim=2))

    def selection(self, group: int) -> torch.Tensor | None:
        """The chunks chosen for ``group`` this step (by a filter layer), or None (all)."""
        return self._step.get(("select", group))

    def set_selection(self, group: int, chunks: torch.Tensor) -> None:
        self._step[("select", group)] = chunks

    def index_of(self, layer: int) -> GroupIndex:
        return self.indexes[self.group_of[layer]]

    def group_bytes(self, layer: int) -> int:
        """Bytes of the sealed KV of ``layer``'s group."""
        g = self.group_of[layer]
        return self.indexes[g].sealed * self.shape.token_bytes(len(self.groups[g]))

    # -- sealing ------------------------------------------------------------------------
    def _after_attention(self, layer: int) -> None:
        """Move ``layer``'s sealable window tokens to host; seal the group after its last layer."""
        k, v = self._window[layer]
        step = self.policy.chunk_tokens
        movable = (k.shape[1] - self.select.window) // step * step
        if movable > 0:
            self._pending[layer].append(KVBlock(k[:, :movable].cpu(), v[:, :movable].cpu()))
            self._window[layer] = (k[:, movable:].clone(), v[:, movable:].clone())
            self.store.device.reserve(f"window:{layer}", 2 * self._window[layer][0].nbytes)
        g = self.group_of[layer]
        if layer == self.groups[g][-1]:
            if self._step.pop(("fetch", g), None) is not None:
                self.store.device.reserve(f"fetch:{g}", 0)
            self._seal(g)

    def _seal(self, g: int) -> None:
        layers = self.groups[g]
        if not self._pending[layers[0]]:
            return
        keys = torch.stack([torch.cat([b.keys for b in self._pending[i]], dim=1) for i in layers])
        values = torch.stack([torch.cat([b.values for b in self._pending[i]], dim=1) for i in layers])
        for i in layers:
            self._pending[i] = []
        index = self.indexes[g]
        start, step = index.sealed, self.policy.chunk_tokens
        bounds = [(s, s + step) for s in range(start, start + keys.shape[2], step)]
        records = index.add(bounds, keys[0])
        for key, (s, e) in zip(records, bounds):
            block = KVBlock(keys[:, :, s - start:e - start], values[:, :, s - start:e - start])
            self.store.put(key, block)

    # -- lifetime -----------------------------------------------------------------------
    def _install(self, model) -> None:
        self._attn_name = f"tierkv_{id(self):x}"
        AttentionInterface.register(self._attn_name, self._attention)
        self._previous_attn = model.config._attn_implementation
        model.set_attn_implementation(self._attn_name)

    def close(self) -> None:
        """Give the model back its own attention and release the tiers (idempotent)."""
        if self._model is None:
            return
        self._model.set_attn_implementation(self._previous_attn)
        AttentionInterface._global_mapping.pop(self._attn_name, None)
        self._model = None
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        """Tokens, tier occupancy and the device tier's peak, as a dict."""
        return {"tokens": self.get_seq_length(), "policy": self.policy.name,
                "device_peak_bytes": self.store.device.peak, **self.store.stats()}
