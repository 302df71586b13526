"""GPU variant of test_pool_lend_race_memfd.py (issue 41 item 1): tensors of other tags, made
by an engine thread with plain PyTorch calls while the main thread lends tag "race-kv", are
never lent, whenever they were made. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_pool_race.py -m gpu -s    # -s shows the counts

- Offers: the engine thread makes its tensors with `torch.empty(..., device="cuda")` inside
  `with sublet.pool(tag)` (tags "race-w0" to "race-w3" in turn, each one's segments given back
  before it allocates again, so that every allocation asks libsublet for pages, which first
  fit takes from the free ones between the cache's layers: pages a loan of "race-kv" lends).
  The main thread makes 100 offers of "race-kv", each keeping other blocks, to a borrower
  process that writes over all it gets. While an offer is being made or runs, a new segment
  is refused (PyTorch raises torch.OutOfMemoryError) and the engine tries again later.
- Loans: sublet.lend("race-kv") routes the whole process into the loan, so the engine thread
  makes its tensors with Pool.empty() (BusyError while the loan is made or runs), between
  the Loan object and its `with` too; 100 loans, each filled by the main thread itself.
- One thread: the Loan made, a tensor made inside `with sublet.pool(...)`, then the `with`.

After every loan, every kept block and every live tensor of the engine are compared as bytes
(copied to pinned host memory: no comparison allocates on the device, where it would be
routed into a pool or the loan), and each engine tensor again when it is dropped. Nothing
waits on the clock: the main thread waits for the engine's progress; no time is asserted.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet

from pool_helpers import (Engine, Engines, Losses, all_equal, borrower,  # noqa: F401 (fixture)
                          fill_until_full, finished, host_noise, on_host, pools_emptied,
                          some_rows)
from test_gpu import cuda_daemon, free_memory_left  # noqa: F401 (fixture)

MiB = 1024 ** 2
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

LOANS = 100
LAYERS, BLOCKS, BLOCK = 4, 128, 64 * 1024     # the cache: 4 layers of (2, 128, 64 KiB) bytes
W_TAGS = [f"race-w{i}" for i in range(4)]


def kv_cache() -> list[torch.Tensor]:
    """The cache, in pool "race-kv", with free pages between its layers (a tag whose segments
    were given back sat there): the pages the next segment of another tag takes first."""
    noise = host_noise(2 * BLOCKS * BLOCK, seed=5)
    caches, gaps = [], []
    for layer in range(LAYERS):
        with sublet.pool("race-kv"):
            caches.append(torch.empty(2, BLOCKS, BLOCK, dtype=torch.uint8, device="cuda"))
        with sublet.pool("race-gap"):   # a 20 MiB segment of its own (PyTorch's large one)
            gaps.append(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"))
        caches[-1].view(-1).copy_(noise)
        caches[-1][0, layer].fill_(layer)  # each layer its own bytes
    del gaps
    sublet.pool("race-gap").empty_cache()  # its segments back: free pages between the layers
    return caches


def kept_blocks(caches: list[torch.Tensor], ids: np.ndarray) -> list[np.ndarray]:
    """The bytes of blocks `ids` (dim 1) of every layer, read on the host."""
    return [on_host(c).numpy().reshape(2, BLOCKS, BLOCK)[:, ids].copy() for c in caches]


class TagWriter(Engine):
    """Makes tensors of the "race-w*" tags (`make(tag, nbytes)`), writes bytes of its own into
    each from pinned host memory and keeps it (one per tag: the tag's previous tensor is
    compared and dropped first), until stopped. A refusal (`refusals`) is counted and tried
    again after a pause that grows while it lasts."""

    NOISE_BYTES = 8 * MiB
    PATIENCE, JOIN = 300, 120

    def __init__(self, make: Callable[[str, int], torch.Tensor],
                 refusals: tuple[type[BaseException], ...], seed: int):
        super().__init__("engine", np.random.default_rng(seed), pauses=(0.0005, 0.02),
                         refusals=refusals)
        self.make = make
        self.noise = host_noise(self.NOISE_BYTES + 4096, seed)
        self.live: dict[str, tuple[torch.Tensor, int]] = {}
        self.step_no = 0

    def holds(self, t: torch.Tensor, start: int) -> bool:
        return torch.equal(on_host(t), self.noise[start:start + t.numel()])

    def tensors(self) -> list[tuple[torch.Tensor, int]]:
        return list(self.live.values())

    def step(self) -> None:
        tag = W_TAGS[self.step_no % len(W_TAGS)]
        with self.progress:
            old = self.live.pop(tag, None)
        if old is not None:
            self.lost += not self.holds(*old)
            del old
        nbytes = int(self.rng.integers(1, 5)) * 2 * MiB
        t = self.attempt(self.make, tag, nbytes)
        if t is None:
            return
        start = int(self.rng.integers(0, 4096))
        t.copy_(self.noise[start:start + nbytes])
        torch.cuda.synchronize()
        with self.progress:
            self.live[tag] = (t, start)
            self.made += 1
            self.step_no += 1
            self.progress.notify_all()


def test_a_tensor_made_in_a_pool_between_lend_and_its_with_is_not_lent():
    """One thread: the Loan made, a tensor of another tag made inside `with sublet.pool(...)`
    (its segment first fit into the free pages between the cache's layers, which the Loan's
    first plan lent), then the `with`: the borrower fills the loan and the tensor's bytes stay."""
    caches = kv_cache()
    with free_memory_left(3 * 1024 * MiB):
        loan = sublet.lend("race-kv", keep=[])
        with sublet.pool("race-late"):
            late = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        late.copy_(host_noise(8 * MiB, seed=9))
        before = on_host(late)
        with loan:
            assert overwrite_in_process() > 0
        assert torch.equal(on_host(late), before), "the borrower wrote over a tensor of " \
                                                    "another tag"
    del caches, late


