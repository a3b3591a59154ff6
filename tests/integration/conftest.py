"""One real SmolLM2-135M for the whole session, and seeded documents with planted facts."""
from __future__ import annotations

import random

import pytest
import torch

from tierkv.hf.model import load_model
from tierkv.textgen import chat_prompt, make_document, passkey_fact


@pytest.fixture(scope="session")
def model_and_tok():
    torch.manual_seed(0)
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def passkey_cases(model_and_tok):
    """Ten (prompt ids, answer) pairs: a ~1K-token document with a pass key at a seeded depth."""
    _, tok = model_and_tok
    cases = []
    for seed in range(10):
        fact = passkey_fact(random.Random(seed))
        doc = make_document(tok, 1000, seed, [fact])
        ids = tok(chat_prompt(tok, doc, fact.question, fact.answer_prefix, fact.hint), return_tensors="pt")["input_ids"]
        cases.append((ids, fact.answer))
    return cases
