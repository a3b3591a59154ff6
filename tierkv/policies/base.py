"""The policy interface: which layers group together, what a layer fetches, how it attends.

A policy is a small class with named hooks, found by name in ``REGISTRY``. The cache asks:

- ``groups()``: the layer groups whose KV is stored together (one record serves one group);
- ``fetch(cache, layer, q)``: the chunks of the layer's group to bring for this decode step
  (``None`` = every chunk);
- ``ahead(cache, layer)``: that fetch when it is known before the layer's query, so that it can
  start while earlier layers compute;
- ``attend(cache, layer, q, k, v, positions, scaling)``: attention of the new token over what
  was fetched plus the recent window (default: plain attention over all of it);
- ``observe_prefill(cache, layer, mass)``: the attention mass each key got during prefill,
  for policies that set ``wants_prefill_mass``;
- ``question_fetch(cache, layer, q)`` and ``observe_question(cache, layer, peak, positions)``:
  what a short continuing prompt (``SelectConfig.question_tokens``) attends of a layer, and the
  attention it paid there (default: all of it, and nothing kept).

Devices: ``q``, ``k``, ``v`` (and attention's outputs) are on the cache's device; ``positions``
and everything a policy keeps between steps (chunk trees, summaries, scores, accumulators) are on
the CPU. What crosses goes explicitly: queries, masses and keys to the CPU for the selection
(``.cpu()``: a query is a few KB, a mass one float per token), masks and biases to the device
for attention (``on_device``).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..config import ChunkConfig, SelectConfig
from ..attention import decode_attention

REGISTRY: dict[str, type["Policy"]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str, layers: int, select: SelectConfig, chunks: ChunkConfig,
                profile: dict | None = None) -> "Policy":
    """Build the policy registered under ``name``."""
    if name not in REGISTRY:
        raise ValueError(f"policy={name!r}: must be one of {', '.join(sorted(REGISTRY))}")
    policy = REGISTRY[name](layers, select, chunks, profile or {})
    for group in policy.groups():  # the chunk trees take leaves of ``chunks.min`` to ``max``
        leaf = policy.leaf_tokens(group) or policy.record_tokens(group)
        if not chunks.min <= leaf <= chunks.max:
            where = f"layer {group[0]}" if len(group) == 1 else f"layers {group[0]}-{group[-1]}"
            raise ValueError(f"policy {name!r} seals {leaf}-token chunks ({where}), outside "
                             f"ChunkConfig(min={chunks.min}, max={chunks.max}): allow {leaf} "
                             "tokens")
    return policy


def filter_layers_of(filters, layers: int, name: str, hint: str = "") -> tuple[int, ...]:
    """``filters`` as a tuple when they are strictly increasing layer indices below the last
    layer (a filter layer serves the layers after it); ValueError naming ``name`` otherwise,
    ``hint`` added when a layer is past the model's."""
    expected = f"must be strictly increasing layer indices in [0, {layers - 1})"
    if not isinstance(filters, (list, tuple)) or not filters or not all(map(_is_index, filters)) \
            or list(filters) != sorted(set(filters)):
        raise ValueError(f"{name}={filters!r}: {expected}")
    if filters[-1] >= layers - 1:
        raise ValueError(f"{name}={filters!r}: layer {filters[-1]} is at or past the model's last "
                         f"layer {layers - 1}; filter layers {expected}{hint}")
    return tuple(filters)


