"""Decode quality of every policy against full attention, at 5 %, 10 % and 25 % token budgets.

* ``top1_agreement``: a seeded generated document is cut into a context (2K tokens with
  --quick; 2K, 4K and 8K without) and its continuation (32 / 64 tokens). One plain forward
  (DynamicCache) over context + continuation gives the reference argmax at every continuation
  position. Each policy prefills the context through a ``TieredCache`` and is fed the
  continuation one token at a time (teacher forcing); agreement is the share of steps whose
  argmax equals the reference, pooled over the contexts.
* ``kl``: the mean KL divergence of the reference's next-token distribution from the policy's
  over the same steps (nats; ``bench.common.divergence``): on generated documents most top-1
  misses are near ties, and KL tells apart budgets and policies that a few whole tokens do not.
* ``passkey_acc``: ~1K-token documents with a planted pass key (3 / 10 seeded cases), greedy
  7 new tokens; correct when the key is in the output.
* ``ms_per_token``: mean wall time of one teacher-forced decode step. Decoding runs on one
  intra-op thread (``DECODE_THREADS``): its operations are small, and with two threads on a
  shared 2-core machine most of a step went to waiting at thread barriers (measured 3.3 s
  against 0.33 s per ``leoam`` step under load). Prefills keep torch's thread count.

``full`` does not depend on the budget: it runs once and is reported at each budget.
A policy that raises is recorded as ``{"error": ...}`` and the bench goes on.

Prefill is exact whatever the policy and budget, so each prompt is prefilled once per *prefill
class* (policies whose caches group layers and cut chunks alike), saved, and reopened for every
policy and budget of the class, its records moved back to the host tier where a fresh prefill
leaves them. A pass-key prompt is saved without its last ``PASSKEY_TAIL`` tokens, which
``generate`` then prefills (exactly, being several) before it decodes. ``h2o`` keeps state of
its own from the prefill (accumulated attention) that a saved document does not hold: it
prefills every prompt itself.

    python -m bench.quality [--quick]   ->  bench/results/quality.json
    python -m bench.quality --policies tierkv omnikv   (printed only: the saved result is whole)
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.common import bench_device, divergence, document_ids, log_probs, sync, write_result
from tierkv import SelectConfig, TierConfig, TieredCache, load_model
from tierkv.hf.model import cache_kwargs
from tierkv.shapes import KVShape
from tierkv.textgen import passkey_prompt

# headline and lossless-by-design policies first, so that a cut-short run keeps the figures that matter most
POLICIES = ("full", "tierkv", "omnikv", "quest", "leoam", "h2o", "streaming", "razor")
BUDGET_FREE = ("full",)
BUDGETS = (0.05, 0.1, 0.25)
PASSKEY_TOKENS = 1000
PASSKEY_NEW = 7
PASSKEY_TAIL = 2
DECODE_THREADS = 1
MIN_DEVICE = 8 * 2**20


def top1_agreement(pred: torch.Tensor, ref: torch.Tensor) -> float:
    """Share of positions where two argmax sequences, shape (n,), agree."""
    if pred.shape != ref.shape or pred.numel() == 0:
        raise ValueError(f"need two equal, non-empty shapes; got {tuple(pred.shape)}, {tuple(ref.shape)}")
    return (pred == ref).float().mean().item()


def passkey_accuracy(outputs: list[str], answers: list[str]) -> float:
    """Share of decoded outputs that contain their answer."""
    if len(outputs) != len(answers) or not outputs:
        raise ValueError(f"need as many outputs as answers, at least one; got {len(outputs)}, {len(answers)}")
    return sum(a in o for o, a in zip(outputs, answers)) / len(outputs)


def device_budget(shape: KVShape, context: int, budget: float) -> int:
    """Device bytes for a step: two layers' whole KV (dense layers) plus the budget's share of all
    layers' KV (a layer group's selected chunks), and at least 8 MiB."""
    layer_kv = context * shape.token_bytes(1)
    return max(MIN_DEVICE, 2 * layer_kv + int(budget * shape.kv_bytes(context)))


def tier_config(model, context: int, budget: float, disk_dir: Path | None = None) -> TierConfig:
    shape = KVShape.from_config(model.config, dtype=model.dtype)
    return TierConfig(device_budget=device_budget(shape, context, budget), host_budget="4GiB",
                      disk_dir=disk_dir)


def open_cache(model, policy: str, context: int, budget: float) -> TieredCache:
    return TieredCache(model, tier_config(model, context, budget), policy,
                       select=SelectConfig(budget=budget))


def prefill_class(cache: TieredCache) -> tuple | None:
    """What a prefill leaves in ``cache`` that another policy's cache can reopen: its layer
    groups and record sizes. None when the policy also keeps prefill state of its own."""
    if cache.policy.wants_prefill_mass:
        return None
    return tuple(cache.groups), tuple(cache.record_tokens), tuple(cache.leaf_tokens)


def hold_on_host(cache: TieredCache) -> None:
    """Keep a host copy of every record of a reopened document (``KVStore.promote``)."""
    keys = [key for index in cache.indexes for key in index.keys]
    for key, block in zip(keys, cache.store.fetch(keys, "cpu")):
        cache.store.promote(key, block, 0.0)


class Prefills:
    """Prompts prefilled once per prefill class, saved under ``root``, reopened for each run."""

    def __init__(self, model, root: Path):
        self.model, self.root = model, root
        self.saved: dict[tuple, Path] = {}

    def cache(self, policy: str, name: str, ids: torch.Tensor, budget: float, tail: int = 0
              ) -> TieredCache:
        """A cache of ``policy`` at ``budget`` for the prompt ``name`` (``ids``, (1, n)), holding
        its first ``n - tail`` tokens; the caller's forward feeds the rest. A policy with prefill
        state of its own gets a fresh cache holding all of ``ids``, or none of them when
        ``tail`` (its state must come from one prefill of the whole prompt, as in ``generate``).
        """
        n = ids.shape[1]
        cache = open_cache(self.model, policy, n, budget)
        kind = prefill_class(cache)
        path = None if kind is None else self.saved.get((name, kind))
        if path is None:
            try:
                if kind is not None or not tail:
                    self.model(ids[:, :n - tail], **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
                if kind is not None:
                    self.saved[(name, kind)] = cache.save(self.root / str(len(self.saved)))
            except BaseException:
                cache.close()
                raise
            return cache
        cache.close()
        cache = TieredCache.open(self.model, path, tier_config(self.model, n, budget, path), policy,
                                 select=SelectConfig(budget=budget))
        hold_on_host(cache)
        return cache


def continuation_case(tok, context: int, continuation: int, seed: int):
    """(context ids, continuation ids), shapes (1, context) and (continuation,), of one document."""
    ids = document_ids(tok, context + continuation, seed)
    return ids[:, :context], ids[0, context:context + continuation]


def reference_log_probs(model, ctx: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Full attention's next-token log-probabilities after each continuation token, shape
    (n, vocab), fp32 on the CPU."""
    ids = torch.cat([ctx, cont.view(1, -1)], dim=1)
    logits = model(ids, **cache_kwargs(model, DynamicCache()), use_cache=True, logits_to_keep=cont.numel()).logits
    return logits[0].float().log_softmax(-1).cpu()


