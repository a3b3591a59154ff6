"""``tierkv generate``: answer a question about a long document, or about a saved one.

The document is prefilled on its own (layer by layer, with a progress bar), optionally saved,
and the question follows as new tokens; so a fresh run and a ``--load`` run feed the model the
same token ids and give the same answer.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from .cli_args import check_new_dir, check_store_dir, read_document, saved_doc
from .cli_report import TimedStreamer, kv_rows, print_table, run_rows
from .config import FETCH_UNITS, SelectConfig
from .hf.model import cache_kwargs
from .shapes import text_config
from .textgen import document_text, question_text

DEFAULT_POLICY = "tierkv"


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    from .cli import budget_arg, positive_int, question_tokens_arg, size_arg
    from .policies import REGISTRY

    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a local model "
                        "directory (default: %(default)s)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--file", type=Path, help="the document, a UTF-8 text file")
    source.add_argument("--load", type=Path, metavar="DIR", help="a document saved by --save "
                        "(no prefill)")
    parser.add_argument("--doc", metavar="NAME", help="with --load: the saved document of DIR to "
                        "ask about, when DIR holds several")
    parser.add_argument("--question", required=True, help="what to ask about the document")
    parser.add_argument("--answer-prefix", default="", metavar="TEXT",
                        help="the first words of the answer, given to the model")
    parser.add_argument("--policy", choices=sorted(REGISTRY), help="KV policy (default: "
                        f"{DEFAULT_POLICY}; with --load, the saved document's)")
    parser.add_argument("--budget", type=budget_arg, metavar="B", help="tokens a sparse layer "
                        "attends to: a fraction of the context in (0, 1] (1.0: all of it), or a "
                        f"token count (default: {SelectConfig().budget}; with --load, the saved document's)")
    parser.add_argument("--fetch-unit", choices=FETCH_UNITS, help="what omnikv/tierkv fill "
                        "the budget with: whole records, or single leaves (finer, reads more; "
                        "default: record; with --load, the saved document's)")
    parser.add_argument("--question-tokens", type=question_tokens_arg, metavar="N",
                        help="a question of at most N tokens attends through omnikv/tierkv's "
                        "selection, not the whole KV; 0: the whole KV (default: "
                        f"{SelectConfig().question_tokens}; with --load, the saved document's)")
    parser.add_argument("--device-budget", type=size_arg, default="64MB", metavar="SIZE",
                        help="KV bytes on the device (default: %(default)s)")
    parser.add_argument("--host-budget", type=size_arg, default="256MB", metavar="SIZE",
                        help="KV bytes in host memory (default: %(default)s)")
    parser.add_argument("--disk-dir", type=Path, metavar="DIR", help="disk tier directory, new "
                        "or empty (default: a temporary one; with --load, the saved directory)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                        help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--save", type=Path, metavar="DIR", help="save the prefilled document "
                        "to DIR, to ask more questions later with --load DIR")
    parser.set_defaults(run=run_generate)


def run_generate(args) -> int:
    """Check the inputs, load the model, prefill or reopen the document, stream the answer."""
    document = read_document(args.file) if args.file is not None else None
    if args.load is not None:
        check_store_dir(args.load, "--load")
        if args.save is not None:
            raise ValueError("--save with --load: the document is saved already")
        if args.disk_dir is not None:
            raise ValueError("--disk-dir with --load: the saved directory is the disk tier")
    elif args.doc is not None:
        raise ValueError("--doc without --load: it names a saved document of --load DIR")
    if args.save is not None:
        check_new_dir(args.save, "--save")
    if args.disk_dir is not None and args.disk_dir != args.save:
        check_new_dir(args.disk_dir, "--disk-dir")  # a used one would mix in another run's records
    if not args.question.strip():
        raise ValueError("--question is empty")
    doc = saved_doc(args.load, args.doc) if args.load is not None else None
    with ExitStack() as stack:
        model, tok = _load(args.model)
        turn = tok(question_text(tok, args.question, args.answer_prefix), return_tensors="pt",
                   add_special_tokens=False)["input_ids"]
        if args.load is not None:
            cache, figures = _reopen(args, model, doc, turn, stack)
        else:
            cache, figures = _prefilled(args, model, tok, document, turn, stack)
        room = answer_room(model, cache.token_ids.shape[1], turn.shape[1], args.max_new_tokens)
        figures.update(_answer(args, model, tok, cache, turn, room))
        print_table(run_rows(figures) + kv_rows(cache))
    return 0


def _load(name: str):
    """The model and tokenizer, with a progress bar (transformers' own bars are turned off)."""
    from transformers.utils import logging as hf_logging

    from .hf.model import load_model

    hf_logging.disable_progress_bar()
    with tqdm(total=1, desc="loading model", unit="model", file=sys.stderr, leave=False) as bar:
        bar.set_postfix_str(name)
        model, tok = load_model(name)
        bar.update()
    # What importing torch and transformers and loading the model left tracked lives as long as
    # this process: frozen, the first full collection after loading (~0.18 s on the 2-core CPU,
    # ~370K objects) skips it instead of landing in the reopen or the first token.
    gc.freeze()
    return model, tok


def _reopen(args, model, doc: str, turn: torch.Tensor, stack: ExitStack):
    """The saved document ``doc`` of --load, reopened as a TieredCache (closed with ``stack``)."""
    from .config import TierConfig
    from .hf.cache import TieredCache
    from .hf.persist import saved_select

    t0 = time.perf_counter()
    config = TierConfig(args.device_budget, args.host_budget, disk_dir=args.load)
    select = _select(args, lambda: saved_select(args.load, doc))
    cache = TieredCache.open(model, args.load, config, args.policy, doc=doc, select=select)
    stack.callback(cache.close)
    check_context(model, cache.token_ids.shape[1], turn.shape[1], f"--load {args.load}")
    return cache, {"reopen_s": time.perf_counter() - t0, "document_tokens": cache.token_ids.shape[1]}


def _prefilled(args, model, tok, document: str, turn: torch.Tensor, stack: ExitStack):
    """A TieredCache holding the document of --file, prefilled now (and saved with --save);
    closed with ``stack``."""
    from .config import TierConfig
    from .hf.cache import TieredCache

    ids = tok(document_text(tok, document), return_tensors="pt")["input_ids"]
    check_context(model, ids.shape[1], turn.shape[1], f"--file {args.file}")
    disk_dir = args.disk_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="tierkv-"))
    config = TierConfig(args.device_budget, args.host_budget, disk_dir=disk_dir)
    cache = TieredCache(model, config, args.policy or DEFAULT_POLICY,
                        select=_select(args, SelectConfig) or SelectConfig())
    stack.callback(cache.close)
    seconds = prefill(model, cache, ids)
    if args.save is not None:
        if args.save.resolve() != Path(disk_dir).resolve():  # written to since it was checked?
            check_new_dir(args.save, "--save")
        cache.save(args.save)
        print(f"saved {ids.shape[1]} document tokens to {args.save}", file=sys.stderr)
    return cache, {"prefill_s": seconds, "document_tokens": ids.shape[1]}