def per_layer(name: str, tensors: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{layer: tensor}`` as ``state``'s ``{"<name>.<layer>": tensor}``."""
    return {f"{name}.{layer}": t for layer, t in tensors.items()}


def layers_of(name: str, arrays: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The ``{layer: tensor}`` that ``per_layer(name, ...)`` saved in ``arrays``."""
    prefix = f"{name}."
    return {int(k[len(prefix):]): t.clone() for k, t in arrays.items()
            if k.startswith(prefix) and k[len(prefix):].isdigit()}


def retrieval_heads_of(heads, layers: int, name: str, kv_heads: int | None = None,
                       hint: str = "") -> dict[int, list[int]]:
    """``{layer: [KV heads]}`` from a profile's ``retrieval_heads`` (layers as ints or decimal
    strings, JSON's keys; KV heads distinct, below ``kv_heads`` when given); ValueError naming
    the entry that is not one, ``hint`` added when an index is past the model's."""
    if not isinstance(heads, dict):
        raise ValueError(f"{name}={heads!r:.60}: expected a dict {{layer: [KV heads]}}, got "
                         f"{type(heads).__name__}")
    out: dict[int, list[int]] = {}
    for key, kv in heads.items():
        layer = int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() else key
        field = f"{name}[{key!r}]"
        if not _is_index(layer):
            raise ValueError(f"{field}: the key must be a layer index (an int or a decimal string)")
        if layer in out:
            raise ValueError(f"{field}: layer {layer} is given twice")
        if layer >= layers:
            raise ValueError(f"{field}: layer out of range [0, {layers}){hint}")
        if not isinstance(kv, (list, tuple)) or not all(map(_is_index, kv)):
            raise ValueError(f"{field}={kv!r:.60}: expected a list of KV head indices")
        if len(set(kv)) != len(kv):
            raise ValueError(f"{field}={list(kv)}: KV heads must be distinct")
        if kv_heads is not None and any(h >= kv_heads for h in kv):
            raise ValueError(f"{field}={list(kv)}: KV head out of range [0, {kv_heads}){hint}")
        out[layer] = list(kv)
    return out


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def keys_gather(k: torch.Tensor):
    """``index -> k[:, index]`` on the CPU, from ``k`` (kv_heads, n, head_dim) on the device
    (``index``, a CPU LongTensor of token indices into ``k``): one gather, one copy down."""
    return lambda index: k.index_select(1, on_device(index, k)).cpu()


def on_device(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` on ``like``'s device (itself when it is there already)."""
    return t.to(like.device, non_blocking=True)


class Policy:
    """Dense attention over every token of every layer (the base the others refine)."""

    name: ClassVar[str] = "base"
    lossy: ClassVar[bool] = False
    adaptive: ClassVar[bool] = False
    wants_prefill_mass: ClassVar[bool] = False
    # whether ``attend_parts`` reads a fetch where it lies (a CPU decode step then skips the
    # packed copy, ``tierkv.scattered``); the others' parts are packed for ``attend``
    reads_parts: ClassVar[bool] = False
    # whether a question (``SelectConfig.question_tokens``) attends through ``question_fetch``
    # (its layers' peak weights to ``observe_question``); the others attend all of a layer
    selects_questions: ClassVar[bool] = False

    def __init__(self, layers: int, select: SelectConfig, chunks: ChunkConfig, profile: dict):
        self.layers, self.select, self.chunks, self.profile = layers, select, chunks, profile

    @property
    def chunk_tokens(self) -> int:
        """Tokens per sealed chunk (one record)."""
        return self.chunks.base

    def record_tokens(self, group: tuple[int, ...]) -> int:
        """Tokens per sealed record of the layer group ``group`` (its first chunking)."""
        return self.chunk_tokens

    def leaf_tokens(self, group: tuple[int, ...]) -> int | None:
        """Tokens per leaf when a record of ``group`` is sealed (None: one leaf per record)."""
        return None

    def groups(self) -> list[tuple[int, ...]]:
        return [(i,) for i in range(self.layers)]

    def fetch(self, cache, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        return None

    def dense(self, cache, layer: int) -> bool:
        """Whether ``layer`` reads all of its KV whatever its query (so it can be prefetched)."""
        return True

    def ahead(self, cache, layer: int) -> tuple[bool, torch.Tensor | None]:
        """``(known, wanted)``: whether ``layer``'s next ``fetch`` is known before its query
        and, if so, what it will return (leaf indices, None for all). Default: a dense layer's,
        all of its KV."""
        return self.dense(cache, layer), None

    def attend(self, cache, layer, q, k, v, positions, scaling) -> torch.Tensor:
        return decode_attention(q, k, v, scaling)

    def preselects(self, cache, layer) -> bool:
        """Whether ``layer`` narrows its own KV by its query before attending: what it fetches
        is known only then (``TieredCache.fetched`` keeps such a fetch read in place to the
        next step, whose query mostly asks the same records)."""
        return False

    def attend_parts(self, cache, layer, q, parts, positions, scaling) -> torch.Tensor:
        """``attend`` over ``parts`` (``scattered.LayerParts``: the layer's fetched records
        where they lie, then its recent window)."""
        k, v = parts.packed()
        return self.attend(cache, layer, q, k, v, positions, scaling)

    def prompt_candidates(self, cache, layer: int, query: torch.Tensor) -> torch.Tensor | None:
        """Leaves ``layer`` would fetch of its own KV were ``query`` (q_heads, head_dim), a
        prompt's last, a decode step's: a prefill ranks their records first for the host tier
        (``prefill.prompt_ranks``). None: no such guess (the prompt's attention ranks them)."""
        return None

    def question_fetch(self, cache, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        """Leaves of ``layer``'s sealed KV that a question attends (a continuing prompt of at
        most ``SelectConfig.question_tokens``; ``q`` its queries, (q_heads, t, head_dim), on the
        device), None for all of them. Asked only of policies that set ``selects_questions``
        (``omnikv``, ``tierkv``; ``quest`` says why it does not), and None wherever ``dense``
        says a layer is read whole (the prefill reads such layers ahead). A selection is not cut
        to the device tier as a decode step's fetch is: a question holds one layer's slice at a
        time, and ``check_prompt_room`` saw each layer's whole context fit."""
        return None

    def observe_question(self, cache, layer: int, peak: torch.Tensor,
                         positions: torch.Tensor) -> None:
        """After a question attended at ``layer``: ``peak`` (n,), on the device, each key's
        largest weight over the query heads and the question's queries; ``positions`` (n,), on
        the CPU, the keys' positions. Called before the next layer's ``question_fetch``."""

    def state(self) -> dict[str, torch.Tensor]:
        """What the policy built up over the steps so far and reads in the next ones, by name
        (``[a-z]+.<layer>``): saved with a document, so that a reopened one goes on as the live
        cache would. Default: nothing."""
        return {}

    def load_state(self, arrays: dict[str, torch.Tensor]) -> None:
        """Take back what ``state`` gave (a reopened document saved under this policy)."""

    def observe_prefill(self, cache, layer: int, mass: torch.Tensor) -> None:
        """Called after each prefill pass of a layer, mass : Tensor, shape (kv_heads, n)."""

    def mark(self) -> None:
        """A forward pass begins: keep what ``roll_back`` would go back to. Default: nothing."""

    def roll_back(self, cache, tokens: int) -> None:
        """Go back to ``mark`` after a forward pass that failed part-way (``hf/recover.py``):
        nothing it added for positions from ``tokens`` on, nor work it left for a later layer,
        may stay; what it learned of earlier positions may. Default: nothing to forget."""

    def crop(self, cache, tokens: int) -> None:
        """The cache took back its newest tokens (``hf/crop.py``) and holds ``tokens``: forget
        what was kept for positions from ``tokens`` on. Default: nothing kept by position."""

    def budget(self, cache, group: int | None = None) -> int:
        """Token budget of the sealed context this step: ``SelectConfig.tokens`` less the recent
        window, attended on top. With ``group``, the window is what that group's layers attend
        unsealed this step (``window + 1`` to ``window + chunk_tokens`` tokens, the new one
        included); without, ``SelectConfig.window``, or what the shortest window holds when a
        crop left less (``hf/crop.py``: a budget of the whole context still covers it)."""
        n = cache.get_seq_length()
        if group is None:
            window = min(self.select.window, cache.shortest_window())
        else:
            window = n - cache.indexes[group].sealed
        return max(0, self.select.tokens(n) - window)

    def max_leaf(self, cache) -> int:
        """Largest leaf a merge may make: a quarter of the fetch budget, so merged leaves still
        compete for it."""
        return max(2 * self.chunks.min, self.budget(cache) // 4)
