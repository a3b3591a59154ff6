"""Shared pieces of the benchmarks: real KV from SmolLM2, result files, page-cache control."""
from __future__ import annotations

import json
import os
import platform
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


@contextmanager
def attention_installed(model, name: str, attention):
    """Route ``model``'s attention through ``attention`` (registered as ``name`` with
    transformers' ``AttentionInterface``) inside the block; the previous one after it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def document_ids(tok, tokens: int, seed: int) -> torch.Tensor:
    """The first ``tokens`` ids of a seeded generated document (no facts), shape (1, tokens), on
    ``bench_device()``. The text for a seed starts alike whatever its length."""
    from tierkv.textgen import make_document

    ids = tok(make_document(tok, tokens + 16, seed), return_tensors="pt")["input_ids"]
    if ids.shape[1] < tokens:
        raise RuntimeError(f"the generated document has {ids.shape[1]} tokens, {tokens} asked")
    return ids[:, :tokens].to(bench_device())


def real_kv(tokens: int, seed: int = 0, model_name: str = "smollm2-135m"):
    """KV of a generated document through SmolLM2: (keys, values, queries, model, tokenizer).

    keys, values : Tensor, shape (layers, kv_heads, tokens, head_dim), fp32, after RoPE.
    queries : Tensor, shape (layers, q_heads, head_dim) -- the last token's queries (after RoPE).
    """
    from transformers import DynamicCache

    from tierkv.hf.model import cache_kwargs, load_model
    from tierkv.textgen import make_document, passkey_fact

    model, tok = load_model(model_name)
    doc = make_document(tok, tokens, seed, [passkey_fact(random.Random(seed))])
    ids = tok(doc, return_tensors="pt")["input_ids"][:, :tokens]
    cache = DynamicCache()
    queries = []
    hooks = [layer.self_attn.q_proj.register_forward_hook(
        lambda mod, inp, out: queries.append(out[0, -1].detach()))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    q = _rope_last_queries(model, torch.stack(queries), ids.shape[1] - 1)
    return keys, values, q, model, tok


def _rope_last_queries(model, q_flat, position):
    """Apply the model's RoPE to the last token's projected queries (layers, q_heads*dim)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = q_flat.view(cfg.num_hidden_layers, 1, 1, cfg.num_attention_heads, head_dim)
    pos = torch.tensor([[position]])
    cos, sin = model.model.rotary_emb(q_flat.new_zeros(1, 1, head_dim), pos)
    out = [apply_rotary_pos_emb(ql.transpose(1, 2), ql.transpose(1, 2), cos, sin)[0] for ql in q]
    return torch.stack([o[0, :, 0] for o in out])  # (layers, q_heads, head_dim)


def drop_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to drop ``path``'s pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_device() -> torch.device:
    """Where the benchmarks that run a model or a device tier put them: CUDA when present.
    ``TIERKV_BENCH_DEVICE=cpu`` keeps a GPU machine's run on the CPU (``cuda`` insists)."""
    wanted = os.environ.get("TIERKV_BENCH_DEVICE", "auto")
    if wanted not in ("auto", "cpu", "cuda"):
        raise ValueError(f"TIERKV_BENCH_DEVICE={wanted!r}: must be auto, cpu or cuda")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ValueError("TIERKV_BENCH_DEVICE=cuda: CUDA is not available on this machine")
    use_cuda = wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (before reading a clock, on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The last position's next-token log-probabilities of model ``logits`` (batch 1), fp32 on
    the CPU, shape (vocab,)."""
    return logits[0, -1].float().log_softmax(-1).cpu()


def divergence(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """How far a run's next-token distributions are from the reference's, step by step.

    ``ref``, ``got``: log-probabilities of the same teacher-forced steps, shape (steps, vocab).
    Returns ``top1_agreement`` (the share of steps with the same argmax), ``kl`` (the mean over
    the steps of KL(ref || got), in nats) and ``top1_misses``: for each step whose argmax differs,
    ``[step, ref_margin]`` (steps numbered from 1), the reference's top-1 log-probability minus
    its second's there.

    Top-1 agreement over a few dozen tokens moves by whole tokens, and on generated documents
    most misses are near ties of the reference (margins of a few tenths): on ``bench.decode``'s
    8K document, ``tierkv`` at token budgets of 5 / 10 / 20 % agreed on 0.859 / 0.969 / 0.938
    of 64 tokens, while its KL fell 0.130 / 0.053 / 0.021 (2026-11-29; 20 % with every tier
    large enough). KL resolves what top-1 cannot; the margins show which misses were close calls.
    """
    if ref.dim() != 2 or ref.shape != got.shape:
        raise ValueError(f"divergence: log-probabilities of shape (steps, vocab) alike expected, "
                         f"got {tuple(ref.shape)} and {tuple(got.shape)}")
    ref, got = ref.double(), got.double()
    kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0.0)  # >= 0 but for rounding
    top = ref.topk(2, dim=-1).values
    miss = (ref.argmax(-1) != got.argmax(-1)).nonzero().flatten().tolist()
    return {"top1_agreement": 1.0 - len(miss) / ref.shape[0], "kl": kl.mean().item() + 0.0,  # not -0.0
            "top1_misses": [[i + 1, round((top[i, 0] - top[i, 1]).item(), 3)] for i in miss]}


def machine() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "gpu": gpu, "device": str(bench_device()), "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def result_path(name: str, quick: bool = False, suffix: str = ".json") -> Path:
    """``bench/results/<name>.json``; ``<name>.quick.json`` for a ``--quick`` run, so that a smoke
    check never replaces a full run's figures; ``.gpu`` before the suffix when the bench runs on
    a GPU."""
    variant = (".quick" if quick else "") + (".gpu" if bench_device().type == "cuda" else "")
    return RESULTS / f"{name}{variant}{suffix}"


def write_result(name: str, data: dict, quick: bool = False) -> Path:
    """Write ``result_path(name, quick)`` (atomically) with the machine description added: a
    quick run writes ``<name>.quick.json``, a run on a GPU ``<name>.gpu.json``, beside the CPU
    machine's full-size figures."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name, quick)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **data}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def timed(fn, *args, repeat: int = 3, **kwargs):
    """Best wall time of ``repeat`` calls and the last result."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best, result
