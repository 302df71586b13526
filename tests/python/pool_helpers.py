"""Helpers of the pool tests: tensors of random bytes, their bits, and a borrower that fills a
loan to its last page (the memfd tests); the mechanics of the race tests
(test_pool_lend_race_memfd.py, test_release_race_memfd.py and their GPU variants): engine
threads that make tensors of another tag, waits on their progress, the allocator hooks, the
losses seen; and the GPU tests' setup (pools emptied after each test, pinned host bytes)."""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import sublet
from sublet import _lib
from sublet import _pool as sublet_pool
from sublet._memory import wrap

from conftest import CHILD_ENV, PAGE, REPO, memfd_free_bytes


def random_bytes(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fills t with random bytes (a generator seeded with `seed`); returns t."""
    g = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return t


def layers(pool: sublet.Pool, n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """n per-layer tensors of a pool, each filled with its own random bytes."""
    return [random_bytes(pool.empty(*shape, dtype=torch.bfloat16), seed + i) for i in range(n)]


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (bits, not values: a NaN the borrower left is not equal to itself)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def fill_until_full(make: Callable[[int], torch.Tensor], sizes, full: type[BaseException],
                    write: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """A borrower's fill: make(size) for each size in turn (the largest first), each tensor
    written by write(), until `full` is raised; returns the tensors, for the caller to drop."""
    held = []
    for size in sizes:
        while True:
            try:
                held.append(write(make(size)))
            except full:
                break
    return held


def fill_loan(loan: sublet.Loan, seed: int) -> int:
    """Loan.empty() pages until the loan is full, each written with noise; returns the bytes.
    The tensors die before the block ends."""
    noise = torch.randint(0, 256, (PAGE,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    held = fill_until_full(lambda n: loan.empty(n, dtype=torch.uint8), [PAGE],
                           sublet.SubletOutOfMemoryError, lambda t: t.copy_(noise))
    n = len(held) * PAGE
    del held
    gc.collect()
    return n


def some_rows(rng: np.random.Generator, n: int, fewer_than: int) -> np.ndarray:
    """A new set of rows (or blocks) out of n, sorted, fewer than `fewer_than` of them: what one
    loan or release keeps."""
    return np.sort(rng.choice(n, int(rng.integers(0, fewer_than)), replace=False))


def rows_of(caches, rows) -> list[np.ndarray]:
    """The bits of rows `rows` (dim 1) of every layer."""
    return [bits(c[:, rows]) for c in caches]


def all_equal(these, those) -> bool:
    """Every array of `these` holds the bits of its peer in `those`."""
    return all(np.array_equal(a, b) for a, b in zip(these, those))


def owner_process(script: str, *args: str) -> subprocess.Popen:
    """An owner process running `script` with args (this checkout's sublet), its stdout read
    by the test."""
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def free_after_kill(child: subprocess.Popen, free0: int, tries: int) -> int:
    """Kills the owner process (SIGKILL), then waits for the memfd daemon's free bytes to come
    back to free0, `tries` times 20 ms at the most (a hang guard, not a timing); returns them."""
    child.send_signal(signal.SIGKILL)
    child.wait()
    for _ in range(tries):
        if memfd_free_bytes() == free0:
            break
        time.sleep(0.02)
    return memfd_free_bytes()


def resume_without_daemon(daemon, rel: sublet.Release) -> tuple[sublet.ReleaseStats, list]:
    """Kills the test's own subletd, then resumes rel (the library puts the kept bytes back by
    itself); returns the stats and the warnings the resume gave."""
    daemon.kill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = rel.resume()
    return stats, caught


# --------------------------------------------------------------------------- races

def just_before(monkeypatch, owner, name: str, first: Callable[[], object]) -> None:
    """owner.name (what sends a Lend or a Release) runs first() just before it sends, for the
    test: what an engine thread could do at that moment, done by the sending thread itself so
    that it comes there every time."""
    send = getattr(owner, name)

    def first_then_send(*args, **kwargs):
        first()
        return send(*args, **kwargs)
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(first_then_send) if static else first_then_send)


def made_or_refused(outcome: dict, make: Callable[[], dict]) -> None:
    """outcome gets what make() returns, or under "refused" the text of its BusyError."""
    try:
        outcome.update(make())
    except sublet.BusyError as error:
        outcome["refused"] = str(error)


def borrower(script: str, *args: str, socket: str | None = None) -> subprocess.Popen:
    """A borrower process running `script` with args: on the daemon at `socket`, or on the
    one it finds itself (no SUBLET_SOCKET)."""
    env = dict(os.environ, **CHILD_ENV)
    env.pop("SUBLET_SOCKET", None)
    if socket is not None:
        env["SUBLET_SOCKET"] = socket
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(child: subprocess.Popen, timeout: float) -> list[str]:
    """Waits for a borrower process, which must succeed; the words it printed."""
    out, err = child.communicate(timeout=timeout)
    assert child.returncode == 0, err
    return out.split()


# --------------------------------------------------------------------------- engine threads

class Engine(threading.Thread):
    """An engine thread: step() until stopped; a refusal (one of `refusals`, through attempt())
    is counted and tried again after a pause that doubles while it lasts, up to the most
    (`pauses`: the first and the most, seconds; a pause, not a bound: nothing counts on its
    length), as an engine waits for memory. Its tensors, with where their bytes start, are
    kept (keep(): the last KEEP, the oldest dropped and, with `check_dropped`, compared then);
    `holds(t, start)` says whether one still holds its bytes. The main thread waits on its
    progress (wait_past), never on the clock: PATIENCE seconds at the most."""

    KEEP = 6
    PATIENCE, JOIN = 120, 60

    def __init__(self, name: str, rng: np.random.Generator,
                 pauses: tuple[float, float] = (0.0001, 0.004), check_dropped: bool = True,
                 refusals: tuple[type[BaseException], ...] = (sublet.BusyError,)):
        super().__init__(name=name, daemon=True)
        self.rng, self.check_dropped, self.refusals = rng, check_dropped, refusals
        self.first_pause, self.most_pause = pauses
        self.backoff = self.first_pause
        self.halt = threading.Event()
        self.progress = threading.Condition()   # an RLock: keep() may run under it
        self.live: list[tuple[torch.Tensor, int]] = []  # (tensor, where its bytes start)
        self.made = self.refused = self.lost = 0
        self.error: BaseException | None = None

    def running(self) -> contextlib.AbstractContextManager:
        """The context the engine's steps run in."""
        return contextlib.nullcontext()

    def run(self) -> None:
        try:
            with self.running():
                while not self.halt.is_set():
                    self.step()
        except BaseException as error:  # noqa: BLE001 - the test raises it
            self.error = error
            with self.progress:
                self.progress.notify_all()

    def step(self) -> None:
        raise NotImplementedError

    def holds(self, t: torch.Tensor, start: int) -> bool:
        raise NotImplementedError

    def attempt(self, make: Callable[..., torch.Tensor], *args) -> torch.Tensor | None:
        """make(*args), or None after a refusal (counted, then a pause)."""
        try:
            t = make(*args)
        except self.refusals:
            self.refused += 1
            self.backoff = min(2 * self.backoff, self.most_pause)
            self.halt.wait(self.backoff)
            return None
        self.backoff = self.first_pause
        return t

    def keep(self, t: torch.Tensor, start: int) -> None:
        """One more tensor made: kept, the oldest beyond KEEP dropped."""
        with self.progress:
            self.live.append((t, start))
            dropped, self.live = self.live[:-self.KEEP], self.live[-self.KEEP:]
            if self.check_dropped:
                self.lost += sum(not self.holds(d, at) for d, at in dropped)
            self.made += 1
            self.progress.notify_all()

    def tensors(self) -> list[tuple[torch.Tensor, int]]:
        return list(self.live)

    def wait_past(self, made: int) -> int:
        """Waits until the engine has made a tensor after its `made`th (or failed); returns
        its count then."""
        with self.progress:
            self.progress.wait_for(lambda: self.made > made or self.error is not None
                                   or not self.is_alive(), timeout=self.PATIENCE)
            if self.error is not None:
                raise self.error
            assert self.made > made, f"{self.name} made no tensor in {self.PATIENCE} s"
            return self.made

    def overwritten(self) -> int:
        """How many of its tensors no longer held the bytes written into them: the live ones
        now, and those dropped so far."""
        with self.progress:
            live = self.tensors()
            lost = self.lost
        return lost + sum(not self.holds(t, at) for t, at in live)

    def stop(self) -> str:
        """Stops it (raising what failed it); says what it made."""
        self.halt.set()
        self.join(timeout=self.JOIN)
        if self.error is not None:
            raise self.error
        with self.progress:
            self.live.clear()
        return f"{self.name} made {self.made}, refused {self.refused}"


class Engines:
    """Engine threads running together, started at once; `unbind` runs when they stop."""

    def __init__(self, threads: list[Engine], unbind: Callable[[], object] | None = None):
        self.threads, self.unbind = threads, unbind
        self.seen = [0] * len(threads)
        for engine in threads:
            engine.start()

    def moved_on(self) -> None:
        """Waits until every engine has made a tensor since the last call: what comes next
        starts while they allocate, whatever the machine's load."""
        self.seen = [e.wait_past(n) for e, n in zip(self.threads, self.seen)]

    def overwritten(self) -> int:
        return sum(e.overwritten() for e in self.threads)

    def stop(self) -> str:
        """Stops them all; says what each made."""
        try:
            return ", ".join([engine.stop() for engine in self.threads])
        finally:
            if self.unbind is not None:
                self.unbind()


class Losses:
    """The loans (or releases) after which tensors of another tag had lost their bytes."""

    def __init__(self, engines: Engine | Engines):
        self.engines = engines
        self.seen: list[tuple[int, int]] = []   # (after which, how many)

    def check(self, i: int) -> None:
        overwritten = self.engines.overwritten()
        if overwritten:
            self.seen.append((i, overwritten))

    def report(self, count: int, what: str, how: str = "overwritten") -> str:
        return (f"{self.seen[-1][1]} tensors of another tag {how} in {count} {what}s, "
                f"first seen after {what} {self.seen[0][0]}")


# --------------------------------------------------------------------------- allocator hooks

class _Block:
    """Owner of one allocation made through the torch hooks: its death frees it there, as
    PyTorch frees a segment."""

    def __init__(self, ptr: int, nbytes: int, slot: int):
        weakref.finalize(self, _lib.lib().sublet_torch_free, ptr, nbytes, slot, None)


def routed(pool: sublet.Pool, slot: int, busy: str) -> Callable[[int], torch.Tensor]:
    """Allocations as PyTorch's allocator asks for them inside `with sublet.pool(tag)`:
    sublet_torch_alloc on device index `slot` (one no machine has), bound to the pool's tag. A
    NULL it returns is what PyTorch turns into torch.OutOfMemoryError; its reason is the
    thread's last error, a BusyError here where it says `busy` (the arena is held: EBUSY)."""
    pool.arena.client.torch_bind_pool(slot, pool.tag_id)

    def make(nbytes: int) -> torch.Tensor:
        ptr = _lib.lib().sublet_torch_alloc(nbytes, slot, None)
        if not ptr:
            message = _lib.last_error()
            if busy in message:
                raise sublet.BusyError(message, _lib.ERROR_CODES["EBUSY"])
            raise RuntimeError(message)
        return wrap(ptr, nbytes, torch.device("cpu"), _Block(ptr, nbytes, slot), (nbytes,),
                    torch.uint8)
    return make


@pytest.fixture
def little_free_memory():
    """All but 8 MiB of the daemon's memory held by a tensor no loan or release touches, for
    the test: a borrower's fill is then the loan's pages and a few fresh ones, not 64 MiB of
    fresh pages mapped at every loan, and the engines' tensors stay in a small arena, where
    first fit reuses the pages the tag frees."""
    gc.collect()
    hog = sublet.empty(sublet.info("cpu").free_bytes - (8 << 20), dtype=torch.uint8,
                       device="cpu")
    yield
    del hog


# --------------------------------------------------------------------------- GPU

@pytest.fixture(autouse=True)
def pools_emptied() -> Iterator[None]:
    """Each test's pool memory goes back after it (the other GPU tests need the device).
    Autouse in the GPU modules that import it."""
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
    out.copy_(t.reshape(-1).view(torch.uint8))
    return out
