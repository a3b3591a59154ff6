"""Calibration: filter-layer proposal and retrieval-head selection on synthetic attention, and one
run on the real model."""
from __future__ import annotations

import itertools

import pytest
import torch

from tierkv.hf.calibrate import (calibrate, copy_scores, layer_similarity, propose_filter_layers,
                                 select_retrieval_heads, top_set_similarity)
from tierkv.hf.profile import load_profile, save_profile


def _blocks(sizes: list[int], inside: float = 0.95, across: float = 0.1) -> torch.Tensor:
    """A similarity matrix of consecutive blocks of alike layers."""
    labels = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    sim = torch.where(labels[:, None] == labels[None, :], inside, across)
    return sim.fill_diagonal_(1.0)


def _objective(sim: torch.Tensor, filters: list[int]) -> float:
    return sum(float(sim[max(f for f in filters if f < layer), layer])
               for layer in range(filters[0], sim.shape[0]) if layer not in filters)


def test_filters_start_each_block():
    assert propose_filter_layers(_blocks([2, 4, 3, 3]), n_filters=3, first=2) == [2, 6, 9]


def test_filters_are_optimal_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    sim = torch.rand(9, 9, generator=gen)
    got = propose_filter_layers(sim, n_filters=3, first=1)
    best = max(_objective(sim, [1, *rest]) for rest in itertools.combinations(range(2, 8), 2))
    assert got[0] == 1 and got == sorted(set(got))
    assert _objective(sim, got) == pytest.approx(best)


def test_one_filter_is_first():
    assert propose_filter_layers(_blocks([3, 3]), n_filters=1, first=3) == [3]


@pytest.mark.parametrize("sim, n_filters, first, match", [
    (torch.ones(4, 5), 1, 0, "similarity shape"),
    (torch.ones(4, 4), 0, 0, "n_filters"),
    (torch.ones(4, 4), 3, 2, r"n_filters=3: 4 layers are too few for 3 filter layers from layer 2 "
                             r"on, each with a layer after it \(at most 1 fit\)"),
    (torch.ones(4, 4), 2, 2, "n_filters=2: 4 layers are too few"),
    (torch.ones(4, 4), 1, -1, "first"),
])
def test_filters_reject_bad_input(sim, n_filters, first, match):
    with pytest.raises(ValueError, match=match):
        propose_filter_layers(sim, n_filters, first)


def test_the_last_layer_is_never_a_filter():
    """It has no layer after it to serve; a profile naming it would not load."""
    sim = _blocks([2, 5, 1], across=0.0)  # the last layer alike to none: alone it would lose nothing
    assert propose_filter_layers(sim, n_filters=2, first=2) == [2, 3]
    assert propose_filter_layers(torch.ones(4, 4), n_filters=1, first=2) == [2]


def test_calibrate_names_a_model_with_too_few_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    config._name_or_path = "/models/tiny4"
    with pytest.raises(ValueError, match=r"model 'tiny4' has 4 layers, too few to calibrate 3 filter "
                                         r"layers: .*at least 6 layers"):
        calibrate(LlamaForCausalLM(config), tokenizer=None)


def test_top_set_similarity():
    mass = torch.tensor([[5.0, 4, 0, 0, 0, 0, 0, 0, 0, 1],
                         [4.0, 5, 0, 0, 0, 0, 0, 0, 0, 1],
                         [0.0, 0, 5, 4, 0, 0, 0, 0, 0, 1]])
    sim = top_set_similarity(mass, top_frac=0.2)
    assert torch.allclose(sim.diagonal(), torch.ones(3))
    assert sim[0, 1] == pytest.approx(1.0) and sim[0, 2] == pytest.approx(0.0)
    assert ((sim >= 0) & (sim <= 1)).all()
    with pytest.raises(ValueError, match="top_frac"):
        top_set_similarity(mass, top_frac=0.0)


def _copy_attention(n: int) -> torch.Tensor:
    """(2 layers, 4 heads) attention over [bos] + r + r: head (0, 1) echoes, head (1, 2) induces,
    the rest attend uniformly to the past."""
    keys = 2 * n + 1
    causal = torch.arange(keys)[None, :] <= (torch.arange(n) + n + 1)[:, None]
    probs = (causal / causal.sum(dim=1, keepdim=True)).expand(2, 4, n, keys).clone()
    rows = torch.arange(n)
    probs[0, 1] = 0
    probs[0, 1, rows, rows + 1] = 1
    probs[1, 2] = 0
    probs[1, 2, rows, (rows + 2).clamp(max=n)] = 1
    return probs


def test_copy_scores_find_echo_and_induction_heads():
    echo, induction = copy_scores(_copy_attention(8), 8)
    assert echo.shape == induction.shape == (2, 4)
    assert echo[0, 1] == pytest.approx(1.0) and induction[1, 2] == pytest.approx(1.0)
    assert echo.flatten().argmax() == 1 and induction.flatten().argmax() == 6
    with pytest.raises(ValueError, match="probs shape"):
        copy_scores(_copy_attention(8), 7)


def test_retrieval_heads_keep_whole_gqa_groups():
    echo, induction = copy_scores(_copy_attention(8), 8)
    # 8 heads: ceil(0.14 * 8) = 2 by induction (the inducing head, then the lowest uniform
    # index on a tie), ceil(0.01 * 8) = 1 by echo; 2 query heads per KV head
    heads = select_retrieval_heads(echo, induction, kv_heads=2)
    assert heads == {0: [0], 1: [1]}
    assert select_retrieval_heads(echo, induction, 2, induction_frac=0, echo_frac=0) == {}
    assert select_retrieval_heads(echo, induction, 4, induction_frac=1, echo_frac=0) == {
        0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_heads": 3}, "kv_heads"),
    ({"kv_heads": 2, "induction_frac": 1.5}, "induction_frac"),
    ({"kv_heads": 2, "echo_frac": -0.1}, "echo_frac"),
])
def test_retrieval_heads_reject_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        select_retrieval_heads(torch.zeros(2, 4), torch.zeros(2, 4), **kwargs)


@pytest.fixture(scope="module")
def smollm():
    from tierkv.hf.model import load_model
    return load_model("smollm2-135m")


@pytest.mark.integration
def test_layer_similarity_on_model(smollm):
    model, tok = smollm
    sim = layer_similarity(model, tok, n_tokens=160)
    layers = model.config.num_hidden_layers
    assert sim.shape == (layers, layers)
    assert torch.allclose(sim.diagonal(), torch.ones(layers))
    assert ((sim >= 0) & (sim <= 1)).all()
    assert model.config._attn_implementation != "eager"  # restored


@pytest.mark.integration
def test_calibrate_profile_round_trips(smollm, tmp_path):
    model, tok = smollm
    profile = calibrate(model, tok)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert profile["model"] == "smollm2-135m" and profile["created_by"] == "tierkv calibrate"
    assert len(profile["filter_layers"]) == 3 and profile["filter_layers"][0] == 2
    assert all(0 <= int(layer) < layers and heads and all(0 <= h < kv_heads for h in heads)
               for layer, heads in profile["retrieval_heads"].items())
    assert 0 <= profile["similarity_mean_next"] <= 1
    save_profile(profile, profile["model"], tmp_path)
    assert load_profile(model, tmp_path) == profile