@contextmanager
def decode_threads():
    """Run the block on ``DECODE_THREADS`` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(DECODE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def teacher_forced(model, cache, cont: torch.Tensor):
    """Feed ``cont`` to a prefilled ``cache`` (any transformers cache) one token at a time:
    (next-token log-probabilities after each, shape (n, vocab), fp32 on the CPU; seconds)."""
    out, seconds = [], 0.0
    with decode_threads():
        for token in cont:
            sync(cont.device)
            t0 = time.perf_counter()
            logits = model(token.view(1, 1), **cache_kwargs(model, cache), use_cache=True).logits
            sync(cont.device)
            seconds += time.perf_counter() - t0
            out.append(log_probs(logits))
    return torch.stack(out), seconds


def passkey_cases(tok, n: int) -> list[tuple[torch.Tensor, str]]:
    """The integration tests' pass-key cases (same prompts, hint included): seeds ``0..n-1``."""
    prompts = (passkey_prompt(tok, PASSKEY_TOKENS, seed) for seed in range(n))
    return [(tok(prompt, return_tensors="pt")["input_ids"].to(bench_device()), answer)
            for prompt, answer in prompts]


def passkey_run(model, tok, cases, policy: str, budget: float, prefills: Prefills) -> float:
    outputs = []
    for i, (ids, _) in enumerate(cases):
        with prefills.cache(policy, f"passkey{i}", ids, budget, PASSKEY_TAIL) as cache, decode_threads():
            out = model.generate(ids, max_new_tokens=PASSKEY_NEW, do_sample=False, **cache_kwargs(model, cache))
        outputs.append(tok.decode(out[0, ids.shape[1]:]))
    return passkey_accuracy(outputs, [answer for _, answer in cases])


