"""Saved documents: a prefilled cache written to a disk-tier directory, reopened without prefill.

A saved document is its records (in the directory's segments) plus one metadata entry in the
manifest: the format version, the model's identity, the policy and configs, and arrays for the
chunk indexes, the unsealed recent windows and the token ids of the cached sequence.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zlib
from pathlib import Path

import torch

from ..config import ChunkConfig, SelectConfig, TierConfig
from ..shapes import KVShape, text_config
from ..storage.base import RecordKey
from ..storage.disk import DiskTier
from ..storage.manifest import MANIFEST_ASIDE
from ..storage.store import open_disk
from .hooks import check_whole

FORMAT_VERSION = 1


def model_identity(model) -> dict:
    """What must match between the model that saved a document and the one that opens it."""
    from .profile import model_id

    cfg = text_config(model.config)
    weight = model.get_input_embeddings().weight
    sample = weight[: min(16, weight.shape[0])].detach().float().cpu().contiguous()
    weights = 0  # the first values of every weight: a fine-tune that left the embeddings alone
    for name, param in model.named_parameters():
        first = param.detach().reshape(-1)[:16].float().cpu().contiguous()
        weights = zlib.crc32(first.numpy().tobytes(), zlib.crc32(name.encode(), weights))
    shape = KVShape.from_config(model.config, dtype=weight.dtype)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    return {"id": model_id(model), "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
            "hidden": cfg.hidden_size, "kv_heads": getattr(cfg, "num_key_value_heads", None),
            "dtype": str(weight.dtype), "fingerprint": zlib.crc32(sample.numpy().tobytes()),
            "q_heads": shape.q_heads, "head_dim": shape.head_dim, "weights": weights,
            "rope": json.dumps({"parameters": rope, "theta": getattr(cfg, "rope_theta", None)},
                               sort_keys=True, default=str)}


def differing(saved, here: dict) -> list[str]:
    """The keys of model identity ``here`` whose value ``saved`` (a document's) differs in; a
    save made before a key was added to ``model_identity`` is compared on the keys it has."""
    if not isinstance(saved, dict):
        return list(here)
    return [k for k in here if k in saved and saved[k] != here[k]]


def save(cache, path) -> Path:
    """Write every record and the document's metadata of ``cache`` under directory ``path``.

    In another directory than the cache's own, the document is held while it is written
    (``DiskTier.hold_doc``), and a document of the same id found there is replaced only when it
    is an earlier state of this one (same model, its tokens a prefix of these): another one is
    refused with ValueError, and records of a replaced state the document no longer has go.
    """
    path = _as_path(path, "save")
    check_whole(cache, "be saved")
    tokens, known = cache.get_seq_length(), cache.token_ids.shape[1]
    if known != tokens:
        raise ValueError(f"the cache holds {tokens} tokens but knows the ids of {known} (the model "
                         "was fed inputs_embeds?): a saved document carries its token ids, so "
                         "feed the model input_ids to save it")
    cache.compact()
    identity = model_identity(cache._model)
    own = cache.store.disk
    same = own is not None and Path(own.path).resolve() == path.resolve()
    disk = own if same else DiskTier(path, codec=cache.config.codec)
    try:
        if not same:
            disk.hold_doc(cache.doc)
            disk.refresh()
            _check_replaceable(disk, cache, identity)
        meta, arrays = _meta(cache, identity), _arrays(cache)
        keys = [key for index in cache.indexes for key in index.keys]
        _write(disk, cache, keys, meta, arrays, same)
        if same:  # the saved state now; close() removes what the document does not list
            cache.snapshot = set(keys)
        kept = set(keys)  # then the records of the state this one replaces, no longer used
        if disk.remove_many([k for k in disk.keys() if k.doc == cache.doc and k not in kept]):
            disk.flush()
    finally:
        if not same:
            disk.close()
    return path


def _write(disk: DiskTier, cache, keys: list, meta: dict, arrays: dict, same: bool) -> None:
    """Write ``keys``' records and then the document's metadata, and flush. On any failure
    (a full disk, Ctrl-C) the directory is left as it was: the metadata it replaced put back,
    the records it added removed (as far as the disk lets them go), the error raised."""
    previous, before, added = disk.doc_meta_state(cache.doc), set(disk.keys()), []
    listed = _listed(cache.doc, previous[1]) if previous is not None else set()
    try:
        for key in keys:  # one the saved state lists holds the same tokens' KV (an earlier
            # state of this document: ``_check_replaceable``), and so does one this store put
            # on disk; any other the directory holds (a killed run's) is written over
            if key not in listed and not (same and cache.store.where(key) == "disk"):
                block = cache.store.get(key)
                disk.put(key, block, codec=cache.store.disk_codec(key, block))
                if key not in before:
                    added.append(key)
        disk.set_doc_meta(cache.doc, meta, arrays)
        disk.flush()
    except BaseException:
        disk.restore_doc_meta(cache.doc, previous)
        with contextlib.suppress(Exception):  # the first error is the one to report
            disk.remove_many(added)
            disk.flush()
        raise


def _listed(doc: str, arrays: dict) -> set[RecordKey]:
    """The records a saved state of ``doc`` lists: its groups' record cuts (``g<N>.records``)."""
    keys = set()
    for name, cuts in arrays.items():
        group = name[1:-len(".records")]
        if name.startswith("g") and name.endswith(".records") and group.isdigit():
            cuts = cuts.long().tolist()
            keys.update(RecordKey(doc, int(group), a, b) for a, b in zip(cuts, cuts[1:]))
    return keys


def _check_replaceable(disk: DiskTier, cache, identity: dict) -> None:
    """Refuse to save ``cache`` (its model's ``identity``) over a document of its id in
    ``disk`` that is not an earlier state of it (another model's, another text's, or records
    never saved)."""
    doc = cache.doc
    if doc not in disk.docs():
        return
    meta = _meta_or_empty(disk, doc)
    if "format" not in meta:
        raise ValueError(f"{disk.path} holds records of a document {doc!r} that was never saved "
                         "(a run that did not save, or crashed): save to another directory, or "
                         "remove them first (DiskTier.delete_doc)")
    saved = disk.doc_meta(doc)[1].get("token_ids")
    mine = cache.token_ids[0]
    earlier = not differing(meta.get("model"), identity) and saved is not None and \
        saved.numel() <= mine.numel() and torch.equal(mine[:saved.numel()], saved.long())
    if not earlier:
        raise ValueError(f"{disk.path} already holds another document {doc!r} (not an earlier "
                         "state of this one): save to another directory, or delete it there "
                         "first (DiskTier.delete_doc)")
    groups = [list(g) for g in cache.groups]
    if meta.get("groups") != groups:  # its records' keys would name other layers' KV
        raise ValueError(f"{disk.path} holds an earlier state of document {doc!r} with other "
                         f"layer groups ({meta.get('policy')!r}: {meta.get('groups')}; this "
                         f"cache's {cache.policy.name!r}: {groups}), which cannot be replaced "
                         "record by record: save to another directory, or delete it there "
                         "first (DiskTier.delete_doc)")


def _meta(cache, identity: dict) -> dict:
    return {"format": FORMAT_VERSION, "model": identity,
            "policy": cache.policy.name, "tokens": cache.get_seq_length(),
            "select": dataclasses.asdict(cache.select), "chunks": dataclasses.asdict(cache.chunks),
            "groups": [list(g) for g in cache.groups], "profile": cache.profile}


def _arrays(cache) -> dict[str, torch.Tensor]:
    arrays = {"token_ids": cache.token_ids[0].clone()}
    for g, index in enumerate(cache.indexes):
        arrays.update({f"g{g}.{name}": t for name, t in index.state().items()})
    for layer, (k, v) in enumerate(cache._window):
        arrays[f"l{layer}.wk"], arrays[f"l{layer}.wv"] = k.cpu(), v.cpu()
    arrays.update({f"p.{name}": t.cpu() for name, t in cache.policy.state().items()})
    return {name: t.contiguous().clone() for name, t in arrays.items()}


def read_meta(path, doc: str | None = None) -> tuple[str, dict, dict]:
    """(doc, meta, arrays) of a saved document; the only one in ``path`` when ``doc`` is None."""
    with DiskTier(_saved_dir(path)) as disk:
        return _read_meta(disk, path, doc)


def _read_meta(disk: DiskTier, path, doc: str | None) -> tuple[str, dict, dict]:
    docs, damage = _saved(disk), _damage(disk)
    if doc is None:
        if not docs:
            raise ValueError(f"{path} holds no saved document"
                             + (damage or " (save one with cache.save)"))
        if len(docs) > 1:
            raise ValueError(f"{path} holds {len(docs)} saved documents ({', '.join(docs)}): "
                             "name one (doc=)")
        doc = docs[0]
    if doc not in docs:
        raise ValueError(f"{path} has no saved document {doc!r} (it has: "
                         f"{', '.join(docs) or 'none'}){damage}")
    meta, arrays = disk.doc_meta(doc)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: saved with format {meta.get('format')}, this tierkv reads {FORMAT_VERSION}")
    return doc, meta, arrays


def saved_docs(path) -> tuple[list[str], str]:
    """(names of the saved documents in directory ``path``, sorted; "" or, when a damaged
    manifest of it was moved aside, losing the documents it listed, where it went)."""
    with DiskTier(_saved_dir(path)) as disk:
        return _saved(disk), _damage(disk)


def _saved_dir(path) -> Path:
    path = _as_path(path, "path")
    if not path.is_dir():
        raise ValueError(f"saved document directory {str(path)!r} "
                         + ("is not a directory" if path.exists() else "does not exist"))
    return path


def _saved(disk: DiskTier) -> list[str]:
    return [d for d in disk.docs() if "format" in _meta_or_empty(disk, d)]


def _damage(disk: DiskTier) -> str:
    """"" or where a damaged manifest of ``disk`` went, now or before (opening sets it aside)."""
    aside = sorted(disk.path.glob(MANIFEST_ASIDE.format("*")), key=lambda p: p.stat().st_mtime)
    if not aside:
        return ""
    return (f": its manifest was found damaged and moved aside to {aside[-1]}; the documents it "
            "listed cannot be reopened unless saved again since (their records are intact)")


def _as_path(path, name: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise ValueError(f"{name}={path!r}: expected a directory path")
    return Path(path)


def _meta_or_empty(disk: DiskTier, doc: str) -> dict:
    try:
        return disk.doc_meta(doc)[0]
    except KeyError:
        return {}


def open_cache(cls, model, path, config: TierConfig | None = None, policy: str | None = None,
               doc: str | None = None, select: SelectConfig | None = None,
               profile: dict | None = None):
    """Reopen a saved document as a ``cls`` (TieredCache) bound to ``model``; ``policy``,
    ``select`` and ``profile`` replace the saved ones when given (the policy must group layers
    alike). A document saved before profiles were saved takes the model's shipped one."""
    if config is not None and not isinstance(config, TierConfig):
        raise ValueError(f"config={type(config).__name__}: expected a TierConfig (or None)")
    where = _saved_dir(path)
    config = config or TierConfig(disk_dir=where)
    if config.disk_dir is None or Path(config.disk_dir).resolve() != where.resolve():
        config = dataclasses.replace(config, disk_dir=where)
    disk = open_disk(config)  # opened once: for the document's metadata, then the cache's tier
    try:
        doc, meta, arrays = _read_meta(disk, path, doc)
        saved, here = meta["model"], model_identity(model)
        differ = differing(saved, here)
        if differ:
            diff = ", ".join(f"{k}: saved {saved[k]!r} vs {here[k]!r}" for k in differ)
            raise ValueError(f"{path} was saved with another model ({diff})")
        select = select or _config(SelectConfig, meta["select"])
        profile = meta.get("profile") if profile is None else profile
        cache = cls(model, config, policy or meta["policy"], select=select,
                    chunks=_config(ChunkConfig, meta["chunks"]), doc=doc, profile=profile,
                    _resume=True, _disk=disk)
    except BaseException:
        disk.close()
        raise
    try:
        _check_unchanged(cache, meta, arrays)
        _check_disk_budget(cache.store.disk, path)
        _restore(cache, meta, arrays)
    except KeyError as exc:
        cache.close()
        raise ValueError(f"saved document {doc!r} in {path} is malformed: no array {exc}") from None
    except Exception:
        cache.close()
        raise
    cache.snapshot = {key for index in cache.indexes for key in index.keys}  # not a killed
    return cache  # run's records past the saved state: close() lets those go


def _check_disk_budget(disk: DiskTier, path) -> None:
    """Refuse a disk budget the directory already exceeds: the first record the document then
    seals (its next turn's) would fail mid-pass."""
    if disk.budget is not None and disk.used > disk.budget:
        raise ValueError(f"{path} holds {disk.used} B of records, more than the disk budget of "
                         f"{disk.budget} B it was opened with: open it with a disk_budget of "
                         f"more than {disk.used} B (TierConfig.disk_budget), or None")


def _check_unchanged(cache, meta: dict, arrays: dict) -> None:
    """The document as read before the cache held it is the one it holds now (another process
    may have saved over it, or deleted it, in between)."""
    disk = cache.store.disk  # refreshed by claim_doc once the document was held
    try:
        now, now_arrays = disk.doc_meta(cache.doc)
    except KeyError:
        now, now_arrays = None, {}
    if now != meta or not torch.equal(now_arrays.get("token_ids", torch.empty(0)),
                                      arrays["token_ids"]):
        raise ValueError(f"saved document {cache.doc!r} in {disk.path} changed while it was being "
                         "opened (saved over or deleted by another process): open it again")


def saved_select(path, doc: str | None = None) -> SelectConfig:
    """The SelectConfig a document was saved with (what ``open_cache`` uses by default)."""
    return _config(SelectConfig, read_meta(path, doc)[1]["select"])


def _config(kind, values: dict):
    if "filter_layers" in values and values["filter_layers"] is not None:
        values = {**values, "filter_layers": tuple(values["filter_layers"])}
    return kind(**values)


def _restore(cache, meta: dict, arrays: dict) -> None:
    if [list(g) for g in cache.groups] != meta["groups"]:
        raise ValueError(f"policy {cache.policy.name!r} groups layers differently from the saved "
                         f"{meta['policy']!r} (layer groups {[list(g) for g in cache.groups]} "
                         f"against {meta['groups']}): reopen with the saved policy and profile")
    missing = []
    for g, index in enumerate(cache.indexes):
        prefix = f"g{g}."
        index.load_state({k[len(prefix):]: t for k, t in arrays.items() if k.startswith(prefix)})
        missing += [k for k in index.keys if cache.store.where(k) is None]
    if missing:
        raise ValueError(f"saved document {cache.doc!r} lacks {len(missing)} records, e.g. {missing[0]}")
    for layer in range(cache.shape.layers):
        k, v = arrays[f"l{layer}.wk"], arrays[f"l{layer}.wv"]
        cache._window[layer] = (k.to(cache.device, cache.shape.dtype), v.to(cache.device, cache.shape.dtype))
        cache.reserve(f"window:{layer}", k.nbytes + v.nbytes)
    cache.token_ids = arrays["token_ids"].view(1, -1).long()
    if meta["policy"] == cache.policy.name:  # another policy starts from its own first step
        cache.policy.load_state({k[2:]: t for k, t in arrays.items() if k.startswith("p.")})
    if cache.get_seq_length() != meta["tokens"] or cache.token_ids.shape[1] != meta["tokens"]:
        raise ValueError(f"saved document {cache.doc!r} is inconsistent: {meta['tokens']} tokens "
                         f"recorded, {cache.get_seq_length()} restored with the ids of "
                         f"{cache.token_ids.shape[1]}")
