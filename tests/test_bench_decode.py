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
