"""The picture of ``tierkv inspect --plot``: chunks along the sequence, per layer group.

For each document: a top panel with the leaf size along the sequence (the saved chunk tree's
leaves: small where attention concentrates, large in attention deserts; the stored chunks when
no tree was saved), and below it one row per layer group whose stored chunks (records) are
coloured by where and how they are stored.
"""
from __future__ import annotations

from pathlib import Path

COLOURS = {"raw": "#4c72b0", "zstd": "#55a868", "int8": "#dd8452", "int4": "#c44e52",
           "missing": "#d0d0d0", "corrupt": "#e31a1c"}
LABELS = {"raw": "on disk, raw", "zstd": "on disk, zstd (lossless)", "int8": "on disk, int8 (lossy)",
          "int4": "on disk, int4 (lossy)", "missing": "not on disk (host / device tier)",
          "corrupt": "on disk, DAMAGED"}
WINDOW_COLOUR = "#8172b3"


def plot_store(docs, path: Path, title: str) -> None:
    """Draw ``docs`` (DocSurvey list from ``cli_inspect.survey``) into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [d for d in docs if d.chunks] or docs[:1]
    heights = [h for d in docs for h in (1.2, 0.28 * max(len(d.chunks), 1) + 0.6)]
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 1.0),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for i, doc in enumerate(docs):
        axes[2 * i, 0].sharex(axes[2 * i + 1, 0])
        _chunk_sizes(axes[2 * i, 0], doc)
        _residency(axes[2 * i + 1, 0], doc)
    used = sorted({s for d in docs for c in d.chunks.values() for *_, s in c}, key=list(COLOURS).index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[s], label=LABELS[s]) for s in used]
    if any(d.window.get(g) for d in docs for g in d.chunks):
        handles.append(plt.Rectangle((0, 0), 1, 1, color=WINDOW_COLOUR, hatch="///", alpha=0.6,
                                     label="recent window (kept in the manifest)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), frameon=False,
               fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05 + 0.02 * (len(handles) > 3), 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _chunk_sizes(ax, doc) -> None:
    """Leaf length (tokens) along the sequence, one step line per layer group (record lengths
    where no tree was saved)."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis", max(len(doc.chunks), 2))
    sizes = []
    for group, chunks in sorted(doc.chunks.items()):
        bounds = doc.leaves.get(group)
        if bounds and len(bounds) > 1:
            xs, ys = bounds, [b - a for a, b in zip(bounds, bounds[1:])]
        elif chunks:
            xs = [s for s, _, _ in chunks] + [chunks[-1][1]]
            ys = [e - s if st != "missing" else float("nan") for s, e, st in chunks]
        else:
            continue
        ax.stairs(ys, xs, color=cmap(group), linewidth=1.5, alpha=0.7, baseline=None)
        sizes += [y for y in ys if y == y]
    sizes = sizes or [1]
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(sizes) / 2, max(sizes) * 2)
    ax.set_ylabel("leaf size\n(tokens)", fontsize=9)
    ax.set_title(_doc_title(doc), fontsize=10, loc="left")
    ax.tick_params(labelbottom=False, labelsize=8)
    ax.grid(axis="y", alpha=0.3)


def _residency(ax, doc) -> None:
    """One row per layer group: each chunk a box coloured by its status, thin gaps between."""
    layers = doc.meta.get("groups", [])
    end = 0
    for row, (group, chunks) in enumerate(sorted(doc.chunks.items())):
        for status in COLOURS:
            spans = [(s, e - s) for s, e, st in chunks if st == status]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[status],
                               edgecolor="white", linewidth=0.3)
        sealed = chunks[-1][1] if chunks else 0
        if doc.window.get(group):
            ax.broken_barh([(sealed, doc.window[group])], (row - 0.4, 0.8), facecolors=WINDOW_COLOUR,
                           hatch="///", alpha=0.6, edgecolor="white", linewidth=0.3)
        end = max(end, sealed + doc.window.get(group, 0))
    rows = sorted(doc.chunks)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_group_label(g, layers) for g in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, max(end, 1))
    ax.set_xlabel("token position", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)


def _group_label(group: int, layers: list) -> str:
    if group < len(layers) and layers[group]:
        span = layers[group]
        return f"g{group}: L{span[0]}" + (f"-{span[-1]}" if len(span) > 1 else "")
    return f"g{group}"


def _doc_title(doc) -> str:
    meta = doc.meta
    chunks = sum(st != "missing" for c in doc.chunks.values() for *_, st in c)
    if "policy" in meta:
        return (f"document {doc.name}: {meta.get('tokens')} tokens, policy {meta['policy']}, "
                f"{chunks} chunks in {len(doc.chunks)} layer groups")
    return (f"document {doc.name}: {chunks} records on disk in {len(doc.chunks)} layer groups "
            "(a run's disk tier: no saved index)")
