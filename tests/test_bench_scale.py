"""Unit tests of bench/scale.py's growth figures (the bench itself runs in ``make bench``)."""
import math

import pytest

from bench.scale import growth, main


def size(tokens: int, step_s: float, fixed_s: float) -> dict:
    return {"tokens": tokens, "step_s": step_s, "fixed_budget": {"step_s": fixed_s}}


def test_growth_between_consecutive_sizes_in_token_order():
    rows = growth({"262144": size(262144, 0.8, 0.2), "16384": size(16384, 0.05, 0.1),
                   "65536": size(65536, 0.2, 0.1)})
    assert [(r["from"], r["to"]) for r in rows] == [(16384, 65536), (65536, 262144)]
    first, second = rows
    assert first["tokens_ratio"] == 4 and first["step_ratio"] == pytest.approx(4)
    assert first["step_exponent"] == pytest.approx(1)          # linear
    assert first["fixed_step_exponent"] == pytest.approx(0)    # flat
    assert second["fixed_step_ratio"] == pytest.approx(2)
    assert second["fixed_step_exponent"] == pytest.approx(math.log(2) / math.log(4))  # 0.5


def test_growth_needs_two_sizes():
    assert growth({"16384": size(16384, 0.05, 0.1)}) == []


@pytest.mark.parametrize("tokens", ["0", "100", "-4096", "5000"])
def test_sizes_checked_before_any_work(tokens, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--tokens", tokens])
    assert exit_.value.code == 2
    assert f"--tokens {tokens}: a context is a multiple of 64 tokens" in capsys.readouterr().err

