"""More of a release by need, end to end on the memfd backend (issue 42): Release.need(N), N
the taker's need in all, releases only the pages the increase takes beyond the device's free
bytes, of those that stayed, chosen as the first need's were (daemon/books/need_pick.c: few
bytes moved, few runs), without resuming anything;
resume() brings everything back at once, bit for bit. Checked against the rule after each
step (pages, host bytes max(0, K - stayed x page), moves), the status, a refused increment,
and the owner, the taker or subletd killed between the first need and the second or during
the second. The books' reference checks are tests/unit/test_books_need.c.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import sublet
from conftest import PAGE, REPO, memfd_free_bytes as free_bytes
from pool_helpers import bits, free_after_kill, random_bytes
from test_survive import Daemon

pytestmark = pytest.mark.daemon

PAGES = 64
SIZE = PAGES * PAGE


def staircase(t: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Page i keeps its first (i % 8 + 1) x 8 KiB: 8 pages of each count, 36 pages' worth."""
    kept = [(i % 8 + 1) * 8192 for i in range(PAGES)]
    return [t[i * PAGE:i * PAGE + kept[i]] for i in range(PAGES)], kept


def host_bytes(kept: list[int], released: int) -> int:
    return max(0, sum(kept) - (PAGES - released) * PAGE)


@pytest.mark.usefixtures("memfd_daemon")
def test_need_alloc_need_alloc_free_then_resume():
    """The sequence a lost draft got wrong (a 64 KiB page counted as used at the end): need,
    the taker allocates it, a larger need, the taker allocates the rest, frees; resume. Each
    step releases what the rule says, nothing comes back before the resume, every kept bit
    comes back, and the device's free bytes are what they were, to the byte."""
    from sublet import _memory
    t = random_bytes(sublet.empty(SIZE, dtype=torch.uint8, device="cpu"), seed=3)
    keep, kept = staircase(t)
    before = [bits(v) for v in keep]
    gc.collect()
    free0 = free_bytes()
    rel = sublet.release(t, keep=keep, need=free0 + 10 * PAGE)
    assert rel.stats.released_pages == 10  # pages 0 to 9, one run: the ten holding the fewest
    assert (rel.moved_bytes, rel.copied_bytes) == (39 * 8192, 0)  # kept bytes would be ten
    first = sublet.empty(free0 + 10 * PAGE, dtype=torch.uint8, device="cpu").fill_(0xA1)
    assert free_bytes() == 0
    stats = rel.need(free0 + 30 * PAGE)                    # 20 more, of those that stay
    assert stats.released_pages == rel.stats.released_pages == 30
    assert stats.stayed_pages == 34 and rel.need_bytes == free0 + 30 * PAGE
    assert rel.copied_bytes == host_bytes(kept, 30) == 2 * PAGE
    assert rel.moved_bytes >= sum(sorted(kept)[:30]) - rel.copied_bytes
    status = _memory.resolve_device("cpu")[1].status()
    mine = [r for r in status["releases"] if r["id"] == rel.stats.release_id][0]
    assert (mine["need_bytes"], mine["need_increments"], mine["free_bytes"]) == \
        (free0 + 30 * PAGE, 1, 0)
    assert (mine["released_bytes"], mine["copied_out_bytes"]) == (30 * PAGE, 2 * PAGE)
    assert mine["moved_bytes"] == rel.moved_bytes
    second = sublet.empty(20 * PAGE, dtype=torch.uint8, device="cpu").fill_(0xB2)
    assert rel.need(free0 + 30 * PAGE).released_pages == 30  # not more: nothing happens
    assert rel.need(PAGE).released_pages == 30
    del first, second
    gc.collect()
    assert free_bytes() == free0 + 30 * PAGE
    stats = rel.resume()
    assert stats.copied_in_bytes == 2 * PAGE
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    assert free_bytes() == free0


@pytest.mark.usefixtures("memfd_daemon")
def test_an_increment_the_pages_that_stay_cannot_give_is_refused():
    t = random_bytes(sublet.empty(16 * PAGE, dtype=torch.uint8, device="cpu"), seed=4)
    whole = bits(t)
    gc.collect()
    free0 = free_bytes()
    with sublet.release(t, need=free0 + 4 * PAGE) as rel:
        taken = sublet.empty(free0 + 4 * PAGE, dtype=torch.uint8, device="cpu")
        with pytest.raises(sublet.NeedTooLargeError) as e:
            rel.need(free0 + 4 * PAGE + 12 * PAGE + 1)
        assert "12 pages" in str(e.value) and "1 short" in str(e.value)
        assert rel.stats.released_pages == 4 and rel.need_bytes == free0 + 4 * PAGE
        assert rel.need(free0 + 16 * PAGE).released_pages == 16   # exactly all of it
        del taken
    assert np.array_equal(bits(t), whole)
    with sublet.release(t) as plain, pytest.raises(ValueError, match="not made by need"):
        plain.need(PAGE)


TAKER = """
import sys, torch, sublet
held = []
for line in sys.stdin:                      # a size a line: allocated, written, held
    held.append(sublet.empty(int(line), dtype=torch.uint8, device="cpu").fill_(0x5A))
    print("holding", sum(t.numel() for t in held), flush=True)
"""


