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


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo process group for the test (FSDP2 and torchtitan's EP checks)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
