"""Pools end to end on the memfd backend (no GPU): tensors of several tags in one process's
arena (one growable region of a private subletd), lent by tag or as a list of tensors, with a
keep that speaks of any of them; every kept bit and every byte of what is not lent checked
after every loan, the loan filled to its last page first.

CPU allocations are not routed (PyTorch has no allocator hook for them), so tensors come from
Pool.empty(); on a GPU `with sublet.pool(tag)` makes them (test_gpu_pool.py).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sublet

from conftest import PAGE
from pool_helpers import bits, fill_loan, layers, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


def test_one_pool_object_per_tag_and_segments_of_whole_pages():
    kv = sublet.pool("seg-kv", device="cpu")
    assert sublet.pool("seg-kv", device="cpu") is kv and kv.tag == "seg-kv"
    a = kv.empty(3 * PAGE + 1, dtype=torch.uint8)   # four pages
    b = kv.empty(10, dtype=torch.uint8)             # one
    segs = kv.segments()
    assert segs[:, 1].tolist() == [4 * PAGE, PAGE] and kv.nbytes == 5 * PAGE
    assert (segs[:, 0] % PAGE == 0).all()
    assert "seg-kv" in repr(kv)
    del a
    gc.collect()
    c = kv.empty(2 * PAGE, dtype=torch.uint8)       # first fit: into the freed four pages
    assert kv.segments()[0].tolist() == [int(segs[0, 0]), 2 * PAGE]
    del b, c


def test_default_dtype_follows_torch():
    t = sublet.pool("dtype", device="cpu").empty(4)
    assert t.dtype == torch.get_default_dtype()


@pytest.mark.parametrize("round_", range(3))
def test_lend_a_tag_keeps_its_keep_and_every_other_tag_whole(round_):
    """Loans in sequence, the keep changing, the arena growing between them: the other tag's
    bytes and the kept views come back bit for bit, and the loan had every other page."""
    kv, weights = sublet.pool("kv", device="cpu"), sublet.pool("weights", device="cpu")
    caches = layers(kv, 8, (2, 16, 1024), seed=100 * round_)          # 8 x 64 KiB x 2
    w = layers(weights, 3, (48, 1024), seed=100 * round_ + 50)
    extra = layers(kv, 1 + round_, (16, 1024), seed=7)                 # grows the arena
    rng = np.random.default_rng(round_)
    for loan_no in range(3):
        live = sorted(rng.choice(16, size=4 + loan_no, replace=False).tolist())
        keep = [c[:, b] for c in caches for b in live]
        kept_before = [bits(v) for v in keep]
        w_before = [bits(t) for t in w]
        with sublet.lend("kv", keep=keep) as loan:
            filled = fill_loan(loan, seed=loan_no)
        assert filled > 0
        assert all(np.array_equal(bits(v), b) for v, b in zip(keep, kept_before))
        assert all(np.array_equal(bits(t), b) for t, b in zip(w, w_before))
        assert loan.stats.copied_out_bytes == loan.stats.copied_in_bytes
    del caches, w, extra


def test_lend_a_list_of_tensors_keeps_the_others():
    kv = sublet.pool("list", device="cpu")
    a, b, c = layers(kv, 3, (32, 1024), seed=3)
    b_before, c_half = bits(b), bits(c[:8])
    with sublet.lend([a, c], keep=c[:8]) as loan:
        fill_loan(loan, seed=9)
    assert np.array_equal(bits(b), b_before)          # not lent: kept whole
    assert np.array_equal(bits(c[:8]), c_half)        # kept
    assert not np.array_equal(bits(a), bits(b))       # sanity: distinct contents


def test_lend_by_pool_object_and_tag_together():
    p, q = sublet.pool("both-p", device="cpu"), sublet.pool("both-q", device="cpu")
    x, y = layers(p, 1, (16, 1024), 1)[0], layers(q, 1, (16, 1024), 2)[0]
    x_before = bits(x[0])
    with sublet.lend([p, "both-q"], keep=[x[0]]) as loan:
        assert loan.stats.served_unkept_bytes >= 0
        fill_loan(loan, seed=4)
    assert np.array_equal(bits(x[0]), x_before)
    del y


def test_a_pool_tensor_freed_during_the_loan_loses_nothing_else():
    kv = sublet.pool("freed", device="cpu")
    a, b = layers(kv, 2, (16, 1024), seed=11)
    b_before = bits(b)
    with sublet.lend(a, keep=[]) as loan:
        del a
        gc.collect()
        fill_loan(loan, seed=5)
    assert np.array_equal(bits(b), b_before)
    again = kv.empty(16, 1024, dtype=torch.bfloat16)   # the freed pages serve the pool again
    assert again.numel() == 16 * 1024


# --------------------------------------------------------------------------- refusals

def test_a_tag_that_holds_nothing_is_refused():
    sublet.pool("empty-tag", device="cpu")
    with pytest.raises(ValueError, match="holds nothing"):
        sublet.lend("empty-tag")


def test_an_unknown_tag_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"sublet\.pool\('no-such-tag'\)"):
        sublet.lend("no-such-tag")


def test_keep_outside_what_is_lent_is_refused():
    p, q = sublet.pool("out-p", device="cpu"), sublet.pool("out-q", device="cpu")
    x, y = p.empty(PAGE, dtype=torch.uint8), q.empty(PAGE, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not lend"):
        sublet.lend("out-p", keep=[y[:10]])
    del x, y


def test_memory_of_two_regions_is_refused_in_one_loan():
    own = sublet.empty(PAGE, dtype=torch.uint8, device="cpu")
    x = sublet.pool("two-regions", device="cpu").empty(PAGE, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one region"):
        sublet.lend([own, x])


def test_a_tensor_not_from_sublet_is_refused():
    with pytest.raises(ValueError, match="not made by sublet"):
        sublet.lend(torch.empty(10))


def test_allocating_in_a_lent_pool_fails_and_the_loan_goes_on():
    kv = sublet.pool("busy", device="cpu")
    a = random_bytes(kv.empty(PAGE, dtype=torch.uint8), 1)
    before = bits(a)
    with sublet.lend("busy") as loan:
        with pytest.raises(sublet.BusyError, match="lent"):
            kv.empty(PAGE, dtype=torch.uint8)
        fill_loan(loan, seed=2)
    assert np.array_equal(bits(a), before)
    kv.empty(PAGE, dtype=torch.uint8)                  # and after the loan, it serves again


def test_routing_a_cpu_pool_is_refused_naming_pool_empty():
    with pytest.raises(RuntimeError, match=r"pool\.empty"):
        with sublet.pool("cpu-routing", device="cpu"):
            pass


def test_the_last_free_gives_the_arena_back():
    """With no tensor of any tag alive, the arena's region goes back to the daemon."""
    gc.collect()
    client = sublet.pool("last", device="cpu").arena.client
    t = sublet.pool("last", device="cpu").empty(3 * PAGE, dtype=torch.uint8)
    arena = client.pool_region()
    assert arena is not None
    del t
    gc.collect()
    assert client.pool_segments(0).size == 0, "a tensor of an earlier test is still alive"
    assert client.pool_region() is None
    assert arena.id not in {r["region"] for r in client.status()["regions"]}


