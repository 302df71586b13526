"""Loans of a tag while tensors of other tags are being made (issue 41 item 1), on the memfd
backend (no GPU): a tensor of another tag is never lent, whenever it was made.

- One made after sublet.lend() returned and before its `with` is the owner's and pinned: the
  loan decides which pages it lends and pins at the `with`, once libsublet refuses pool
  allocations (it holds the arena), not when the Loan object is made.
- One asked for while a loan is being made or runs is refused at once (BusyError), through
  Pool.empty() and through the allocator hooks PyTorch calls inside `with sublet.pool(tag)`
  alike: its page could be a free one the loan lends.
- Engine threads make, fill and drop tensors of another tag all along while the main thread
  runs 120 loans and 120 offers, each keeping other rows, to borrowers that write over all
  they get; every tensor of the other tag is compared as bits after every loan and when its
  engine drops it, and the kept rows after every loan.

CPU allocations are not routed, so the threads allocate with Pool.empty() and through the
hooks themselves (sublet_torch_alloc, on a device index no machine has). Nothing here waits on
the clock: the main thread waits for the engines' progress, never for time, and asserts
nothing about how long anything took. test_gpu_pool_race.py runs the same with PyTorch on a
GPU.
"""

from __future__ import annotations

import gc
import subprocess
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet
from sublet import _wait

from conftest import PAGE
from pool_helpers import (Engine, Engines, Losses, all_equal, bits,  # noqa: F401 (fixture)
                          borrower as borrower_on, fill_until_full, finished, just_before,
                          layers, little_free_memory, made_or_refused, random_bytes, routed,
                          rows_of, some_rows)

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

SLOT = 63   # the torch hooks' device index for these tests: no machine has a 64th GPU
LOANS = 120
CHUNKS = [16 << 20, 4 << 20, 1 << 20, 256 << 10, PAGE]  # a borrower's allocations, largest first


def kv_caches(tag: str, seed: int) -> tuple[sublet.Pool, list[torch.Tensor]]:
    """A KV cache of 8 one-page layers of `tag`, with two freed pages between two of them: the
    next page of another tag lands in that gap (first fit), a free page a loan lends."""
    kv = sublet.pool(tag, device="cpu")
    caches = layers(kv, 4, (2, 16, 1024), seed)
    gap = kv.empty(2 * PAGE, dtype=torch.uint8)
    caches += layers(kv, 4, (2, 16, 1024), seed + 4)
    del gap
    return kv, caches


def live_rows(rng: np.random.Generator) -> torch.Tensor:
    """Rows (dim 1 of a cache layer) kept by one loan: a new set each time."""
    return torch.from_numpy(some_rows(rng, 16, 12))


NOISE = torch.randint(0, 256, (CHUNKS[0] + 4096,), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(41))


def overwrite_loan(loan: sublet.Loan, seed: int) -> int:
    """The borrower: Loan.empty() until the loan is full (the largest chunks that still fit,
    down to a page), every byte written with noise (other noise for each seed); returns the
    bytes. Nothing it made survives it."""
    noise = NOISE[seed * 17 % 4096:]
    held = fill_until_full(lambda size: loan.empty(size, dtype=torch.uint8), CHUNKS,
                           sublet.SubletOutOfMemoryError, lambda t: t.copy_(noise[:t.numel()]))
    n = sum(t.numel() for t in held)
    del held
    return n


# --------------------------------------------------------------------------- one thread

@pytest.mark.parametrize("where", ["gap", "tail"])
def test_a_tensor_of_another_tag_made_before_the_with_is_never_lent(where):
    """sublet.lend() returns the Loan; a tensor of another tag made then, before the `with`,
    is the owner's like any other: the borrower, filling the loan to its last page, leaves
    its bytes alone. Whether it lands in a page a freed tensor left or grows the arena."""
    gc.collect()  # the arena holds this test's tensors alone: where they land is known
    kv, caches = kv_caches(f"one-kv-{where}", seed=10)
    w = sublet.pool(f"one-w-{where}", device="cpu")
    if where == "tail":
        filler = w.empty(2 * PAGE, dtype=torch.uint8)   # the gap taken: the next page grows it
    keep = sublet.blocks(caches, torch.tensor([1, 5]), dim=1)
    kept_before = [bits(c[:, [1, 5]]) for c in caches]
    loan = sublet.lend(f"one-kv-{where}", keep=keep)
    size_then = kv.arena.size
    late = random_bytes(w.empty(2 * PAGE, dtype=torch.uint8), seed=11)
    grew = late.data_ptr() - kv.arena.addr >= size_then
    assert grew == (where == "tail")
    before = bits(late)
    with loan:
        assert overwrite_loan(loan, seed=12) > 0
        with pytest.raises(sublet.BusyError, match="is lent"):
            w.empty(PAGE, dtype=torch.uint8)              # during the loan: refused
    assert np.array_equal(bits(late), before), "the borrower wrote over a tensor of another tag"
    assert all(np.array_equal(bits(c[:, [1, 5]]), b) for c, b in zip(caches, kept_before))
    again = w.empty(PAGE, dtype=torch.uint8)              # after it: served again
    del caches, late, loan, again
    if where == "tail":
        del filler


