"""The scoring helpers of ``bench.quality`` (no model)."""
from __future__ import annotations

import pytest
import torch

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
    ok = {"top1_agreement": 0.9, "passkey_acc": 1.0, "ms_per_token": 12.5}
    text = table({"full": {str(b): ok for b in BUDGETS},
                  "razor": {str(b): {"error": "boom"} for b in BUDGETS}})
    assert "0.900" in text and "12.5" in text
    assert text.splitlines()[-1].count("error") == len(BUDGETS)


def test_policies_option_rejects_an_unknown_policy_before_loading_a_model(capsys):
    from bench.quality import main
    with pytest.raises(SystemExit) as exit_info:
        main(["--policies", "tierkv", "nosuch"])
    assert exit_info.value.code == 2
    assert "nosuch" in capsys.readouterr().err
