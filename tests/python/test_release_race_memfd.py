"""Releases of a tag while tensors of other tags are being made, on the memfd backend (no
GPU): a release gives the driver the pages of its tag and nothing else, whenever another
tensor was made (issue 41 item 1's race, for releases).

- While a release is being made (its pages decided, the Release sent, subletd's answer), no
  pool allocation is served (BusyError, or NULL from the allocator hooks PyTorch calls): a
  page it took could be one the release gives away, a tag's tensor freed just before.
- While it is live, pool allocations are served again, from pages outside the release's set
  only: neither a released page (a hole of the arena's address range, PROT_NONE here) nor a
  page that stayed, whose unkept bytes hold kept bytes moved there until the resume, even once
  the tensor that had that page is freed.
- Engine threads make, fill and drop tensors of another tag, and a third makes and drops
  tensors of the released tag, all along while the main thread releases and resumes 120
  times with changing keeps and stays; every tensor of the other tag is compared as bytes
  after every cycle, and the kept rows.

On memfd a released page is PROT_NONE in this process: a tensor released under an engine
would kill the test with SIGSEGV at its first touch. The engines write and read their
tensors with process_vm_writev/readv on their own process instead, which fail with EFAULT on
such a page: it is counted, not crashed on. Nothing waits on the clock: the main thread waits
for the engines' progress. test_gpu_release_race.py runs the same on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet
from sublet import _lib

from conftest import PAGE
from pool_helpers import (Engine, Engines, Losses, all_equal, bits,  # noqa: F401 (fixture)
                          just_before, layers, little_free_memory, made_or_refused,
                          random_bytes, routed, rows_of, some_rows)

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

SLOT = 62   # the torch hooks' device index here: no machine has a 63rd GPU
CYCLES = 120

# --------------------------------------------------------------------------- safe touches

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm(call, local: int, remote: int, n: int) -> bool:
    here, there = _Iovec(local, n), _Iovec(remote, n)
    return call(os.getpid(), ctypes.byref(here), 1, ctypes.byref(there), 1, 0) == n


def safe_write(t: torch.Tensor, data: np.ndarray) -> bool:
    """Writes data into t's memory; False (nothing written) where a page of it is not mapped
    (released under it)."""
    return _vm(_libc.process_vm_writev, data.ctypes.data, t.data_ptr(), data.nbytes)


def safe_bits(t: torch.Tensor) -> np.ndarray | None:
    """t's bytes, or None where a page of it is not mapped."""
    out = np.empty(t.numel() * t.element_size(), np.uint8)
    return out if _vm(_libc.process_vm_readv, out.ctypes.data, t.data_ptr(), out.nbytes) \
        else None


def mapped(t: torch.Tensor) -> bool:
    return safe_bits(t) is not None


# --------------------------------------------------------------------------- the arena

def fill_gaps(pool: sublet.Pool) -> list[torch.Tensor]:
    """Tensors of pool taking every free gap of the arena below its end, so that the next
    allocation of one page lands where the test frees one (first fit), not in a gap an earlier
    test left."""
    arena, fillers = pool.arena, []
    segs = arena.segments().astype(np.int64)
    at = 0
    for off, n in list(segs) + [(arena.size, 0)]:
        if off > at:
            fillers.append(pool.empty(int(off - at), dtype=torch.uint8))
        at = max(at, int(off + n))
    return fillers


def page_of(t: torch.Tensor, pool: sublet.Pool) -> int:
    return (t.data_ptr() - pool.arena.addr) // PAGE


def kv_layers(tag: str, seed: int) -> tuple[sublet.Pool, list[torch.Tensor]]:
    """8 one-page layers of a KV cache (2, 16 rows, 1024 bf16) of tag, random bytes."""
    kv = sublet.pool(tag, device="cpu")
    return kv, layers(kv, 8, (2, 16, 1024), seed)


# --------------------------------------------------------------------------- one thread

