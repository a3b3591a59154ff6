"""TieredCache on the real model: exactness of the lossless path, budgets, retrieval, multi-turn."""
from __future__ import annotations

import threading

import pytest
import torch

from transformers import DynamicCache

from tierkv import SelectConfig, TierConfig, TieredCache
from tierkv.textgen import make_document
from tierkv.hf.model import cache_kwargs

from .common import LOGIT_ATOL, generate, saved_document, two_questions

pytestmark = pytest.mark.integration


def test_prefill_logits_match_plain(model_and_tok, passkey_cases):
    model, _ = model_and_tok
    ids, _ = passkey_cases[0]
    with torch.no_grad():
        # Twice in about 50 runs (under CPU load) the process's first plain forward came out
        # 0.0088 off the usual logits while the tiered ones were the usual: plain torch and
        # transformers, no tierkv code in that call. The reference comes from a second forward.
        model(ids)
        ref = model(ids).logits[0, -1]
        with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "full",
                         prefill_block=128) as cache:
            got = model(ids, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
    assert torch.allclose(got, ref, atol=LOGIT_ATOL), (got - ref).abs().max()
    assert got.argmax() == ref.argmax()


def test_full_through_disk_reproduces_greedy(model_and_tok, passkey_cases, tmp_path):
    model, _ = model_and_tok
    ids, _ = passkey_cases[1]
    ref = generate(model, ids, new=12)
    kv_bytes = 2 * 30 * 3 * 64 * 4 * ids.shape[1]
    budget = kv_bytes // 10
    config = TierConfig(device_budget=budget, host_budget=kv_bytes // 4, disk_dir=tmp_path)
    with TieredCache(model, config, "full") as cache:
        got = generate(model, ids, cache, new=12)
        stats = cache.stats()
        assert cache.store.device.peak <= budget
        assert cache.store.disk.used > 0, "part of the KV must have spilled to disk"
    assert torch.equal(got, ref), f"{got.tolist()} != {ref.tolist()}"
    assert stats["device_peak_bytes"] <= budget


# The target: 9/10 for every lossless policy. All five measure 10/10 here; quest and
# leoam (8-token pages, per-query-head criticality) also found 20 of 20 keys on seeds 10-29.
PASSKEY_FLOOR = {"tierkv": 9, "omnikv": 9, "full": 9, "quest": 9, "leoam": 9}


@pytest.mark.parametrize("policy", sorted(PASSKEY_FLOOR))
def test_passkey_retrieval(model_and_tok, passkey_cases, policy):
    model, tok = model_and_tok
    correct = 0
    for ids, answer in passkey_cases:
        with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), policy,
                         select=SelectConfig(budget=0.1)) as cache:
            correct += answer in tok.decode(generate(model, ids, cache, new=7))
    assert correct >= PASSKEY_FLOOR[policy], f"{policy}: {correct}/10"


@pytest.mark.parametrize("policy", ["tierkv", "full"])
def test_two_questions_on_one_cache(model_and_tok, policy, tmp_path):
    model, tok = model_and_tok
    config = TierConfig(device_budget="8MB", host_budget="16MB", disk_dir=tmp_path)
    with TieredCache(model, config, policy) as cache:
        for i, (fact, answer) in enumerate(two_questions(model, tok, cache)):
            assert fact.answer in answer, f"question {i}"


def test_batch_and_close(model_and_tok):
    model, tok = model_and_tok
    before = model.config._attn_implementation
    cache = TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full")
    assert model.config._attn_implementation != before
    ids = tok(["one two three", "four five six"], return_tensors="pt")["input_ids"]
    with pytest.raises(ValueError, match="batch size 2"):
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache), use_cache=True)
    cache.close()
    cache.close()
    assert model.config._attn_implementation == before


def test_sampling_runs(model_and_tok, passkey_cases):
    model, _ = model_and_tok
    ids, _ = passkey_cases[2]
    torch.manual_seed(0)
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "tierkv") as cache:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=20,
                                 **cache_kwargs(model, cache))
    assert out.shape[1] == ids.shape[1] + 5


