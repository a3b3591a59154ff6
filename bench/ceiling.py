"""How close any token selection can come to full attention: exact top-k oracles, teacher-forced.

``bench.quality`` measures each policy's top-1 agreement with full attention. This bench measures
the same agreement, on the same contexts and continuations, for attention that *knows* every
token's exact weight and keeps only the best ones: not a method, a ceiling. Where the ceiling
of a kind of selection is below a target, no ranking of that kind reaches it.

Each oracle runs every decode step through a ``transformers.AttentionInterface`` function over a
plain ``DynamicCache`` (the prompt is prefilled once per context with ordinary attention, and
each run is cropped back to it). At a budget of ``b``, a step keeps ``SelectConfig(b).tokens``
tokens of the context; the kept tokens' exact scores go through the softmax, the others are
dropped. The oracles, from most to least free:

* ``per_head_tokens``: every query head of every layer keeps its own top-k tokens;
* ``per_head_tokens_dense``: the same, with the layers tierkv attends densely (those before the
  first filter layer, and the filter layers, from the model's profile) attended in full;
* ``per_kv_head_tokens`` / ``per_kv_head_chunks``: one set of tokens (or chunks) per KV head for
  the query heads that read it (ranked by their largest weight), sinks and window always in,
  dense layers as above: what a selection per head of the stored KV could reach;
* ``per_layer_tokens``: one set of tokens per layer for all its heads (ranked by their largest
  weight over the heads, as ``omnikv`` ranks), sinks and recent window always in, dense layers as
  above: the ceiling of a per-layer selection (``leoam``, ``quest``);
* ``per_layer_chunks``: the same on the chunk grid the selective policies seal
  (``ChunkConfig().base`` tokens), chunks ranked by exact mass per token fetched;
* ``filter_tokens`` / ``filter_chunks``: each layer reuses its filter layer's exact choice of this
  step (OmniKV's reuse across layers), tokens or chunks: the ceiling of ``omnikv`` and ``tierkv``.

Two rows are not oracles but the cheapest way known to come near the per-head one (Loki's):
``per_head_sketch16`` / ``per_head_sketch32`` rank each query head's tokens by its scores against
a rank-16 / rank-32 projection of the keys (per KV head, onto the top principal directions of
the prompt's keys), sinks and window always in, dense layers as above.

Beside agreement, each row says what its choice must bring: ``moved_tokens``, the share of a
sparse layer's tokens that some head keeps, and ``moved_chunks``, the share of its
``ChunkConfig().base``-token chunks holding one (a chunk is the unit the tiers store and move),
averaged over the decode steps and sparse layers.

    python -m bench.ceiling [--quick]   ->  bench/results/ceiling.json
"""
from __future__ import annotations

import argparse
import time
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.common import attention_installed, bench_device, write_result
from bench.quality import (BUDGETS, continuation_case, reference_log_probs, teacher_forced,
                           top1_agreement)
from tierkv import SelectConfig, load_model
from tierkv.config import ChunkConfig
from tierkv.hf.model import cache_kwargs
from tierkv.hf.profile import load_profile
from tierkv.policies.omnikv import DEFAULT_FILTERS

CHUNK = ChunkConfig().base


class Oracle(NamedTuple):
    source: str       # "head", "kv_head", "layer" or "filter": whose exact weights choose
    granularity: int  # 1: tokens; else chunks of this many tokens
    dense: bool       # tierkv's dense layers attend in full
    rank: int = 0     # "head" only: > 0 ranks by scores against a key sketch of this rank


ORACLES = {"per_head_tokens": Oracle("head", 1, False),
           "per_head_tokens_dense": Oracle("head", 1, True),
           "per_kv_head_tokens": Oracle("kv_head", 1, True),
           "per_kv_head_chunks": Oracle("kv_head", CHUNK, True),
           "per_layer_tokens": Oracle("layer", 1, True),
           "per_layer_chunks": Oracle("layer", CHUNK, True),
           "filter_tokens": Oracle("filter", 1, True),
           "filter_chunks": Oracle("filter", CHUNK, True),
           "per_head_sketch16": Oracle("head", 1, True, 16),
           "per_head_sketch32": Oracle("head", 1, True, 32)}


