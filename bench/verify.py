"""Passes that verify drafted tokens (assisted and prompt-lookup decoding) through the tiers: what
one costs against a decode step, and how its tokens agree with full attention.

transformers' assisted and prompt-lookup decoding feed each pass the last token and the tokens
drafted after it, keep every position's logits, and crop the rejected tokens back. Through a
``TieredCache`` such a pass attends as a decode step (``TieredCache.verifying``): each layer
group brings what its selection chooses for all of the pass's queries, within a decode step's
budget, and each token sees it and the recent window up to its own. Before, it attended as a
question: each selecting layer's choice within four times the budget, copied layer by layer.

One seeded generated document is prefilled into each case (8,128 tokens; ``--quick``: 2,048),
then the document's next 64 tokens are fed in passes of ``t`` (teacher forcing: every draft
accepted), all cases live in one process, each with its own instance of the model, taking turns
a block of ``BLOCK`` tokens at a time (every other round in reverse order), so that a change of
the machine's speed weighs on all alike. Cases:

* ``full_memory``: transformers' ``DynamicCache``, one token a pass (the reference);
* ``full_memory_t``: the same, passes of ``t`` tokens (plain transformers verifying drafts);
* ``step``: ``TieredCache`` policy ``tierkv``, one token a pass (decode steps);
* ``verify_t``: the same, passes of ``t`` tokens attended as decode steps;
* ``question_t``: the same passes attended as questions (``verifying`` off: what they did
  before).

The ``TieredCache`` cases have ``bench.decode``'s budgets (device tier 5 % of the KV, raised as
there when it does not hold a case, host 20 %, the rest on disk, ``SelectConfig(budget=0.1)``);
their segment files' pages are dropped after the prefill. Per case: ``ms_per_pass``, ``ms_per_token``, ``passes``, ``top1_agreement`` (the
share of positions whose argmax is ``full_memory``'s) and ``disk_bytes_per_token``. Top level,
per ``t``: ``pass_cost`` (a ``verify_t`` pass / a ``step``), ``full_memory_pass_cost`` (the same
for plain transformers) and ``speedup_vs_question`` (a ``question_t`` pass / a ``verify_t`` one).
With every draft accepted, ``t / pass_cost`` is what assisted decoding could gain at most; what
it does gain depends on how many drafts the model accepts.

    python -m bench.verify [--quick]   ->  bench/results/verify.json
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.common import bench_device, document_ids, sync, write_result
from bench.decode import DEVICE_SHARE, HOST_SHARE, SELECT, drop_disk, new_cache, raised
from tierkv import DeviceBudgetWarning, TieredCache, TierFullError, load_model
from tierkv.hf.model import cache_kwargs
from tierkv.shapes import KVShape

DRAFTS = (6, 11)  # tokens a pass: transformers' prompt lookup drafts up to 10 after the last one
TOKENS = 64
BLOCK = 12  # tokens each case is fed per turn


class Case:
    """One cache fed the continuation in passes of ``t`` tokens; ``verifying`` says how a
    TieredCache attends them."""

    def __init__(self, name: str, model, cache, t: int, verifying: bool = False):
        self.name, self.model, self.cache, self.t, self.verifying = name, model, cache, t, verifying
        self.fed, self.seconds, self.argmax, self.disk = 0, [], [], None

    def prefill(self, ids: torch.Tensor) -> None:
        self.model(ids, **cache_kwargs(self.model, self.cache), use_cache=True, logits_to_keep=1)
        if isinstance(self.cache, TieredCache):
            drop_disk(self.cache)
            self.disk = self.cache.stats()["disk_bytes_read"]

    def feed_to(self, cont: torch.Tensor, end: int) -> None:
        """Feed passes of ``t`` tokens of ``cont`` (shape (n,)) until ``end`` tokens are in."""
        while self.fed < min(end, cont.numel()):
            tokens = cont[self.fed:self.fed + self.t].view(1, -1)
            if isinstance(self.cache, TieredCache):
                self.cache.verifying = self.verifying
            sync(tokens.device)
            t0 = time.perf_counter()
            logits = self.model(tokens, **cache_kwargs(self.model, self.cache), use_cache=True).logits
            sync(tokens.device)
            self.seconds.append(time.perf_counter() - t0)
            if isinstance(self.cache, TieredCache):
                self.cache.verifying = False
            self.argmax.append(logits[0].argmax(-1).cpu())
            self.fed += tokens.shape[1]

    def figures(self, ref: torch.Tensor | None) -> dict:
        argmax = torch.cat(self.argmax)
        out = {"t": self.t, "passes": len(self.seconds),
               "ms_per_pass": 1e3 * statistics.fmean(self.seconds),
               "ms_per_token": 1e3 * sum(self.seconds) / argmax.numel()}
        if ref is not None:
            out["top1_agreement"] = (argmax == ref).float().mean().item()
        if self.disk is not None:
            out["disk_bytes_per_token"] = (self.cache.stats()["disk_bytes_read"] - self.disk) / \
                argmax.numel()
        return out


def run(quick: bool) -> dict:
    """Every case at ``bench.decode``'s budgets; all again with the device budget raised by the
    shortfall named (``bench.decode.raised``) when a case raises ``TierFullError`` or would cut
    a selection to fit (``DeviceBudgetWarning``, an error here: it would measure a smaller
    budget)."""
    torch.manual_seed(0)
    where = str(bench_device())
    tokens = 2048 if quick else 8192 - TOKENS
    first, tok = load_model("smollm2-135m", device=where)
    models = [first] + [load_model("smollm2-135m", device=where)[0]
                        for _ in range(1 + 3 * len(DRAFTS))]
    ids = document_ids(tok, tokens + TOKENS, seed=0)
    kv = KVShape.from_config(models[0].config, dtype=models[0].dtype).kv_bytes(tokens + TOKENS)
    device, host, tried = int(DEVICE_SHARE * kv), int(HOST_SHARE * kv), []
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeviceBudgetWarning)
                results = measure(models, ids[:, :tokens], ids[0, tokens:], device, host)
            break
        except (TierFullError, DeviceBudgetWarning) as err:
            if device >= kv:
                raise
            tried.append(device)
            device = min(kv, raised(device, str(err)))
    step, plain = results["step"]["ms_per_pass"], results["full_memory"]["ms_per_pass"]
    summary = {str(t): {"pass_cost": results[f"verify_{t}"]["ms_per_pass"] / step,
                        "full_memory_pass_cost": results[f"full_memory_{t}"]["ms_per_pass"] / plain,
                        "speedup_vs_question": results[f"question_{t}"]["ms_per_pass"]
                        / results[f"verify_{t}"]["ms_per_pass"]} for t in DRAFTS}
    return {"quick": quick, "config": {"tokens": tokens, "continuation": TOKENS, "block": BLOCK,
                                       "kv_bytes": kv, "device_budget": device,
                                       "device_budget_raised_from": tried or None,
                                       "host_budget": host, "select_budget": SELECT,
                                       "model": "smollm2-135m", "threads": torch.get_num_threads()},
            "cases": results, "drafts": summary}


@torch.no_grad()
def measure(models: list, prompt: torch.Tensor, cont: torch.Tensor, device: int,
            host: int) -> dict:
    """Each case's figures: ``prompt`` (1, n) prefilled into its cache, then ``cont`` fed in
    passes, the cases taking turns; ``models``: one instance of the model a case."""
    root = Path(tempfile.mkdtemp(prefix="tierkv-bench-verify-"))
    nets = iter(models)
    cases = [Case("full_memory", next(nets), DynamicCache(), 1)]
    try:
        cases += [Case(f"full_memory_{t}", next(nets), DynamicCache(), t) for t in DRAFTS]
        runs = [("step", 1, False)] + [(f"{kind}_{t}", t, kind == "verify") for t in DRAFTS
                                      for kind in ("verify", "question")]
        for name, t, verifying in runs:
            net = next(nets)
            cases.append(Case(name, net, new_cache(net, "tierkv", device, host, root / name), t,
                              verifying))
        for case in cases:
            case.prefill(prompt)
        for turn, start in enumerate(range(0, cont.numel(), BLOCK)):
            for case in (cases if turn % 2 == 0 else cases[::-1]):
                case.feed_to(cont, start + BLOCK)
        ref = torch.cat(cases[0].argmax)
        return {c.name: c.figures(None if c is cases[0] else ref) for c in cases}
    finally:
        for case in cases:
            if isinstance(case.cache, TieredCache):
                case.cache.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2K tokens of context")
    args = parser.parse_args(argv)
    result = run(args.quick)
    path = write_result("verify", result, args.quick)
    print(f"{'case':<14} {'ms/pass':>8} {'ms/tok':>8} {'passes':>6} {'top1':>6}")
    for name, c in result["cases"].items():
        print(f"{name:<14} {c['ms_per_pass']:8.1f} {c['ms_per_token']:8.1f} {c['passes']:6d} "
              f"{c.get('top1_agreement', 1.0):6.3f}")
    for t, d in result["drafts"].items():
        print(f"t={t}: a verifying pass {d['pass_cost']:.2f}x a step (plain transformers "
              f"{d['full_memory_pass_cost']:.2f}x), {d['speedup_vs_question']:.2f}x faster than "
              "as a question")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
