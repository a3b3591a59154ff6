"""``tierkv inspect DIR``: the documents of a disk tier, their chunks, sizes, codecs and health.

Exit status 0 when the store is whole, 1 when a record does not read back intact, opening it
dropped something, or a saved document lacks records (the report says which).
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cli_args import check_creatable, check_store_dir
from .cli_report import human_bytes

MAX_LISTED = 10


@dataclass
class DocSurvey:
    """One document of a store: its saved metadata and, per layer group, its chunks.

    chunks : group -> list of (start, end, status); status is a codec name, "corrupt", or
        "missing": a chunk of the saved index with no record (damage), or, in a run's disk tier
        without a saved index, a range between records (it was on the host or device tier).
    window : group -> tokens of the unsealed recent window kept in the manifest.
    leaves : group -> leaf bounds of the saved chunk tree (a record may hold several leaves,
        and a merged leaf several records); absent without a saved index.
    """

    name: str
    meta: dict
    chunks: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)
    window: dict[int, int] = field(default_factory=dict)
    leaves: dict[int, list[int]] = field(default_factory=dict)
    bytes_by_codec: Counter = field(default_factory=Counter)
    records_by_codec: Counter = field(default_factory=Counter)


def add_inspect_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, metavar="DIR", help="a disk tier or saved-document directory")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also draw the chunks and where "
                        "they are, per layer group, into this PNG file")
    parser.set_defaults(run=run_inspect)


def run_inspect(args) -> int:
    """Print the report (and draw the picture); 1 when the store is not whole."""
    from .storage.disk import DiskTier

    check_store_dir(args.dir, "inspect", segments_enough=True)
    if args.plot is not None:  # before the store is read: a picture that cannot be written
        if args.plot.suffix.lower() != ".png":
            raise ValueError(f"--plot {args.plot}: expected a .png file name")
        if args.plot.is_dir():
            raise ValueError(f"--plot {args.plot}: a directory, not a file name")
        check_creatable(args.plot.absolute().parent, "--plot")
    with DiskTier(args.dir, read_only=True) as disk:
        health = disk.check()
        docs = survey(disk, health)
        report = disk.open_report
        print("\n".join(store_lines(args.dir, disk, report) + health_lines(health)))
        segments_bytes = disk.used
    for doc in docs:
        print("\n".join(doc_lines(doc)))
    if args.plot is not None:
        from .cli_plot import plot_store

        if not docs:
            raise ValueError(f"--plot {args.plot}: {args.dir} holds no document to draw")

        plot_store(docs, args.plot, f"{args.dir} ({human_bytes(segments_bytes)} on disk)")
        print(f"picture written to {args.plot}")
    return 0 if whole(health, report, docs) else 1


def whole(health: list[dict], report: dict, docs: list[DocSurvey]) -> bool:
    """No damaged record, nothing dropped on open, no damaged manifest (its saved documents
    could not be opened), no saved document missing a chunk."""
    missing = any(s == "missing" for d in docs if "format" in d.meta
                  for chunks in d.chunks.values() for *_, s in chunks)
    return all(entry["ok"] for entry in health) and not report["dropped"] and not missing \
        and not report["manifest"].startswith("corrupt")


def survey(disk, health: list[dict]) -> list[DocSurvey]:
    """Every document of ``disk`` with its chunks' status, from records, manifest and ``health``."""
    bad = {entry["key"] for entry in health if not entry["ok"]}
    codecs = {key: disk.codec_of(key) for key in disk.keys()}
    by_doc = defaultdict(dict)
    for key in codecs:
        by_doc[key.doc][(key.group, key.start, key.end)] = key
    docs = []
    for name in disk.docs():
        meta, arrays = _meta(disk, name)
        doc, on_disk = DocSurvey(name, meta), by_doc[name]
        for key in on_disk.values():
            doc.records_by_codec[codecs[key]] += 1
            doc.bytes_by_codec[codecs[key]] += disk.size_of(key)
        for group, (starts, ends) in _layout(on_disk, arrays).items():
            doc.chunks[group] = [(s, e, _status(on_disk.get((group, s, e)), bad, codecs))
                                 for s, e in zip(starts, ends)]
            doc.window[group] = _window(meta, arrays, group)
            if f"g{group}.bounds" in arrays:
                doc.leaves[group] = arrays[f"g{group}.bounds"].long().tolist()
        docs.append(doc)
    return docs


def _meta(disk, name: str) -> tuple[dict, dict]:
    try:
        return disk.doc_meta(name)
    except KeyError:
        return {}, {}


