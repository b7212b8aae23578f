"""A fixture for test modules that train small recurrent or transformer models on the CPU."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small ops on a CPU shared with other processes run many times slower with two OpenMP threads
    than with one (threads spin-wait on each other); these tests time nothing, so take the fast path."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
