"""Release offers end to end on the memfd backend (no GPU): a release that a scheduler in
another process starts and ends (sublet.offer(..., release=True) / sublet.take), with real
processes and a real daemon.

What each test would catch: memory that is not the driver's while taken (a third process's
allocation that failed before the take fails during it too), a kept bit lost or put back in
the wrong place (bits compared, after the released memory was written over by someone else),
an owner that does not resume when the scheduler dies, a scheduler left waiting when the
owner dies, an owner that loses its data when subletd dies, offers another user may take.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import sublet
from sublet import _memory

from conftest import CHILD_ENV, PAGE, memfd_free_bytes as free_bytes
from pool_helpers import bits, random_bytes
from test_survive import Daemon, daemon  # noqa: F401 (the fixture: a subletd of the test's own)

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

# A scheduler: takes the offer `name` `rounds` times; each time says "taken <bytes released>",
# then (hold) waits for a line on stdin before giving it back, and says "back <bytes restored>"
# or the error that giving back raised.
SCHEDULER = textwrap.dedent("""
    import sys, sublet
    name, rounds, hold = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "hold"
    for _ in range(rounds):
        t = sublet.take(name=name, device="cpu", timeout=300)
        try:
            with t:
                print("taken", t.released_bytes, t.offer_id, flush=True)
                if hold:
                    sys.stdin.readline()
            print("back", t.resumed_stats.copied_in_bytes, flush=True)
        except sublet.SubletError as e:
            print("error", type(e).__name__, e, flush=True)
""")

# A plain process of the device (on memfd, a client that makes memory of its own, as a
# cudaMalloc would on a GPU; no torch, which a plain process need not have): allocates n bytes
# and writes them; "ok" or "oom". hold: keeps them until a line on stdin.
HOG = textwrap.dedent("""
    import ctypes, sys
    from sublet import _client, _lib
    n, hold = int(sys.argv[1]), sys.argv[2] == "hold"
    try:
        region = _client.client_for("memfd", 0).region_create(n)
    except _lib.SubletOutOfMemoryError:
        print("oom", flush=True)
        sys.exit(0)
    ctypes.memset(region.addr, 0xEE, region.size)
    print("ok", flush=True)
    if hold:
        sys.stdin.readline()