def _layout(on_disk: dict, arrays: dict) -> dict[int, tuple[list[int], list[int]]]:
    """Record bounds per group: the saved index's records when there is one, else the records
    on disk with the gaps between them (ranges that were on the host or device tier). Groups
    may seal different lengths (their records differ in size), so no group is padded."""
    groups = sorted(int(n[1:-len(".records")]) for n in arrays if re.fullmatch(r"g\d+\.records", n))
    if groups:
        cuts = {g: arrays[f"g{g}.records"].tolist() for g in groups}
        return {g: (c[:-1], c[1:]) for g, c in cuts.items()}
    layout = defaultdict(lambda: ([], []))
    for group, start, end in sorted(on_disk):
        starts, ends = layout[group]
        if start > (ends[-1] if ends else 0):
            starts.append(ends[-1] if ends else 0)
            ends.append(start)
        starts.append(start)
        ends.append(end)
    return dict(layout)


def _status(key, bad: set, codecs: dict) -> str:
    if key is None:
        return "missing"
    return "corrupt" if key in bad else codecs[key]


def _window(meta: dict, arrays: dict, group: int) -> int:
    layers = meta.get("groups", [])
    if group >= len(layers) or not layers[group]:
        return 0
    window = arrays.get(f"l{layers[group][0]}.wk")
    return int(window.shape[1]) if isinstance(window, torch.Tensor) and window.dim() == 3 else 0


def store_lines(path: Path, disk, report: dict) -> list[str]:
    problems = [f"{len(report['dropped'])} dropped"] + [
        f"{len(report[k])} segments {k}" for k in ("truncated", "foreign", "refused") if report[k]]
    lines = [f"store {path}: {report['segments']} segments, {report['records']} records, "
             f"{human_bytes(disk.used)}; manifest {report['manifest']}",
             f"  on open: {', '.join(problems)}"]
    lines += [f"    dropped: {p}" for p in report["dropped"][:MAX_LISTED]]
    for kind in ("truncated", "foreign", "refused"):
        lines += [f"    {kind}: {seg}: {why}" for seg, why in list(report[kind].items())[:MAX_LISTED]]
    return lines


def health_lines(health: list[dict]) -> list[str]:
    bad = [entry for entry in health if not entry["ok"]]
    if not bad:
        return [f"  health: all {len(health)} records read back and verified"]
    lines = [f"  health: {len(bad)} of {len(health)} records DAMAGED:"]
    lines += [f"    {e['key']} at {e['segment']}+{e['offset']}: {e['error']}" for e in bad[:MAX_LISTED]]
    if len(bad) > MAX_LISTED:
        lines.append(f"    ... and {len(bad) - MAX_LISTED} more")
    return lines


def doc_lines(doc: DocSurvey) -> list[str]:
    meta = doc.meta
    saved = (f"saved document: model {meta['model'].get('id')}, policy {meta.get('policy')}, "
             f"{meta.get('tokens')} tokens, format {meta.get('format')}"
             if "format" in meta and isinstance(meta.get("model"), dict) else "records only")
    status = Counter(s for chunks in doc.chunks.values() for _, _, s in chunks)
    lines = [f"document {doc.name} ({saved})",
             f"  {len(doc.chunks)} layer groups, {sum(status.values())} chunks: "
             + ", ".join(f"{n} {s}" for s, n in sorted(status.items()))]
    lines += [f"  codec {c}: {n} records, {human_bytes(doc.bytes_by_codec[c])}"
              for c, n in sorted(doc.records_by_codec.items())]
    outside = sum(doc.records_by_codec.values()) - sum(n for s, n in status.items() if s != "missing")
    if outside > 0:
        lines.append(f"  {outside} records outside the saved index (written after the save)")
    for group, chunks in sorted(doc.chunks.items()):
        sizes = [e - s for s, e, st in chunks if st != "missing"]
        absent = sum(e - s for s, e, st in chunks if st == "missing")
        layers = meta.get("groups", [])
        who = f" (layers {_span(layers[group])})" if group < len(layers) else ""
        gap = f", {absent} tokens not on disk" if absent else ""
        bounds = doc.leaves.get(group, [])
        leaves = [b - a for a, b in zip(bounds, bounds[1:])]
        tree = f"; tree: {len(leaves)} leaves of {min(leaves)}-{max(leaves)} tokens" if leaves else ""
        lines.append(f"  group {group}{who}: {len(sizes)} chunks of {min(sizes, default=0)}-"
                     f"{max(sizes, default=0)} tokens on disk{gap}, sealed up to "
                     f"{chunks[-1][1] if chunks else 0}, window {doc.window.get(group, 0)}{tree}")
    return lines


def _span(layers: list[int]) -> str:
    return f"{layers[0]}" if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
