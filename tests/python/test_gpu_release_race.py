"""GPU variant of test_release_race_memfd.py: a release of tag "rr-kv" gives the driver its
pages and nothing else, while threads make tensors of other tags. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_release_race.py -m gpu -s    # -s shows the counts

- One thread: a tensor of "rr-kv" dies and one of another tag is asked for as the Release goes
  out (the releasing thread itself does both at that moment): refused (BusyError), never
  placed in the dead tensor's page, which the release gives to the driver.
- Threads: an engine thread makes tensors of "rr-w" with Pool.empty() and writes its own
  bytes into each, another makes and drops tensors of "rr-kv" (the pages it frees are those a
  new "rr-w" tensor would take first), while the main thread makes 100 releases of "rr-kv",
  each keeping other blocks of its layers with stay None, 0 or one page, and resumes them.
  After every resume every live "rr-w" tensor and every kept block is compared as bytes.

On a GPU, a tensor released under the engine would be touched by it (an illegal address: the
CUDA context is lost and the test fails with it). Comparisons copy into pinned host memory, so
nothing allocates on the device. Nothing waits on the clock: the main thread waits for the
engines' progress; no time is asserted.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet
from sublet import _lib
from sublet import _pool as sublet_pool

from test_gpu import cuda_daemon  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

RELEASES = 100
LAYERS, BLOCKS, BLOCK = 4, 64, 64 * 1024     # the cache: 4 layers of (2, 64, 64 KiB) bytes


@pytest.fixture(autouse=True)
def pools_emptied():
    """Each test's pool memory goes back after it (the other GPU tests need the device)."""
    yield
    gc.collect()
    for pool in list(sublet_pool._pools.values()):
        pool.empty_cache()
    torch.cuda.empty_cache()


def host_noise(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).pin_memory()


def on_host(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
    out.copy_(t.reshape(-1).view(torch.uint8))
    return out


def kv_layers(pool: sublet.Pool, seed: int) -> list[torch.Tensor]:
    noise = host_noise(2 * BLOCKS * BLOCK, seed)
    return [pool.empty(2, BLOCKS, BLOCK, dtype=torch.uint8).copy_(noise.view(2, BLOCKS, BLOCK))
            for _ in range(LAYERS)]


def kept_of(caches, rows) -> list[torch.Tensor]:
    return [on_host(c[:, rows]) for c in caches]


def test_a_tensor_of_another_tag_made_as_the_release_goes_out_is_refused(cuda_daemon,
                                                                         monkeypatch):
    kv = sublet.pool("rr-one-kv")
    w = sublet.pool("rr-one-w")
    page = kv.arena.client.info.page_size
    caches = kv_layers(kv, seed=1)
    victim = kv.empty(page, dtype=torch.uint8)
    rows = torch.tensor([1, 5, 9], device="cuda")
    kept = kept_of(caches, rows)
    outcome: dict[str, object] = {}
    send = _lib.Client.release

    def die_and_allocate_then_send(*args, **kwargs):
        nonlocal victim
        victim = None
        gc.collect()
        try:
            late = w.empty(page, dtype=torch.uint8).fill_(0x5A)
            outcome["late"] = late
        except sublet.BusyError as error:
            outcome["refused"] = str(error)
        return send(*args, **kwargs)

    monkeypatch.setattr(_lib.Client, "release", staticmethod(die_and_allocate_then_send))
    rel = sublet.release("rr-one-kv", keep=sublet.blocks(caches, rows, dim=1))
    monkeypatch.undo()
    rel.resume()
    assert "late" not in outcome, "a tensor of another tag was made while the release was made"
    assert "being lent or released" in str(outcome.get("refused")), outcome
    assert all(torch.equal(a, b) for a, b in zip(kept_of(caches, rows), kept))
    del caches


class Engine(threading.Thread):
    """Makes tensors (`make`), writes its own bytes into each (with `noise`), keeps the last
    6, until stopped; a refusal (BusyError) is counted and tried again."""

    def __init__(self, name: str, make: Callable[[int], torch.Tensor], page: int,
                 noise: torch.Tensor | None):
        super().__init__(name=name, daemon=True)
        self.make, self.page, self.noise = make, page, noise
        self.rng = np.random.default_rng(len(name))
        self.halt = threading.Event()
        self.progress = threading.Condition()
        self.live: list[tuple[torch.Tensor, int]] = []
        self.made = self.refused = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        torch.cuda.set_device(torch.cuda.current_device())
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not self.halt.is_set():
                    self.step()
        except BaseException as error:  # noqa: BLE001 - the test raises it
            self.error = error
            with self.progress:
                self.progress.notify_all()

    def step(self) -> None:
        try:
            t = self.make(int(self.rng.integers(1, 4)) * self.page)
        except sublet.BusyError:
            self.refused += 1
            self.halt.wait(0.001)  # a pause, not a bound
            return
        at = int(self.rng.integers(0, 4096))
        if self.noise is not None:
            t.copy_(self.noise[at:at + t.numel()])
            torch.cuda.current_stream().synchronize()
        with self.progress:
            self.live = (self.live + [(t, at)])[-6:]
            self.made += 1
            self.progress.notify_all()
        self.halt.wait(0.0002)

    def wait_past(self, made: int) -> int:
        with self.progress:
            self.progress.wait_for(lambda: self.made > made or self.error is not None,
                                   timeout=120)
            if self.error is not None:
                raise self.error
            assert self.made > made, f"{self.name} made no tensor in 120 s"
            return self.made

    def overwritten(self) -> int:
        if self.noise is None:
            return 0
        with self.progress:
            live = list(self.live)
        return sum(not torch.equal(on_host(t), self.noise[at:at + t.numel()]) for t, at in live)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=60)
        if self.error is not None:
            raise self.error
        self.live.clear()