def model_context(model) -> int | None:
    """The model's context in tokens (``max_position_embeddings``), None when it names none."""
    return getattr(text_config(model.config), "max_position_embeddings", None)


def check_context(model, document: int, question: int, source: str) -> None:
    """Refuse a document and question that leave no room for an answer in the model's context,
    before the model runs."""
    context = model_context(model)
    if context is None or document + question < context:
        return
    total = (f"the document is {document} tokens and the question {question}, "
             f"{document + question} in all")
    if document + question > context:
        raise ValueError(f"{source}: {total}: more than the model's context of {context} tokens")
    raise ValueError(f"{source}: {total}: the whole of the model's context of {context} tokens, "
                     "with no room left for an answer")


def answer_room(model, document: int, question: int, wanted: int) -> int:
    """``wanted`` new tokens, or fewer when the document and question leave less room in the
    model's context (said on stderr): past it, positions are ones the model never saw."""
    context = model_context(model)
    if context is None or document + question + wanted <= context:
        return wanted
    room = context - document - question
    print(f"the answer is capped at {room} tokens (--max-new-tokens {wanted}): the document and "
          f"question take {document + question} of the model's {context}-token context",
          file=sys.stderr)
    return room


def _select(args, base) -> SelectConfig | None:
    """``base()`` with the --budget, --fetch-unit and --question-tokens given; None when none
    is."""
    given = {k: v for k, v in (("budget", args.budget), ("fetch_unit", args.fetch_unit),
                               ("question_tokens", args.question_tokens)) if v is not None}
    return dataclasses.replace(base(), **given) if given else None


def _answer(args, model, tok, cache, turn: torch.Tensor, new_tokens: int) -> dict:
    """Stream the answer to ``turn`` (the question's ids), at most ``new_tokens`` tokens, to
    stdout; its timings and disk reads."""
    ids = torch.cat([cache.token_ids, turn], dim=1)
    streamer = TimedStreamer(tok, cache)
    sys.stdout.write(args.answer_prefix)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                           max_new_tokens=new_tokens, do_sample=False, streamer=streamer)
    except BaseException:
        sys.stdout.write("\n")  # an error mid-answer goes on a line of its own
        sys.stdout.flush()
        raise
    return {"question_tokens": turn.shape[1], **streamer.figures(t0)}


def prefill(model, cache, ids: torch.Tensor) -> float:
    """Prefill ``ids`` (1, n) into ``cache`` with a per-layer progress bar; the seconds taken."""
    t0 = time.perf_counter()
    with layer_progress(model, f"prefill {ids.shape[1]} tokens"), torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


@contextmanager
def layer_progress(model, desc: str):
    """A tqdm bar that advances as each decoder layer starts (forward pre-hooks, removed on exit)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: expected model.model.layers (a decoder)")
    bar = tqdm(total=len(layers), desc=desc, unit="layer", file=sys.stderr, leave=False)

    def started(module, args) -> None:  # a pre-hook's return value would replace the input
        bar.update()

    handles = [layer.register_forward_pre_hook(started) for layer in layers]
    try:
        yield bar
    finally:
        for handle in handles:
            handle.remove()
        bar.close()