def submissions(monkeypatch) -> list[tuple[int | None, int]]:
    """Spy on the pipeline: the list it returns fills with (layer decoding when a fetch was
    submitted or done in the decoding thread, the fetch's layer group), one entry per group
    of each plan."""
    from tierkv.pipeline.fetcher import Pipeline

    issued, current = [], {"layer": None}
    real_submit, real_now, real_decode = Pipeline.submit, Pipeline.fetch_now, TieredCache._decode

    def submit(self, plan):
        issued.extend((current["layer"], fetch.group) for fetch in plan.groups)
        return real_submit(self, plan)

    def fetch_now(self, plan):
        issued.extend((current["layer"], fetch.group) for fetch in plan.groups)
        return real_now(self, plan)

    def decode(self, layer, q, scaling):
        current["layer"] = layer
        return real_decode(self, layer, q, scaling)

    monkeypatch.setattr(Pipeline, "submit", submit)
    monkeypatch.setattr(Pipeline, "fetch_now", fetch_now)
    monkeypatch.setattr(TieredCache, "_decode", decode)
    return issued


@pytest.mark.parametrize("early", [True, False])
def test_dense_group_prefetch_starts_a_group_early_when_it_fits(model_and_tok, passkey_cases,
                                                                 monkeypatch, early):
    """With room on the device, a dense group's fetch starts when the group before it is
    delivered (hidden behind that whole group); without room, after that group, as before."""
    model, _ = model_and_tok
    ids, _ = passkey_cases[0]
    issued = submissions(monkeypatch)
    if not early:  # as if the device tier had no room while the group before holds its fetch
        room = TieredCache._room
        monkeypatch.setattr(TieredCache, "_room", lambda self: 0 if any(
            kind == "fetch" for kind, _ in self._step) else room(self))
    config = TierConfig(device_budget="64MB", host_budget="1GB")
    with TieredCache(model, config, "omnikv") as cache, torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        issued.clear()
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
        filters = cache.policy.filters
        before = cache.groups[cache.group_of[filters[-1]] - 1]  # multi-layer group, then a filter
        dense_next = cache.group_of[filters[-1]]
        assert len(before) > 1 and cache.policy.dense(cache, filters[-1])
        layers = {layer for layer, group in issued if group == dense_next}
        assert layers == ({before[0]} if early else {before[-1]})


def test_split_leaves_attend_exactly_their_tokens(model_and_tok, passkey_cases, monkeypatch):
    """tierkv's trees split hot leaves below their 8-token records; with ``fetch_unit="leaf"``
    a fetch of such leaves keeps only their tokens of the records. Every layer attends keys equal to the plain model's
    at the prompt positions it names, and no selecting layer attends more than its budget."""
    from tierkv.hf.groups import GroupIndex

    model, _ = model_and_tok
    ids, _ = passkey_cases[3]
    prompt = ids.shape[1]
    with torch.no_grad():
        ref = DynamicCache()
        model(ids, **cache_kwargs(model, ref), use_cache=True)
    trimmed, checked = [], []
    real_fetch = GroupIndex.fetch

    def fetch(self, leaves):
        spec = real_fetch(self, leaves)
        if spec.keep is not None:
            trimmed.append((spec.tokens, spec.positions.numel()))
        return spec

    monkeypatch.setattr(GroupIndex, "fetch", fetch)
    select = SelectConfig(budget=0.1, fetch_unit="leaf")
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), "tierkv",
                     select=select) as cache:
        attend, attend_parts = cache.policy.attend, cache.policy.attend_parts

        def check(q, layer, k, positions):
            if q.shape[1] == 1:
                old = positions < prompt
                want = ref.layers[layer].keys[0][:, positions[old]]
                assert torch.allclose(k[:, old], want.to(k.dtype), atol=1e-3), layer
                if cache.policy.is_selecting(cache, layer):
                    assert positions.numel() <= select.tokens(cache.get_seq_length()), layer
                checked.append(layer)

        def spy(c, layer, q, k, v, positions, scaling):
            check(q, layer, k, positions)
            return attend(c, layer, q, k, v, positions, scaling)

        def spy_parts(c, layer, q, parts, positions, scaling):  # read in place (a CPU)
            check(q, layer, parts.packed()[0], positions)
            return attend_parts(c, layer, q, parts, positions, scaling)

        cache.policy.attend, cache.policy.attend_parts = spy, spy_parts
        with torch.no_grad():
            model.generate(ids, min_new_tokens=16, max_new_tokens=16, do_sample=False,
                           **cache_kwargs(model, cache))
        leaves = [index.tree.sizes for index in cache.indexes]
    assert min(int(s.min()) for s in leaves) < 8, "no leaf split below its record"
    assert trimmed and all(kept < tokens for tokens, kept in trimmed)
    assert len(checked) >= 15 * 30


