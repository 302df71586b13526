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

import contextlib
import gc
from collections.abc import Callable

import numpy as np
import pytest
import torch

import sublet
from sublet import _lib

from pool_helpers import (Engine, Engines, Losses, host_noise, just_before,  # noqa: F401 (fixture)
                          made_or_refused, on_host, pools_emptied, some_rows)
from test_gpu import cuda_daemon  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

RELEASES = 100
LAYERS, BLOCKS, BLOCK = 4, 64, 64 * 1024     # the cache: 4 layers of (2, 64, 64 KiB) bytes


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

    def die_and_allocate():
        nonlocal victim
        victim = None
        gc.collect()
        made_or_refused(outcome, lambda: {"late": w.empty(page, dtype=torch.uint8).fill_(0x5A)})

    just_before(monkeypatch, _lib.Client, "release", die_and_allocate)
    rel = sublet.release("rr-one-kv", keep=sublet.blocks(caches, rows, dim=1))
    monkeypatch.undo()
    rel.resume()
    assert "late" not in outcome, "a tensor of another tag was made while the release was made"
    assert "being lent or released" in str(outcome.get("refused")), outcome
    assert all(torch.equal(a, b) for a, b in zip(kept_of(caches, rows), kept))
    del caches


class Writer(Engine):
    """Makes tensors (`make`), writes its own bytes into each (with `noise`), keeps the last
    6, until stopped, on a stream of its own; a refusal (BusyError) is counted and tried
    again."""

    def __init__(self, name: str, make: Callable[[int], torch.Tensor], page: int,
                 noise: torch.Tensor | None):
        super().__init__(name, np.random.default_rng(len(name)), pauses=(0.001, 0.001),
                         check_dropped=False)
        self.make, self.page, self.noise = make, page, noise

    @contextlib.contextmanager
    def running(self):
        torch.cuda.set_device(torch.cuda.current_device())
        with torch.cuda.stream(torch.cuda.Stream()):
            yield

    def holds(self, t: torch.Tensor, at: int) -> bool:
        return self.noise is None or torch.equal(on_host(t), self.noise[at:at + t.numel()])

    def step(self) -> None:
        t = self.attempt(self.make, int(self.rng.integers(1, 4)) * self.page)
        if t is None:
            return
        at = int(self.rng.integers(0, 4096))
        if self.noise is not None:
            t.copy_(self.noise[at:at + t.numel()])
            torch.cuda.current_stream().synchronize()
        self.keep(t, at)
        self.halt.wait(0.0002)


def test_threads_allocating_while_the_main_thread_releases_and_resumes_lose_nothing(
        cuda_daemon):
    kv = sublet.pool("rr-kv")
    w = sublet.pool("rr-w")
    page = kv.arena.client.info.page_size
    caches = kv_layers(kv, seed=2)
    noise = host_noise(4 * page + 4096, seed=3)
    engines = Engines(
        [Writer("rr-w-engine", lambda n: w.empty(n, dtype=torch.uint8), page, noise),
         Writer("rr-kv-churn", lambda n: kv.empty(n, dtype=torch.uint8), page, None)])
    rng = np.random.default_rng(4)
    lost = Losses(engines)
    try:
        for i in range(RELEASES):
            rows = torch.from_numpy(some_rows(rng, BLOCKS, 24)).cuda()
            kept = kept_of(caches, rows)
            engines.moved_on()
            rel = sublet.release("rr-kv", keep=sublet.blocks(caches, rows, dim=1),
                                 stay=[None, 0, page][i % 3])
            engines.moved_on()
            rel.resume()
            assert all(torch.equal(a, b) for a, b in zip(kept_of(caches, rows), kept)), \
                f"release {i}: kept blocks lost"
            lost.check(i)
    finally:
        made = engines.stop()
    print(f"\n{RELEASES} releases: {made}")
    assert not lost.seen, lost.report(RELEASES, "release", how="lost their bytes")
    del caches
