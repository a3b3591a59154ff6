"""One real SmolLM2-135M for the whole session, and seeded documents with planted facts."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tierkv.hf.model import load_model
from tierkv.textgen import passkey_prompt


@pytest.fixture(scope="session")
def model_and_tok():
    torch.manual_seed(0)
    return load_model("smollm2-135m")


@pytest.fixture(autouse=True)
def no_live_cache_left(request):
    """A test that stopped before its cache's ``close()`` (a failed assertion outside a
    ``with``) leaves that cache serving the session's model: it is closed here, so the tests
    after it fail only for what they test."""
    yield
    if "model_and_tok" not in request.fixturenames:
        return
    model = request.getfixturevalue("model_and_tok")[0]
    live = getattr(model, "_tierkv_cache", lambda: None)()
    if live is not None:
        with contextlib.suppress(Exception):  # the test's own failure is the one to read
            live.close()


@pytest.fixture(scope="session")
def passkey_cases(model_and_tok):
    """Ten (prompt ids, answer) pairs: a ~1K-token document with a pass key at a seeded depth."""
    _, tok = model_and_tok
    prompts = (passkey_prompt(tok, 1000, seed) for seed in range(10))
    return [(tok(prompt, return_tensors="pt")["input_ids"], answer) for prompt, answer in prompts]
