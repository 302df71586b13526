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

import gc
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet
from sublet import _pool as sublet_pool

from conftest import CHILD_ENV
from test_gpu import cuda_daemon, free_memory_left  # noqa: F401 (fixture)

MiB = 1024 ** 2
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

LOANS = 100
LAYERS, BLOCKS, BLOCK = 4, 128, 64 * 1024     # the cache: 4 layers of (2, 128, 64 KiB) bytes
W_TAGS = [f"race-w{i}" for i in range(4)]


@pytest.fixture(autouse=True)
def pools_emptied():
    """Each test's pool memory goes back after it (the other GPU tests need the device)."""
    yield
    gc.collect()
    for pool in list(sublet_pool._pools.values()):
        pool.empty_cache()
    torch.cuda.empty_cache()


def host_noise(nbytes: int, seed: int) -> torch.Tensor:
    """Random bytes in pinned host memory (copied to the device, they allocate nothing there)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).pin_memory()


def on_host(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, copied into pinned host memory (the device allocates nothing)."""
    out = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
    out.copy_(t.view(-1).view(torch.uint8))
    return out


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


class Engine(threading.Thread):
    """Makes tensors of the "race-w*" tags (`make(tag, nbytes)`), writes bytes of its own into
    each from pinned host memory and keeps it (one per tag: the tag's previous tensor is
    compared and dropped first), until stopped. A refusal (`refusals`) is counted and tried
    again after a pause that grows while it lasts."""

    NOISE_BYTES = 8 * MiB

    def __init__(self, make: Callable[[str, int], torch.Tensor],
                 refusals: tuple[type[BaseException], ...], seed: int):
        super().__init__(name="engine", daemon=True)
        self.make, self.refusals = make, refusals
        self.rng = np.random.default_rng(seed)
        self.noise = host_noise(self.NOISE_BYTES + 4096, seed)
        self.halt, self.progress = threading.Event(), threading.Condition()
        self.live: dict[str, tuple[torch.Tensor, int]] = {}
        self.made = self.refused = self.lost_when_dropped = self.step_no = 0
        self.backoff = 0.0005
        self.error: BaseException | None = None

    def holds(self, t: torch.Tensor, start: int) -> bool:
        return torch.equal(on_host(t), self.noise[start:start + t.numel()])

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                self.step()
        except BaseException as error:  # noqa: BLE001 - the test raises it
            self.error = error
            with self.progress:
                self.progress.notify_all()

    def step(self) -> None:
        tag = W_TAGS[self.step_no % len(W_TAGS)]
        with self.progress:
            old = self.live.pop(tag, None)
        if old is not None:
            self.lost_when_dropped += not self.holds(*old)
            del old
        nbytes = int(self.rng.integers(1, 5)) * 2 * MiB
        try:
            t = self.make(tag, nbytes)
        except self.refusals:
            self.refused += 1
            self.backoff = min(2 * self.backoff, 0.02)
            self.halt.wait(self.backoff)  # a pause, not a bound: nothing counts on its length
            return
        self.backoff = 0.0005
        start = int(self.rng.integers(0, 4096))
        t.copy_(self.noise[start:start + nbytes])
        torch.cuda.synchronize()
        with self.progress:
            self.live[tag] = (t, start)
            self.made += 1
            self.step_no += 1
            self.progress.notify_all()

    def wait_past(self, made: int) -> int:
        with self.progress:
            self.progress.wait_for(lambda: self.made > made or self.error is not None,
                                   timeout=300)
            if self.error is not None:
                raise self.error
            assert self.made > made, "the engine made no tensor in 300 s"
            return self.made

    def overwritten(self) -> int:
        with self.progress:
            live = list(self.live.values())
        return self.lost_when_dropped + sum(not self.holds(t, at) for t, at in live)

    def stop(self) -> str:
        self.halt.set()
        self.join(timeout=120)
        if self.error is not None:
            raise self.error
        self.live.clear()
        return f"engine made {self.made}, refused {self.refused}"


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
    env = dict(os.environ, **CHILD_ENV)
    env.pop("SUBLET_SOCKET", None)
    child = subprocess.Popen([sys.executable, "-c", BORROWER, "race-gpu", str(LOANS)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lost: list[tuple[int, int]] = []
    with free_memory_left(3 * 1024 * MiB):   # the borrower's fill reaches the kept pages
        engine = Engine(in_pool, (torch.OutOfMemoryError, sublet.BusyError), seed=11)
        engine.start()
        made = 0
        try:
            for i in range(LOANS):
                ids = np.sort(rng.choice(BLOCKS, int(rng.integers(0, BLOCKS // 2)),
                                         replace=False))
                before = kept_blocks(caches, ids)
                made = engine.wait_past(made)  # the engine allocates as the offer is made
                with sublet.offer("race-kv", keep=sublet.blocks(caches, torch.from_numpy(ids),
                                                                dim=1),
                                  name="race-gpu") as offer:
                    offer.wait(timeout=300)
                after = kept_blocks(caches, ids)
                assert all(np.array_equal(a, b) for a, b in zip(after, before)), \
                    f"offer {i}: kept blocks lost"
                overwritten = engine.overwritten()
                if overwritten:
                    lost.append((i, overwritten))
            out, err = child.communicate(timeout=300)
            assert child.returncode == 0, err
            assert out.split() == ["borrowed", str(LOANS)]
        finally:
            child.kill()
            child.wait()
            counts = engine.stop()
    print(f"\n{LOANS} offers: {counts}")
    assert not lost, (f"{lost[-1][1]} tensors of another tag overwritten in {LOANS} offers, "
                      f"first seen after offer {lost[0][0]}")
    del caches


def direct(tag: str, nbytes: int) -> torch.Tensor:
    return sublet.pool(tag).empty(nbytes, dtype=torch.uint8)


def overwrite_in_process() -> int:
    """The borrower, in this process: plain PyTorch allocations until the loan is full, each
    written; all freed before the block ends."""
    held = []
    for size in (256 * MiB, 64 * MiB, 16 * MiB, 2 * MiB):
        while True:
            try:
                held.append(torch.empty(size, dtype=torch.uint8, device="cuda").fill_(0xAB))
            except torch.OutOfMemoryError:
                break
    torch.cuda.synchronize()
    n = sum(t.numel() for t in held)
    del held
    return n


def test_an_engine_allocating_by_pool_empty_while_the_main_thread_lends_loses_nothing():
    caches = kv_cache()
    rng = np.random.default_rng(8)
    lost: list[tuple[int, int]] = []
    with free_memory_left(3 * 1024 * MiB):
        engine = Engine(direct, (sublet.BusyError,), seed=12)
        engine.start()
        made = 0
        try:
            for i in range(LOANS):
                ids = np.sort(rng.choice(BLOCKS, int(rng.integers(0, BLOCKS // 2)),
                                         replace=False))
                before = kept_blocks(caches, ids)
                loan = sublet.lend("race-kv", keep=sublet.blocks(caches, torch.from_numpy(ids),
                                                                 dim=1))
                made = engine.wait_past(made)  # a tensor of another tag made before the `with`
                with loan:
                    assert overwrite_in_process() > 0
                after = kept_blocks(caches, ids)
                assert all(np.array_equal(a, b) for a, b in zip(after, before)), \
                    f"loan {i}: kept blocks lost"
                overwritten = engine.overwritten()
                if overwritten:
                    lost.append((i, overwritten))
        finally:
            counts = engine.stop()
    print(f"\n{LOANS} loans: {counts}")
    assert not lost, (f"{lost[-1][1]} tensors of another tag overwritten in {LOANS} loans, "
                      f"first seen after loan {lost[0][0]}")
    del caches
