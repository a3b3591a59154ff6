"""Generated documents, with a word-counting stand-in for a tokenizer (no model)."""
from __future__ import annotations

import random

import pytest

from tierkv.textgen import filler_sentence, make_document, passkey_fact


def words(text: str, add_special_tokens: bool = True) -> dict:
    return {"input_ids": text.split()}


LONGEST = max(len(filler_sentence(random.Random(seed)).split()) for seed in range(200))


@pytest.mark.parametrize("n_tokens", [16, 300, 5000])
def test_a_document_has_the_tokens_asked_up_to_a_sentence_more(n_tokens):
    fact = passkey_fact(random.Random(1))
    for facts in ([], [fact]):
        doc = make_document(words, n_tokens, seed=3, facts=facts)
        assert n_tokens <= len(doc.split()) < n_tokens + LONGEST
        assert all(f.sentence in doc for f in facts)


def test_a_seed_starts_alike_whatever_the_length():
    short, long = make_document(words, 200, seed=5), make_document(words, 2000, seed=5)
    assert long.startswith(short) and make_document(words, 200, seed=6) != short


def test_too_few_tokens_or_depths_are_refused():
    with pytest.raises(ValueError, match="n_tokens=15: must be at least 16"):
        make_document(words, 15, seed=0)
    with pytest.raises(ValueError, match="1 facts but 2 depths"):
        make_document(words, 100, seed=0, facts=[passkey_fact(random.Random(0))], depths=[0.1, 0.2])
