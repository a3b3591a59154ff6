"""bench.decode's pieces that need no model: the profiling option, the budget raise after a
TierFullError."""
from __future__ import annotations

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


def test_a_tier_full_error_raises_the_budget_by_its_shortfall_or_a_tenth():
    message = "device: prefetch:7 needs 15040000 B, 14670000 B free of 18730000: ..."
    assert decode.raised(18_730_000, message) == 20 * 2**20  # +0.37 MB is under a tenth
    message = "device: prefetch:7 needs 9000000 B, 1000000 B free of 10000000: ..."
    assert decode.raised(10_000_000, message) == -(-18_000_000 // 2**20) * 2**20
    assert decode.raised(10_000_000, "some other error") == -(-11_000_000 // 2**20) * 2**20
