"""Checks of the paths a user names on the command line, before any model is loaded."""
from __future__ import annotations

import os
from pathlib import Path

from .storage.manifest import MANIFEST
from .storage.segment import SEGMENT_RE

MAX_DOCUMENT_BYTES = 64 << 20


def read_document(path: Path) -> str:
    """The text of ``--file``: an existing, non-empty UTF-8 text file of at most 64 MiB."""
    if not path.exists():
        raise ValueError(f"--file {path}: no such file")
    if not path.is_file():
        raise ValueError(f"--file {path}: not a regular file")
    size = path.stat().st_size
    if size > MAX_DOCUMENT_BYTES:
        raise ValueError(f"--file {path}: {size} bytes, more than the {MAX_DOCUMENT_BYTES} allowed")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if "\x00" in text:
        raise ValueError(f"--file {path}: holds NUL bytes (a binary file?)")
    if not text.strip():
        raise ValueError(f"--file {path}: is empty")
    return text


def check_new_dir(path: Path, option: str) -> None:
    """``path`` may become a new store: it is absent or an empty directory, and can be made."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"{option} {path}: exists and is not an empty directory")
    check_creatable(path, option)


def check_creatable(path: Path, option: str) -> None:
    """``path`` is a directory, or one this process can create: its nearest existing ancestor
    is a directory it may write in (checked before a model loads, not after a prefill)."""
    if path.is_dir():
        return
    if path.exists():
        raise ValueError(f"{option} {path}: cannot be created, it exists and is not a directory")
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot be created, {parent} is not writable")


def check_store_dir(path: Path, option: str, segments_enough: bool = False) -> None:
    """``path`` is a directory holding a tierkv disk tier: its manifest, or (with
    ``segments_enough``, for reading what is there) segment files alone."""
    if not path.is_dir():
        raise ValueError(f"{option} {path}: " + ("not a directory" if path.exists() else
                                                  "no such directory"))
    if (path / MANIFEST).is_file():
        return
    segments = any(SEGMENT_RE.match(p.name) for p in path.iterdir())
    if segments and segments_enough:
        return
    if segments:
        raise ValueError(f"{option} {path}: has segment files but no {MANIFEST}, so no saved "
                         f"document (a run that never saved, or a crash before the save ended); "
                         f"'tierkv inspect {path}' shows its records")
    raise ValueError(f"{option} {path}: not a tierkv store (no {MANIFEST})")


def saved_doc(path: Path, doc: str | None) -> str:
    """The saved document of ``--load`` to answer about: ``--doc``, or the only one there."""
    from .hf.persist import saved_docs

    docs, damage = saved_docs(path)
    if not docs:
        raise ValueError(f"--load {path}: holds no saved document" + (
            damage or " (the disk tier of a run without --save?); save one with --save DIR"))
    if doc is None and len(docs) > 1:
        raise ValueError(f"--load {path}: holds {len(docs)} saved documents ({', '.join(docs)}): "
                         "choose one with --doc NAME")
    if doc is not None and doc not in docs:
        raise ValueError(f"--doc {doc}: {path} holds no saved document of that name (it holds "
                         f"{', '.join(docs)}){damage}")
    return doc or docs[0]
