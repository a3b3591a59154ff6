"""bench.verify's pieces that need no model: the passes a case feeds, their figures, and the
results table's rows."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.report import render
from bench.verify import Case


def _net(guess):
    """A stand-in model: each position's argmax is ``guess(its id)``; records the passes."""
    passes = []

    def net(ids, **kwargs):
        passes.append(ids.shape[1])
        logits = torch.zeros(1, ids.shape[1], 50)
        for i, token in enumerate(ids[0].tolist()):
            logits[0, i, guess(token)] = 1.0
        return SimpleNamespace(logits=logits)
    return net, passes


def test_a_case_feeds_passes_of_its_tokens_and_scores_every_position():
    """Passes of ``t`` tokens, the last one shorter, until the turn's end is reached (a pass
    may run past it, as a drafted pass would); every position's argmax is compared."""
    cont = torch.arange(10)
    net, passes = _net(lambda t: t + 1 if t % 4 else 0)
    case = Case("verify_4", net, None, 4)
    case.feed_to(cont, 5)
    assert passes == [4, 4] and case.fed == 8
    case.feed_to(cont, 5)  # nothing more this turn
    case.feed_to(cont, 64)
    assert passes == [4, 4, 2] and case.fed == 10
    ref = cont + 1
    figures = case.figures(ref)
    assert figures["passes"] == 3 and figures["t"] == 4
    assert abs(figures["top1_agreement"] - 0.7) < 1e-6  # ids 0, 4 and 8 guessed 0
    assert abs(figures["ms_per_token"] * 10 - figures["ms_per_pass"] * 3) < 1e-6
    assert "top1_agreement" not in case.figures(None)  # the reference itself


def test_the_results_table_shows_each_draft_length():
    machine = {"cpus": 2, "gpu": None, "torch": "2.x", "platform": "Linux", "when": "today"}
    cases = {"full_memory": {"ms_per_pass": 100.0}, "step": {"ms_per_pass": 80.0, "top1_agreement": 0.95},
             "verify_6": {"ms_per_pass": 120.0, "top1_agreement": 0.9},
             "question_6": {"ms_per_pass": 480.0, "top1_agreement": 0.94}}
    result = {"machine": machine, "cases": cases, "config": {"tokens": 2048, "continuation": 64},
              "drafts": {"6": {"pass_cost": 1.5, "full_memory_pass_cost": 3.2,
                               "speedup_vs_question": 4.0}}}
    table = render({"verify": result})
    assert "| verify | t=6: verifying pass / step | 1.5 | 120 ms a pass of 6 tokens attended as a " \
           "decode step; plain transformers' pass / its step: 3.2 |" in table
    assert "| verify | t=6: as a question / verifying | 4 | the same passes attended as questions " \
           "(before): 480 ms a pass |" in table
    assert "| verify | t=6: verifying top1 | 0.9 | every draft accepted; as questions 0.94 |" in table
    assert "| verify | step top1 | 0.95 | tierkv, one token a pass: 80 ms a pass (full_memory 100) |" \
        in table
