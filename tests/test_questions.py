"""A question (a continuing prompt of at most ``SelectConfig.question_tokens``) attends through
its policy's selection, as a decode step does, instead of every layer's whole KV (tiny random
Llamas, no model file read)."""
from __future__ import annotations

import pytest
import torch

import tierkv.hf.prefill as prefill
from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.policies.omnikv import QUESTION_BUDGET_FACTOR
from tinyllama import PER_TOKEN, ids, tiny

SELECTING = ["tierkv", "omnikv"]
FIRST, QUESTION = 600, 20


class Attended:
    """The positions each layer's question attended (sealed and window), per forward pass."""

    def __init__(self, monkeypatch):
        self.layers: dict[int, torch.Tensor] = {}
        sealed = prefill.sealed_layer_kv

        def watched(cache, layer, window, wanted=None):
            out = sealed(cache, layer, window, wanted)
            self.layers[layer] = out[3]
            return out

        monkeypatch.setattr(prefill, "sealed_layer_kv", watched)

    def sealed(self, layer: int) -> int:
        """Sealed tokens ``layer`` attended (those before its window)."""
        positions = self.layers[layer]
        return int((positions < FIRST - 64).sum())


def saved(model, tmp_path, policy, select) -> object:
    """A first prompt of ``FIRST`` tokens saved under ``policy``: all of its records on disk."""
    path = tmp_path / f"saved-{policy}"
    config = TierConfig(device_budget="64MB", host_budget="64MB", disk_dir=tmp_path / f"kv-{policy}")
    with TieredCache(model, config, policy, select=select) as cache, torch.no_grad():
        model(ids(FIRST), cache=cache, use_cache=True)
        cache.save(path)
    return path


def ask(model, path, policy, select, question=QUESTION, device="64MB"):
    """The logits of a question to the document saved at ``path`` and the disk bytes it read."""
    config = TierConfig(device_budget=device, host_budget="64MB")
    with TieredCache.open(model, path, config, policy, select=select) as cache, torch.no_grad():
        logits = model(ids(question, seed=3), cache=cache, use_cache=True).logits
        return logits, cache.store.stats()["disk_bytes_read"]


@pytest.mark.parametrize("device", ["64MB", 4 * FIRST * PER_TOKEN])
@pytest.mark.parametrize("policy", SELECTING)
def test_a_question_whose_budget_holds_its_context_attends_as_a_whole_prompt(tmp_path, policy,
                                                                             device):
    """Also where the device tier holds a layer's whole context but not a whole group's (a
    question holds one layer's slice at a time: no cut to a decode step's fetch room)."""
    model = tiny(16)
    wide = SelectConfig(budget=4096, filter_layers=(2,))
    path = saved(model, tmp_path, policy, wide)
    sparse, _ = ask(model, path, policy, wide, device=device)
    whole, _ = ask(model, path, policy, SelectConfig(budget=4096, filter_layers=(2,), question_tokens=0),
                   device=device)
    torch.testing.assert_close(sparse, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", SELECTING)
def test_a_question_reads_what_its_policy_chooses(tmp_path, monkeypatch, policy):
    """A tenth of the context: the layers that select attend the question's budget's worth
    (``QUESTION_BUDGET_FACTOR`` x a decode step's) and the question reads a fraction of what
    the whole prompt reads from disk."""
    model = tiny(16)
    select = SelectConfig(budget=0.1, filter_layers=(2,))
    path = saved(model, tmp_path, policy, select)
    _, whole_read = ask(model, path, policy, SelectConfig(budget=0.1, filter_layers=(2,),
                                                          question_tokens=0))
    attended = Attended(monkeypatch)
    logits, read = ask(model, path, policy, select)
    assert torch.isfinite(logits).all()
    budget = QUESTION_BUDGET_FACTOR * (select.tokens(FIRST + QUESTION) - select.window)
    chosen = attended.layers[3]  # layers 0-2 read whole (a short context), 3-15 the choice
    assert all(torch.equal(attended.layers[layer], chosen) for layer in range(3, 16))
    assert all(attended.sealed(layer) >= FIRST - 64 - 8 for layer in range(3))
    assert 0 < attended.sealed(3) <= budget
    assert read < 0.4 * whole_read, (read, whole_read)


def test_a_question_leaves_what_decode_steps_built_as_it_was(tmp_path):
    """The selector's running scores, the last step's queries and candidates, and the step count
    follow decode steps: a question changes none of them."""
    model = tiny(16)
    select = SelectConfig(budget=0.1, filter_layers=(2,), selector="exp")
    config = TierConfig(device_budget="64MB", host_budget="64MB", disk_dir=tmp_path)
    with TieredCache(model, config, "tierkv", select=select) as cache, torch.no_grad():
        model(ids(FIRST), cache=cache, use_cache=True)
        for step in range(3):
            model(ids(1, seed=10 + step), cache=cache, use_cache=True)
        before, steps = cache.policy.state(), cache.steps
        assert before
        model(ids(QUESTION, seed=3), cache=cache, use_cache=True)
        after = cache.policy.state()
        assert cache.steps == steps and before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        model(ids(1, seed=20), cache=cache, use_cache=True)  # and decoding goes on
        assert cache.steps == steps + 1


@pytest.mark.parametrize("policy, question_tokens, question", [
    ("tierkv", 0, QUESTION),  # questions turned off
    ("tierkv", 16, QUESTION),  # longer than a question
    ("full", 64, QUESTION),  # policies whose questions attend all of it
    ("h2o", 64, QUESTION),
    ("streaming", 64, QUESTION),
    ("quest", 64, QUESTION),
    ("leoam", 64, QUESTION),
])
def test_other_prompts_attend_their_whole_context(tmp_path, monkeypatch, policy, question_tokens,
                                                  question):
    model = tiny(16)
    select = SelectConfig(budget=0.1, filter_layers=(2,), question_tokens=question_tokens)
    path = saved(model, tmp_path, policy, select)
    attended = Attended(monkeypatch)
    ask(model, path, policy, select, question)
    assert all(attended.sealed(layer) >= FIRST - 64 - 128 for layer in range(16))


def test_a_preselecting_filter_layer_scores_its_candidates_for_a_question(tmp_path, monkeypatch):
    """Where a filter layer's KV outgrows a quarter of the device tier, a question's filter
    layer attends the candidates all of its queries rank first by their LKA bounds, as a decode
    step's, and the device tier holds the question within its budget."""
    model = tiny(16)
    select = SelectConfig(budget=0.02, filter_layers=(2,))  # candidates: 40 % of the context
    first = 3000
    device = 2 * first * PER_TOKEN  # a filter layer's KV is half of it
    config = TierConfig(device_budget=device, host_budget="64MB", disk_dir=tmp_path)
    attended = Attended(monkeypatch)
    with TieredCache(model, config, "tierkv", select=select) as cache, torch.no_grad():
        model(ids(first), cache=cache, use_cache=True)
        assert cache.policy.preselects(cache, 2)
        model(ids(QUESTION, seed=3), cache=cache, use_cache=True)
        filter_layer = int((attended.layers[2] < first - 64).sum())
        assert select.tokens(first) < filter_layer < first - 64
        assert cache.store.device.peak <= device
        logits = model(ids(1, seed=4), cache=cache, use_cache=True).logits
        assert torch.isfinite(logits).all() and cache.store.device.peak <= device


@pytest.mark.parametrize("value", [-1, 257, 1.5, True, "8"])
def test_question_tokens_is_checked(value):
    with pytest.raises(ValueError, match="question_tokens"):
        SelectConfig(question_tokens=value)