def test_a_tensor_of_another_tag_made_as_the_release_goes_out_is_refused(monkeypatch):
    """The Release's moment: its pages are decided, then a tensor of the tag dies and one of
    another tag is asked for (here by the releasing thread itself, just before the Release is
    sent, so that it comes there every time). It is refused, as during a loan's making, never
    placed in the dead tensor's page, which the release gives to the driver: the tensors of
    the other tag come back whole after the resume, the kept rows too."""
    gc.collect()
    kv, caches = kv_layers("one-rel-kv", seed=1)
    w = sublet.pool("one-rel-w", device="cpu")
    fillers = fill_gaps(w)
    victim = kv.empty(PAGE, dtype=torch.uint8)            # a tensor of the tag, one page
    victim_page = page_of(victim, kv)
    early = random_bytes(w.empty(PAGE, dtype=torch.uint8), seed=2)
    early_bits = bits(early)
    rows = torch.tensor([1, 5, 9])
    kept = rows_of(caches, rows)
    outcome: dict[str, object] = {}

    def another_tag() -> dict:
        late = random_bytes(w.empty(PAGE, dtype=torch.uint8), seed=3)
        return {"late": late, "late_bits": bits(late), "page": page_of(late, w)}

    def die_and_allocate():
        nonlocal victim
        victim = None  # the tag's tensor dies: its page is free, in the release's set
        gc.collect()
        made_or_refused(outcome, another_tag)

    just_before(monkeypatch, _lib.Client, "release", die_and_allocate)
    rel = sublet.release("one-rel-kv", keep=sublet.blocks(caches, rows, dim=1))
    monkeypatch.undo()
    late = outcome.get("late")
    released_under = late is not None and not mapped(late)
    rel.resume()
    if late is not None:
        assert not released_under, (
            f"a tensor of another tag made as the Release went out landed in page "
            f"{outcome['page']} (the dead tensor's: {victim_page}) and was released under it")
        assert np.array_equal(safe_bits(late), outcome["late_bits"]), \
            "a tensor of another tag made as the Release went out lost its bytes"
    assert "being lent or released" in str(outcome.get("refused")), outcome
    assert np.array_equal(bits(early), early_bits)
    assert all_equal(rows_of(caches, rows), kept)
    after = w.empty(PAGE, dtype=torch.uint8)               # served again after it
    del caches, early, fillers, after, outcome, late


def test_while_live_a_new_tensor_takes_no_page_of_the_release():
    """A live release's pages are the driver's (released) or hold the kept bytes moved there
    (stayed): a tensor made meanwhile, of another tag or of the tag itself, takes neither,
    even once the tensor whose page stayed has died. The kept rows come back whole, and so do
    the new tensors."""
    gc.collect()
    kv, caches = kv_layers("live-rel-kv", seed=10)
    w = sublet.pool("live-rel-w", device="cpu")
    fillers = fill_gaps(w)
    rows = torch.tensor([2, 7])
    kept_all = rows_of(caches, rows)
    rel = sublet.release("live-rel-kv", keep=sublet.blocks(caches, rows, dim=1))
    assert rel.stats.stayed_pages == 1 and rel.stats.released_pages == 7 and rel.moved_bytes
    stayed = [i for i, c in enumerate(caches) if mapped(c)]
    assert len(stayed) == 1, stayed
    # The layer whose page stayed dies: its page holds the other layers' kept rows.
    survivors = [c for i, c in enumerate(caches) if i != stayed[0]]
    kept = [k for i, k in enumerate(kept_all) if i != stayed[0]]
    set_pages = {page_of(c, kv) for c in caches}
    del caches
    gc.collect()
    made = [random_bytes(p.empty(PAGE, dtype=torch.uint8), seed=11 + i)
            for i, p in enumerate([w, w, kv, w])]
    made_bits = [bits(t) for t in made]
    landed = sorted(set_pages & {page_of(t, w) for t in made})
    rel.resume()
    assert not landed, f"tensors made while the release was live took its pages {landed}"
    assert all(np.array_equal(bits(t), b) for t, b in zip(made, made_bits))
    assert all_equal(rows_of(survivors, rows), kept), \
        "the kept rows moved into the page that stayed were overwritten"
    del survivors, made, fillers


