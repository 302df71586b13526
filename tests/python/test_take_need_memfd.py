"""A scheduler's take by need, end to end on the memfd backend (issue 42): sublet.take(name=,
need=N) makes the owner's library release its offer by need (as sublet.release(need=N)), and
Taken.need(M), M the taker's need in all, makes it release more of the live release, nothing
resumed; the give back resumes everything at once, bit for bit. Real processes: the owner
here, a scheduler child that takes, allocates its need (a plain client of the device) and asks
for more; the taker, the owner or subletd killed between the needs or during the second. The
refusals (ENEED with the figures, an owner that predates take(need=)) are also checked through
the C API in tests/integration/test_release_offer.c ("by need").
"""

from __future__ import annotations

import gc
import textwrap

import numpy as np
import pytest
import torch

import sublet
from conftest import PAGE, memfd_free_bytes as free_bytes
from pool_helpers import bits, free_after_kill, owner_process, random_bytes
from test_release_more_memfd import (PAGES, SIZE, host_bytes, kill_when_releasing,  # noqa: F401
                                     paced_daemon, staircase)
from test_release_offer_memfd import Child, offers_named, status

pytestmark = pytest.mark.daemon

# A scheduler driven a line at a time (no torch): "take NAME NEED", "alloc N" (a plain client's
# memory, written), "need N", "free", "back"; each answered a line, or "error Type message".
SCHEDULER = textwrap.dedent("""
    import ctypes, sys, sublet
    from sublet import _client
    t, held = None, []
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "take":
                t = sublet.take(name=args[0], device="cpu", timeout=300, need=int(args[1]))
                t.__enter__()
                print("taken", t.stats.released_pages, t.stats.copied_out_bytes, flush=True)
            elif cmd == "need":
                s = t.need(int(args[0]))
                print("more", s.released_pages, s.copied_out_bytes, flush=True)
            elif cmd == "alloc":
                r = _client.client_for("memfd", 0).region_create(int(args[0]))
                ctypes.memset(r.addr, 0xEE, r.size)
                held.append(r)
                print("ok", flush=True)
            elif cmd == "free":
                while held:
                    _client.client_for("memfd", 0).region_release(held.pop())
                print("ok", flush=True)
            elif cmd == "back":
                t.__exit__(None, None, None)
                print("back", t.resumed_stats.copied_in_bytes, flush=True)
        except sublet.SubletError as e:
            print("error", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
""")


def ask(child: Child, line: str) -> list[str]:
    child.say(line)
    return child.line().split()


def offered(name: str, seed: int, stay: int | None = None):
    """An offer of SIZE random bytes here, page i keeping its first (i % 8 + 1) x 8 KiB."""
    t = random_bytes(sublet.empty(SIZE, dtype=torch.uint8, device="cpu"), seed=seed)
    keep, kept = staircase(t)
    before = [bits(v) for v in keep]
    gc.collect()
    free0 = free_bytes()
    off = sublet.offer(t, keep=keep, name=name, release=True, stay=stay)
    return t, keep, kept, before, free0, off


@pytest.mark.usefixtures("memfd_daemon")
def test_take_by_need_then_more_then_one_give_back():
    """Need, the taker allocates it, a larger need (the next fewest pages, nothing resumed),
    the taker allocates the rest; the status shows the need and its increment; refusals leave
    the offer on offer (at the take) or as it was (more); one give back brings every kept bit
    back and the device's free bytes to the byte."""
    t, keep, kept, before, free0, off = offered("need-rt", 11)
    sched = Child(SCHEDULER)
    try:
        # more than the free bytes and all 64 pages: refused, the figures, still on offer
        words = ask(sched, f"take need-rt {free0 + SIZE + 1}")
        assert words[:2] == ["error", "NeedTooLargeError"] and "1 short" in " ".join(words)
        assert "on offer again" in " ".join(words)
        assert offers_named("need-rt")[0]["state"] == "offered" and off.state == "offered"
        assert free_bytes() == free0
        assert ask(sched, f"take need-rt {free0 + 10 * PAGE}") == ["taken", "10", "0"]
        assert off.state == "released" and off.released_bytes == 10 * PAGE
        assert ask(sched, f"alloc {free0 + 10 * PAGE}") == ["ok"]
        assert free_bytes() == 0
        assert ask(sched, f"need {free0 + 30 * PAGE}") == ["more", "30", str(2 * PAGE)]
        assert host_bytes(kept, 30) == 2 * PAGE and off.state == "released"
        assert off.released_bytes == 30 * PAGE            # the owner's stats follow
        s = status()
        mine = [r for r in s["releases"] if r["id"] == off.released_stats.release_id][0]
        assert (mine["need_bytes"], mine["need_increments"], mine["free_bytes"]) == \
            (free0 + 30 * PAGE, 1, 0)
        assert (mine["released_bytes"], mine["copied_out_bytes"]) == (30 * PAGE, 2 * PAGE)
        shown = offers_named("need-rt")[0]
        assert shown["need_bytes"] == free0 + 30 * PAGE and shown["state"] == "released"
        from sublet import _status
        text = _status.text_status(dict(s, socket="test"))
        assert f"for a need of {sublet._units.human(free0 + 30 * PAGE)}" in text
        assert "1 more need since" in text
        assert ask(sched, f"alloc {20 * PAGE}") == ["ok"]
        assert ask(sched, f"need {free0 + 30 * PAGE}") == ["more", "30", str(2 * PAGE)]  # no-op
        words = ask(sched, f"need {free0 + SIZE + 1}")    # 34 stay, none free: 1 byte short
        assert words[:2] == ["error", "NeedTooLargeError"] and "1 short" in " ".join(words)
        assert off.released_bytes == 30 * PAGE and free_bytes() == 0   # as it was, still held
        assert ask(sched, "free") == ["ok"]
        assert ask(sched, "back") == ["back", str(2 * PAGE)]
        stats = off.wait(timeout=300)
    finally:
        sched.close()
    assert stats.copied_in_bytes == 2 * PAGE and stats.released_pages == 30
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    assert free_bytes() == free0 and not offers_named("need-rt")


