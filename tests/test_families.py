"""The model families a TieredCache serves beside Llama: tiny random Qwen2 (biased q/k/v
projections), Mistral (no sliding window) and a Llama with Llama-3 RoPE scaling, each through
the tiers with the device and host tiers far below its KV. Lossless attention through the tiers
gives plain transformers' greedy tokens and logits, a second turn continues the same cache, a
saved document reopens on the same model and is refused by the same family with other RoPE
settings, and every policy decodes within its device budget."""
from __future__ import annotations

import pytest
import torch
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from tierkv import TierConfig, TieredCache
from tierkv.hf.model import cache_kwargs
from tierkv.policies import REGISTRY

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
FAMILIES = {
    "qwen2": lambda **over: Qwen2ForCausalLM(Qwen2Config(**{**TINY, **over})),
    "mistral": lambda **over: MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": None,
                                                                  **over})),
    "llama3-rope": lambda **over: LlamaForCausalLM(LlamaConfig(**{**TINY, "rope_scaling":
                                                                   LLAMA3_ROPE, **over})),
}
PROMPT = 1500  # tokens: KV of 1500 * 5 layers * 2 * 2 heads * 8 dims * 4 B = 960 KB
DEVICE = 256_000  # B: a layer's prompt (192 KB) and the windows, a quarter of the KV


def _model(family: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    model = FAMILIES[family](**over).eval()
    model.config._name_or_path = f"tiny-{family}"
    if family == "qwen2":  # random biases: the stored keys must carry them
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _config(tmp_path, **over) -> TierConfig:
    return TierConfig(**{"device_budget": DEVICE, "host_budget": "128KB",
                         "disk_dir": str(tmp_path / "kv"), **over})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lossless_attention_through_the_tiers_is_plain_transformers(family, tmp_path):
    model, ids = _model(family), _ids(PROMPT)
    more = _ids(40, seed=2)
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        first = model(ids, **cache_kwargs(model, plain), use_cache=True).logits
        reference = model.generate(ids, max_new_tokens=12, do_sample=False)
        turn = torch.cat([reference, more], dim=1)
        second = model.generate(turn, max_new_tokens=8, do_sample=False)
        with TieredCache(model, _config(tmp_path), "full") as cache:
            logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
            # the prompt was prefilled one layer at a time into the tiers, mostly on disk
            stats = cache.stats()
            assert stats["disk_bytes"] > stats["host_bytes"] and stats["device_peak_bytes"] <= DEVICE
            torch.testing.assert_close(logits, first, rtol=1e-4, atol=1e-4)
        with TieredCache(model, _config(tmp_path / "second"), "full") as cache:
            out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=12,
                                 do_sample=False)
            assert out.tolist() == reference.tolist()
            out = model.generate(torch.cat([out, more], dim=1), **cache_kwargs(model, cache),
                                 max_new_tokens=8, do_sample=False)
            assert out.tolist() == second.tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_saved_document_reopens_only_on_its_own_model(family, tmp_path):
    model, ids = _model(family), _ids(PROMPT)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=6, do_sample=False)
        with TieredCache(model, _config(tmp_path), "full") as cache:
            model(ids[:, :-1], **cache_kwargs(model, cache), use_cache=True)
            cache.save(tmp_path / "saved")
        with TieredCache.open(model, tmp_path / "saved", _config(tmp_path)) as cache:
            out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=6,
                                 do_sample=False)
        assert out.tolist() == reference.tolist()
        other = {"rope_theta": 5000.0} if family != "llama3-rope" else \
            {"rope_scaling": {**LLAMA3_ROPE, "factor": 4.0}}
        with pytest.raises(ValueError, match="rope"):
            TieredCache.open(_model(family, **other), tmp_path / "saved", _config(tmp_path))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_every_policy_decodes_within_its_device_budget(family, policy, tmp_path):
    model, ids = _model(family), _ids(PROMPT)
    profile = {"filter_layers": [1, 3], "retrieval_heads": {"2": [0]}}
    with TieredCache(model, _config(tmp_path), policy, profile=profile) as cache, \
            torch.no_grad():
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=10,
                             do_sample=False)
        assert out.shape == (1, PROMPT + 10) and cache.get_seq_length() == PROMPT + 9
        assert cache.stats()["device_peak_bytes"] <= DEVICE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_decode_through_the_tiers(dtype, tmp_path):
    """The tiers hold a half-precision model's KV as it is (half the bytes a token): `full`
    gives plain transformers' greedy tokens, and a selecting policy decodes within budget."""
    model, ids = _model("qwen2").to(dtype), _ids(PROMPT)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=12, do_sample=False)
        for policy in ("full", "tierkv"):
            with TieredCache(model, _config(tmp_path / policy), policy,
                             profile={"filter_layers": [1, 3]}) as cache:
                out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=12,
                                     do_sample=False)
                assert cache.stats()["device_peak_bytes"] <= DEVICE
                assert cache.stats()["disk_bytes"] > 0
                if policy == "full":
                    assert out.tolist() == reference.tolist()