@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "razor", "quest", "leoam",
                                    "omnikv", "tierkv"])
def test_policies_keep_device_and_host_tensors_apart(model_and_tok, passkey_cases, monkeypatch,
                                                      policy):
    """On a GPU, q, k, v and attention's results are CUDA tensors while positions, trees and
    scores are CPU ones, and an operation mixing them raises. Here the tensors a policy gets
    from attention are marked as device tensors (``tests/devicesim.py``), so such a mix raises
    on the CPU too: through prefill, 12 decode steps (tree adaptation, leaf splits, filter-layer
    preselection on a device budget below four filter layers' KV) and a second turn."""
    from devicesim import OnDevice, to_device, to_host

    model, _ = model_and_tok
    ids = torch.cat([passkey_cases[0][0], passkey_cases[1][0]], dim=1)  # ~2K tokens
    for module in ("base", "streaming", "h2o", "razor"):  # the way up: mark, do not move
        monkeypatch.setattr(f"tierkv.policies.{module}.on_device", lambda t, like: to_device(t))
    calls = []
    with TieredCache(model, TierConfig(device_budget="10MB", host_budget="1GB"), policy,
                     select=SelectConfig(budget=0.1)) as cache:
        p = cache.policy
        cache.in_place = False  # a simulated GPU: fetches packed, as on CUDA
        attend, fetch, observe = p.attend, p.fetch, p.observe_prefill

        def on_attend(c, layer, q, k, v, positions, scaling):
            assert not isinstance(positions, OnDevice)
            calls.append("attend")
            return to_host(attend(c, layer, to_device(q), to_device(k), to_device(v), positions,
                                  scaling))

        def on_fetch(c, layer, q):
            wanted = fetch(c, layer, to_device(q))
            assert not isinstance(getattr(wanted, "positions", wanted), OnDevice), layer
            calls.append("fetch")
            return wanted

        def on_observe(c, layer, mass):
            calls.append("observe")
            return observe(c, layer, to_device(mass))

        p.attend, p.fetch, p.observe_prefill = on_attend, on_fetch, on_observe
        with torch.no_grad():
            out = model.generate(ids, min_new_tokens=12, max_new_tokens=12, do_sample=False,
                                 **cache_kwargs(model, cache))
            more = torch.cat([out, out[:, -4:]], dim=1)
            model.generate(more, min_new_tokens=2, max_new_tokens=2, do_sample=False,
                           **cache_kwargs(model, cache))
        if policy == "tierkv":  # the paths that cross most: preselection and leaf splits
            filters = [cache.group_of[f] for f in p.filters]
            assert any(p.preselects(cache, cache.groups[g][0]) for g in filters)
            assert min(int(index.tree.sizes.min()) for index in cache.indexes) < 8
    assert calls.count("attend") == 12 * 30  # 11 steps, then 1 after the second turn's prefill
    assert policy != "h2o" or "observe" in calls


def test_device_tier_follows_the_model(model_and_tok, monkeypatch):
    """``device="auto"`` puts the device tier where the model computes; a device tier elsewhere
    (attention would mix devices) and a model on a device TieredCache does not run on are
    refused before anything is stored."""
    model, _ = model_and_tok
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB")) as cache:
        assert cache.device == torch.device("cpu")  # auto, with CUDA or not: the model is on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"the model is on cpu; the device tier must be"):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB", device="cuda"))
    monkeypatch.undo()
    param = next(model.parameters())
    monkeypatch.setattr(type(model), "parameters",
                        lambda self, recurse=True: iter([param.to("meta")]))
    with pytest.raises(ValueError, match="the model is on meta"):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="8MB"))