def test_a_release_of_the_arena_without_the_hold_is_refused_by_libsublet():
    """libsublet refuses a Release of the pools' region whose pages were not read under
    sublet_pool_hold(): a C caller (the preload library's pause) cannot release another tag's
    new page by forgetting it."""
    kv, caches = kv_layers("nohold-rel-kv", seed=20)
    client, handle = kv.arena.client, kv.arena.handle
    pages = kv.segments()
    try:
        stats = client.release(handle, pages, None, _lib.STAY_ANY)
    except sublet.SubletError as error:
        assert "sublet_pool_hold" in str(error)
    else:
        client.resume(handle, stats.release_id)
        pytest.fail("libsublet released pages of the pools' arena without the hold")
    del caches


# --------------------------------------------------------------------------- threads

ENGINE_NOISE = np.random.default_rng(43).integers(0, 256, 4 * PAGE + 4096, dtype=np.uint8)


class Writer(Engine):
    """A thread making tensors (`make`: bytes -> tensor), keeping the last KEEP and dropping
    the oldest (their pages free for the next, first fit), until stopped. With `write`, each
    gets bytes of its own, compared when it is dropped and by overwritten(); a page released
    under one shows as a failed write or read (counted, never touched). A refusal (BusyError)
    is counted and tried again, as an engine waits for memory."""

    def __init__(self, name: str, make: Callable[[int], torch.Tensor], seed: int,
                 write: bool = True):
        super().__init__(name, np.random.default_rng(seed), check_dropped=write)
        self.make, self.write = make, write

    def holds(self, t: torch.Tensor, start: int) -> bool:
        if not self.write:
            return True  # its bytes are nobody's: not compared
        got = safe_bits(t)
        return got is not None and np.array_equal(got, ENGINE_NOISE[start:start + got.size])

    def step(self) -> None:
        t = self.attempt(self.make, int(self.rng.integers(1, 4)) * PAGE)
        if t is None:
            return
        start = int(self.rng.integers(0, 4096))
        with self.progress:
            if self.write and not safe_write(t, ENGINE_NOISE[start:start + t.numel()]):
                self.lost += 1  # released as it was made
            self.keep(t, start)
        self.halt.wait(0.0002)  # the GIL's turn for the main thread: a pause, not a bound


def test_threads_allocating_while_the_main_thread_releases_and_resumes_lose_nothing(
        little_free_memory):
    """120 releases of "thr-rel-kv", each keeping other rows of its 8 layers in as many pages
    as they need, none, or one, then resumed, while two threads make, fill and drop tensors of
    "thr-rel-w" (Pool.empty and the allocator hooks) and a third makes and drops tensors of
    "thr-rel-kv" itself (the pages it frees are those another tag's tensor would take). After
    every cycle every "thr-rel-w" tensor and every kept row holds its bits."""
    kv, caches = kv_layers("thr-rel-kv", seed=30)
    w = sublet.pool("thr-rel-w", device="cpu")
    rng = np.random.default_rng(31)
    engines = Engines(
        [Writer("pool-empty", lambda n: w.empty(n, dtype=torch.uint8), seed=1000),
         Writer("pool-routed", routed(w, SLOT, busy="being lent or released"), seed=2000),
         Writer("kv-churn", lambda n: kv.empty(n, dtype=torch.uint8), seed=3000, write=False)],
        unbind=lambda: w.arena.client.torch_bind_pool(SLOT, 0))
    lost = Losses(engines)
    try:
        for i in range(CYCLES):
            rows = torch.from_numpy(some_rows(rng, 16, 12))
            stay = [None, 0, PAGE][i % 3]
            kept = rows_of(caches, rows)
            engines.moved_on()      # they allocate meanwhile
            rel = sublet.release("thr-rel-kv", keep=sublet.blocks(caches, rows, dim=1),
                                 stay=stay)
            engines.moved_on()      # ... and while it is live
            rel.resume()
            assert all_equal(rows_of(caches, rows), kept), f"cycle {i}: kept rows lost"
            lost.check(i)
    finally:
        made = engines.stop()
    print(f"\n{CYCLES} releases: {made}")
    assert not lost.seen, lost.report(CYCLES, "release", how="lost their bytes")
    del caches
