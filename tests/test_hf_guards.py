"""What a TieredCache refuses, on tiny random models (no model file read): models its attention
would serve wrongly, forward passes it did not see, a closed cache; and what a refusal leaves
(a whole cache that goes on). Reopening checks the model that saved a document in full."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (BertConfig, BertForMaskedLM, DynamicCache, GptOssConfig,
                          GptOssForCausalLM)

from tierkv import TierConfig, TieredCache
from tierkv.hf.model import ModelLoadError, load_model
from tierkv.hf.profile import save_profile
from tierkv.hf.model import cache_kwargs
from tinyllama import ids, tiny

SMALL = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, intermediate_size=64,
             vocab_size=64)
TIERS = dict(device_budget="8MB", host_budget="8MB")


@pytest.mark.parametrize("make, message", [
    (lambda: BertForMaskedLM(BertConfig(**SMALL)), "attends both ways"),
    (lambda: GptOssForCausalLM(GptOssConfig(**SMALL, num_key_value_heads=2, head_dim=8,
                                            num_local_experts=2, num_experts_per_tok=1)),
     "learned attention sinks"),
])
def test_models_its_attention_would_serve_wrongly_refused(make, message):
    with pytest.raises(ValueError, match=message):
        TieredCache(make(), TierConfig(**TIERS), "full")


def test_a_model_pruned_without_its_config_refused():
    model = tiny()
    model.model.layers = model.model.layers[:2]
    with pytest.raises(ValueError, match="has 2 attention layers but its config says "
                                         "num_hidden_layers=4"):
        TieredCache(model, TierConfig(**TIERS), "full")


def test_forward_passes_it_would_attend_wrongly_refused_and_the_cache_goes_on():
    """A batch of two, a forward pass without the cache or with another cache, and another
    model's forward pass through it are refused; none leaves the cache marked broken, and its
    answer is then plain transformers' own."""
    model, other = tiny(), tiny(seed=5)
    prompt = ids(20)
    with TieredCache(model, TierConfig(**TIERS), "full") as cache, torch.no_grad():
        model(prompt, **cache_kwargs(model, cache), use_cache=True)
        more = torch.cat([cache.token_ids, ids(1, seed=2)], 1)
        with pytest.raises(ValueError, match="batch size 2: a TieredCache holds one sequence"):
            model.generate(more, **cache_kwargs(model, cache), num_beams=2, max_new_tokens=2)
        with pytest.raises(ValueError, match="batch size 2"):
            model(more[:, -1:].repeat(2, 1), **cache_kwargs(model, cache), use_cache=True)
        with pytest.raises(ValueError, match="was given no cache: pass cache=cache"):
            model(ids(1))
        with pytest.raises(ValueError, match="was given a DynamicCache"):
            model(ids(1), **cache_kwargs(model, DynamicCache()), use_cache=True)
        with pytest.raises(RuntimeError, match="serves the LlamaForCausalLM it was made with"):
            other(ids(1), **cache_kwargs(other, cache), use_cache=True)
        assert cache.get_seq_length() == 20 and torch.equal(cache.token_ids, prompt)
        got = model.generate(more, **cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
    assert torch.equal(got, model.generate(more, max_new_tokens=4, do_sample=False))


def test_an_interruption_before_any_layer_leaves_the_cache_whole():
    """A KeyboardInterrupt (or any error) after the forward pass began but before a layer took
    its keys: nothing changed, so the cache goes on; after some layers did, the pass is undone
    (``tests/test_recover.py``) and it goes on too."""
    model = tiny()

    def interrupt(module, args):
        raise KeyboardInterrupt

    with TieredCache(model, TierConfig(**TIERS), "full") as cache, torch.no_grad():
        model(ids(12), **cache_kwargs(model, cache), use_cache=True)
        hook = model.model.embed_tokens.register_forward_hook(lambda *a: interrupt(*a[:2]))
        with pytest.raises(KeyboardInterrupt):
            model(ids(1), **cache_kwargs(model, cache), use_cache=True)
        hook.remove()
        model(ids(1), **cache_kwargs(model, cache), use_cache=True)  # goes on
        assert cache.token_ids.shape[1] == cache.get_seq_length() == 13
        hook = model.model.layers[2].register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(ids(1), **cache_kwargs(model, cache), use_cache=True)
        hook.remove()
        model(ids(1), **cache_kwargs(model, cache), use_cache=True)
        assert cache.token_ids.shape[1] == cache.get_seq_length() == 14


def test_a_closed_cache_takes_no_more_keys():
    model = tiny()
    cache = TieredCache(model, TierConfig(**TIERS), "full")
    with torch.no_grad():
        model(ids(10), **cache_kwargs(model, cache), use_cache=True)
        cache.close()
        with pytest.raises(RuntimeError, match="this TieredCache is closed"):
            model(ids(1), **cache_kwargs(model, cache), use_cache=True)


def test_reopening_checks_the_whole_model_and_keeps_the_profile(tmp_path):
    """A document reopens with the profile it was saved with (razor's retrieval heads were
    given, not shipped), and only for the model that saved it: not for one whose RoPE or
    whose attention weights differ, though its embeddings are the same."""
    model = tiny()
    profile = {"retrieval_heads": {"1": [0]}}
    with TieredCache(model, TierConfig(**TIERS), "razor", profile=profile) as cache, torch.no_grad():
        model(ids(30), **cache_kwargs(model, cache), use_cache=True)
        cache.save(tmp_path / "saved")
    with TieredCache.open(model, tmp_path / "saved") as cache:
        assert cache.policy.name == "razor" and cache.profile == profile
    rescaled = tiny(rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="saved with another model .*rope"):
        TieredCache.open(rescaled, tmp_path / "saved")
    tuned = tiny()
    with torch.no_grad():
        tuned.model.layers[2].self_attn.k_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match="saved with another model .*weights"):
        TieredCache.open(tuned, tmp_path / "saved")


def test_closing_an_unsaved_cache_frees_its_disk_records(tmp_path):
    model = tiny()
    config = TierConfig(device_budget="8MB", host_budget=0, disk_dir=tmp_path / "kv")
    for _ in range(2):
        with TieredCache(model, config, "full") as cache, torch.no_grad():
            model(ids(40), **cache_kwargs(model, cache), use_cache=True)
            assert cache.store.disk.keys()
    assert sum(p.stat().st_size for p in (tmp_path / "kv").glob("seg-*.tkv")) == 0


def test_load_model_refuses_missing_weights(tmp_path):
    path = tmp_path / "partial"
    tiny().save_pretrained(path, safe_serialization=True)
    weights = load_file(path / "model.safetensors")
    save_file({k: t for k, t in weights.items() if "layers.3.self_attn" not in k},
              path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks 4 weights the LlamaForCausalLM needs, e\.g\. "
                                             r"model\.layers\.3\.self_attn"):
        load_model(path)


@pytest.mark.parametrize("profile, name, message", [
    ({"filter_layers": [5, 2]}, "p", "strictly increasing"),
    ({"retrieval_heads": {"x": "y"}}, "p", "layer index"),
    ({"a": float("nan")}, "p", "not JSON without NaN"),
    ({}, "../escaped", "expected a file name"),
    ([], "p", "expected a dict"),
])
def test_save_profile_checks_before_writing(tmp_path, profile, name, message):
    with pytest.raises(ValueError, match=message):
        save_profile(profile, name, tmp_path / "profiles")
    assert not (tmp_path / "profiles").exists() and not (tmp_path / "escaped.json").exists()
