"""Small shared fixtures of the storage tests: keys, blocks whose content derives from the key."""
from __future__ import annotations

import zlib

import pytest
import torch

from tierkv.storage.base import KVBlock, RecordKey


def block_for(key: RecordKey, layers: int = 2, kv_heads: int = 2, head_dim: int = 8,
              dtype: torch.dtype = torch.float32) -> KVBlock:
    """A block whose values are a pure function of ``key`` (so any reader can verify it)."""
    seed = zlib.crc32(f"{key.doc}/{key.group}/{key.start}/{key.end}".encode())
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, kv_heads, key.tokens, head_dim)
    return KVBlock(torch.randn(shape, generator=gen).to(dtype),
                   torch.randn(shape, generator=gen).to(dtype))


def same(a: KVBlock, b: KVBlock) -> bool:
    """Bit-exact equality of two blocks (dtype, shape and bytes)."""
    return all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
               for x, y in zip(a, b))


@pytest.fixture
def make_block():
    return block_for


@pytest.fixture
def blocks_equal():
    return same