def in_pool(tag: str, nbytes: int) -> torch.Tensor:
    """A tensor as an engine makes one inside `with sublet.pool(tag)`, its tag's segments given
    back first: PyTorch asks libsublet for a new segment."""
    pool = sublet.pool(tag)
    pool.empty_cache()
    with pool:
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


BORROWER = textwrap.dedent("""
    import sys, torch, sublet
    for i in range(int(sys.argv[2])):
        with sublet.borrow(name=sys.argv[1], timeout=300) as loan:
            held = []
            for size in (256 << 20, 64 << 20, 16 << 20, 2 << 20):
                while True:
                    try:
                        held.append(torch.empty(size, dtype=torch.uint8, device="cuda")
                                    .fill_(i % 251))
                    except torch.OutOfMemoryError:
                        break
            torch.cuda.synchronize()
            del held
    print("borrowed", i + 1, flush=True)
""")


def test_an_engine_allocating_in_pools_while_the_main_thread_offers_loses_nothing():
    caches = kv_cache()
    rng = np.random.default_rng(7)
    child = borrower(BORROWER, "race-gpu", str(LOANS))
    with free_memory_left(3 * 1024 * MiB):   # the borrower's fill reaches the kept pages
        engine = Engines([TagWriter(in_pool, (torch.OutOfMemoryError, sublet.BusyError),
                                    seed=11)])
        lost = Losses(engine)
        try:
            for i in range(LOANS):
                ids = some_rows(rng, BLOCKS, BLOCKS // 2)
                before = kept_blocks(caches, ids)
                engine.moved_on()  # the engine allocates as the offer is made
                with sublet.offer("race-kv", keep=sublet.blocks(caches, torch.from_numpy(ids),
                                                                dim=1),
                                  name="race-gpu") as offer:
                    offer.wait(timeout=300)
                assert all_equal(kept_blocks(caches, ids), before), f"offer {i}: kept blocks lost"
                lost.check(i)
            assert finished(child, timeout=300) == ["borrowed", str(LOANS)]
        finally:
            child.kill()
            child.wait()
            counts = engine.stop()
    print(f"\n{LOANS} offers: {counts}")
    assert not lost.seen, lost.report(LOANS, "offer")
    del caches


def direct(tag: str, nbytes: int) -> torch.Tensor:
    return sublet.pool(tag).empty(nbytes, dtype=torch.uint8)


def overwrite_in_process() -> int:
    """The borrower, in this process: plain PyTorch allocations until the loan is full, each
    written; all freed before the block ends."""
    held = fill_until_full(lambda size: torch.empty(size, dtype=torch.uint8, device="cuda"),
                           (256 * MiB, 64 * MiB, 16 * MiB, 2 * MiB), torch.OutOfMemoryError,
                           lambda t: t.fill_(0xAB))
    torch.cuda.synchronize()
    n = sum(t.numel() for t in held)
    del held
    return n


def test_an_engine_allocating_by_pool_empty_while_the_main_thread_lends_loses_nothing():
    caches = kv_cache()
    rng = np.random.default_rng(8)
    with free_memory_left(3 * 1024 * MiB):
        engine = Engines([TagWriter(direct, (sublet.BusyError,), seed=12)])
        lost = Losses(engine)
        try:
            for i in range(LOANS):
                ids = some_rows(rng, BLOCKS, BLOCKS // 2)
                before = kept_blocks(caches, ids)
                loan = sublet.lend("race-kv", keep=sublet.blocks(caches, torch.from_numpy(ids),
                                                                 dim=1))
                engine.moved_on()  # a tensor of another tag made before the `with`
                with loan:
                    assert overwrite_in_process() > 0
                assert all_equal(kept_blocks(caches, ids), before), f"loan {i}: kept blocks lost"
                lost.check(i)
        finally:
            counts = engine.stop()
    print(f"\n{LOANS} loans: {counts}")
    assert not lost.seen, lost.report(LOANS, "loan")
    del caches
