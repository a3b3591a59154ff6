"""A budget of the whole context (``SelectConfig(budget=1.0)``, ``--budget 1.0``): every policy
that selects within a budget then attends everything, so its logits are plain transformers'
through prompts, questions and decode steps; a float 1.0 is a fraction, an int 1 one token."""
from __future__ import annotations

import argparse
import tempfile

import pytest
import torch
from transformers import DynamicCache

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.cli import budget_arg
from tierkv.hf.model import cache_kwargs
from tierkv.policies import REGISTRY
from tinyllama import tiny


def test_a_float_up_to_one_is_a_fraction_and_an_int_a_count():
    assert SelectConfig(budget=1.0).tokens(500) == 500
    assert SelectConfig(budget=0.1).tokens(500) == 50
    assert SelectConfig(budget=1).tokens(500) == 1
    assert SelectConfig(budget=64.0).tokens(500) == 64 and SelectConfig(budget=64).tokens(500) == 64
    with pytest.raises(ValueError, match=r"budget=1.5: a token count must be a whole number"):
        SelectConfig(budget=1.5)
    with pytest.raises(ValueError, match=r"a fraction in \(0, 1\]"):
        SelectConfig(budget=0.0)


@pytest.mark.parametrize("text, value", [("1.0", 1.0), ("1", 1), ("+1", 1), (" 1 ", 1),
                                         ("0.25", 0.25), ("512", 512), ("512.0", 512),
                                         ("1e0", 1.0), ("2e2", 200)])
def test_the_command_line_reads_a_budget_as_written(text, value):
    got = budget_arg(text)
    assert got == value and type(got) is type(value)


def test_the_command_line_refuses_a_budget_that_is_neither():
    for text in ("0", "1.5", "-0.1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            budget_arg(text)


@pytest.mark.parametrize("policy", sorted(set(REGISTRY) - {"razor"}))  # razor's heads keep
def test_a_whole_context_budget_is_full_attention(policy):  # sinks and window, whatever the budget
    model, other = tiny(layers=6), tiny(layers=6)
    plain = DynamicCache(config=other.config)
    gen = torch.Generator().manual_seed(0)
    config = TierConfig(device_budget="4MB", host_budget="100KB", disk_dir=tempfile.mkdtemp())
    with TieredCache(model, config, policy, select=SelectConfig(budget=1.0)) as cache, \
            torch.no_grad():
        for n in (300, 1, 1, 20, 1, 200, 1, 1, 1):  # a prompt, steps, a question, a second prompt
            tokens = torch.randint(0, 64, (1, n), generator=gen)
            got = model(tokens, **cache_kwargs(model, cache), use_cache=True).logits
            want = other(tokens, **cache_kwargs(other, plain), use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert cache.stats()["disk_records"] > 0


@pytest.mark.parametrize("policy, device, profile", [
    ("quest", "4MB", None), ("leoam", "4MB", None),
    ("tierkv", 400_000, {"filter_layers": [2, 4]})])  # its first layers preselect
def test_a_whole_context_budget_stays_full_attention_after_a_crop(policy, device, profile):
    """A crop can leave the recent windows shorter than SelectConfig.window: the budget then
    counts what they hold, so the sealed tokens they no longer cover are still all attended."""
    model, other = tiny(layers=6), tiny(layers=6)
    plain = DynamicCache(config=other.config)
    gen = torch.Generator().manual_seed(1)
    config = TierConfig(device_budget=device, disk_dir=tempfile.mkdtemp())
    select = SelectConfig(budget=1.0, question_tokens=0)

    def both(tokens):
        got = model(tokens, **cache_kwargs(model, cache), use_cache=True).logits
        torch.testing.assert_close(got, other(tokens, **cache_kwargs(other, plain),
                                              use_cache=True).logits, rtol=1e-5, atol=1e-5)

    with TieredCache(model, config, policy, select=select, profile=profile) as cache, \
            torch.no_grad():
        for n in (928, 1, 1, 1):
            both(torch.randint(0, 64, (1, n), generator=gen))
        held = cache.shortest_window()
        cache.crop(2 - held)  # 2 tokens left in the shortest window
        plain.crop(2 - held)
        assert cache.shortest_window() == 2 < select.window
        for _ in range(4):
            both(torch.randint(0, 64, (1, 1), generator=gen))
