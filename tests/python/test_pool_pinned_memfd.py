"""Pinned pages end to end on the memfd backend (no GPU): lending tag "kv" of the arena pins
the pages of the other tags, so the owner reads and writes them during the loan (the trainer
uses its weights while it lends its KV cache) and its writes are what they hold after it,
however full the borrower made the loan. Pinned pages never appear in the loan.

Tensors come from Pool.empty() (CPU allocations are not routed); pool allocations are whole
pages, so every page of the other tags is pinned here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sublet

from conftest import PAGE
from pool_helpers import bits, fill_loan, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


def pool_bytes(pool: sublet.Pool) -> int:
    return int(pool.segments()[:, 1].sum())


@pytest.mark.parametrize("keep_rows", [False, True])
def test_the_owners_writes_to_another_tag_during_a_full_loan_survive(keep_rows):
    """Weights written before the borrower fills the loan are intact in it; written again
    while it is full, they hold those writes after the loan (no restore over them)."""
    kv, weights = sublet.pool("pin-kv", device="cpu"), sublet.pool("pin-w", device="cpu")
    caches = [random_bytes(kv.empty(4, 16, 1024, dtype=torch.bfloat16), i) for i in range(6)]
    w = [random_bytes(weights.empty(40, 1024, dtype=torch.bfloat16), 50 + i) for i in range(3)]
    more = random_bytes(kv.empty(16, 1024, dtype=torch.bfloat16), 9)  # kv after w: w in the middle
    keep = [c[1] for c in caches] if keep_rows else None
    kept_before = [bits(v) for v in keep] if keep else [bits(c) for c in caches + [more]]
    with sublet.lend("pin-kv", keep=keep) as loan:
        for i, t in enumerate(w):
            random_bytes(t, 500 + i)
        during = [bits(t) for t in w]
        assert fill_loan(loan, seed=1) > 0
        assert all(np.array_equal(bits(t), b) for t, b in zip(w, during)), \
            "the borrower's pages overlap the owner's pinned weights"
        for i, t in enumerate(w):
            random_bytes(t, 900 + i)
        after = [bits(t) for t in w]
    assert all(np.array_equal(bits(t), b) for t, b in zip(w, after)), \
        "the loan's end wrote over the owner's writes to pinned pages"
    now = [bits(v) for v in keep] if keep else [bits(c) for c in caches + [more]]
    assert all(np.array_equal(a, b) for a, b in zip(now, kept_before))
    assert loan.stats.copied_out_bytes == loan.stats.copied_in_bytes
    del caches, w, more


def test_pinned_pages_never_appear_in_the_loan():
    """The loan's status counts the other tag's pages as pinned, and what the borrower was
    served of the region (unkept and kept pages) leaves them out."""
    kv, weights = sublet.pool("pin2-kv", device="cpu"), sublet.pool("pin2-w", device="cpu")
    w = [random_bytes(weights.empty(3 * PAGE, dtype=torch.uint8), 70 + i) for i in range(2)]
    caches = [random_bytes(kv.empty(2 * PAGE, dtype=torch.uint8), i) for i in range(4)]
    arena = kv.arena
    region, pinned = arena.size, pool_bytes(weights)
    before = [bits(t) for t in w]
    with sublet.lend("pin2-kv", keep=[caches[0][:PAGE]]) as loan:
        status = arena.client.status()["loan"]
        assert status["pinned_pages"] * PAGE == pinned
        assert (status["unkept_pages"] + status["kept_pages"]) * PAGE == region - pinned
        fill_loan(loan, seed=2)
    stats = loan.stats
    assert stats.served_unkept_bytes + stats.served_kept_bytes + pinned <= region
    assert stats.served_unkept_bytes + stats.served_kept_bytes == region - pinned
    assert all(np.array_equal(bits(t), b) for t, b in zip(w, before))
    del w, caches


def test_lending_every_tag_pins_nothing():
    """A loan of the whole arena (every tag) has no page to pin: the pinned list is empty."""
    from sublet import _lent

    only = sublet.pool("pin3", device="cpu")
    t = random_bytes(only.empty(2 * PAGE, dtype=torch.uint8), 3)
    lent = _lent.resolve("pin3")
    others = [s for s in lent.region.segments() if int(s[0]) not in
              {int(x) for x in only.segments()[:, 0]}]
    if not others:  # no tensor of an earlier test alive: nothing else in the arena
        assert lent.pinned is not None and len(lent.pinned) == 0
    before = bits(t)
    with sublet.lend("pin3", keep=t) as loan:
        fill_loan(loan, seed=3)
    assert np.array_equal(bits(t), before)
    del t


def test_pinned_ranges_of_part_pages_are_refused_naming_the_fix():
    kv = sublet.pool("pin4", device="cpu")
    t = kv.empty(2 * PAGE, dtype=torch.uint8)
    arena = kv.arena
    with pytest.raises(sublet.SubletError, match="whole pages"):
        arena.client.lend_local(arena.handle, None, 0,
                                np.array([[PAGE // 2, PAGE]], np.uint64))
    del t