BORROW_ONCE = textwrap.dedent("""
    import sys, torch, sublet
    with sublet.borrow(name=sys.argv[1], device="cpu", timeout=60) as loan:
        held = []
        for size in (16 << 20, 4 << 20, 1 << 20, 256 << 10, 64 << 10):
            while True:
                try:
                    held.append(loan.empty(size, dtype=torch.uint8).fill_(0xAB))
                except sublet.SubletOutOfMemoryError:
                    break
        del held
""")


def borrower(script: str, *args: str) -> subprocess.Popen:
    """A borrower process on the module's memfd daemon."""
    from sublet import _client
    return borrower_on(script, *args, socket=_client.client_for("memfd", 0).path)


@pytest.mark.parametrize("how", ["lend", "offer"])
def test_another_tags_allocation_while_the_loan_is_being_made_is_refused(how, monkeypatch):
    """An engine thread's allocation that comes as the Lend goes out (here: made by the
    lending thread itself at that moment, so that it comes there every time) is refused, as
    during the loan, rather than placed in a page the loan lends; the tensors made before
    come back whole, after a borrower that took everything."""
    kv, caches = kv_caches(f"made-kv-{how}", seed=20)
    w = sublet.pool(f"made-w-{how}", device="cpu")
    early = random_bytes(w.empty(PAGE, dtype=torch.uint8), seed=21)
    early_before = bits(early)
    outcome: dict[str, object] = {}

    def another_tag() -> dict:
        late = random_bytes(w.empty(PAGE, dtype=torch.uint8), seed=22)
        return {"late": late, "late_bits": bits(late)}

    just_before(monkeypatch, _wait, {"lend": "lend_local", "offer": "lend"}[how],
                lambda: made_or_refused(outcome, another_tag))
    if how == "lend":
        with sublet.lend(f"made-kv-{how}", keep=[]) as loan:
            overwrite_loan(loan, seed=23)
    else:
        with sublet.offer(f"made-kv-{how}", keep=[], name="made-offer") as offer:
            child = borrower(BORROW_ONCE, "made-offer")
            offer.wait(timeout=60)
        assert child.wait(timeout=60) == 0, child.stderr.read()
    if "late" in outcome:
        assert np.array_equal(bits(outcome["late"]), outcome["late_bits"]), \
            "a tensor made while the loan was being made was lent: the borrower wrote over it"
    assert "being lent" in str(outcome.get("refused")), outcome
    assert np.array_equal(bits(early), early_before)
    del caches, early, outcome


def test_a_lend_of_the_arena_without_the_hold_is_refused_by_libsublet():
    """libsublet itself refuses a Lend of the pools' region whose plan was not made under
    sublet_pool_hold(): a C caller cannot lend another tag's new page by forgetting it."""
    kv, caches = kv_caches("nohold-kv", seed=50)
    client, handle = kv.arena.client, kv.arena.handle
    try:
        loan_id = client.lend_local(handle, None)
    except sublet.SubletError as error:
        assert "sublet_pool_hold" in str(error)
    else:  # the loan is given back, so that the module's other tests find the pools free
        client.return_loan(force=True)
        client.reclaim(loan_id, -1)
        pytest.fail("libsublet lent the pools' arena without the hold")
    layout = client.pool_hold()
    with pytest.raises(sublet.BusyError, match="held for a loan already"):
        client.pool_hold()
    client.pool_unhold()
    assert client.pool_layout() == layout          # nothing was allocated meanwhile
    kv.empty(PAGE, dtype=torch.uint8)
    assert client.pool_layout() != layout          # a page taken moves the layout
    del caches


# --------------------------------------------------------------------------- threads

