"""Pass keys asked as a question after the document (a continuing prompt, as ``tierkv generate``
and a reopened document ask): ``tierkv`` and ``omnikv`` attend the question through their
selection (``SelectConfig.question_tokens``) and still find the keys."""
from __future__ import annotations

import random

import pytest
import torch

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.hf import prefill
from tierkv.hf.model import cache_kwargs
from tierkv.textgen import document_text, make_document, passkey_fact, question_text

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def asked_cases(model_and_tok):
    """Ten (document ids, question ids, answer): a ~1K-token document with a pass key at a
    seeded depth, and the question that asks it."""
    _, tok = model_and_tok
    cases = []
    for seed in range(10):
        fact = passkey_fact(random.Random(seed))
        document = make_document(tok, 1000, seed, [fact])
        doc = tok(document_text(tok, document, fact.hint), return_tensors="pt")["input_ids"]
        question = tok(question_text(tok, fact.question, fact.answer_prefix), return_tensors="pt",
                       add_special_tokens=False)["input_ids"]
        cases.append((doc, question, fact.answer))
    return cases


@pytest.mark.parametrize("policy", ["tierkv", "omnikv"])
def test_pass_keys_asked_as_questions(model_and_tok, asked_cases, tmp_path, monkeypatch, policy):
    """Device 10 % / host 20 % of the KV, the rest on disk, a 10 % budget: at least 9 of 10 keys
    (both found 10 on 2026-11-29, against 9 and 10 when the question attended all of the KV),
    while the question's layers attend well under half of the sealed tokens they would read
    whole (36 % and 40 %)."""
    model, tok = model_and_tok
    attended = []
    sealed = prefill.sealed_layer_kv

    def watched(cache, layer, window, wanted=None):
        out = sealed(cache, layer, window, wanted)
        attended.append((out[0].shape[1] - window[0].shape[1], cache.indexes[cache.group_of[layer]].sealed))
        return out

    monkeypatch.setattr(prefill, "sealed_layer_kv", watched)
    correct = 0
    for i, (doc, question, answer) in enumerate(asked_cases):
        kv = 2 * 30 * 3 * 64 * 4 * doc.shape[1]
        config = TierConfig(device_budget=kv // 10, host_budget=kv // 5, disk_dir=tmp_path / str(i))
        with TieredCache(model, config, policy, select=SelectConfig(budget=0.1)) as cache, \
                torch.no_grad():
            model(doc, **cache_kwargs(model, cache), use_cache=True)
            attended.clear()
            ids = torch.cat([doc, question], dim=1)
            out = model.generate(ids, max_new_tokens=7, do_sample=False, **cache_kwargs(model, cache))
            correct += answer in tok.decode(out[0, ids.shape[1]:])
            read, whole = map(sum, zip(*attended))
            assert len(attended) == 30 and read < 0.5 * whole
    assert correct >= 9, f"{policy}: {correct}/10"
