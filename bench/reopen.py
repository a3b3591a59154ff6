"""Reopening a saved document against prefilling it again, up to the first answer token.

    python -m bench.reopen [--quick]

A generated document (quick: 2K tokens, full: 7.5K, leaving SmolLM2's 8K context room for
the chat template and the question) is prefilled into a ``TieredCache`` (device
budget 10 % of its KV, host 25 %, the rest on disk) and saved. Then a fresh process, with the
model loaded and the saved segments evicted from the page cache, times side by side:

- ``reopen_s``: ``TieredCache.open`` (``open_s``; the same device and host budgets) + the
  question + the first answer token;
- ``reopen_whole_s``: the same with the question attending every layer's whole KV
  (``SelectConfig(question_tokens=0)``, what a question did before it attended through the
  policy's selection), the segments evicted from the page cache again;
- ``prefill_s``: a new cache, the document's prefill + the question + the first answer token.

``question_read_bytes`` / ``question_whole_read_bytes``: what the two reopened caches read from
disk up to the first token. Writes ``bench/results/reopen.json``; ``ratio`` = reopen_s /
prefill_s (target < 0.1).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import bench_device, drop_page_cache, write_result
from tierkv import SelectConfig, TierConfig, TieredCache, load_model
from tierkv.hf.model import cache_kwargs
from tierkv.shapes import KVShape
from tierkv.textgen import document_text, make_document, passkey_fact, question_text

SEED = 3
DEVICE_SHARE, HOST_SHARE = 0.10, 0.25


def prompt_ids(tok, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the document part and of the question part, each (1, n)."""
    fact = passkey_fact(random.Random(SEED))
    document = make_document(tok, tokens, SEED, [fact])
    question = question_text(tok, fact.question, fact.answer_prefix)
    return (tok(document_text(tok, document), return_tensors="pt")["input_ids"],
            tok(question, return_tensors="pt", add_special_tokens=False)["input_ids"])


def tier_config(model, tokens: int, disk_dir: Path) -> TierConfig:
    kv = KVShape.from_config(model.config, dtype=model.dtype).kv_bytes(tokens)
    return TierConfig(device_budget=int(kv * DEVICE_SHARE), host_budget=int(kv * HOST_SHARE),
                      disk_dir=disk_dir)


def first_token(model, cache, ids: torch.Tensor) -> int:
    ids = ids.to(bench_device())
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                             max_new_tokens=1, do_sample=False)
    return int(out[0, -1])


def save_document(tokens: int, work: Path) -> dict:
    """Prefill the document and save it under ``work/saved``; what it took."""
    model, tok = load_model("smollm2-135m", device=str(bench_device()))
    doc, _ = prompt_ids(tok, tokens)
    t0 = time.perf_counter()
    with TieredCache(model, tier_config(model, doc.shape[1], work / "disk")) as cache:
        with torch.no_grad():
            model(doc.to(bench_device()), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        cache.save(work / "saved")
    return {"document_tokens": doc.shape[1], "first_prefill_s": t1 - t0,
            "save_s": time.perf_counter() - t1}


def child(tokens: int, work: Path) -> dict:
    """In a fresh process: time reopening against prefilling again, both to the first token."""
    t0 = time.perf_counter()
    model, tok = load_model("smollm2-135m", device=str(bench_device()))
    load_s = time.perf_counter() - t0
    doc, question = prompt_ids(tok, tokens)
    reopened = {}
    for name, select in (("", None), ("_whole", SelectConfig(question_tokens=0))):
        for segment in (work / "saved").glob("seg-*.tkv"):
            drop_page_cache(segment)
        t0 = time.perf_counter()
        config = tier_config(model, doc.shape[1], work / "saved")
        with TieredCache.open(model, work / "saved", config, select=select) as cache:
            open_s = time.perf_counter() - t0
            token = first_token(model, cache, torch.cat([cache.token_ids, question], dim=1))
            reopened.update({f"reopen{name}_s": time.perf_counter() - t0, f"open{name}_s": open_s,
                             f"question{name}_read_bytes": cache.store.stats()["disk_bytes_read"],
                             f"first_token{name}": token})
    t0 = time.perf_counter()
    with TieredCache(model, tier_config(model, doc.shape[1], work / "again")) as cache:
        prefilled = first_token(model, cache, torch.cat([doc, question], dim=1))
    prefill_s = time.perf_counter() - t0
    return {"model_load_s": load_s, **reopened, "prefill_s": prefill_s,
            "ratio": reopened["reopen_s"] / prefill_s,
            "same_first_token": reopened["first_token"] == prefilled,
            "same_first_token_whole": reopened["first_token_whole"] == prefilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2K-token document instead of 7.5K")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the fresh process's work dir
    args = parser.parse_args()
    tokens = 2048 if args.quick else 7500
    if args.child is not None:
        print(json.dumps(child(tokens, args.child)))
        return
    Path("kv").mkdir(exist_ok=True)  # on the local disk, and git-ignored
    with tempfile.TemporaryDirectory(prefix="bench-reopen-", dir="kv") as work:
        saved = save_document(tokens, Path(work))
        command = [sys.executable, "-m", "bench.reopen", "--child", work] + ["--quick"] * args.quick
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        timed = json.loads(run.stdout.strip().splitlines()[-1])
    result = {"quick": args.quick, "tokens": tokens, **saved, **timed}
    path = write_result("reopen", result, args.quick)
    print(f"{saved['document_tokens']} tokens: reopen + first token {timed['reopen_s']:.2f} s "
          f"({timed['question_read_bytes'] / 1e6:.1f} MB read; the question attending all of "
          f"the KV: {timed['reopen_whole_s']:.2f} s, {timed['question_whole_read_bytes'] / 1e6:.1f}"
          f" MB), prefill + first token {timed['prefill_s']:.2f} s, ratio {timed['ratio']:.3f} "
          f"(target < 0.1), same first token: {timed['same_first_token']}  -> {path}")


if __name__ == "__main__":
    main()
