"""Layer-wise prefill: a layer's new tokens attend over that layer's KV only.

transformers runs a prompt through the model one layer at a time; ``TieredCache`` makes each
layer's attention exact (in query blocks, or in one causal call for a first prompt on a CPU:
``causal_attention``) and seals the layer's KV into the tiers right after, so only one layer's
KV (plus the recent windows) is on the device at once. Logits equal an ordinary prefill's up to
floating-point summation order.

Where a disk tier is configured, each layer also weighs its KV by the attention of the prompt's
last ``RECENT_QUERIES`` queries (SnapKV's observation window), and the records are sealed ranked
by it (``prompt_ranks``): the host tier keeps those the first decode steps are likely to read.
Before, a prompt's records all ranked alike and the host kept the last ones sealed. Measured with
``bench.decode``'s 8K case (device 6.25 % / host 20 % of the KV, ``tierkv``, 64 teacher-forced
steps, both caches and ``full_memory`` decoding alternate blocks of 8 steps in one process,
2026-11-27): the first step read 11.3 MB from disk against 33.9 and took 181 ms against 263;
over the 64 steps 2.72 MB a token against 3.11 and 99.4 ms a token against 103.9 (``full_memory``
114.1), top-1 agreement 0.969 either way. Ranking 32 queries over 8K tokens costs ~8-9 ms a layer.

A layer that preselects (``tierkv``'s filter layers, and those before the first) reads 40 % of
its context on the first step, chosen by its query, not by what the prompt attended: those 167
records were most of that step's 11.2 MB from disk. So the records of the candidates the
prompt's last query picks (``Policy.prompt_candidates``) rank first. Measured on the same case
(device 5 % / host 20 % of the KV; two caches, prefilled with and without, and ``full_memory``
decoding alternate blocks of 8 steps in one process, 2026-11-28, twice): the first step took
126.9 and 128.2 ms against 157.9 and 160.6 and read 5.4 MB from disk against 11.2; the other
63 steps 97.8 / 100.5 against 98.2 / 99.5 ms a token (2.62 against 2.59 MB), top-1 62 of 64
either way.
"""
from __future__ import annotations

from concurrent import futures
from typing import NamedTuple

import torch

from ..attention import attention_with_mass, causal_attention, recent_query_mass

FETCH_BATCH_BYTES = 8 << 20
RECENT_QUERIES = 32  # the prompt's last queries whose attention ranks its records for the host
RANK_LEVELS, RANK_SPAN = 32, 0.5  # their ranks: this many steps of importance, within this span


