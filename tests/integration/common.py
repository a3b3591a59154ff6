"""Helpers of the integration tests on the real model."""
from __future__ import annotations

import random

import torch

from tierkv import TierConfig, TieredCache
from tierkv.textgen import city_fact, make_document, passkey_fact, question_turn
from tierkv.hf.model import cache_kwargs

# Layer-wise prefill sums attention in query blocks, plain transformers in one pass: fp32
# rounding differs by a few ulps per layer, ~1e-5 relative on the logits after 30 layers.
LOGIT_ATOL = 1e-3


def saved_document(model, tok, path):
    """A short text prefilled through a ``full`` cache and saved under ``path``: (ids, doc)."""
    ids = tok("A short text. " * 40, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache, \
            torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
        cache.save(path)
        return ids, cache.doc


def generate(model, ids, cache=None, new=8):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **cache_kwargs(model, cache))
    return out[0, ids.shape[1]:]


def two_questions(model, tok, cache, device="cpu") -> list[tuple]:
    """A ~900-token document with a pass key and a city planted, asked about one after the other
    on ``cache`` (the second turn continues the first): [(fact, the answer's text)] per question."""
    rng = random.Random(7)
    facts = [passkey_fact(rng), city_fact(rng)]
    doc = make_document(tok, 900, 7, facts, depths=[0.3, 0.7])
    context, answers = torch.zeros(1, 0, dtype=torch.long, device=device), []
    for i, fact in enumerate(facts):
        intro = (f"There is {facts[0].hint} and {facts[1].hint} hidden in the text below. "
                 f"Find them and remember them.\n\n{doc}\n\n") if i == 0 else ""
        turn = question_turn(tok, intro + fact.question, fact.answer_prefix)
        new_ids = tok(turn, return_tensors="pt", add_special_tokens=False)["input_ids"]
        ids = torch.cat([context, new_ids.to(device)], dim=1)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache))
        answers.append((fact, tok.decode(out[0, ids.shape[1]:])))
        context = out
    return answers