def test_what_the_tiers_would_attend_wrongly_is_refused(model_and_tok):
    """Padding (zeros in attention_mask) and a context past a sliding window would be attended
    as plain tokens: refused before any layer runs, so the cache is as it was; a model whose
    attention does not go through AttentionInterface is refused up front."""
    from transformers import FalconConfig, FalconForCausalLM, Gemma2Config, Gemma2ForCausalLM, \
        MistralConfig, MistralForCausalLM

    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    with TieredCache(model, config, "full") as cache, torch.no_grad():
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        with pytest.raises(ValueError, match="attention_mask masks 3 of its"):
            model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=2)
        assert cache.get_seq_length() == 0 and cache.token_ids.numel() == 0
        model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                       max_new_tokens=2)
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(**tiny, sliding_window=16)).eval()
    with TieredCache(mistral, config, "full") as cache, torch.no_grad():
        mistral(torch.arange(10)[None], **cache_kwargs(mistral, cache), use_cache=True)
        with pytest.raises(ValueError, match=r"17 tokens pass the model's sliding window \(16\)"):
            mistral(torch.arange(7)[None], **cache_kwargs(mistral, cache), use_cache=True)
        assert cache.get_seq_length() == 10
    falcon = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4)).eval()
    with pytest.raises(ValueError, match="FalconForCausalLM does not run its attention through"):
        TieredCache(falcon, config, "full")
    gemma = Gemma2ForCausalLM(Gemma2Config(**tiny, head_dim=8)).eval()
    with pytest.raises(ValueError, match=r"caps its attention logits \(attn_logit_softcapping=50"):
        TieredCache(gemma, config, "full")