def test_threads_allocating_while_the_main_thread_releases_and_resumes_lose_nothing(
        cuda_daemon):
    kv = sublet.pool("rr-kv")
    w = sublet.pool("rr-w")
    page = kv.arena.client.info.page_size
    caches = kv_layers(kv, seed=2)
    noise = host_noise(4 * page + 4096, seed=3)
    engines = [Engine("rr-w-engine", lambda n: w.empty(n, dtype=torch.uint8), page, noise),
               Engine("rr-kv-churn", lambda n: kv.empty(n, dtype=torch.uint8), page, None)]
    for e in engines:
        e.start()
    rng = np.random.default_rng(4)
    seen = [0] * len(engines)
    lost: list[tuple[int, int]] = []
    try:
        for i in range(RELEASES):
            rows = torch.from_numpy(np.sort(rng.choice(BLOCKS, int(rng.integers(0, 24)),
                                                       replace=False))).cuda()
            kept = kept_of(caches, rows)
            seen = [e.wait_past(n) for e, n in zip(engines, seen)]
            rel = sublet.release("rr-kv", keep=sublet.blocks(caches, rows, dim=1),
                                 stay=[None, 0, page][i % 3])
            seen = [e.wait_past(n) for e, n in zip(engines, seen)]
            rel.resume()
            assert all(torch.equal(a, b) for a, b in zip(kept_of(caches, rows), kept)), \
                f"release {i}: kept blocks lost"
            overwritten = sum(e.overwritten() for e in engines)
            if overwritten:
                lost.append((i, overwritten))
    finally:
        for e in engines:
            e.stop()
    print(f"\n{RELEASES} releases: " + ", ".join(f"{e.name} made {e.made}, refused "
                                                  f"{e.refused}" for e in engines))
    assert not lost, (f"{lost[-1][1]} tensors of another tag lost their bytes in {RELEASES} "
                      f"releases, first seen after release {lost[0][0]}")
    del caches