def measure(model, tok, policy: str, budget: float, texts, cases, prefills: Prefills) -> dict:
    """One policy at one budget: agreement over ``texts`` (ctx, cont, ref), pass-key accuracy, ms."""
    agree, kl, steps, seconds, by_context = 0.0, 0.0, 0, 0.0, {}
    for ctx, cont, ref in texts:
        with prefills.cache(policy, f"context{ctx.shape[1]}", ctx, budget) as cache:
            probs, secs = teacher_forced(model, cache, cont)
        got = divergence(ref, probs)
        by_context[str(ctx.shape[1])] = round(got["top1_agreement"], 4)
        agree, kl = agree + got["top1_agreement"] * cont.numel(), kl + got["kl"] * cont.numel()
        steps, seconds = steps + cont.numel(), seconds + secs
    return {"top1_agreement": round(agree / steps, 4), "top1_by_context": by_context,
            "kl": round(kl / steps, 5),
            "passkey_acc": round(passkey_run(model, tok, cases, policy, budget, prefills), 4),
            "ms_per_token": round(1000 * seconds / steps, 2)}


def safe_measure(*args) -> dict:
    try:
        return measure(*args)
    except Exception as exc:  # one failing policy must not sink the others' figures
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_policy(model, tok, policy: str, texts, cases, prefills: Prefills) -> dict:
    if policy in BUDGET_FREE:
        once = {**safe_measure(model, tok, policy, BUDGETS[0], texts, cases, prefills),
                "budget_independent": True}
        return {str(b): dict(once) for b in BUDGETS}
    return {str(b): safe_measure(model, tok, policy, b, texts, cases, prefills) for b in BUDGETS}


def warm_up(model, tok) -> None:
    ctx, cont = continuation_case(tok, 256, 4, seed=999)
    reference_log_probs(model, ctx, cont)
    with open_cache(model, "tierkv", 256, 0.25) as cache:
        model(ctx, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        teacher_forced(model, cache, cont)


def table(results: dict) -> str:
    head = f"{'policy':<10}" + "".join(f" | {'agree':>6} {'KL':>6} {'pass':>5} {'ms/tok':>7} @{b:<4}"
                                       for b in BUDGETS)
    lines = [head, "-" * len(head)]
    for policy, per_budget in results.items():
        row = f"{policy:<10}"
        for b in BUDGETS:
            r = per_budget[str(b)]
            if "error" in r:
                row += f" | {'error':>33}"
            else:
                kl = "-" if r.get("kl") is None else f"{r['kl']:.4f}"
                row += (f" | {r['top1_agreement']:>6.3f} {kl:>6} {r['passkey_acc']:>5.2f} "
                        f"{r['ms_per_token']:>7.1f}      ")
        lines.append(row.rstrip())
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 2K context, 32 tokens, 3 pass-key cases")
    parser.add_argument("--policies", nargs="+", choices=POLICIES,
                        help="run only these policies; the table is printed, not saved")
    args = parser.parse_args(argv)
    policies = tuple(p for p in POLICIES if p in (args.policies or POLICIES))
    random.seed(0)
    torch.manual_seed(0)
    contexts, n_cont, n_cases = ((2048,), 32, 3) if args.quick else ((2048, 4096, 8192), 64, 10)
    started = time.perf_counter()
    model, tok = load_model("smollm2-135m", device=str(bench_device()))
    result = {"policies": {}, "context_tokens": list(contexts), "continuation_tokens": n_cont,
              "passkey_cases": n_cases, "passkey_tokens": PASSKEY_TOKENS, "quick": args.quick,
              "decode_threads": DECODE_THREADS, "model": "smollm2-135m"}
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="tierkv-quality-") as root:
        warm_up(model, tok)
        texts = [(ctx, cont, reference_log_probs(model, ctx, cont))
                 for ctx, cont in (continuation_case(tok, c, n_cont, seed=c) for c in contexts)]
        cases = passkey_cases(tok, n_cases)
        prefills = Prefills(model, Path(root))
        for policy in policies:
            result["policies"][policy] = run_policy(model, tok, policy, texts, cases, prefills)
            wall = time.perf_counter() - started
            print(f"{policy} at {wall:.0f} s: {json.dumps(result['policies'][policy])}", flush=True)
            if not args.policies:  # written after each policy: a cut-short run keeps the rest
                result.update(complete=policy == POLICIES[-1], wall_s=round(wall, 1))
                path = write_result("quality", result, args.quick)
    print(table(result["policies"]))
    if not args.policies:
        print(path)
    return result


if __name__ == "__main__":
    main()