def test_a_forward_that_fails_part_way_leaves_a_cache_that_says_so(model_and_tok, tmp_path,
                                                                 monkeypatch):
    """A KeyboardInterrupt raised inside the cache's own code (an application's SIGINT handler,
    not a held Ctrl-C: ``tests/test_recover.py``) may have stopped it anywhere, and leaves some
    layers with the step and others without: the cache refuses to go on or to be saved, naming
    what broke it, rather than attend wrongly; closing it still hands everything back, and the
    saved document it was reopened from is as it was saved."""
    model, tok = model_and_tok
    ids, _ = saved_document(model, tok, tmp_path)
    more = tok(" And again.", return_tensors="pt", add_special_tokens=False)["input_ids"]
    cache = TieredCache.open(model, tmp_path)
    calls, attend = [0], cache.policy.attend

    def interrupted(*args):
        calls[0] += 1
        if calls[0] == 40:  # layer 9 of the second decode step
            raise KeyboardInterrupt("injected")
        return attend(*args)

    monkeypatch.setattr(cache.policy, "attend", interrupted)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model.generate(torch.cat([ids, more], 1), **cache_kwargs(model, cache), max_new_tokens=4)
    assert len({cache.layer_length(layer) for layer in range(cache.shape.layers)}) == 2
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"cannot go on: a forward pass failed "
                                                            r"part-way \(KeyboardInterrupt: injected\)"):
        model(cache.token_ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
    with pytest.raises(RuntimeError, match="cannot be saved"):
        cache.save(tmp_path / "copy")
    cache.close()
    assert model.config._attn_implementation == "sdpa"
    with TieredCache.open(model, tmp_path) as reopened, torch.no_grad():
        assert torch.equal(reopened.token_ids, ids)
        logits = model(ids[:, -1:], **cache_kwargs(model, reopened), use_cache=True).logits
    with torch.no_grad():
        plain = model(torch.cat([ids, ids[:, -1:]], dim=1)).logits
    assert torch.allclose(logits[0, -1], plain[0, -1], atol=LOGIT_ATOL)


@pytest.mark.parametrize("kwargs, message", [
    ({"config": {"device_budget": "8MB"}}, "config=dict: expected a TierConfig"),
    ({"select": {"budget": 0.1}}, "select=dict: expected a SelectConfig"),
    ({"chunks": {"min": 2}}, "chunks=dict: expected a ChunkConfig"),
    ({"prefill_block": True}, "prefill_block=True"),
    ({"doc": "../x"}, "doc"),
    ({"doc": 5}, "doc"),
])
def test_cache_arguments_of_the_wrong_kind(model_and_tok, kwargs, message):
    model, _ = model_and_tok
    with pytest.raises(ValueError, match=message):
        TieredCache(model, **kwargs)
    with pytest.raises(ValueError, match="expected a loaded transformers model"):
        TieredCache("smollm2-135m")


def test_a_device_budget_too_small_says_what_it_must_hold(model_and_tok):
    from tierkv.storage import TierFullError

    model, tok = model_and_tok
    ids = tok("A short text. " * 60, return_tensors="pt")["input_ids"]
    with TieredCache(model, TierConfig(device_budget="100KB", host_budget="64MB")) as cache:
        with pytest.raises(TierFullError, match=r"needs \d+ B, 100000 B free of 100000: .*whole "
                                                r"during prefill \(1536 B a token and layer\); "
                                                r"raise the device budget"):
            with torch.no_grad():
                model(ids, **cache_kwargs(model, cache), use_cache=True)
    from tierkv.hf.admit import device_need

    assert "a smaller SelectConfig.budget, --budget, brings fewer" in device_need("fetch:0", 1536)


def test_continuing_without_the_cached_ids_is_named(model_and_tok):
    """generate feeds the model only the ids past what the cache holds: given only new ids,
    nothing would reach it, and given fewer ids than it holds, a tail of them would be fed again
    at the wrong positions; the error says what to pass, and the cache goes on."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    more = tok(" And more.", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        generate(model, ids, cache, new=2)
        with pytest.raises(ValueError, match="pass cache.token_ids followed by the new tokens"):
            generate(model, more, cache, new=2)
        held = cache.get_seq_length()
        with pytest.raises(ValueError, match=f"new tokens would sit at position 1, but the cache "
                                             f"holds {held}: generate was given fewer ids"):
            generate(model, ids, cache, new=2)  # the first prompt again: part of it, re-fed
        assert cache.get_seq_length() == held
        again = generate(model, torch.cat([cache.token_ids, more], dim=1), cache, new=2)
    assert again.numel() == 2


def test_continuing_another_text_is_refused(model_and_tok):
    """generate takes the first ids it is given, as many as the cache holds, for the cached ones
    without looking: another text of that length or longer would be answered against this
    one's context. It is refused before any layer runs, naming the first differing position;
    the cache goes on, and once it is closed the model's own generate is back."""
    model, tok = model_and_tok
    ids = tok("A short text. " * 20, return_tensors="pt")["input_ids"]
    more = tok(" And more.", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        generate(model, ids, cache, new=2)
        held = cache.get_seq_length()
        other = torch.cat([cache.token_ids, more], dim=1)
        other[0, 5] = (other[0, 5] + 1) % model.config.vocab_size
        with pytest.raises(ValueError, match=f"differ from the cache's at position 5 \\(of the "
                                             f"{held} it holds\\)"):
            generate(model, other, cache, new=2)
        assert cache.get_seq_length() == held
        assert "prepare_inputs_for_generation" in vars(model)
        again = generate(model, torch.cat([cache.token_ids, more], dim=1), cache, new=2)
    assert again.numel() == 2
    assert "prepare_inputs_for_generation" not in vars(model)
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), "full") as cache:
        generate(model, ids[:, :10], cache, new=2)  # a fresh cache: nothing held, nothing checked
        assert cache.get_seq_length() == 11


