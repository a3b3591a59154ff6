"""Model profiles: calibrated filter layers and retrieval heads, as small JSON files.

Shipped profiles live in ``tierkv/profiles/<model id>.json``; ``tierkv calibrate`` writes new
ones. The model id is the last part of the model's name or path (``smollm2-135m``). A profile is
checked against the model it serves (``check_profile``) wherever it enters: a profile made for
another model of the same id is refused, not half applied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..policies.base import filter_layers_of, retrieval_heads_of
from ..shapes import KVShape

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def model_id(model) -> str:
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""))
    return Path(name.rstrip("/")).name or "unknown"


def load_profile(model, directory: Path = PROFILES) -> dict:
    """The profile of ``model`` from ``directory``, or {} when none exists; checked against the
    model (``check_profile``)."""
    path = directory / f"{model_id(model)}.json"
    if not path.is_file():
        return {}
    try:
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: not valid JSON ({exc})") from exc
    if not isinstance(profile, dict):
        raise ValueError(f"profile {path}: expected a JSON object")
    shape = KVShape.from_config(model.config)
    name = str(getattr(model.config, "_name_or_path", "") or "") or "DIR"
    check_profile(profile, shape.layers, shape.kv_heads, f"profile {path}", name)
    return profile


def check_profile(profile, layers: int, kv_heads: int, source: str = "profile=",
                  model: str = "DIR") -> None:
    """Raise ValueError, naming ``source`` and the field, unless ``profile`` fits a model of
    ``layers`` layers and ``kv_heads`` KV heads: ``filter_layers`` and ``retrieval_heads``, when
    present, as ``filter_layers_of`` and ``retrieval_heads_of`` take them; other keys are kept as
    they are. An index past the model's names the profile as made for another model, and
    ``model`` (its name or path) in the ``tierkv calibrate`` to run.
    """
    if not isinstance(profile, dict):
        raise ValueError(f"{source}: expected a dict (a JSON object) of filter_layers and "
                         f"retrieval_heads, got {type(profile).__name__} {profile!r:.60}")
    hint = (f": the profile does not fit this model of {layers} layers and {kv_heads} KV "
            f"head{'s' * (kv_heads != 1)} (made for another model?); calibrate one with "
            f"`tierkv calibrate --model {model}`")
    if "filter_layers" in profile:
        filter_layers_of(profile["filter_layers"], layers, f"{source}: filter_layers", hint)
    if "retrieval_heads" in profile:
        retrieval_heads_of(profile["retrieval_heads"], layers, f"{source}: retrieval_heads",
                           kv_heads, hint)
    try:  # a saved document carries it as JSON: refused now, not after its records are written
        json.dumps(profile, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: not JSON without NaN or inf ({exc})") from None


def save_profile(profile: dict, name: str, directory: Path = PROFILES) -> Path:
    """Write ``profile`` as ``directory/name.json``; ValueError, nothing written, when the name
    would leave the directory or the profile is not one (JSON without NaN; filter layers and
    retrieval heads of the right form, checked against a model when it loads)."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or \
            name.startswith(".") or "\x00" in name:
        raise ValueError(f"profile name {name!r}: expected a file name (no path, not hidden)")
    if not isinstance(profile, dict):
        raise ValueError(f"profile={type(profile).__name__}: expected a dict")
    if "filter_layers" in profile:
        filter_layers_of(profile["filter_layers"], 1 << 16, "profile filter_layers")
    if "retrieval_heads" in profile:
        retrieval_heads_of(profile["retrieval_heads"], 1 << 16, "profile retrieval_heads")
    try:
        text = json.dumps(profile, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ValueError(f"profile {name!r} is not JSON without NaN or inf: {exc}") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = directory / f".{name}.json.tmp"  # a write cut short leaves the old profile whole
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
