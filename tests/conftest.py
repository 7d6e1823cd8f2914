"""Shared test hygiene: a test module that calls zeroedu.initialize() in the pytest process itself makes that
process a world of one (torch.distributed's default group); the next module (test_launch checks that a launch
leaves the caller's process untouched) must not inherit it."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def no_process_group_left_behind():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