def test_one_live_cache_per_model(model_and_tok):
    """A second TieredCache on a model a live one serves is refused (it would take over the
    model's attention, and closing either would hand it back under the other); once the first
    is closed, a new one is fine."""
    model, _ = model_and_tok
    config = TierConfig(device_budget="8MB", host_budget="8MB")
    first = TieredCache(model, config, "full")
    with pytest.raises(ValueError, match="already serves a live TieredCache"):
        TieredCache(model, config, "full")
    first.close()
    with TieredCache(model, config, "full") as second:
        assert model.config._attn_implementation == second._attn_name
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("policy, kwargs, message", [
    ("tierkv", {"profile": {"filter_layers": [12, 2, 17]}},
     r"profile=: filter_layers=\[12, 2, 17\]: must be strictly increasing layer indices in \[0, 29\)"),
    ("razor", {"profile": {"retrieval_heads": {"14": [7]}}},
     r"profile=: retrieval_heads\['14'\]=\[7\]: KV head out of range \[0, 3\): the profile does not fit"),
    ("razor", {"profile": {"retrieval_heads": [[14, 1]]}}, r"retrieval_heads=\[\[14, 1\]\]: expected a dict"),
    ("tierkv", {"profile": "abc"}, "profile=: expected a dict"),
    ("tierkv", {"select": SelectConfig(filter_layers=(2, 29))},
     r"filter_layers=\(2, 29\): layer 29 is at or past the model's last layer 29"),
])
def test_profiles_and_filter_layers_are_checked_against_the_model(model_and_tok, policy, kwargs, message):
    from tierkv.hf.profile import load_profile

    model, _ = model_and_tok
    assert load_profile(model)["filter_layers"] == [2, 12, 17]  # the shipped profile fits SmolLM2
    with pytest.raises(ValueError, match=message):
        TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), policy, **kwargs)
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="64MB"), policy) as cache:
        assert cache.profile["filter_layers"] == [2, 12, 17]  # the model serves a cache again


@pytest.mark.parametrize("ahead", [True, False])
def test_preselecting_layers_fetch_while_earlier_layers_compute(model_and_tok, monkeypatch, ahead):
    """With ``fetch_ahead`` (a GPU's default), once a preselecting layer has had a query, its
    candidates (ranked by that query) start coming up before its next query: at the end of the
    step before (layer 0), or while the layers before it compute; without, when its own query
    arrives (a CPU's default)."""
    model, tok = model_and_tok
    ids = tok(make_document(tok, 1600, 3), return_tensors="pt")["input_ids"][:, :1400]
    issued = submissions(monkeypatch)
    config = TierConfig(device_budget="6MB", host_budget="1GB")  # preselects past ~1020 tokens
    with TieredCache(model, config, "tierkv") as cache, torch.no_grad():
        assert cache.fetch_ahead is (cache.device.type == "cuda")
        cache.fetch_ahead = ahead
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        out = model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
        first = {cache.group_of[layer]: layer for layer in range(cache.shape.layers)
                 if cache.policy.preselects(cache, layer)}
        assert {0, 1, cache.group_of[cache.policy.filters[0]]} <= set(first)
        issued.clear()
        for _ in range(3):
            cache._kept.clear()  # no records kept from the step before: every group fetches
            out = model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
    fetches = [(layer, g) for layer, g in issued if g in first]
    assert {g for _, g in fetches} == set(first)
    assert all((layer != first[g]) is ahead for layer, g in fetches), fetches


def test_a_filter_layer_that_starts_preselecting_unpins_its_records(model_and_tok):
    """The records of a filter layer and of a layer before it, read whole (pinned on the host)
    while the context is short, rank by the step like the others' once the context outgrows a
    quarter of the device tier and the layers preselect: pinned, they would hold the host tier
    for good."""
    from tierkv.hf.cache import PINNED

    model, tok = model_and_tok
    ids = tok(make_document(tok, 1600, 3), return_tensors="pt")["input_ids"][:, :1400]
    config = TierConfig(device_budget="6MB", host_budget="1GB")  # preselects past ~1020 tokens
    with TieredCache(model, config, "tierkv") as cache, torch.no_grad():
        layers = (0, cache.policy.filters[0])
        ranks = cache.store._ranks
        out = model(ids[:, :300], **cache_kwargs(model, cache), use_cache=True)
        model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
        firsts = [cache.index_of(layer).keys[0] for layer in layers]
        for layer, first in zip(layers, firsts):
            assert not cache.policy.preselects(cache, layer) and ranks.importance(first) == PINNED
        for start in range(301, ids.shape[1], 350):  # prompts of a few hundred tokens each
            out = model(ids[:, start:start + 350], **cache_kwargs(model, cache), use_cache=True)
        model(out.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache), use_cache=True)
        for layer, first in zip(layers, firsts):
            assert cache.policy.preselects(cache, layer)
            assert ranks.importance(first) == cache.steps and first in cache.index_of(layer).keys


