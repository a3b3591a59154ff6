"""Chunk selection on real SmolLM2 KV: LKA recall, adaptive vs fixed chunks, evaluations.

For each seeded document the model prefills, then decodes a few greedy steps; an attention
function registered through ``transformers.AttentionInterface`` captures every layer's post-RoPE
queries and keys. Per layer, one tree per case holds the prompt's sealed tokens (everything
before the recent window): ``fixed64`` (64-token leaves, never adapted), ``adaptive`` (the
project's default ChunkConfig) and ``adaptive_base64`` (adaptive, starting from 64-token
leaves); ``adaptive_min4``, ``adaptive_min8`` and ``adaptive_min8_base16`` show how the recall follows
the smallest leaf (the default splits down to 2 tokens).
Adaptive trees are adapted by ``ChunkTree.update`` with the layer's exact attention for the
last ``WARMUP`` prompt positions, then online after each decode step. At a 10 % token budget,
each decode step measures:

* ``lka_mass_recall``: attention mass (mean over heads) of the tokens chosen from summaries
  alone (``select_by_query``: sinks + leaves + window) / mass of the exact top-k tokens
  (k = the budget); ``chunk_oracle_recall``: the same for leaves chosen by exact scores
  (``select_by_scores``), the best a leaf structure allows;
* ``adaptive_vs_fixed_bytes``: tokens (hence bytes) fetched outside the sinks and window to
  capture the mass ``fixed64`` captures at the budget, adaptive / fixed, leaves ranked by
  exact-score density (the filter-layer path); ``bytes(lka)``: the same with the LKA key;
* summaries scored per step (every leaf), the desert fraction (tokens in cold leaves), and the
  bookkeeping time of one layer;
* ``bound_mass_recall`` and ``evaluations_per_step_bound_pruned``: the same for Quest's bound
  ranking found by the tree's pruned search (``select_by_bound``), the ranking used before.

Run: ``python -m bench.selection [--quick]``.
"""
from __future__ import annotations

import argparse
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import attention_installed, result_path, write_result  # noqa: E402
from tierkv.config import ChunkConfig, SelectConfig  # noqa: E402
from tierkv.hf.model import cache_kwargs  # noqa: E402
from tierkv.select import (adaptation_mass, adaptation_scores, leaf_costs,  # noqa: E402
                           query_keys, select_by_bound, select_by_query, select_by_scores)
from tierkv.tree import ChunkTree  # noqa: E402

FIXED = ChunkConfig(min=64, base=64, max=64)
CASES = {"fixed64": FIXED, "adaptive": ChunkConfig(),  # the project's default tree
         "adaptive_base64": ChunkConfig(min=16, base=64, max=1024),  # same start as fixed64
         # smallest leaf larger: the recall follows it (records stay ``base`` tokens in all)
         "adaptive_min4": ChunkConfig(min=4),
         "adaptive_min8": ChunkConfig(min=8),  # 8-token chunks that never split
         "adaptive_min8_base16": ChunkConfig(min=8, base=16)}  # the default before 2026-11-22
SELECT = SelectConfig(budget=0.1)
WARMUP = 32
PLOT_LAYERS = (2, 10, 18, 27)


def capture_attention(model, record):
    """Route attention through sdpa while ``record(layer, query, key)`` sees its inputs."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        record(module.layer_idx, query[0].detach(), key[0].detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention_installed(model, "tierkv_capture", attention)


def run_document(model, tok, tokens: int, seed: int, steps: int):
    """Prefill + greedy decode; returns keys per layer (kv, n+steps, d), prompt-tail queries
    (layers, WARMUP, q_heads, d), decode queries (steps, layers, q_heads, d), prompt length."""
    import random

    from transformers import DynamicCache

    from tierkv.textgen import make_document, passkey_fact

    doc = make_document(tok, tokens, seed, [passkey_fact(random.Random(seed))])
    ids = tok(doc, return_tensors="pt")["input_ids"][:, :tokens]
    tail, decode = {}, []

    def record(layer, query, key):
        if query.shape[1] > 1:
            tail[layer] = query[:, -WARMUP:].transpose(0, 1).float()
        else:
            decode.append(query[:, 0].float())

    cache = DynamicCache()
    with torch.no_grad(), capture_attention(model, record):
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
    layers = len(cache.layers)
    keys = [layer.keys[0].float() for layer in cache.layers]
    queries = torch.stack(decode).view(steps, layers, *decode[0].shape)
    return keys, torch.stack([tail[i] for i in range(layers)]), queries, ids.shape[1]


def attention_probs(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``query`` (q_heads, d) over ``keys`` (kv, ctx, d), mean over heads."""
    kv, _, dim = keys.shape
    logits = torch.einsum("hgd,hnd->hgn", query.view(kv, -1, dim), keys) * dim ** -0.5
    return logits.softmax(-1).mean((0, 1))