ENGINE_NOISE = torch.randint(0, 256, (4 * PAGE + 4096,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(43))


class Writer(Engine):
    """An engine thread: makes tensors of another tag (`make`: bytes -> tensor), writes bytes
    of their own into each and keeps it, dropping the oldest (their pages free for the next
    ones, which first fit puts in the gaps a loan lends), until stopped. Every tensor's bits
    are compared when it is dropped too. A refusal (BusyError: a loan is being made or runs)
    is counted and tried again, as an engine waits for memory."""

    def __init__(self, name: str, make: Callable[[int], torch.Tensor], seed: int):
        super().__init__(name, np.random.default_rng(seed))
        self.make = make

    def holds(self, t: torch.Tensor, start: int) -> bool:
        """Does the tensor hold the bytes written into it (uint8: bits, not values)?"""
        return torch.equal(t, ENGINE_NOISE[start:start + t.numel()])

    def step(self) -> None:
        t = self.attempt(self.make, int(self.rng.integers(1, 4)) * PAGE)
        if t is None:
            return
        # Its own bytes (a slice of the noise, at an offset of its own), compared as bytes.
        start = int(self.rng.integers(0, 4096))
        t.copy_(ENGINE_NOISE[start:start + t.numel()])
        self.keep(t, start)


def engines(tag: str) -> Engines:
    """Two engine threads making tensors of tag: by Pool.empty() and through the hooks."""
    w = sublet.pool(tag, device="cpu")
    return Engines([Writer("pool-empty", lambda n: w.empty(n, dtype=torch.uint8), seed=1000),
                    Writer("pool-routed", routed(w, SLOT, busy="is lent"), seed=2000)],
                   unbind=lambda: w.arena.client.torch_bind_pool(SLOT, 0))


def test_threads_making_another_tag_while_the_main_thread_lends_lose_nothing(little_free_memory):
    """120 loans of "thr-kv", each keeping other rows, each filled to its last page by the
    borrower, while two threads make, fill and drop tensors of "thr-w": each Loan is made, the
    engines make more, then its `with` is entered while they go on. After each loan every
    kept row and every "thr-w" tensor holds its bits."""
    kv, caches = kv_caches("thr-kv", seed=30)
    rng = np.random.default_rng(31)
    running = engines("thr-w")
    lost = Losses(running)
    try:
        for i in range(LOANS):
            rows = live_rows(rng)
            kept_before = rows_of(caches, rows)
            loan = sublet.lend("thr-kv", keep=sublet.blocks(caches, rows, dim=1))
            running.moved_on()      # tensors of "thr-w" made after the Loan, before its `with`
            with loan:
                overwrite_loan(loan, seed=i)
            assert all_equal(rows_of(caches, rows), kept_before), f"loan {i}: kept rows lost"
            lost.check(i)
    finally:
        made = running.stop()
    print(f"\n{LOANS} loans: {made}")
    assert not lost.seen, lost.report(LOANS, "loan")
    del caches


BORROW_MANY = textwrap.dedent("""
    import sys, torch, sublet
    for i in range(int(sys.argv[2])):
        with sublet.borrow(name=sys.argv[1], device="cpu", timeout=60) as loan:
            held = []
            for size in (16 << 20, 4 << 20, 1 << 20, 256 << 10, 64 << 10):
                while True:
                    try:
                        held.append(loan.empty(size, dtype=torch.uint8).fill_(i % 251))
                    except sublet.SubletOutOfMemoryError:
                        break
            del held
    print("borrowed", i + 1, flush=True)
""")


def test_threads_making_another_tag_while_the_main_thread_offers_lose_nothing(little_free_memory):
    """The same with 120 offers of "off-kv", each taken by a borrower process that writes over
    everything it gets; the engines allocate as each offer is made."""
    kv, caches = kv_caches("off-kv", seed=40)
    rng = np.random.default_rng(41)
    running = engines("off-w")
    child = borrower(BORROW_MANY, "race-offer", str(LOANS))
    lost = Losses(running)
    try:
        for i in range(LOANS):
            rows = live_rows(rng)
            kept_before = rows_of(caches, rows)
            running.moved_on()
            with sublet.offer("off-kv", keep=sublet.blocks(caches, rows, dim=1),
                              name="race-offer") as offer:
                offer.wait(timeout=60)
            assert all_equal(rows_of(caches, rows), kept_before), f"offer {i}: kept rows lost"
            lost.check(i)
        assert finished(child, timeout=60) == ["borrowed", str(LOANS)]
    finally:
        child.kill()
        child.wait()
        made = running.stop()
    print(f"\n{LOANS} offers: {made}")
    assert not lost.seen, lost.report(LOANS, "offer")
    del caches
