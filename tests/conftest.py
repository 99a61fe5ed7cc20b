"""Test-wide settings.

One torch thread: the tiny models gain nothing from two, and on a 2-core machine shared
with other jobs two OpenMP threads stall each other (steps measured 10-100x slower).
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