def build_tree(keys: torch.Tensor, sealed: int, config: ChunkConfig) -> ChunkTree:
    """Seal ``[0, sealed)`` in base-size chunks, the last one possibly short."""
    tree = ChunkTree(config, keys.shape[0], keys.shape[2])
    for start in range(0, sealed, config.base):
        end = min(start + config.base, sealed)
        tree.append_keys(keys[:, start:end], (start, end))
    return tree


def adapt(tree: ChunkTree, probs: torch.Tensor, keys: torch.Tensor) -> None:
    """One ``update`` from exact attention ``probs`` (ctx,), splits done from ``keys``."""
    chosen = torch.zeros(tree.num_leaves, dtype=torch.bool)
    chosen[select_by_scores(tree, probs, SELECT).leaves] = True
    scores = adaptation_scores(probs, SELECT)
    changes = tree.update(tree.mass_per_leaf(scores), chosen, scores)
    for request in changes.splits:
        tree.split(request, keys[:, request.start:request.end])


def fetched_to_reach(tree: ChunkTree, rank: torch.Tensor, probs: torch.Tensor,
                     target: float) -> int:
    """Tokens outside sinks/window fetched, taking leaves by ``rank`` (desc; leaves over the
    budget last, as in selection), until the captured mass reaches ``target``."""
    ctx = probs.numel()
    costs = leaf_costs(tree, ctx, SELECT)
    value = adaptation_mass(tree, probs, SELECT).double()
    free_mass = float(probs.double().sum() - value.sum())  # sinks, window, unsealed tokens
    if free_mass >= target - 1e-9:
        return 0
    rank = torch.where(costs <= SELECT.tokens(ctx), rank, -float("inf"))
    order = torch.sort(rank, descending=True, stable=True).indices
    reached = (free_mass + value[order].cumsum(0) >= target - 1e-9).nonzero()
    return int(costs[order].cumsum(0)[reached[0, 0]]) if reached.numel() else int(costs.sum())


def step_metrics(trees: dict, query, probs) -> dict:
    """Metrics of one decode step for one layer, per case (``trees`` maps case -> tree)."""
    ctx = probs.numel()
    out = {"oracle_mass": float(probs.topk(SELECT.tokens(ctx)).values.sum())}
    for name, tree in trees.items():
        lka = select_by_query(tree, query, SELECT, ctx)
        out[f"{name}/lka_mass"] = float(probs[lka.tokens].sum())
        out[f"{name}/evaluations"] = lka.evaluations
        bound = select_by_bound(tree, query, SELECT, ctx, prune=True)
        out[f"{name}/bound_mass"] = float(probs[bound.tokens].sum())
        out[f"{name}/bound_evaluations"] = bound.evaluations
        out[f"{name}/chunk_mass"] = float(probs[select_by_scores(tree, probs, SELECT).tokens].sum())
    for name, tree in trees.items():  # the two selection keys of tierkv.select
        costs = leaf_costs(tree, ctx, SELECT)
        estimate = query_keys(tree, query, costs)
        density = adaptation_mass(tree, probs, SELECT) / costs.clamp(min=1)
        out[f"{name}/exact_fetched"] = fetched_to_reach(tree, density, probs,
                                                        out["fixed64/chunk_mass"])
        out[f"{name}/lka_fetched"] = fetched_to_reach(tree, estimate, probs,
                                                      out["fixed64/lka_mass"])
    return out


