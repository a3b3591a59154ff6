"""``tierkv generate``'s context checks: a document and question that leave no room for an answer
are refused before the model runs; an answer that would run past the context is capped."""
from types import SimpleNamespace

import pytest

from tierkv.cli_generate import answer_room, check_context

MODEL = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100))


@pytest.mark.parametrize("document, question, message", [
    (95, 10, r"--file d: the document is 95 tokens and the question 10, 105 in all: more than "
             r"the model's context of 100 tokens$"),
    (90, 10, r"--file d: the document is 90 tokens and the question 10, 100 in all: the whole "
             r"of the model's context of 100 tokens, with no room left for an answer$"),
])
def test_no_room_for_an_answer_is_refused(document, question, message):
    with pytest.raises(ValueError, match=message):
        check_context(MODEL, document, question, "--file d")


def test_room_for_one_token_passes():
    check_context(MODEL, 89, 10, "--file d")
    check_context(SimpleNamespace(config=SimpleNamespace()), 10**6, 10, "--file d")  # no limit known


def test_an_answer_past_the_context_is_capped_and_said(capsys):
    assert answer_room(MODEL, 80, 10, 6) == 6
    assert capsys.readouterr().err == ""
    assert answer_room(MODEL, 80, 10, 64) == 10
    assert capsys.readouterr().err == ("the answer is capped at 10 tokens (--max-new-tokens 64): "
                                       "the document and question take 90 of the model's "
                                       "100-token context\n")
    assert answer_room(SimpleNamespace(config=SimpleNamespace()), 10**6, 10, 64) == 64


def test_output_dirs_that_cannot_be_made_refused_before_the_model_loads(tmp_path):
    """``--save``/``--disk-dir``/``--out`` under a file: refused by the path checks, which run
    before a model is loaded, not by the save after a prefill."""
    from tierkv.cli_args import check_creatable, check_new_dir

    (tmp_path / "doc.txt").write_text("text")
    for path in (tmp_path / "doc.txt" / "sub", tmp_path / "doc.txt" / "a" / "b"):
        with pytest.raises(ValueError, match=rf"--save {path}: cannot be created, "
                                             rf"{tmp_path / 'doc.txt'} is not a directory"):
            check_new_dir(path, "--save")
    check_new_dir(tmp_path / "new" / "deeper", "--save")  # absent, under a writable directory
    check_creatable(tmp_path, "--out")
    assert not (tmp_path / "new").exists()  # checked, not made
    with pytest.raises(ValueError, match=rf"--out {tmp_path / 'doc.txt'}: cannot be created, it "
                                         "exists and is not a directory"):
        check_creatable(tmp_path / "doc.txt", "--out")

