"""tierkv's thread pools: their torch operations run on the calling thread only.

torch (OpenMP builds) gives every thread that runs a large enough operation a team of worker
threads of its own. Once a cache's threads (a tree fold on the helper thread, a fetch's copies)
had made theirs, libgomp managed more threads than the machine has cores and from then on every
parallel region of the decoding thread's matrix products put its workers to sleep and woke them
(libgomp spins only briefly when oversubscribed): on the 2-core CPU (``bench.decode``'s 8K
``tierkv`` case, 2026-11-28), the step's linear layers took 48.2 ms a step against 23.5 for
``full_memory``'s, and a step 88.8 ms; with the helper thread's operations on one thread,
29.9 and 63.2. The cache's threads run small operations, or copies bound by memory, so one
thread each loses nothing.

``torch.set_num_threads`` in a pool's thread also sets the count that threads yet to run their
first torch operation start with; ``restore_threads``, called from a thread whose own count is
the process's (the decoding thread, after each forward pass), puts that back.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def worker_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor of ``threads`` threads named ``name_N`` whose torch operations run
    on one thread each."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_one_thread)


def _one_thread() -> None:
    torch.set_num_threads(1)


def restore_threads() -> None:
    """Make the calling thread's torch thread count the one new threads start with again."""
    torch.set_num_threads(torch.get_num_threads())
