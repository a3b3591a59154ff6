"""bench.decode's pieces that need no model: the profiling option, the budget raise after a
TierFullError."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench import decode


def test_profiled_writes_tables_and_a_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "PROFILE", tmp_path / "prof")
    with decode.profiled("case"):
        torch.ones(64, 64).matmul(torch.ones(64, 64)).sum()
    table = (tmp_path / "prof" / "case.txt").read_text()
    assert "aten::matmul" in table or "aten::mm" in table
    assert (tmp_path / "prof" / "case.trace.json").stat().st_size > 0


def test_profiled_does_nothing_unasked(tmp_path, monkeypatch):
    with decode.profiled("case"):  # PROFILE unset
        pass
    monkeypatch.setattr(decode, "PROFILE", tmp_path)
    with decode.profiled(None):  # an unlabelled run (the warm-up)
        pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [["--profile", "p"], ["--chunk-min", "4"],
                                  ["--fetch-unit", "leaf"], ["--fetch-ahead", "on"]])
def test_profiling_options_need_cases(argv, capsys):
    with pytest.raises(SystemExit):
        decode.main(argv)
    assert "give --cases too" in capsys.readouterr().err


def test_comparing_fetch_ahead_needs_the_tierkv_case(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--cases", "quest", "--fetch-ahead", "both"])
    assert "give --cases tierkv" in capsys.readouterr().err


def test_alternate_runs_blocks_in_turn_and_scores_each_run():
    """Each run is prefilled, then fed the reference tokens ``block`` steps at a time, the runs
    taking turns (every other round in reverse order); a run's agreement is the share of steps
    whose argmax is the next token."""
    calls = []

    def net_of(name, guess):
        def net(ids, past_key_values=None, **kwargs):
            calls.append((name, ids.numel()))
            logits = torch.zeros(1, 1, 10)
            logits[0, -1, guess(int(ids[0, -1]))] = 1.0
            return SimpleNamespace(logits=logits)
        return net

    ref = torch.arange(6)
    runs = [("right", net_of("right", lambda t: t + 1), None),
            ("wrong", net_of("wrong", lambda t: 0), None)]
    out = decode.alternate(runs, torch.zeros(1, 3, dtype=torch.long), ref, steps=5, block=2)
    assert [name for name, n in calls if n == 3] == ["right", "wrong"]  # the prefills
    # rounds of 2 steps each, every other round in reverse order
    assert [name for name, n in calls if n == 1] == ["right"] * 2 + ["wrong"] * 2 + ["wrong"] * 2 \
        + ["right"] * 2 + ["right", "wrong"]
    assert out["top1_agreement"] == {"right": 1.0, "wrong": 0.0}
    assert set(out["ms_per_token"]) == {"right", "wrong"}
    for name in ("right", "wrong"):  # blocks of 2, 2 and 1 steps
        blocks = out["block_ms"][name]
        assert len(blocks) == 3 and all(ms > 0 for ms in blocks)
        assert sum(blocks[:2]) * 2 + blocks[2] == pytest.approx(5 * out["ms_per_token"][name])


def test_a_tier_full_error_raises_the_budget_by_its_shortfall_or_a_tenth():
    message = "device: prefetch:7 needs 15040000 B, 14670000 B free of 18730000: ..."
    assert decode.raised(18_730_000, message) == 20 * 2**20  # +0.37 MB is under a tenth
    message = "device: prefetch:7 needs 9000000 B, 1000000 B free of 10000000: ..."
    assert decode.raised(10_000_000, message) == -(-18_000_000 // 2**20) * 2**20
    assert decode.raised(10_000_000, "some other error") == -(-11_000_000 // 2**20) * 2**20
    message = ("the device tier (18874368 B) holds 1157 tokens of layer group 3 (layers 3-11) ...: "
               "a device budget of 23000000 B holds them all (TierConfig.device_budget, ...)")
    assert decode.raised(18_874_368, message) == -(-23_000_000 // 2**20) * 2**20


def test_a_run_cut_short_leaves_its_headline_and_a_complete_run_removes_it(tmp_path, monkeypatch):
    """Cases run tierkv (with the paired run) first and the all-KV readers last; each case
    rewrites ``decode.partial.quick.json`` (a ``--quick`` run's names); the complete run writes
    ``decode.quick.json`` and removes it."""
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setenv("TIERKV_BENCH_DEVICE", "cpu")
    config = SimpleNamespace(max_position_embeddings=80, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, hidden_size=16, head_dim=8)
    model = SimpleNamespace(config=config, dtype=torch.float32)
    monkeypatch.setattr(decode, "load_model", lambda *a, **k: (model, None))
    monkeypatch.setattr(decode, "document_ids", lambda tok, n, seed: torch.zeros(1, n, dtype=torch.long))
    monkeypatch.setattr(decode, "warm_up", lambda *a: None)
    full = {"ms_per_token": 10.0, "disk_bytes_per_token": 0.0, "top1_agreement": 1.0,
            "device_peak_bytes": None, "stall_frac": None}
    monkeypatch.setattr(decode, "full_memory_case", lambda *a: (dict(full), torch.zeros(17, 5)))
    monkeypatch.setattr(decode, "paired_speed", lambda *a: {"speedup": 1.25})
    ran, partial = [], []

    def case(model, ids, ref, steps, policy, *rest):
        name = "brute_offload" if policy == "full" else policy
        if (tmp_path / "decode.partial.quick.json").exists():
            partial.append(__import__("json").loads((tmp_path / "decode.partial.quick.json").read_text()))
        ran.append(name)
        if name == STOP:
            raise KeyboardInterrupt  # the lent machine's time runs out
        return {"ms_per_token": {"tierkv": 8.0, "brute_offload": 200.0}.get(name, 9.0),
                "disk_bytes_per_token": 1000.0, "top1_agreement": 0.95,
                "device_peak_bytes": 1, "stall_frac": 0.1, "device_budget": 1}
    monkeypatch.setattr(decode, "tiered_case", case)

    STOP = "brute_offload"
    with pytest.raises(KeyboardInterrupt):
        decode.main(["--quick"])
    assert ran == ["tierkv", "quest", "leoam", "omnikv", "brute_offload"]
    cut = partial[-1]
    assert cut["partial"] is True
    assert cut["cases"].keys() == {"full_memory", "tierkv", "offloaded", "quest", "leoam", "omnikv"}
    assert "needs the model on a GPU" in cut["cases"]["offloaded"]["skipped"]
    assert cut["speedup_vs_full_memory"] == 1.25 and cut["speedup_vs_brute_offload"] is None
    assert partial[0]["cases"].keys() == {"full_memory", "tierkv", "offloaded"}
    assert not (tmp_path / "decode.quick.json").exists()

    STOP, ran[:] = None, []
    result = decode.main(["--quick"])
    assert ran[-3:] == ["brute_offload", "h2o", "razor"]
    assert result["speedup_vs_brute_offload"] == 25.0 and result["full_memory_drift"] == 1.0
    assert (tmp_path / "decode.quick.json").exists() and not (tmp_path / "decode.partial.quick.json").exists()


def test_summary_leaves_out_what_needs_a_case_not_run():
    config = {"kv_bytes": 4000}
    cases = {"full_memory": {"ms_per_token": 12.0},
             "tierkv": {"ms_per_token": 10.0, "disk_bytes_per_token": 40.0}}
    got = decode.summary(cases, None, config)
    assert got["speedup_vs_full_memory"] is None and got["speedup_vs_brute_offload"] is None
    assert got["speedup_vs_full_memory_unpaired"] == pytest.approx(1.2)
    assert got["disk_read_frac"] == pytest.approx(0.01)
    assert got["speedup_vs_offloaded"] is None
    offloaded = {**cases, "offloaded": {"ms_per_token": 15.0}}
    assert decode.summary(offloaded, None, config)["speedup_vs_offloaded"] == pytest.approx(1.5)
    skipped = {**cases, "offloaded": {"skipped": "needs a GPU"}}
    assert decode.summary(skipped, None, config)["speedup_vs_offloaded"] is None
    failed = decode.summary({**cases, "tierkv": {"error": "TierFullError: x"}}, None, config)
    assert failed["disk_read_frac"] is None and failed["speedup_vs_full_memory_unpaired"] is None


def test_the_offloaded_case_needs_the_model_on_a_gpu(capsys):
    model = torch.nn.Linear(2, 2)
    model.device = torch.device("cpu")
    assert decode.offloaded_case(model, None, None, 4) == {
        "skipped": "transformers offloads a GPU's KV to CPU RAM: needs the model on a GPU"}
    decode.print_table({"offloaded": decode.offloaded_case(model, None, None, 4)})
    assert "offloaded      skipped: transformers offloads" in capsys.readouterr().out


def test_case_figures_judge_the_decode_steps_not_the_prefill():
    ref = torch.tensor([[0.0, 5.0], [5.0, 0.0], [0.0, 5.0], [4.0, 3.0]]).log_softmax(-1)
    got = ref.clone()
    got[0] = torch.tensor([5.0, 0.0]).log_softmax(-1)  # after prefill: not a decode step
    got[3] = torch.tensor([3.0, 4.0]).log_softmax(-1)
    out = decode.case_figures(got, [0.01, 0.03, 0.02], ref)
    assert out["ms_per_token"] == pytest.approx(20.0)
    assert out["top1_agreement"] == pytest.approx(2 / 3)
    assert out["top1_misses"] == [[3, 1.0]]  # decode step 3, where the reference led by 4 - 3
    assert out["kl"] > 0
    assert decode.case_figures(got, [0.01], None) == {"ms_per_token": 10.0, "top1_agreement": None,
                                                       "kl": None, "top1_misses": None}
