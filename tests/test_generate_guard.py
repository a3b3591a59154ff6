"""GenerateGuard and cache_kwargs against stand-ins for a transformers model (no model loaded):
both under the keyword a transformers release passes the cache by, ``cache`` (5.24 on) or
``past_key_values`` (before)."""
from __future__ import annotations

import pytest
import torch

from tierkv.hf.admit import GenerateGuard
from tierkv.hf.model import cache_kwargs


class Held:
    """What the guard reads of a TieredCache: its length and its ids."""

    def __init__(self, ids):
        self.token_ids = torch.tensor([ids])

    def get_seq_length(self):
        return self.token_ids.shape[1]


class Model:
    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, **kwargs):
        return {"input_ids": input_ids[:, -next_sequence_length:]}

    def generate(self, input_ids):
        return input_ids


def test_generate_settles_the_cache_first():
    """``generate`` on the guarded model first hands the cache to ``settle`` (a pass stopped
    by what skipped the model's forward hook is undone before generate reads its length)."""
    model, cache, settled = Model(), Held([5]), []
    guard = GenerateGuard(model, cache, settled.append)
    assert model.generate(7) == 7 and settled == [cache]
    guard.remove()
    assert "generate" not in vars(model) and model.generate(8) == 8 and settled == [cache]
    model.generate = mine = lambda ids: -ids  # the application's own: wrapped, then put back
    guard = GenerateGuard(model, cache, settled.append)
    assert model.generate(3) == -3 and settled == [cache, cache]
    guard.remove()
    assert model.generate is mine


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_the_first_step_of_a_generate_on_the_cache_checks_its_ids(keyword):
    model, cache = Model(), Held([5, 6, 7])
    guard = GenerateGuard(model, cache, lambda cache: None)
    step = {"is_first_iteration": True, keyword: cache, "next_sequence_length": 2}
    assert model.prepare_inputs_for_generation(torch.tensor([[5, 6, 7, 8, 9]]), **step)[
        "input_ids"].tolist() == [[8, 9]]
    with pytest.raises(ValueError, match="differ from the cache's at position 1 \\(of the 3"):
        model.prepare_inputs_for_generation(torch.tensor([[5, 0, 7, 8, 9]]), **step)
    later = {**step, "is_first_iteration": False}  # decode steps pass unchecked
    model.prepare_inputs_for_generation(torch.tensor([[5, 0, 7, 8, 9]]), **later)
    other = {**step, keyword: Held([5, 0, 7])}  # another cache's generate: not this guard's
    model.prepare_inputs_for_generation(torch.tensor([[5, 0, 7, 8, 9]]), **other)
    guard.remove()
    assert "prepare_inputs_for_generation" not in vars(model)


def test_cache_kwargs_names_the_keyword_the_models_forward_takes():
    class New:
        def forward(self, input_ids, cache=None):
            pass

    class Old:
        def forward(self, input_ids, past_key_values=None):
            pass

    held = object()
    assert cache_kwargs(New(), held) == {"cache": held}
    assert cache_kwargs(Old(), held) == {"past_key_values": held}