def prefill_attention(cache, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of ``layer``'s new tokens over its KV: all of it, or for a question
    (``asks``) what the policy chooses (``Policy.question_fetch``).

    q : Tensor, shape (q_heads, t, head_dim), the new tokens' queries (after RoPE).
    Returns Tensor, shape (q_heads, t, head_dim).
    """
    wk, wv = cache._window[layer]
    if layer == 0:
        cache.asking = asks(cache, q.shape[1])
        cache.question_choice.clear()
    wanted = cache.policy.question_fetch(cache, layer, q) if cache.asking else None
    k, v, sealed, positions = sealed_layer_kv(cache, layer, (wk, wv), wanted)
    cache.reserve(f"prefill:{layer}", sealed)
    ranks = cache.store.disk is not None  # the prompt's last queries rank its records
    mass = None
    try:
        if cache.asking:
            out, recent, peak = attention_with_mass(q, k, v, scaling, peak=True,
                                                    queries=RECENT_QUERIES)
            cache.policy.observe_question(cache, layer, peak, positions)
        elif ranks and q.shape[1] <= RECENT_QUERIES and not cache.policy.wants_prefill_mass:
            out, recent = attention_with_mass(q, k, v, scaling)  # a short prompt: one pass for both
        else:
            out, mass = causal_attention(q, k, v, scaling, cache.prefill_block,
                                         column_mass=cache.policy.wants_prefill_mass)
            recent = recent_query_mass(q, k, scaling, RECENT_QUERIES) if ranks else None
        if ranks:
            recent, n = recent.cpu(), int(positions[-1]) + 1
            if recent.numel() < n:  # a question's: of the keys it attended, by position
                recent = torch.zeros(n).index_copy_(0, positions, recent)
            cache.prompt_mass[layer] = recent
            cache.prompt_query[layer] = q[:, -1].cpu()
    finally:
        cache.store.device.reserve(f"prefill:{layer}", 0)
    if mass is not None:
        cache.policy.observe_prefill(cache, layer, mass)
    return out


def asks(cache, new: int) -> bool:
    """Whether a forward pass of ``new`` tokens is a question: a continuing prompt of at most
    ``SelectConfig.question_tokens``, through a policy that selects for questions."""
    return cache.policy.selects_questions and 1 < new <= cache.select.question_tokens and \
        cache.get_seq_length() > new


class _Pass(NamedTuple):
    """Consecutive layers of one group whose sealed records are held for a continuing prompt."""

    group: int
    keys: tuple  # the group's records when they were read
    layers: tuple[int, ...]
    parts: list  # per record (k, v), shape (len(layers), kv_heads, tokens, head_dim) each
    left: set  # the layers that have not attended yet
    read: int  # bytes of ``parts`` read from disk (new memory)


def sealed_layer_kv(cache, layer: int, window, wanted: torch.Tensor | None = None):
    """One layer's K and V, its sealed tokens (all, or the leaves ``wanted``) followed by
    ``window`` (its recent window's keys and values, on the device): (k, v, bytes of the
    sealed tokens, the positions of k's tokens), k and v of shape (kv_heads, tokens, head_dim),
    on the device (on a CPU, one copy of each sealed token), the positions a CPU LongTensor.

    Records hold a whole layer group, and a continuing prompt attends over each layer's whole
    KV (a question over what its policy chose): the group's records are read a few at a time,
    and each layer copies its own slice to the device (counted there, ``prefill:<layer>``).
    Records the memory tiers hold are used where they lie. Those read from disk are new host
    memory, so of them only the slices of one pass of the group's layers are kept: as many
    layers as the host budget holds. A group whose records on disk fit is read once, a larger
    one in passes, each reading its records again; beyond the tiers the prefill holds at most
    the host budget, or one layer's slices where that is more (and the ~8 MB batch being read).
    It held a whole group and read the next one ahead: 40 % of the KV for ``tierkv``'s last
    group on SmolLM2, whatever the host budget. The next pass is read in the background when
    the two fit together (``_read_ahead``).
    """
    g = cache.group_of[layer]
    spec = cache.indexes[g].fetch(wanted)
    start = cache.layer_length(layer) - window[0].shape[1]
    tail = torch.arange(start, start + window[0].shape[1])
    if not spec.keys:
        return window[0], window[1], 0, tail
    held = _staged(cache, g, layer, spec)
    i = held.layers.index(layer)
    k, v = (_joined([part[j][i] for part in held.parts], window[j], cache.device, spec.keep)
            for j in (0, 1))
    held.left.discard(layer)
    if not held.left:
        cache.prefill_staged = None
    sealed = k.shape[1] - window[0].shape[1]
    return k, v, sealed * cache.shape.token_bytes(1), torch.cat([spec.positions, tail])


def _joined(parts: list, tail: torch.Tensor, device: torch.device,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """``parts`` (on the host or the device; of their tokens concatenated, those ``keep``
    indexes when given) and then ``tail`` (on ``device``), concatenated along the token axis
    on ``device``."""
    if keep is None and all(part.device == tail.device for part in parts):
        return torch.cat(parts + [tail], dim=1)
    head = torch.cat(parts, dim=1)
    if keep is not None:
        head = head.index_select(1, keep.to(head.device))
    return torch.cat([head.to(device), tail], dim=1)


def _staged(cache, g: int, layer: int, spec) -> _Pass:
    """The pass holding ``layer`` (read now unless read ahead)."""
    held = cache.prefill_staged
    if held is not None and (held.group, held.keys) == (g, spec.keys) and layer in held.left:
        return held
    cache.prefill_staged = None  # what is left of it is not needed: let it go before reading
    ahead, cache.prefill_ahead = cache.prefill_ahead, None
    if ahead is not None and ahead[0] == (g, spec.keys) and ahead[1][0] == layer:
        layers, read, parts = ahead[1], ahead[2], ahead[3].result()
    else:
        if ahead is not None and not ahead[3].cancel():  # a read under way: let it end, and
            futures.wait([ahead[3]])  # its bytes go before this pass is read
        ahead = None
        layers, read = _pass_layers(cache, g, layer, spec)
        parts = _stage(cache, g, spec, layers)
    cache.prefill_staged = held = _Pass(g, spec.keys, layers, parts, set(layers), read)
    _read_ahead(cache)
    return held


def _pass_layers(cache, g: int, first: int, spec) -> tuple[tuple[int, ...], int]:
    """Group ``g``'s layers from ``first`` on whose slices of the records that are new host
    memory (read from disk, or copied from a GPU's device tier) fit the host budget (at least
    one layer), and the bytes of those slices."""
    found = cache.store.locate(spec.keys)
    new = sum(key.end - key.start for key, (block, _) in zip(spec.keys, found)
              if block is None or block.keys.device.type != "cpu")
    per_layer = cache.shape.token_bytes(1) * new
    rest = cache.groups[g][cache.groups[g].index(first):]
    layers = tuple(rest[:max(1, cache.store.host.budget // max(1, per_layer))])
    return layers, per_layer * len(layers)


def _stage(cache, g: int, spec, layers: tuple[int, ...]) -> list:
    """Per record of group ``g`` (``spec``, a ``Fetch`` of all of them) its K and V of
    ``layers`` (consecutive layers of the group), on the host: the memory tiers' blocks where
    they lie, disk records read in batches of about ``FETCH_BATCH_BYTES``, each batch let go
    but for those layers' slices."""
    first = cache.slot_of[layers[0]]
    part = slice(first, first + len(layers))
    whole = len(layers) == len(cache.groups[g])
    per_record = max(1, cache.shape.token_bytes(len(cache.groups[g])) * cache.record_tokens[g])
    step = max(1, FETCH_BATCH_BYTES // per_record)
    parts = []
    for i in range(0, len(spec.keys), step):
        keys = spec.keys[i:i + step]
        found = [block for block, _ in cache.store.locate(keys)]
        read = iter(cache.store.fetch([key for key, block in zip(keys, found) if block is None],
                                      "cpu"))
        for block in found:
            if block is None:
                block = next(read)
                if not whole:  # a copy of the slice: the rest of the block is let go
                    parts.append((block.keys[part].clone(), block.values[part].clone()))
                    continue
            # in place on the host; from a GPU's device tier only the slice is copied
            parts.append((block.keys[part].to("cpu"), block.values[part].to("cpu")))
    return parts


def _read_ahead(cache) -> None:
    """Start reading the pass after the one just staged in the background when what the two
    may read from disk fits the host budget (a pass is held until its last layer attends); the
    next group's only where the disk's records are lossless."""
    held = cache.prefill_staged
    if held is None or cache.prefill_ahead is not None:
        return
    group = cache.groups[held.group]
    if held.layers[-1] != group[-1]:
        nxt, first = held.group, group[group.index(held.layers[-1]) + 1]
    elif held.group + 1 < len(cache.groups) and not cache.store.config.codec.allow_lossy:
        # this group's seal, before the next group's first layer, spills host records: read
        # before it, a record is the host's exact copy, after it, a lossy codec's disk copy
        nxt, first = held.group + 1, cache.groups[held.group + 1][0]
    else:
        return
    if cache.asking and not cache.policy.dense(cache, first):  # chosen by the question's queries
        return
    spec = cache.indexes[nxt].fetch(None)
    if not spec.keys:
        return
    layers = _pass_layers(cache, nxt, first, spec)[0]
    read = len(layers) * cache.shape.token_bytes(1) * spec.tokens  # were all on disk by then:
    if held.read + read > cache.store.host.budget:  # this prompt's seals spill host records
        return
    cache.prefill_ahead = ((nxt, spec.keys), layers, read,
                           cache.reader.submit(_stage, cache, nxt, spec, layers))


def prompt_ranks(cache, g: int, start: int, count: int, hot: float, ranked: bool) -> list[float]:
    """Importance of the ``count`` records group ``g`` seals now from position ``start``.

    After a prompt, each record ranks by the attention its group's layers paid it from the
    prompt's last ``RECENT_QUERIES`` queries: ``hot`` plus up to ``RANK_SPAN``, in
    ``RANK_LEVELS`` steps (below the next decode step's reads, which rank ``hot + 1``). The
    store keeps the higher ranked on the host when it spills, so the first decode steps find
    what they read there, not on disk. Otherwise (a decode step's seal, or not ``ranked``) all
    rank ``hot``.
    """
    masses = [cache.prompt_mass.pop(layer, None) for layer in cache.groups[g]]
    query = [cache.prompt_query.pop(layer, None) for layer in cache.groups[g]][0]
    step = cache.record_tokens[g]
    end = start + count * step
    if not ranked or not count or any(m is None or m.numel() < end for m in masses):
        return [hot] * count
    mass = torch.stack([m[start:end] for m in masses]).sum(dim=0).view(count, -1).sum(dim=1)
    order = mass.argsort().argsort()  # 0: the record paid the least attention
    level = -(-(order + 1) * RANK_LEVELS // count)  # 1 .. RANK_LEVELS, the top record's last
    wanted = None if query is None else cache.policy.prompt_candidates(cache, cache.groups[g][0],
                                                                       query)
    if wanted is not None:  # what the layer would fetch were the prompt's last query a step's
        starts = torch.tensor([key.start for key in cache.indexes[g].fetch(wanted).keys],
                              dtype=torch.long)
        starts = starts[(starts >= start) & (starts < end)]
        level[(starts - start) // step] = RANK_LEVELS
    return (hot + level * (RANK_SPAN / RANK_LEVELS)).tolist()
