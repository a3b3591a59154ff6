"""tierkv's thread pools compute on one thread each, and leave new threads torch's count."""
import threading

import torch

from tierkv.workers import restore_threads, worker_pool


def count_in_new_thread() -> int:
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_a_pools_threads_compute_on_one_thread_and_new_threads_get_the_count_back():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert count_in_new_thread() == 2
        with worker_pool(2, "tierkv-test") as pool:
            assert list(pool.map(lambda _: torch.get_num_threads(), range(4))) == [1] * 4
            names = pool.submit(lambda: threading.current_thread().name).result()
        assert names.startswith("tierkv-test")
        assert torch.get_num_threads() == 2  # the calling thread's own count is its own
        assert count_in_new_thread() == 1  # what torch.set_num_threads in a pool's thread left
        restore_threads()
        assert count_in_new_thread() == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