""")

# An owner in a process of its own: offers n bytes of random data keeping a block of every
# third page, says "offered <id>", waits, then says how the wait ended and whether every kept
# bit is back.
OWNER = textwrap.dedent("""
    import sys, torch, sublet
    n, name, page = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    cache = sublet.empty(n, dtype=torch.uint8, device="cpu")
    g = torch.Generator().manual_seed(5)
    cache.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    keep = [cache[i * page + 100:i * page + 5000] for i in range(0, n // page, 3)]
    before = [k.clone() for k in keep]
    off = sublet.offer(cache, keep=keep, name=name, release=True)
    print("offered", off.offer_id, flush=True)
    try:
        off.wait(timeout=60)
        outcome = "ok"
    except sublet.SubletError as e:
        outcome = type(e).__name__
    print(outcome, all(torch.equal(k, b) for k, b in zip(keep, before)), flush=True)
""")


class Child:
    """A Python child of this test, driven line by line."""

    def __init__(self, script: str, *args: object, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None):
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-c", script,
                                      *map(str, args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env or dict(os.environ, **CHILD_ENV))

    def line(self) -> str:
        out = self.proc.stdout.readline().strip()
        assert out, f"the child said nothing (exit {self.proc.poll()})"
        return out

    def say(self, text: str = "") -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def hog(nbytes: int) -> str:
    """Whether a plain process of the device can allocate nbytes now: "ok" or "oom"."""
    r = subprocess.run([sys.executable, "-c", HOG, str(nbytes), "no"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, **CHILD_ENV))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def status() -> dict:
    return _memory.resolve_device("cpu")[1].status()


def offers_named(name: str) -> list[dict]:
    return [o for o in status()["release_offers"] if o["name"] == name]


def wait_for(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def scattered(cache: torch.Tensor, rng: np.random.Generator, page: int) -> list[torch.Tensor]:
    """A new keep: a few blocks of random length in random pages."""
    pages = cache.numel() // page
    chosen = sorted(rng.choice(pages, size=int(rng.integers(1, pages // 2)), replace=False))
    out = []
    for p in chosen:
        start = int(rng.integers(0, page - 4096))
        out.append(cache[p * page + start:p * page + start + int(rng.integers(1, 4096))])
    return out


# --------------------------------------------------------------------------- the round trip

def test_a_scheduler_takes_the_offer_and_a_third_process_allocates_the_memory():
    n = 32 * PAGE
    cache = random_bytes(sublet.empty(n, dtype=torch.uint8, device="cpu"), 21)
    keep = [cache[i * PAGE + 64:i * PAGE + 64 + 3000] for i in range(0, 32, 4)]  # 8 pages
    before = [bits(k) for k in keep]
    free0 = free_bytes()
    assert hog(free0 + 16 * PAGE) == "oom"               # not there before the take
    off = sublet.offer(cache, keep=keep, name="rt-kv", release=True)
    assert off.state == "offered" and offers_named("rt-kv")[0]["state"] == "offered"
    sched = Child(SCHEDULER, "rt-kv", 1, "hold")
    try:
        word, released, offer_id = sched.line().split()
        assert word == "taken" and int(offer_id) == off.offer_id
        # 24 KiB kept in 8 pages fit in one: 31 of 32 pages went back to the driver
        assert int(released) == 31 * PAGE == off.released_bytes
        assert free_bytes() == free0 + 31 * PAGE and off.state == "released"
        shown = offers_named("rt-kv")[0]
        assert shown["state"] == "released" and shown["taker_pid"] == sched.proc.pid
        assert shown["released_bytes"] == 31 * PAGE and shown["kept_bytes"] == 8 * 3000
        from sublet import _status
        assert f"offer    {off.offer_id} \"rt-kv\" (release)" in _status.text_status(
            dict(status(), socket="test"))
        assert hog(free0 + 16 * PAGE) == "ok"            # someone else allocates it, writes it
        sched.say()
        assert sched.line() == "back 0"
        stats = off.wait(timeout=300)
    finally:
        sched.close()
    assert stats.released_pages == 31 and stats.copied_in_bytes == 0
    assert off.released_stats.moved_bytes == 7 * 3000
    assert all(np.array_equal(bits(k), b) for k, b in zip(keep, before))
    assert free_bytes() == free0 and off.state == "ended" and not offers_named("rt-kv")
    with pytest.raises(sublet.SubletOutOfMemoryError):   # the owner's own memory again
        sublet.empty(free0 + PAGE, dtype=torch.uint8, device="cpu")


@pytest.mark.parametrize("stay", [None, 0])
def test_loans_in_sequence_with_changing_keeps_bring_every_kept_bit_back(stay):
    n = 24 * PAGE
    cache = random_bytes(sublet.empty(n, dtype=torch.uint8, device="cpu"), 31)
    rng = np.random.default_rng(3 if stay is None else 4)
    free0 = free_bytes()
    sched = Child(SCHEDULER, f"seq-{stay}", 4, "no")
    try:
        for round_ in range(4):
            cache[round_ * PAGE:(round_ + 1) * PAGE].copy_(    # the owner works between loans
                random_bytes(torch.empty(PAGE, dtype=torch.uint8), 100 + round_))
            keep = scattered(cache, rng, PAGE)
            before = [bits(k) for k in keep]
            off = sublet.offer(cache, keep=keep, name=f"seq-{stay}", release=True, stay=stay)
            assert sched.line().startswith("taken")
            assert sched.line().startswith("back")
            stats = off.wait(timeout=300)
            kept = sum(k.numel() for k in keep)
            assert off.released_stats.kept_bytes == kept
            if stay == 0:
                assert stats.copied_in_bytes == kept and off.released_stats.stayed_pages == 0
            else:
                assert stats.copied_in_bytes == 0
            assert all(np.array_equal(bits(k), b) for k, b in zip(keep, before)), round_
            assert free_bytes() == free0
    finally:
        sched.close()


# --------------------------------------------------------------------------- deaths

def test_the_scheduler_killed_while_holding_and_the_owner_resumes():
    n = 16 * PAGE
    cache = random_bytes(sublet.empty(n, dtype=torch.uint8, device="cpu"), 41)
    keep = [cache[5 * PAGE:5 * PAGE + 777], cache[9 * PAGE + 1:11 * PAGE]]
    before = [bits(k) for k in keep]
    free0 = free_bytes()
    off = sublet.offer(cache, keep=keep, name="die-sched", release=True)
    sched = Child(SCHEDULER, "die-sched", 1, "hold")
    try:
        assert sched.line().startswith("taken")
        assert free_bytes() > free0
        sched.kill()
        with pytest.raises(sublet.BorrowerDiedError, match="went without giving it back") as e:
            off.wait(timeout=300)
    finally:
        sched.close()
    assert e.value.stats.released_pages == off.released_stats.released_pages > 0
    assert all(np.array_equal(bits(k), b) for k, b in zip(keep, before))
    assert free_bytes() == free0


def test_the_owner_killed_while_offered_leaves_nothing_to_take():
    owner = Child(OWNER, 8 * PAGE, "die-offered", PAGE)
    try:
        assert owner.line().startswith("offered")
        assert offers_named("die-offered")
        owner.kill()
        assert wait_for(lambda: not offers_named("die-offered"))
        with pytest.raises(sublet.NoOfferError, match="no release offer named \"die-offered\""):
            with sublet.take(name="die-offered", device="cpu", timeout=0):
                pass
    finally:
        owner.close()


def test_the_owner_killed_while_released_tells_the_scheduler():
    gc.collect()            # an earlier module's dropped tensors go first: free0 is the floor
    free0 = free_bytes()
    owner = Child(OWNER, 16 * PAGE, "die-released", PAGE)
    try:
        assert owner.line().startswith("offered")
        t = sublet.take(name="die-released", device="cpu", timeout=300)
        # subletd sees the death before the give-back (released) or after it (returning):
        # the scheduler is told either way
        with pytest.raises(sublet.OwnerGoneError, match="went while it was (released|returning)"):
            with t:
                assert t.released_bytes > 0
                owner.kill()
        assert not t.active
    finally:
        owner.close()
    assert wait_for(lambda: free_bytes() == free0)     # its memory went with its regions
    assert hog(free0) == "ok" and status()["release_offers"] == []  # and the daemon serves on


def test_the_daemon_killed_while_released_and_the_owner_resumes_alone(daemon):
    n = 32 * PAGE
    cache = random_bytes(sublet.empty(n, dtype=torch.uint8, device="cpu"), 51)
    keep = [cache[i * PAGE + 10:i * PAGE + 2000] for i in range(0, 32, 5)]
    before = [bits(k) for k in keep]
    off = sublet.offer(cache, keep=keep, name="die-daemon", release=True, stay=0)
    sched = Child(SCHEDULER, "die-daemon", 1, "hold")
    try:
        assert sched.line().startswith("taken")
        assert off.released_bytes > 0
        daemon.kill()
        with pytest.raises(sublet.DaemonDiedError) as e:
            off.wait(timeout=300)
        sched.say()
        assert sched.line().startswith("error Daemon")   # its give back hears subletd is gone
    finally:
        sched.close()
    assert e.value.stats.daemon_died and e.value.stats.copied_in_bytes == 7 * 1990
    assert all(np.array_equal(bits(k), b) for k, b in zip(keep, before))
    cache.fill_(1)                                       # its memory is this process's own now
    del cache
    gc.collect()


def test_the_daemon_killed_while_offered_releases_nothing(daemon):
    cache = random_bytes(sublet.empty(8 * PAGE, dtype=torch.uint8, device="cpu"), 52)
    before = bits(cache)
    off = sublet.offer(cache, keep=[], name="die-daemon-offered", release=True)
    daemon.kill()
    with pytest.raises(sublet.DaemonDiedError, match="nothing was released"):
        off.wait(timeout=300)
    assert np.array_equal(bits(cache), before)


# --------------------------------------------------------------------------- the rest

def test_resume_waits_for_the_memory_to_be_freed_and_status_says_why():
    free0 = free_bytes()
    owner = Child(OWNER, 16 * PAGE, "oom-resume", PAGE)
    holder = None
    try:
        assert owner.line().startswith("offered")
        t = sublet.take(name="oom-resume", device="cpu", timeout=300).__enter__()
        holder = Child(HOG, free_bytes(), "hold")         # takes every byte released
        assert holder.line() == "ok"
        with pytest.raises(sublet.SubletTimeoutError, match="resume fails"):
            t.give_back(timeout=1)
        assert "free it" in offers_named("oom-resume")[0]["trouble"]
        holder.say()                                     # the memory is freed ...
        holder.proc.wait()
        assert t.give_back(timeout=300).released_pages > 0    # ... and the owner resumes
        assert owner.line() == "ok True"
    finally:
        owner.close()
        if holder is not None:
            holder.close()
    assert wait_for(lambda: free_bytes() == free0)


def test_what_release_offers_refuse():
    cache = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    off = sublet.offer(cache, keep=[], name="refuse", release=True)
    other = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    with pytest.raises(sublet.BusyError, match="named \"refuse\" is live already"):
        sublet.offer(other, name="refuse", release=True)
    with pytest.raises(sublet.NoOfferError, match="no release offer named \"nothing\""):
        with sublet.take(name="nothing", device="cpu", timeout=0):
            pass
    with pytest.raises(sublet.NoOfferError):              # a routed borrow does not see it
        with sublet.borrow(name="refuse", device="cpu", timeout=0):
            pass
    with pytest.raises(ValueError, match="a routed offer's"):
        sublet.offer(other, name="x", release=True, verify=True)
    off.withdraw()
    assert off.state == "ended" and not offers_named("refuse")
    with pytest.raises(RuntimeError, match="withdrawn"):
        off.wait()
    with sublet.offer(cache, keep=[], name="refuse", release=True) as again:  # the name is free
        sched = Child(SCHEDULER, "refuse", 1, "hold")
        try:
            assert sched.line().startswith("taken")
            with pytest.raises(sublet.BusyError, match="taken already"):
                with sublet.take(name="refuse", device="cpu", timeout=0):
                    pass
            with pytest.raises(sublet.BusyError, match="has been taken"):
                again.withdraw()
            sched.say()                                  # leaving the block waits for it
        finally:
            sched.proc.wait(timeout=300)
            sched.close()
    assert again.state == "ended"
    del off, again
    gc.collect()


# --------------------------------------------------------------------------- another user

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
# As another user, through the C library alone (torch is not that user's to import): take the
# offer, wait for its release, give it back; then give back the offer by its id.
NOBODY_TAKES = textwrap.dedent("""
    import os, sys
    from sublet import _lib
    client = _lib.Client.open(os.environ["SUBLET_SOCKET"])
    try:
        offer = client.take(sys.argv[1], 0)
        state, stats = client.take_wait(offer, 30000)
        print("taken", stats.released_pages * client.info.page_size, flush=True)
        client.give_back(offer)
        client.take_wait(offer, 30000)
    except _lib.SubletError as e:
        print(type(e).__name__, e, flush=True)
    try:
        client.give_back(int(sys.argv[2]))
    except _lib.SubletError as e:
        print(type(e).__name__, e.code_name, flush=True)
""")


@pytest.fixture
def open_daemon(native, monkeypatch, request):
    """A subletd whose socket another user may reach (0666, in a 0755 directory); with
    --allow-group nogroup when the test is parametrised so."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chmod(path, 0o755)
    d = Daemon(str(path / "gpu0.sock"))
    if getattr(request, "param", False):
        env = dict(os.environ, SUBLET_MEMFD_PAGE_SIZE="64K", SUBLET_MEMFD_TOTAL="16M")
        d.proc = subprocess.Popen([os.environ["SUBLETD"], "--backend", "memfd", "--socket",
                                   d.path, "--log-level", "warn", "--allow-group", "nogroup"],
                                  env=env)
        assert wait_for(lambda: os.path.exists(d.path))
        time.sleep(0.1)
    else:
        d.start()
    os.chmod(d.path, 0o666)
    from sublet import _client
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    monkeypatch.setenv("SUBLET_SOCKET", d.path)
    monkeypatch.setattr(_client, "_clients", {})
    yield d
    d.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes the user nobody: needs root")
@pytest.mark.parametrize("open_daemon", [False, True], indirect=True,
                         ids=["another-user", "allow-group"])
def test_another_user_may_take_only_with_allow_group(open_daemon, native, request):
    allowed = request.node.callspec.params["open_daemon"]
    home = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chown(home, 65534, 65534)
    cache = random_bytes(sublet.empty(8 * PAGE, dtype=torch.uint8, device="cpu"), 61)
    before = bits(cache[:100])
    off = sublet.offer(cache, keep=cache[:100], name="root-kv", release=True)
    env = dict(os.environ, **CHILD_ENV, HOME=str(home), XDG_RUNTIME_DIR=str(home),
               SUBLET_LIB=str(native.libsublet))
    r = subprocess.run([*AS_NOBODY, sys.executable, "-c", NOBODY_TAKES, "root-kv",
                        str(off.offer_id)], capture_output=True, text=True, timeout=60, env=env)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr)
    if allowed:
        assert lines[0] == f"taken {7 * PAGE}"
        assert lines[1].startswith("SubletError")        # given back and over: not its any more
        off.wait(timeout=300)
    else:
        assert lines[0].startswith("NoOfferError") and "another user's offers" in lines[0]
        assert lines[1] == "SubletError ENOENT"         # another user's: refused as missing
        assert off.state == "offered"
        off.withdraw()
    assert np.array_equal(bits(cache[:100]), before)
