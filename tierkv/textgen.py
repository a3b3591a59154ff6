"""Seeded, generated long documents with planted facts (for tests, the demo and benchmarks).

Text is made of plain English sentences from small word lists, so a small model reads it as
ordinary prose; facts ("The pass key is 48213.") are planted at chosen depths.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

_SUBJECTS = ["The river", "An old farmer", "The small village", "A quiet teacher", "The market",
             "Every traveller", "The northern road", "A young painter", "The city council",
             "The library", "A tired merchant", "The mountain path", "The harbour", "A local baker"]
_VERBS = ["watched", "followed", "remembered", "described", "crossed", "visited", "painted",
          "measured", "repaired", "ignored", "welcomed", "studied", "collected", "opened"]
_OBJECTS = ["the long bridge", "a field of wheat", "the morning fog", "an empty station",
            "the stone tower", "a wooden boat", "the winter garden", "a narrow street",
            "the evening bells", "a box of letters", "the green hills", "an open window"]
_TAILS = ["before the rain came", "during the spring festival", "without saying a word",
          "as the sun went down", "for many years", "with great care", "early in the day",
          "while the children played", "after the long winter", "near the old mill"]


@dataclass(frozen=True)
class Fact:
    """A fact planted in a document: the sentence, the question that asks it, the answer, the
    words that start the answer (given to the model as the start of its reply), and what kind of
    thing is hidden (named in the instruction: small models retrieve far better when told)."""

    sentence: str
    question: str
    answer: str
    answer_prefix: str
    hint: str


def passkey_fact(rng: random.Random) -> Fact:
    key = str(rng.randint(10000, 99999))
    return Fact(f"The pass key is {key}. Remember it. {key} is the pass key.",
                "What is the pass key?", key, "The pass key is", "a pass key")


def city_fact(rng: random.Random) -> Fact:
    name = rng.choice(["Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo"])
    city = rng.choice(["Lisbon", "Oslo", "Cairo", "Lima", "Vienna", "Dublin", "Seoul", "Quito"])
    return Fact(f"{name} lives in the city of {city}.", f"In which city does {name} live?", city,
                f"{name} lives in the city of", "the city where someone lives")


def filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def make_document(tokenizer, n_tokens: int, seed: int, facts: list[Fact] = (),
                  depths: list[float] | None = None) -> str:
    """A document of ``n_tokens`` tokens as ``tokenizer`` counts them (up to a sentence more),
    with ``facts`` planted at ``depths`` (0..1)."""
    if n_tokens < 16:
        raise ValueError(f"n_tokens={n_tokens}: must be at least 16")
    rng = random.Random(seed)
    depths = list(depths) if depths is not None else [rng.uniform(0.2, 0.8) for _ in facts]
    if len(depths) != len(facts):
        raise ValueError(f"{len(facts)} facts but {len(depths)} depths")
    # This draw once sized the document from one sentence (which left it up to 10 % short); it
    # is still drawn so that each seed's text, which the recorded benchmarks read, stays the same.
    filler_sentence(rng)
    room = n_tokens - sum(_token_count(tokenizer, " " + fact.sentence) for fact in facts)
    sentences = []
    while room > 0 or not sentences:
        sentences.append(filler_sentence(rng))
        room -= _token_count(tokenizer, " " + sentences[-1])  # as it follows another in the text
    for fact, depth in sorted(zip(facts, depths), key=lambda p: -p[1]):
        sentences.insert(int(depth * len(sentences)), fact.sentence)
    return " ".join(sentences)


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_prompt(tokenizer, document: str, question: str, answer_prefix: str = "",
                hint: str = "important information") -> str:
    """The document and a question as one user turn of the model's chat template, with the
    assistant's reply started by ``answer_prefix``; ``hint`` names what is hidden in it."""
    content = (f"There is {hint} hidden in the text below. Find it and remember it."
               f"\n\n{document}\n\n{question}")
    return question_turn(tokenizer, content, answer_prefix)


def passkey_prompt(tokenizer, n_tokens: int, seed: int) -> tuple[str, str]:
    """The seeded pass-key task of the tests and benchmarks: a chat prompt over a document of
    about ``n_tokens`` tokens with a pass key planted at a seeded depth, and its answer."""
    fact = passkey_fact(random.Random(seed))
    document = make_document(tokenizer, n_tokens, seed, [fact])
    return chat_prompt(tokenizer, document, fact.question, fact.answer_prefix, fact.hint), fact.answer


def question_turn(tokenizer, content: str, answer_prefix: str = "") -> str:
    """One user turn and the start of the reply, in the model's chat template."""
    messages = [{"role": "user", "content": content}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt + answer_prefix


_MARK = "\x00"  # stands for the part of the prompt a function leaves out; no document holds it


def document_text(tokenizer, document: str, hint: str = "important information") -> str:
    """The start of ``chat_prompt`` up to the end of the document: what a saved document holds."""
    full = chat_prompt(tokenizer, document, _MARK, hint=hint)
    return full[:full.index("\n\n" + _MARK)]


def question_text(tokenizer, question: str, answer_prefix: str = "") -> str:
    """The rest of ``chat_prompt`` after the document: the question, the end of the user turn
    and the start of the reply."""
    full = chat_prompt(tokenizer, _MARK, question, answer_prefix)
    return full[full.index(_MARK) + len(_MARK):]