def run_layer(keys, tail_queries, queries, prompt) -> tuple[list[dict], dict, torch.Tensor]:
    """Adapt on the prompt tail, then measure each decode step (adapting online); returns
    per-step metrics, the trees by case and the mean decode attention (prompt,)."""
    sealed = prompt - SELECT.window + 1  # every later token is in the recent window
    trees = {name: build_tree(keys, sealed, config) for name, config in CASES.items()}
    adaptive = [tree for name, tree in trees.items() if name != "fixed64"]
    for i, query in enumerate(tail_queries):
        probs = attention_probs(query, keys[:, :prompt - WARMUP + i + 1])
        for tree in adaptive:
            adapt(tree, probs, keys)
    steps, mean_probs = [], torch.zeros(prompt)
    for t, query in enumerate(queries):
        probs = attention_probs(query, keys[:, :prompt + t + 1])
        steps.append(step_metrics(trees, query, probs))
        for tree in adaptive:
            adapt(tree, probs, keys)
        mean_probs += probs[:prompt] / len(queries)
    return steps, trees, mean_probs


def bookkeeping_ms(tree: ChunkTree, query, probs, keys, repeat: int = 20) -> dict:
    """Wall time of one layer's per-step work: LKA selection, exact selection + update."""
    ctx = probs.numel()
    timings = {}
    for name, fn in (("lka_select", lambda: select_by_query(tree, query, SELECT, ctx)),
                     ("bound_select_pruned",
                      lambda: select_by_bound(tree, query, SELECT, ctx, prune=True)),
                     ("exact_select_and_update", lambda: adapt(tree, probs, keys))):
        fn()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        timings[name] = round((time.perf_counter() - t0) / repeat * 1e3, 4)
    return timings


def summarize_case(per_layer: list[list[dict]], trees: list[ChunkTree], name: str) -> dict:
    """Per-layer means of one case; byte ratios are against fixed64 at equal captured mass."""
    def mean(layer, key):
        return sum(step[key] for step in layer) / len(layer)

    def total(key):
        return sum(mean(s, f"{name}/{key}") for s in per_layer)

    recall = [mean(s, f"{name}/lka_mass") / mean(s, "oracle_mass") for s in per_layer]
    chunk = [mean(s, f"{name}/chunk_mass") / mean(s, "oracle_mass") for s in per_layer]
    bound = [mean(s, f"{name}/bound_mass") / mean(s, "oracle_mass") for s in per_layer]
    return {
        "lka_mass_recall": sum(recall) / len(recall),
        "lka_mass_recall_layers_2plus": sum(recall[2:]) / len(recall[2:]),
        "lka_mass_recall_per_layer": [round(r, 4) for r in recall],
        "chunk_oracle_recall": sum(chunk) / len(chunk),
        "vs_fixed64_bytes_exact_ranking": total("exact_fetched") / max(
            sum(mean(s, "fixed64/exact_fetched") for s in per_layer), 1),
        "vs_fixed64_bytes_lka_ranking": total("lka_fetched") / max(
            sum(mean(s, "fixed64/lka_fetched") for s in per_layer), 1),
        "evaluations_per_step": total("evaluations"),
        "bound_mass_recall": sum(bound) / len(bound),
        "evaluations_per_step_bound_pruned": total("bound_evaluations"),
        "leaves_per_layer": [t.num_leaves for t in trees],
        "desert_fraction": [round(float(t.sizes[t.cold > 0].sum()) / t.n, 4) for t in trees],
    }


def summarize_document(per_layer: list[list[dict]], trees: list[dict]) -> dict:
    cases = {name: summarize_case(per_layer, [t[name] for t in trees], name) for name in CASES}
    head = cases["adaptive"]
    return {
        "lka_mass_recall": head["lka_mass_recall"],
        "adaptive_vs_fixed_bytes": head["vs_fixed64_bytes_exact_ranking"],
        "evaluations_per_step": {name: c["evaluations_per_step"] for name, c in cases.items()},
        "desert_fraction": head["desert_fraction"],
        "cases": cases,
    }


