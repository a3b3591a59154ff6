"""The scoring helpers of ``bench.quality`` (no model)."""
from __future__ import annotations

import pytest
import torch

from bench.common import divergence
from bench.quality import BUDGETS, device_budget, passkey_accuracy, table, top1_agreement
from tierkv.shapes import KVShape

SMOLLM2 = KVShape(layers=30, kv_heads=3, q_heads=9, head_dim=64, dtype=torch.float32)


def test_top1_agreement_counts_equal_positions():
    ref = torch.tensor([1, 2, 3, 4])
    assert top1_agreement(ref.clone(), ref) == 1.0
    assert top1_agreement(torch.tensor([1, 0, 3, 0]), ref) == 0.5
    assert top1_agreement(torch.tensor([0, 0, 0, 0]), ref) == 0.0


@pytest.mark.parametrize("pred, ref", [(torch.tensor([1, 2]), torch.tensor([1, 2, 3])),
                                       (torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))])
def test_top1_agreement_rejects_bad_shapes(pred, ref):
    with pytest.raises(ValueError):
        top1_agreement(pred, ref)


def test_passkey_accuracy_is_substring_share():
    outputs = [" 48213. Remember", " 1234", "The key is 77777"]
    assert passkey_accuracy(outputs, ["48213", "12345", "77777"]) == pytest.approx(2 / 3)


def test_passkey_accuracy_rejects_mismatch():
    with pytest.raises(ValueError):
        passkey_accuracy(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        passkey_accuracy([], [])


def test_device_budget_holds_two_layers_and_the_selection():
    assert device_budget(SMOLLM2, 256, 0.05) == 8 * 2**20
    layer_kv = 8192 * SMOLLM2.token_bytes(1)
    got = device_budget(SMOLLM2, 8192, 0.25)
    assert got >= 2 * layer_kv + 0.25 * SMOLLM2.kv_bytes(8192) - 1


def test_table_shows_errors_and_figures():
    ok = {"top1_agreement": 0.9, "kl": 0.0123, "passkey_acc": 1.0, "ms_per_token": 12.5}
    older = {"top1_agreement": 0.8, "passkey_acc": 1.0, "ms_per_token": 13.5}  # no KL then
    text = table({"full": {str(b): ok for b in BUDGETS}, "quest": {str(b): older for b in BUDGETS},
                  "razor": {str(b): {"error": "boom"} for b in BUDGETS}})
    assert "0.900" in text and "0.0123" in text and "12.5" in text
    assert "0.800      -" in text
    assert text.splitlines()[-1].count("error") == len(BUDGETS)


def test_policies_option_rejects_an_unknown_policy_before_loading_a_model(capsys):
    from bench.quality import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--policies", "tierkv", "nosuch"])
    assert exit_info.value.code == 2
    assert "nosuch" in capsys.readouterr().err


def test_divergence_measures_agreement_kl_and_how_close_each_miss_was():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0], [1.0, 0.9, 0.0]]).log_softmax(-1)
    same = divergence(ref, ref.clone())
    assert same["top1_agreement"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-12)
    assert same["top1_misses"] == [] and str(same["kl"]) == "0.0"  # not "-0.0" in the results
    got = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0], [0.9, 1.0, 0.0]]).log_softmax(-1)
    out = divergence(ref, got)
    assert out["top1_agreement"] == pytest.approx(2 / 3)
    assert out["top1_misses"] == [[3, 0.1]]  # step 3 (from 1), the reference's margin 1.0 - 0.9
    p = ref[2].exp()
    assert out["kl"] == pytest.approx((p * (ref[2] - got[2])).sum().item() / 3)
    assert out["kl"] > 0


@pytest.mark.parametrize("ref, got", [(torch.zeros(4, 3), torch.zeros(4, 2)),
                                      (torch.zeros(3), torch.zeros(3))])
def test_divergence_rejects_log_probabilities_of_other_shapes(ref, got):
    with pytest.raises(ValueError, match="shape"):
        divergence(ref, got)
