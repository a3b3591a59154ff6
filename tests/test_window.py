"""The recent windows: written in place within a buffer reserved once, cut without aliasing."""
import pytest
import torch

from tierkv.hf.window import RecentWindows
from tierkv.storage.base import TierFullError

HEADS, DIM = 3, 8
TOKEN = 2 * HEADS * DIM * 4  # bytes of one token's keys and values, fp32


class Ledger:
    """A device tier's reservations by tag; refuses above ``budget``."""

    def __init__(self, budget=None):
        self.budget, self.tags, self.calls = budget, {}, 0

    def __call__(self, tag, nbytes):
        self.calls += 1
        if self.budget is not None and sum(self.tags.values()) - self.tags.get(tag, 0) + nbytes > self.budget:
            raise TierFullError(f"{tag} needs {nbytes} B")
        self.tags[tag] = nbytes


def tokens(t, start=0):
    """Keys and values of t tokens whose entries name their token (values negated)."""
    k = torch.arange(start, start + t, dtype=torch.float32).view(1, t, 1).expand(HEADS, t, DIM)
    return k.clone(), -k.clone()


def windows(budget=None, capacity=4):
    """Two layers' windows, each growing to ``capacity`` tokens in decode."""
    ledger = Ledger(budget)
    return RecentWindows([capacity] * 2, HEADS, DIM, torch.float32, torch.device("cpu"),
                         ledger), ledger


def test_decode_appends_write_in_place_within_a_buffer_reserved_once():
    win, ledger = windows(capacity=6)
    for i in range(6):
        win.append(0, *tokens(1, i))
    k, v = win[0]
    assert torch.equal(k, tokens(6)[0]) and torch.equal(v, tokens(6)[1])
    assert ledger.calls == 1 and ledger.tags == {"window:0": 6 * TOKEN}
    assert win.held_bytes(0) == 6 * TOKEN and win.held_bytes(1) == 0
    assert win.growth() == 6 * TOKEN  # layer 1 may still take its whole capacity


def test_a_full_buffer_moves_to_a_larger_one_and_keeps_the_window():
    win, ledger = windows()
    for i in range(5):
        win.append(0, *tokens(1, i))
    assert torch.equal(win[0][0], tokens(5)[0])
    assert ledger.tags["window:0"] == 5 * TOKEN and ledger.calls == 2


def test_a_prompt_takes_exactly_its_tokens():
    win, ledger = windows()
    win.append(1, *tokens(1))
    win.append(1, *tokens(10, 1))
    assert torch.equal(win[1][1], tokens(11)[1])
    assert ledger.tags["window:1"] == 11 * TOKEN


def test_a_cut_hands_out_the_oldest_tokens_and_later_appends_leave_them_alone():
    win, ledger = windows(capacity=6)
    for i in range(6):
        win.append(0, *tokens(1, i))
    taken = win.cut(0, 4)
    for i in range(6, 10):
        win.append(0, *tokens(1, i))
    assert torch.equal(taken.keys, tokens(4)[0]) and torch.equal(taken.values, tokens(4)[1])
    assert torch.equal(win[0][0], tokens(6, 4)[0])
    assert ledger.tags["window:0"] == 6 * TOKEN


def test_a_refused_reservation_leaves_the_window_as_it_was():
    win, ledger = windows(budget=4 * TOKEN)
    for i in range(4):
        win.append(0, *tokens(1, i))
    with pytest.raises(TierFullError, match="window:0"):
        win.append(0, *tokens(1, 4))
    assert torch.equal(win[0][0], tokens(4)[0])
    assert ledger.tags == {"window:0": 4 * TOKEN}


def test_a_window_set_from_outside_is_not_written_over():
    win, _ = windows()
    win.append(0, *tokens(1))
    restored = tokens(2, 7)
    win[0] = restored
    win.append(0, *tokens(1, 9))
    assert torch.equal(restored[0], tokens(2, 7)[0])  # the restored tensors stay as they were
    assert torch.equal(win[0][0], tokens(3, 7)[0])
    assert [k.shape[1] for k, _ in win] == [3, 0] and len(win) == 2


def test_a_buffer_made_under_inference_mode_is_replaced_outside_it():
    """A window grown under ``torch.inference_mode`` (one ``generate``) goes on growing outside
    it (the next, under ``no_grad``): tensors made under it may not be written outside it."""
    win, ledger = windows()
    with torch.inference_mode():
        win.append(0, *tokens(1))
    win.append(0, *tokens(1, 1))
    assert torch.equal(win[0][0], tokens(2)[0]) and not win[0][0].is_inference()
    assert ledger.tags == {"window:0": 4 * TOKEN}
