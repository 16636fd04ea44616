"""One torch intra-op thread for tests of tiny models: a second thread only adds synchronisation, and on
a busy (shared) machine the oversubscription makes these tests many times slower and less steady."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield
