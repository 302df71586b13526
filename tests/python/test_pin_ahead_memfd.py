"""sublet.pin_ahead on the memfd backend (no GPU): an owner that knows what it will keep pins
its loans' save area before the first lend; the daemon bounds the pin by the user's regions,
and the loan that follows pins nothing more and keeps every bit. tests/integration/test_pin.c
times it (a first save after a pin ahead waits for no pinning) and checks its refusals."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import sublet
from sublet import _memory

from conftest import PAGE
from pool_helpers import bits, fill_loan, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

PIECE = 256 << 20  # the save area is pinned in pieces of this size (pool.c's SL_HOST_PIECE)


def status() -> dict:
    return _memory.resolve_device("cpu")[1].status()


def settled(seconds: float = 10) -> dict:
    """The status once no pin runs."""
    deadline = time.monotonic() + seconds
    while (st := status()).get("pin") is not None:
        assert time.monotonic() < deadline, f"the pin ahead never ended: {st['pin']}"
        time.sleep(0.02)
    return st


def test_a_pin_ahead_serves_the_first_loans_saves():
    cache = random_bytes(sublet.empty(16 * PAGE, dtype=torch.uint8, device="cpu"), 3)
    before = bits(cache)
    sublet.pin_ahead(1 << 40, device="cpu")  # far more than the region: bounded by it
    pinned = settled()["host_bytes"]
    assert pinned >= PIECE
    with sublet.lend(cache) as loan:
        assert fill_loan(loan, seed=4) > 0
    assert loan.stats.copied_out_bytes > 0  # the borrower reached kept pages
    assert np.array_equal(bits(cache), before)
    assert settled()["host_bytes"] == pinned  # the loan found its save area pinned
    del cache


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1G"])
def test_a_pin_ahead_takes_a_byte_count(bad):
    with pytest.raises(ValueError, match="byte count"):
        sublet.pin_ahead(bad, device="cpu")