@pytest.mark.usefixtures("memfd_daemon")
def test_the_taker_killed_between_the_needs_and_after_the_second():
    """Killed holding a need and its memory: the owner resumes everything at once
    (BorrowerDiedError, every kept bit back), once the memory the taker held is free."""
    for when in ("between", "after"):
        t, keep, kept, before, free0, off = offered(f"need-die-{when}", 12)
        sched = Child(SCHEDULER)
        try:
            assert ask(sched, f"take need-die-{when} {free0 + 6 * PAGE}")[:2] == ["taken", "6"]
            assert ask(sched, f"alloc {free0 + 6 * PAGE}") == ["ok"]
            if when == "after":
                assert ask(sched, f"need {free0 + 20 * PAGE}")[:2] == ["more", "20"]
                assert ask(sched, f"alloc {14 * PAGE}") == ["ok"]
            sched.kill()
            with pytest.raises(sublet.BorrowerDiedError, match="went without giving it back"):
                off.wait(timeout=300)
        finally:
            sched.close()
        assert off.released_stats.released_pages == (6 if when == "between" else 20)
        assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before)), when
        assert free_bytes() == free0
        del t, keep, off
        gc.collect()


# An owner in a process of its own, through the C library alone (no torch to import): offers a
# region of SIZE bytes (the staircase keep: 2 pages to the host once 30 are released), says
# "offered", then waits for the offer's end.
OWNER = textwrap.dedent(f"""
    import ctypes, sys
    import numpy as np
    from sublet import _client, _lib
    region = _client.client_for("memfd", 0).region_create({SIZE})
    ctypes.memset(region.addr, 7, region.size)
    keep = np.array([[i * {PAGE}, (i % 8 + 1) * 8192] for i in range({PAGES})], np.uint64)
    off = _lib.Client.offer_release(region, None, keep, _lib.STAY_ANY, sys.argv[1])
    print("offered", _lib.Client.release_offer_id(off), flush=True)
    _lib.Client.release_offer_wait(off, 60000)
""")


def test_the_owner_killed_during_the_second_need(paced_daemon):
    """Killed while subletd saves for its second need (paced): the taker's need() hears
    OwnerGoneError, and every page of the owner goes back to the driver."""
    free0 = sublet.info("cpu").free_bytes
    owner = owner_process(OWNER, "need-owner")
    try:
        assert owner.stdout.readline().split()[0] == "offered"
        free1 = sublet.info("cpu").free_bytes
        t = sublet.take(name="need-owner", device="cpu", timeout=300, need=free1 + 10 * PAGE)
        with pytest.raises(sublet.OwnerGoneError):
            with t:
                assert t.stats.released_pages == 10
                from sublet import _client
                hold = _client.client_for("memfd", 0).region_create(free1 + 10 * PAGE)
                watch = kill_when_releasing(owner.kill)
                t.need(t.need_bytes + 20 * PAGE)         # 2 pages saved, paced: killed then
        watch.join()
        assert not t.active
        _client.client_for("memfd", 0).region_release(hold)
        assert free_after_kill(owner, free0, tries=1000) == free0
    finally:
        owner.kill()
        owner.wait()


def test_the_daemon_killed_during_the_second_need(paced_daemon):
    """subletd killed while it saves for the second need: the owner resumes alone from the
    save area and the flat plan (DaemonDiedError), every kept bit back; the taker hears that
    subletd is gone."""
    t, keep, kept, before, free0, off = offered("need-daemon", 13)
    sched = Child(SCHEDULER)
    try:
        assert ask(sched, f"take need-daemon {free0 + 10 * PAGE}")[:2] == ["taken", "10"]
        assert ask(sched, f"alloc {free0 + 10 * PAGE}") == ["ok"]
        watch = kill_when_releasing(paced_daemon.kill, off.released_stats.release_id)
        words = ask(sched, f"need {free0 + 30 * PAGE}")   # 2 pages saved, paced: killed then
        watch.join()
        assert words[:2] == ["error", "DaemonUnavailableError"], words
        with pytest.raises(sublet.DaemonDiedError) as e:
            off.wait(timeout=300)
    finally:
        sched.close()
    assert e.value.stats.daemon_died
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    t.fill_(1)                                           # its memory is this process's own now
    del t, keep
    gc.collect()