@pytest.mark.parametrize("policy", ["omnikv", "tierkv"])
def test_a_filter_layers_choice_is_fetched_once_its_own_records_are_let_go(model_and_tok,
                                                                         passkey_cases, policy):
    """The records a filter layer attended (its whole KV, or its preselected candidates) and the
    chunks it chose for the layers after it never hold the device tier together: the choice's
    prefetch is reserved right after the filter layer's attention, once its records are let go.
    At 8K tokens and a device tier of 5 % of the KV, the two together did not fit."""
    model, _ = model_and_tok
    ids, _ = passkey_cases[3]
    with TieredCache(model, TierConfig(device_budget="8MB", host_budget="1GB"), policy,
                     select=SelectConfig(budget=0.1)) as cache:
        tier = cache.store.device
        filters = {cache.group_of[f] for f in cache.policy.filters}
        chosen = {g for g, group in enumerate(cache.groups)
                  if cache.policy.is_selecting(cache, group[0])}
        reserve, seen = tier.reserve, []

        def watched(tag, nbytes):
            kind, group = tag.split(":")
            if kind == "prefetch" and int(group) in chosen and nbytes:
                held = {f: tier.reserved_for(f"fetch:{f}") for f in filters}
                seen.append(held)
            reserve(tag, nbytes)

        tier.reserve = watched
        generate(model, ids, cache, new=6)
    assert chosen and len(seen) >= 5 * len(filters), seen  # every decode step's choices
    assert all(not any(held.values()) for held in seen), seen


def test_decode_steps_compute_on_decode_threads_and_put_them_back(model_and_tok, passkey_cases,
                                                                  monkeypatch):
    """A decode step computes on ``decode_threads`` (torch's own by default), a prompt on
    torch's own; torch's setting is back after each forward pass, also one that raised. A bad
    value is refused before any layer runs, and the cache goes on."""
    model, _ = model_and_tok
    ids = passkey_cases[0][0][:, :200]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = TierConfig(device_budget="8MB", host_budget="1GB")
        with TieredCache(model, config, "tierkv") as cache, torch.no_grad():
            assert cache.decode_threads is None
            seen = []
            for name in ("attend", "attend_parts"):  # packed, or read in place (a CPU)
                real = getattr(cache.policy, name)
                monkeypatch.setattr(cache.policy, name, lambda *a, real=real:
                                    seen.append(torch.get_num_threads()) or real(*a))
            model(ids, **cache_kwargs(model, cache), use_cache=True)
            assert torch.get_num_threads() == 2
            model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
            assert seen[-1] == 2
            new = []  # the cache's threads compute on one thread; a new one starts with torch's
            thread = threading.Thread(target=lambda: new.append(torch.get_num_threads()))
            thread.start()
            thread.join()
            assert new == [2]
            cache.decode_threads = 1
            model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
            assert seen[-1] == 1 and torch.get_num_threads() == 2

            def broken(*args):
                raise RuntimeError("attention failed")
            monkeypatch.setattr(cache.policy, "attend", broken)
            monkeypatch.setattr(cache.policy, "attend_parts", broken)
            with pytest.raises(RuntimeError, match="attention failed"):
                model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
            assert torch.get_num_threads() == 2
        with TieredCache(model, config, "tierkv") as cache, torch.no_grad():
            model(ids, **cache_kwargs(model, cache), use_cache=True)
            cache.decode_threads = 0
            with pytest.raises(ValueError, match=r"decode_threads=0: expected a positive int"):
                model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
            cache.decode_threads = None
            model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
            assert cache.get_seq_length() == ids.shape[1] + 1
    finally:
        torch.set_num_threads(before)


