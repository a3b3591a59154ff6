"""Ctrl-C while SmolLM2 answers through a ``TieredCache`` (``tierkv.hf.recover``): the cache is
left whole, and the same question asked again on it finds the pass key."""
from __future__ import annotations

import random
import signal

import pytest
import torch

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.textgen import document_text, make_document, passkey_fact, question_text

pytestmark = pytest.mark.integration


class CtrlC:
    """Send SIGINT to this process as ``layer`` begins its ``call``-th forward pass."""

    def __init__(self, model, layer: int, call: int):
        self.calls, self.call = 0, call
        self.hook = model.model.layers[layer].register_forward_pre_hook(self.pre)

    def pre(self, module, args):
        self.calls += 1
        if self.calls == self.call:
            signal.raise_signal(signal.SIGINT)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.hook.remove()


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_ctrl_c_while_answering_leaves_a_cache_that_answers_again(model_and_tok, tmp_path, seed):
    """A ~1K-token document with a pass key, device 10 % / host 20 % of the KV, the rest on
    disk, ``tierkv`` at a 10 % budget. Ctrl-C as the document is read: the cache is left empty,
    and reads it again. Ctrl-C as the question is read (at layer 11 of its
    prefill): the question is undone, and asked again gives the tokens of a cache never
    interrupted. Ctrl-C at the third token of the answer: that step ends, generate stops; the
    question asked again after what was answered finds the key."""
    model, tok = model_and_tok
    fact = passkey_fact(random.Random(seed))
    document = make_document(tok, 1000, seed, [fact])
    doc = tok(document_text(tok, document, fact.hint), return_tensors="pt")["input_ids"]
    question = tok(question_text(tok, fact.question, fact.answer_prefix), return_tensors="pt",
                   add_special_tokens=False)["input_ids"]
    kv = 2 * 30 * 3 * 64 * 4 * doc.shape[1]
    answers = []
    for run in ("plain", "interrupted"):
        config = TierConfig(device_budget=kv // 10, host_budget=kv // 5, disk_dir=tmp_path / run)
        with TieredCache(model, config, "tierkv", select=SelectConfig(budget=0.1)) as cache, \
                torch.no_grad():
            if run == "interrupted":  # the document's prefill, from layer 11 on
                with CtrlC(model, 11, 1), pytest.raises(KeyboardInterrupt):
                    model(doc, **cache_kwargs(model, cache), use_cache=True)
                stats = cache.store.stats()
                assert cache.get_seq_length() == 0 and not any(
                    count for name, count in stats.items() if name.endswith("_records"))
            model(doc, **cache_kwargs(model, cache), use_cache=True)
            ids = torch.cat([doc, question], dim=1)
            if run == "interrupted":
                with CtrlC(model, 11, 1), pytest.raises(KeyboardInterrupt):
                    model.generate(ids, max_new_tokens=7, do_sample=False, **cache_kwargs(model, cache))
                assert torch.equal(cache.token_ids, doc)
                assert cache.get_seq_length() == doc.shape[1]
                assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            out = model.generate(ids, max_new_tokens=7, do_sample=False, **cache_kwargs(model, cache))
            answers.append(out[0, ids.shape[1]:])
            if run == "interrupted":
                again = torch.cat([cache.token_ids, question], dim=1)
                with CtrlC(model, 20, 3), pytest.raises(KeyboardInterrupt):
                    model.generate(again, max_new_tokens=7, do_sample=False,
                                   **cache_kwargs(model, cache))
                held = cache.token_ids.shape[1]
                assert held == again.shape[1] + 2 == cache.get_seq_length()
                again = torch.cat([cache.token_ids, question], dim=1)
                out = model.generate(again, max_new_tokens=7, do_sample=False,
                                     **cache_kwargs(model, cache))
                assert fact.answer in tok.decode(out[0, again.shape[1]:])
    assert torch.equal(answers[0], answers[1])
    assert fact.answer in tok.decode(answers[0])
