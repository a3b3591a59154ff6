"""Model profiles: calibrated filter layers and retrieval heads, as small JSON files.

Shipped profiles live in ``tierkv/profiles/<model id>.json``; ``tierkv calibrate`` writes new
ones. The model id is the last part of the model's name or path (``smollm2-135m``).
"""
from __future__ import annotations

import json
from pathlib import Path

PROFILES = Path(__file__).resolve().parent.parent / "profiles"


def model_id(model) -> str:
    name = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""))
    return Path(name.rstrip("/")).name or "unknown"


def load_profile(model, directory: Path = PROFILES) -> dict:
    """The profile of ``model`` from ``directory``, or {} when none exists."""
    path = directory / f"{model_id(model)}.json"
    if not path.is_file():
        return {}
    try:
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: not valid JSON ({exc})") from exc
    if not isinstance(profile, dict):
        raise ValueError(f"profile {path}: expected a JSON object")
    return profile


def save_profile(profile: dict, name: str, directory: Path = PROFILES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")
    return path