def plot(path, trees, mean_probs, layers) -> None:
    """Mean decode attention along the prompt, leaves shaded (grey: cold), leaf size in red."""
    fig, axes = plt.subplots(len(layers), 1, figsize=(12, 2.4 * len(layers)), sharex=True)
    for ax, layer in zip(axes, layers):
        tree, probs = trees[layer], mean_probs[layer]
        bounds = tree.bounds.tolist()
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            ax.axvspan(a, b, color="#dddddd" if bool(tree.cold[i] > 0) else "#cfe3f7", lw=0)
        ax.vlines(bounds, 1e-7, 1, colors="#888888", lw=0.3)
        ax.semilogy(probs.clamp(min=1e-7).numpy(), lw=0.5, color="black")
        ax.set_ylim(1e-7, 1)
        ax.set_ylabel(f"layer {layer}\nattention")
        size = ax.twinx()
        size.step(bounds, [int(s) for s in tree.sizes] + [int(tree.sizes[-1])], where="post",
                  color="tab:red", lw=0.8)
        size.set_yscale("log", base=2)
        size.set_ylabel("leaf tokens", color="tab:red")
        ax.set_title(f"layer {layer}: {tree.num_leaves} leaves over {tree.n} sealed tokens "
                     "(blue: warm, grey: cold / desert; red: leaf size)", fontsize=9)
    axes[-1].set_xlabel("token position (prompt)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 2K document, 4 decode steps")
    args = parser.parse_args(argv)
    from tierkv.hf.model import load_model

    torch.manual_seed(0)
    torch.set_num_threads(1)  # bookkeeping timings on one core, as one runtime thread sees it
    model, tok = load_model("smollm2-135m")
    docs, steps = ([(2048, 0)], 4) if args.quick else ([(2048, 0), (4096, 1), (8192, 2)], 8)
    results = {}
    for tokens, seed in docs:
        t0 = time.perf_counter()
        keys, tail, queries, prompt = run_document(model, tok, tokens, seed, steps)
        runs = [run_layer(k, tail[i], queries[:, i], prompt) for i, k in enumerate(keys)]
        doc = summarize_document([r[0] for r in runs], [r[1] for r in runs])
        layer = PLOT_LAYERS[1]
        probs = attention_probs(queries[-1, layer], keys[layer][:, :prompt + steps])
        doc["bookkeeping_ms_per_layer"] = bookkeeping_ms(runs[layer][1]["adaptive"],
                                                         queries[-1, layer], probs, keys[layer])
        doc["seconds"] = time.perf_counter() - t0
        results[f"{prompt}_tokens"] = doc
        plot(result_path("selection", args.quick, ".png"), [r[1]["adaptive"] for r in runs], [r[2] for r in runs],
             PLOT_LAYERS)
        report(prompt, doc)
    config = {"cases": {name: vars(c) for name, c in CASES.items()}, "select": vars(SELECT),
              "warmup_positions": WARMUP, "decode_steps": steps, "quick": args.quick}
    print(write_result("selection", {"config": config, "documents": results}, args.quick))


def report(prompt: int, doc: dict) -> None:
    print(f"--- {prompt} tokens, budget {SELECT.budget:.0%} ({doc['seconds']:.0f} s)")
    print(f"{'case':14s} {'lka_recall':>10s} {'layers2+':>9s} {'chunk_orc':>9s} "
          f"{'bytes/fixed':>11s} {'bytes(lka)':>10s} {'evals':>7s} {'bound_rec':>9s} "
          f"{'evals_prn':>9s}")
    for name, c in doc["cases"].items():
        print(f"{name:14s} {c['lka_mass_recall']:10.3f} {c['lka_mass_recall_layers_2plus']:9.3f} "
              f"{c['chunk_oracle_recall']:9.3f} {c['vs_fixed64_bytes_exact_ranking']:11.3f} "
              f"{c['vs_fixed64_bytes_lka_ranking']:10.3f} "
              f"{c['evaluations_per_step']:7.0f} {c['bound_mass_recall']:9.3f} "
              f"{c['evaluations_per_step_bound_pruned']:9.0f}")
    print("bookkeeping ms / layer:", doc["bookkeeping_ms_per_layer"])


if __name__ == "__main__":
    main()