@pytest.mark.usefixtures("memfd_daemon")
def test_taker_killed_between_the_needs_and_after():
    t = random_bytes(sublet.empty(32 * PAGE, dtype=torch.uint8, device="cpu"), seed=5)
    keep = [t[i * PAGE + 100:i * PAGE + 40000] for i in range(32)]
    before = [bits(v) for v in keep]
    taker = subprocess.Popen([sys.executable, "-c", TAKER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    gc.collect()
    free0 = free_bytes()
    try:
        rel = sublet.release(t, keep=keep, need=free0 + 6 * PAGE)
        taker.stdin.write(f"{free0 + 6 * PAGE}\n")
        taker.stdin.flush()
        assert taker.stdout.readline().split() == ["holding", str(free0 + 6 * PAGE)]
        rel.need(free0 + 14 * PAGE)
        taker.stdin.write(f"{8 * PAGE}\n")
        taker.stdin.flush()
        assert taker.stdout.readline().split()[0] == "holding"
        assert free_after_kill(taker, free0 + 14 * PAGE, tries=500) == free0 + 14 * PAGE
        assert rel.need(free0 + 20 * PAGE).released_pages == 14   # the free bytes cover it
        stats = rel.resume()
        assert stats.copied_in_bytes == rel.copied_bytes > 0   # 18 pages cannot hold 14's
    finally:
        taker.kill()
        taker.wait()
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    assert free_bytes() == free0


@pytest.fixture
def paced_daemon(native, tmp_path, monkeypatch):
    """A subletd of the test's own whose copies to the host run at 256 KiB/s: a save of 192
    KiB lasts long enough to be seen running (in the status) and something killed then."""
    from sublet import _client
    monkeypatch.setenv("SUBLET_MEMFD_LINK", "256K")
    d = Daemon(str(tmp_path / "gpu0.sock"))
    d.start()
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    monkeypatch.setenv("SUBLET_SOCKET", d.path)
    monkeypatch.setattr(_client, "_clients", {})
    yield d
    d.stop()


def kill_when_releasing(kill, release_id: int | None = None) -> threading.Thread:
    """A thread that calls kill() once a release's increment runs (its state, as another
    connection's status shows it, is "releasing" again; release_id None: any release)."""
    from sublet import _daemon
    watcher = _daemon.connect(0, "memfd")

    def watch() -> None:
        while True:
            states = {r["id"]: r["state"] for r in watcher.status()["releases"]}
            if (states.get(release_id) if release_id else
                    next(iter(states.values()), None)) == "releasing":
                kill()
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("when", ["between", "during"])
def test_daemon_killed_between_the_needs_or_during_the_second(paced_daemon, when):
    t = random_bytes(sublet.empty(24 * PAGE, dtype=torch.uint8, device="cpu"), seed=6)
    before = bits(t)
    free = sublet.info("cpu").free_bytes
    rel = sublet.release(t, keep=[t[:3 * PAGE]], need=free + 16 * PAGE)  # 3 pages' worth:
    assert rel.stats.released_pages == 16 and rel.copied_bytes == 0    # the holes hold them
    hold = sublet.empty(free + 16 * PAGE, dtype=torch.uint8, device="cpu")
    watch = (kill_when_releasing(paced_daemon.kill, rel.stats.release_id) if when == "during"
             else None)
    if when == "between":
        paced_daemon.kill()
    with pytest.raises(sublet.DaemonDiedError, match="nothing more was released"):
        rel.need(free + 16 * PAGE + 8 * PAGE)  # all 8 that stay: 3 pages saved, paced
    if watch is not None:
        watch.join()
    with pytest.warns(RuntimeWarning, match="subletd died"):
        stats = rel.resume()
    assert stats.daemon_died
    assert np.array_equal(bits(t[:3 * PAGE]), before[:3 * PAGE])
    del hold


OWNER = """
import sys, torch, sublet
cache = sublet.empty(int(sys.argv[1]), dtype=torch.uint8, device="cpu")
cache[:3 * 65536].fill_(7)
free = sublet.info("cpu").free_bytes
rel = sublet.release(cache, keep=[cache[:3 * 65536]], need=free + int(sys.argv[2]))
hold = sublet.empty(free + int(sys.argv[2]), dtype=torch.uint8, device="cpu")  # its taker
print("released", rel.stats.released_pages, flush=True)
rel.need(rel.need_bytes + int(sys.argv[3]))          # killed while subletd saves for it
"""


def test_owner_killed_during_the_second_need(paced_daemon):
    """(Killed between the first need and the second: test_release_need_memfd's
    test_owner_killed_while_released_by_need_gives_everything_back.) Killed while subletd
    saves for its second need: every page goes back to the driver once the job is done."""
    from pool_helpers import owner_process
    free0 = sublet.info("cpu").free_bytes
    child = owner_process(OWNER, str(24 * PAGE), str(16 * PAGE), str(8 * PAGE))
    try:
        assert child.stdout.readline().split() == ["released", "16"]
        watch = kill_when_releasing(child.kill)
        watch.join()
        assert free_after_kill(child, free0, tries=1000) == free0
    finally:
        child.kill()
        child.wait()