@pytest.mark.parametrize("keep", ["nothing", "all", "head"])
def test_a_loan_of_the_arena_hands_out_none_of_its_addresses(keep):
    """PyTorch's blocks live at the arena's addresses (its tensors stay alive while lent): a
    borrower's block at one of them would be a second live block at one address, which
    PyTorch's allocator does not survive (an abort, seen on the H200). So a loan of the arena
    is never served in place, whatever its layout (keeping nothing, all, or the head would
    each be served over the region's own mapping otherwise)."""
    kv = sublet.pool("no-alias", device="cpu")
    a, b = layers(kv, 2, (32, 1024), seed=21)
    arena = kv.arena.client.pool_region()
    lo, hi = arena.addr, arena.addr + arena.size
    chosen = {"nothing": [], "all": None, "head": [a]}[keep]
    with sublet.lend("no-alias", keep=chosen) as loan:
        held = []
        while True:
            try:
                held.append(loan.empty(PAGE, dtype=torch.uint8))
            except sublet.SubletOutOfMemoryError:
                break
        inside = [t.data_ptr() for t in held if lo <= t.data_ptr() < hi]
        del held
    assert not inside, f"{len(inside)} loan allocations at the arena's own addresses"
    del a, b


def test_sublet_empty_follows_the_default_dtype_and_loans_read_well():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        t = sublet.empty(8, device="cpu")
    finally:
        torch.set_default_dtype(previous)
    assert t.dtype == torch.float64
    loan = sublet.lend(t)
    assert "not started" in repr(loan)
    with loan:
        assert "active" in repr(loan)
    assert "returned" in repr(loan) and "B to the host" in repr(loan)
    with sublet.offer(t, name="repr") as offer:
        assert "lent" in repr(offer) and "repr" in repr(offer)
        offer.withdraw()
    assert "withdrawn" in repr(offer)