def test_a_forward_outside_no_grad_runs_without_autograd(model_and_tok, passkey_cases,
                                                        monkeypatch):
    """Called without ``torch.no_grad()`` (a hand-written decode loop), a forward pass through a
    TieredCache runs without autograd: the prompt and ``tierkv``'s decode steps give the logits
    they give under ``no_grad``, none carries a graph, and autograd's mode is back after each
    pass, also after one that raised."""
    model, _ = model_and_tok
    ids = passkey_cases[2][0][:, :300]
    config = TierConfig(device_budget="8MB", host_budget="1GB")
    runs = []
    for grad in (False, True):
        with TieredCache(model, config, "tierkv") as cache, torch.set_grad_enabled(grad):
            logits = [model(ids, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]]
            for token in ids[0, :6]:
                logits.append(model(token.view(1, 1), **cache_kwargs(model, cache),
                                    use_cache=True).logits[0, -1])
            assert torch.is_grad_enabled() == grad
            assert not any(step.requires_grad for step in logits)
            runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
    with TieredCache(model, config, "tierkv") as cache:
        model(ids, **cache_kwargs(model, cache), use_cache=True)

        def broken(*args):
            raise RuntimeError("attention failed")
        monkeypatch.setattr(cache.policy, "attend", broken)
        monkeypatch.setattr(cache.policy, "attend_parts", broken)
        with pytest.raises(RuntimeError, match="attention failed"):
            model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)
        assert torch.is_grad_enabled()


def test_tree_folds_run_beside_their_group_and_a_failed_one_stops_the_step(model_and_tok,
                                                                           passkey_cases,
                                                                           monkeypatch):
    """``tierkv`` folds a filter layer's scores into a selecting group's tree on the cache's
    helper thread while the group's layers compute: every fold is done by the end of its forward
    pass, the trees do change, and a fold that raises fails the forward pass it ran in."""
    from tierkv.hf.groups import GroupIndex

    model, _ = model_and_tok
    ids, _ = passkey_cases[1]
    threads, real = [], GroupIndex.adapt

    def adapt(self, *args):
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(GroupIndex, "adapt", adapt)
    config = TierConfig(device_budget="8MB", host_budget="1GB")
    with TieredCache(model, config, "tierkv") as cache, torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
        leaves = [len(index) for index in cache.indexes]
        for token in ids[0, :12]:
            model(token.view(1, 1), **cache_kwargs(model, cache), use_cache=True)
            assert not cache._folds
        assert threads and all(name.startswith("tierkv-helper") for name in threads)
        assert [len(index) for index in cache.indexes] != leaves

        def broken(self, *args):
            raise ValueError("fold failed")

        monkeypatch.setattr(GroupIndex, "adapt", broken)
        with pytest.raises(ValueError, match="fold failed"):
            for token in ids[0, 12:24]:
                model(token.view(1, 1), **cache_kwargs(model, cache), use_cache=True)
        with pytest.raises(RuntimeError, match=r"a forward pass failed part-way \(ValueError: "
                                               r"fold failed\)"):
            model(ids[:, -1:], **cache_kwargs(model, cache), use_cache=True)


def test_a_cache_goes_from_inference_mode_to_no_grad_and_back(model_and_tok, passkey_cases):
    """One ``generate`` under ``torch.inference_mode``, the next under ``no_grad``, then a
    forward pass with neither: the cache's buffers and the folds on its helper thread follow
    each pass's mode (tensors made under inference mode may be written only under it)."""
    model, _ = model_and_tok
    ids = passkey_cases[4][0][:, :600]
    config = TierConfig(device_budget="8MB", host_budget="1GB")
    with TieredCache(model, config, "tierkv") as cache:
        with torch.inference_mode():
            out = model.generate(ids, **cache_kwargs(model, cache), min_new_tokens=24, max_new_tokens=24,
                                 do_sample=False)
        with torch.no_grad():
            out = model.generate(torch.cat([out, ids[:, :5]], 1), **cache_kwargs(model, cache),
                                 min_new_tokens=24, max_new_tokens=24, do_sample=False)
        model(out[:, -1:], **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == out.shape[1]
