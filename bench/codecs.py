"""Codec ratios and speeds on real KV, and the native helpers against their fallbacks.

    python -m bench.codecs [--quick]

Prints one table per part and writes ``bench/results/codecs.json``. ``bench/storage.py`` calls
``bench_codecs`` and ``bench_native`` directly.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import zlib

import numpy as np
import torch

from bench.common import real_kv, timed, write_result
from tierkv.config import CodecConfig
from tierkv.storage import native
from tierkv.storage.base import KVBlock
from tierkv.storage.codec import CODECS, decode_block, encode_block, make_codec


def bench_codecs(keys: torch.Tensor, values: torch.Tensor, config: CodecConfig | None = None,
                 repeat: int = 3) -> dict:
    """Each codec on one block (``encode_block`` / ``decode_block``, the disk tier's path).

    Parameters
    ----------
    keys, values : Tensor, shape (layers, kv_heads, tokens, head_dim), fp16/bf16/fp32, CPU.
    config : zstd level and group size (default ``CodecConfig()``).

    Returns
    -------
    {codec: {"ratio": raw bytes / stored bytes, "encode_gbps", "decode_gbps" (raw GB/s),
    "rel_err": mean |x - x_hat| / mean |x| (0 for lossless codecs)}}
    """
    config = config or CodecConfig()
    block = KVBlock(keys.contiguous(), values.contiguous())
    results = {}
    for name in CODECS:
        codec = make_codec(name, config)
        t_enc, payload = timed(encode_block, codec, block, repeat=repeat)
        t_dec, out = timed(decode_block, codec, payload, keys.dtype, keys.shape, repeat=repeat)
        results[name] = {"ratio": block.nbytes / len(payload),
                         "encode_gbps": block.nbytes / t_enc / 1e9,
                         "decode_gbps": block.nbytes / t_dec / 1e9,
                         "rel_err": _relative_error(block, out)}
    return results


def _relative_error(block: KVBlock, out: KVBlock) -> float:
    err = sum((a.double() - b.double()).abs().sum() for a, b in zip(block, out))
    mag = sum(a.double().abs().sum() for a in block)
    return float(err / mag)


def bench_native(nbytes: int = 32 << 20, extent: int = 64 << 10, repeat: int = 5) -> dict:
    """GB/s of each helper, native and fallback, and the speedup (native is None when not built).

    Shuffles run on ``nbytes`` random fp16 bytes; ``pread_extents`` gathers ``extent``-byte
    extents in random order from a ``nbytes`` file in the page cache; ``crc32`` (every record's
    check) is zlib-ng's against the standard library's, on the same bytes.
    """
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    out = np.empty_like(src)
    cases = {
        "shuffle": (native.shuffle_py, native.shuffle, (src, 2, out)),
        "unshuffle": (native.unshuffle_py, native.unshuffle, (src, 2, out)),
    }
    results = {name: _compare(py, c, args, nbytes, repeat) for name, (py, c, args) in cases.items()}
    results["crc32"] = _compare(zlib.crc32, native.crc32, (src,), nbytes, repeat,
                                native.crc32 is not zlib.crc32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "segment")
        src.tofile(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            offsets = [int(o) for o in np.random.default_rng(1).permutation(nbytes // extent) * extent]
            args = (fd, offsets, [extent] * len(offsets), out)
            results["pread_extents"] = _compare(native.pread_extents_py, native.pread_extents,
                                                args, nbytes, repeat)
        finally:
            os.close(fd)
    return results


def _compare(fallback, fn, args, nbytes: int, repeat: int, built: bool = native.HAVE_NATIVE
             ) -> dict:
    py = nbytes / timed(fallback, *args, repeat=repeat)[0] / 1e9
    if not built:
        return {"fallback_gbps": py, "native_gbps": None, "speedup": None}
    c = nbytes / timed(fn, *args, repeat=repeat)[0] / 1e9
    return {"fallback_gbps": py, "native_gbps": c, "speedup": c / py}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 tokens, 32 MiB native buffers")
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.tokens < 16:
        parser.error(f"--tokens {args.tokens}: at least 16 (a generated document's shortest)")
    torch.manual_seed(0)
    tokens = 512 if args.quick else args.tokens
    keys, values = real_kv(tokens)[:2]
    codecs = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        codecs[str(dtype).removeprefix("torch.")] = bench_codecs(keys.to(dtype), values.to(dtype))
    natives = bench_native(nbytes=(32 if args.quick else 128) << 20)
    _print_tables(codecs, natives)
    path = write_result("codecs", {"tokens": tokens, "shape": list(keys.shape),
                                   "codecs": codecs, "native": natives}, args.quick)
    print(f"wrote {path}")


def _print_tables(codecs: dict, natives: dict) -> None:
    print(f"{'dtype':9} {'codec':6} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'rel err':>9}")
    for dtype, rows in codecs.items():
        for name, r in rows.items():
            print(f"{dtype:9} {name:6} {r['ratio']:6.2f} {r['encode_gbps']:9.2f} "
                  f"{r['decode_gbps']:9.2f} {r['rel_err']:9.2e}")
    print(f"\n{'helper':14} {'fallback GB/s':>13} {'native GB/s':>12} {'speedup':>8}")
    for name, r in natives.items():
        c = "-" if r["native_gbps"] is None else f"{r['native_gbps']:.2f}"
        s = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
        print(f"{name:14} {r['fallback_gbps']:13.2f} {c:>12} {s:>8}")


if __name__ == "__main__":
    main()
