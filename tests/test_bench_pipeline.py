"""bench.pipeline's codec verdict (no model needed)."""
from __future__ import annotations

from bench.pipeline import codec_summary


def times(mix, raw, zstd, int8):
    return {"chosen_mix": [mix] * 3, "raw": [raw] * 3, "zstd": [zstd] * 3, "int8": [int8] * 3}


def test_a_mix_of_one_codec_is_judged_by_that_codecs_own_store():
    """All records raw: the mix's bytes are the raw store's, so its own (noisier) timing of the
    same bytes does not decide; raw against the best allowed codec does."""
    chosen = {i: "raw" for i in range(4)}
    out = codec_summary(times(0.66, 0.59, 1.3, 2.0), chosen, {2, 3}, {})
    assert out["mix_is"] == "raw" and out["fastest_or_tied"] and out["mix_over_best_allowed"] == 1.0
    out = codec_summary(times(0.5, 0.59, 0.4, 2.0), chosen, {2, 3}, {})  # zstd was faster
    assert out["best_allowed"] == "zstd" and not out["fastest_or_tied"]


def test_a_mixed_choice_is_judged_by_its_own_timing():
    chosen = {0: "raw", 1: "raw", 2: "int8", 3: "int8"}
    out = codec_summary(times(2.7, 3.15, 3.1, 2.0), chosen, {2, 3}, {})
    assert out["mix_is"] is None and out["best_allowed"] == "zstd" and out["fastest_or_tied"]
    assert out["chosen_cold"] == {"int8": 2} and out["allowed"]["int8"] is False
    out = codec_summary(times(3.5, 3.15, 3.1, 2.0), chosen, {2, 3}, {})
    assert not out["fastest_or_tied"]