class OracleAttention:
    """The attention function: ordinary attention for prefill (and for every step while
    ``oracle`` is None), the oracle's selection for decode steps."""

    def __init__(self, filters: tuple[int, ...]):
        self.filters = filters
        self.oracle: Oracle | None = None
        self.select = SelectConfig()
        self.weights: dict[int, torch.Tensor] = {}  # filter layer -> this step's token weights
        self.bases: dict[tuple[int, int], torch.Tensor] = {}  # (layer, rank) -> key sketch basis
        self.moved: list[tuple[float, float]] = []  # (tokens, chunks) kept, a sparse layer each

    def dense_layer(self, layer: int) -> bool:
        return layer < self.filters[0] or layer in self.filters

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if self.oracle is None or query.shape[2] != 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, **kwargs)
        if query.shape[0] != 1:
            raise ValueError(f"batch {query.shape[0]}: the oracles decode one sequence")
        layer, groups = module.layer_idx, query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = (query @ keys.transpose(-1, -2)) * scaling  # (1, q_heads, 1, n)
        probs = scores.softmax(-1)
        if layer in self.filters:
            self.weights[layer] = probs.amax(dim=1)[0, 0]
        if self.oracle.dense and self.dense_layer(layer):
            return (probs @ values).transpose(1, 2).contiguous(), None
        ranking = self.sketch_scores(layer, query, key) if self.oracle.rank else probs
        keep = self.kept(layer, ranking, key.shape[1])
        self.moved.append(moved(keep, probs.shape[-1]))
        scores = scores.masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ values).transpose(1, 2).contiguous(), None

    def sketch_scores(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Each query head's scores against the keys projected on the top ``oracle.rank``
        principal directions of the layer's keys (per KV head, taken at the first decode step of
        a context: the prompt's), sinks and window set to +inf; shape (1, q_heads, 1, n)."""
        kv_heads, n = key.shape[1], key.shape[2]
        basis = self.bases.get((layer, self.oracle.rank))
        if basis is None:
            keys = key[0].float()
            basis = torch.linalg.eigh(keys.transpose(1, 2) @ keys).eigenvectors[:, :, -self.oracle.rank:]
            self.bases[(layer, self.oracle.rank)] = basis  # (kv_heads, head_dim, rank)
        sketch = key[0].float() @ basis  # (kv_heads, n, rank)
        q = query[0, :, 0].float().view(kv_heads, -1, query.shape[-1]) @ basis
        scores = (q @ sketch.transpose(1, 2)).view(1, -1, 1, n)
        scores[..., :self.select.sinks] = float("inf")
        scores[..., max(n - self.select.window, 0):] = float("inf")
        return scores

    def kept(self, layer: int, probs: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Boolean mask of the kept tokens, broadcastable to ``probs`` (1, q_heads, 1, n); query
        head ``h`` reads KV head ``h // (q_heads // kv_heads)``."""
        n = probs.shape[-1]
        budget = min(self.select.tokens(n), n)
        if self.oracle.source == "head":
            top = probs.topk(budget, dim=-1).indices
            return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, True)
        if self.oracle.source == "kv_head":  # one choice per KV head, for its query heads
            heads = probs.shape[1]
            groups = heads // kv_heads
            weights = probs[0, :, 0].view(kv_heads, groups, n).amax(dim=1)
            keep = torch.stack([self.chosen(w, n, budget) for w in weights]).to(probs.device)
            return keep.repeat_interleave(groups, 0).view(1, heads, 1, n)
        if self.oracle.source == "layer":
            weights = probs.amax(dim=1)[0, 0]
        else:
            source = max(f for f in self.filters if f <= layer)
            weights = self.weights[source]
        return self.chosen(weights, n, budget).to(probs.device).view(1, 1, 1, n)

    def chosen(self, weights: torch.Tensor, n: int, budget: int) -> torch.Tensor:
        """Sinks, recent window, and the densest tokens or chunks within ``budget`` tokens: a
        chunk costs its tokens not already kept, and chunks are taken by mass per token cost
        while the cost fits (the greedy rule of ``tierkv.select``)."""
        sinks, window = self.select.sinks, self.select.window
        weights = weights.float().cpu()  # the choice is made on the CPU; ``kept`` moves it back
        keep = torch.zeros(n, dtype=torch.bool)
        keep[:sinks] = True
        keep[max(n - window, 0):] = True
        chunk = torch.arange(n) // self.oracle.granularity
        count = int(chunk[-1]) + 1
        mass = torch.zeros(count).index_add_(0, chunk, torch.where(keep, 0.0, weights.float()))
        cost = torch.zeros(count, dtype=torch.long).index_add_(0, chunk, (~keep).long())
        order = torch.sort(mass / cost.clamp(min=1), descending=True, stable=True).indices
        order = order[cost[order] > 0]
        room = max(budget - int(keep.sum()), 0)
        taken = order[cost[order].cumsum(0) <= room]
        return keep | torch.isin(chunk, taken)


def moved(keep: torch.Tensor, n: int) -> tuple[float, float]:
    """Shares of the ``n`` tokens and of the ``CHUNK``-token chunks that some head's ``keep``
    (broadcastable to (1, heads, 1, n)) holds."""
    union = keep.reshape(-1, n).any(0)
    chunks = torch.cat([union, union.new_zeros(-n % CHUNK)]).view(-1, CHUNK).any(1)
    return union.float().mean().item(), chunks.float().mean().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 2K context, 32 tokens")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # small decode operations: a second thread mostly waits at barriers
    contexts, n_cont = ((2048,), 32) if args.quick else ((2048, 4096, 8192), 64)
    started = time.perf_counter()
    model, tok = load_model("smollm2-135m", device=str(bench_device()))
    filters = tuple(load_profile(model).get("filter_layers", DEFAULT_FILTERS))
    attention = OracleAttention(filters)
    agree = {name: {str(b): {} for b in BUDGETS} for name in ORACLES}
    shares = {name: {str(b): [] for b in BUDGETS} for name in ORACLES}
    with torch.no_grad(), attention_installed(model, "tierkv_oracle", attention):
        for context in contexts:
            ctx, cont = continuation_case(tok, context, n_cont, seed=context)  # bench.quality's
            ref = reference_log_probs(model, ctx, cont).argmax(-1)
            cache = DynamicCache()
            model(ctx, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            attention.bases = {}
            for name, oracle in ORACLES.items():
                for budget in BUDGETS:
                    attention.oracle, attention.select = oracle, SelectConfig(budget=budget)
                    try:
                        probs, _ = teacher_forced(model, cache, cont)
                    finally:
                        attention.oracle = None
                        extra = cache.get_seq_length() - context
                        if extra:
                            cache.crop(-extra)  # back to the prompt alone
                    agree[name][str(budget)][str(context)] = top1_agreement(probs.argmax(-1), ref)
                    shares[name][str(budget)] += attention.moved
                    attention.moved = []
            print(f"{context} tokens at {time.perf_counter() - started:.0f} s", flush=True)
    oracles = {name: {b: {"top1_agreement": sum(by.values()) / len(by), "top1_by_context": by,
                          **mean_moved(shares[name][b])}
                      for b, by in budgets.items()} for name, budgets in agree.items()}
    result = {"oracles": oracles, "context_tokens": list(contexts), "continuation_tokens": n_cont,
              "filter_layers": list(filters), "chunk_tokens": CHUNK, "quick": args.quick,
              "model": "smollm2-135m", "wall_s": round(time.perf_counter() - started, 1)}
    print(f"{'oracle':24s}" + "".join(f"{b:>8}" for b in BUDGETS) + "   moved tokens / chunks at 0.1")
    for name, budgets in oracles.items():
        at = budgets["0.1"]
        print(f"{name:24s}" + "".join(f"{budgets[str(b)]['top1_agreement']:8.3f}" for b in BUDGETS)
              + f"   {at['moved_tokens']:.3f} / {at['moved_chunks']:.3f}")
    print(write_result("ceiling", result, args.quick))
    return result


def mean_moved(shares: list[tuple[float, float]]) -> dict:
    if not shares:  # no layer attended sparsely
        return {"moved_tokens": None, "moved_chunks": None}
    tokens, chunks = zip(*shares)
    return {"moved_tokens": sum(tokens) / len(tokens), "moved_chunks": sum(chunks) / len(chunks)}


if __name__ == "__main__":
    main()
