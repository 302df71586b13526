"""Owners wait their turn (memfd backend): while a loan runs on the device, sublet.lend and
sublet.offer wait for it in the daemon's line, served in arrival order, up to their timeout;
Ctrl-C works while they wait, and leaves nothing lent.

Owners are child processes (one process has one connection per device, and one loan at a time
in it). Every kept byte is compared after every loan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import sublet
from sublet import _client

from conftest import CHILD_ENV

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


# SIGINT raises KeyboardInterrupt whatever the test was started under (a shell's background
# job starts with it ignored, and Python then leaves it so).
OWNER = textwrap.dedent("""
    import signal, sys, torch, sublet
    signal.signal(signal.SIGINT, signal.default_int_handler)
    who, loans = int(sys.argv[1]), int(sys.argv[2])
    timeout = None if sys.argv[3] == "None" else float(sys.argv[3])
    t = sublet.empty(4, 65536, dtype=torch.uint8, device="cpu")
    print("ready", flush=True)
    sys.stdin.readline()
    for n in range(loans):
        g = torch.Generator().manual_seed(who * 1000 + n)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        before = t.clone()
        try:
            with sublet.lend(t, keep=t[n % 4, 100:5000], timeout=timeout) as loan:
                taken, size = [], 1 << 22
                while size >= 65536:  # everything the loan has: the kept page too
                    try:
                        taken.append(loan.empty(size, dtype=torch.uint8).fill_(0xEE))
                    except sublet.SubletOutOfMemoryError:
                        size //= 2
                del taken
        except sublet.SubletTimeoutError as error:
            print("timeout", error, flush=True)
            sys.exit(3)
        except sublet.BusyError as error:
            print("busy", error, flush=True)
            sys.exit(5)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(4)
        assert loan.copied_bytes + loan.moved_bytes > 0, "the kept page was not taken"
        kept = t[n % 4, 100:5000].view(torch.uint8)
        assert torch.equal(kept, before[n % 4, 100:5000]), "kept bytes changed"
    print("done", flush=True)
""")


def spawn_owner(who: int, loans: int, timeout: float | None) -> subprocess.Popen:
    socket = _client.client_for("memfd", 0).path
    env = dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV)
    return subprocess.Popen([sys.executable, "-c", OWNER, str(who), str(loans), str(timeout)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ready(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    return proc


def start_owner(who: int, loans: int, timeout: float | None) -> subprocess.Popen:
    return ready(spawn_owner(who, loans, timeout))


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def lends_waiting() -> int:
    return _client.client_for("memfd", 0).status()["lends_waiting"]


def wait_for_line(n: int) -> None:
    deadline = time.monotonic() + 30  # a hang guard
    while lends_waiting() != n:
        assert time.monotonic() < deadline, f"{lends_waiting()} lends wait, not {n}"
        time.sleep(0.01)


def test_owners_lending_at_once_all_get_their_loans():
    owners = [ready(proc) for proc in [spawn_owner(who, 10, None) for who in range(4)]]
    for proc in owners:
        go(proc)
    for proc in owners:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.endswith("done\n"), err + out


def test_a_lend_waits_for_the_device_then_lends():
    held = sublet.empty(2, 65536, dtype=torch.uint8, device="cpu")
    with sublet.lend(held, keep=[]):
        owner = start_owner(1, 1, 30)
        go(owner)
        wait_for_line(1)
    out, err = owner.communicate(timeout=60)
    assert owner.returncode == 0 and out.endswith("done\n"), err + out


def test_timeouts_say_what_to_do():
    held = sublet.empty(2, 65536, dtype=torch.uint8, device="cpu")
    with sublet.lend(held, keep=[]):
        patient, at_once = [ready(p) for p in [spawn_owner(2, 1, 0.5), spawn_owner(3, 1, 0)]]
        go(patient)
        go(at_once)
        out, _ = at_once.communicate(timeout=60)
        assert at_once.returncode == 5 and "lend with a timeout" in out, out
        out, _ = patient.communicate(timeout=60)
        assert patient.returncode == 3 and "lend again with a longer timeout" in out, out
        assert lends_waiting() == 0


def test_ctrl_c_while_waiting_leaves_nothing_lent():
    held = sublet.empty(2, 65536, dtype=torch.uint8, device="cpu")
    with sublet.lend(held, keep=[]):
        owner = start_owner(4, 1, None)
        go(owner)
        wait_for_line(1)
        owner.send_signal(signal.SIGINT)
        out, err = owner.communicate(timeout=30)
        assert owner.returncode == 4 and out.endswith("interrupted\n"), err + out
        assert lends_waiting() == 0


def test_ctrl_c_before_the_lend_is_sent_still_cancels_it():
    """The interrupt comes before the waiting thread has sent its Lend: the first cancel finds
    nothing waiting, so it is sent again until the call is over (after a single cancel, a
    Lend sent later waited for ever). A stand-in client: its Lend is sent once a cancel has
    found nothing waiting, then waits until a cancel reaches it. Each wait gives up after 30 s
    (a hang guard): the Lend that no cancel reaches says so."""
    import _thread
    from sublet import _wait

    class LateLend:
        def __init__(self):
            self.sent, self.cancelled = threading.Event(), threading.Event()
            self.missed = threading.Event()
            self.cancels_before = self.cancels_after = 0
            self.reached = False

        def lend(self):
            self.missed.wait(30)
            self.sent.set()
            self.reached = self.cancelled.wait(30)
            if not self.reached:
                raise AssertionError("never cancelled: the Lend would wait for ever")
            raise sublet.SubletError("cancelled by the client: nothing was lent")

        def cancel(self):
            if not self.sent.is_set():
                self.cancels_before += 1  # nothing waits in the daemon yet: a no-op
                self.missed.set()
            else:
                self.cancels_after += 1
                self.cancelled.set()

    def waiting_in_waiting() -> bool:
        """The main thread waits in _waiting's loop (not in the thread's start before it)."""
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None and frame.f_back is not None:
            if frame.f_code.co_name == "wait" and frame.f_back.f_code is _wait._waiting.__code__:
                return True
            frame = frame.f_back
        return False

    def interrupt_once_waiting():
        for _ in range(30_000):  # 30 s: a hang guard
            if waiting_in_waiting():
                break
            time.sleep(0.001)
        _thread.interrupt_main()

    client = LateLend()
    was = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in OWNER
    try:
        threading.Thread(target=interrupt_once_waiting, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            _wait._waiting(client.lend, client, lambda value: None)
    finally:
        signal.signal(signal.SIGINT, was)
    assert client.cancels_before >= 1 and client.cancels_after >= 1
    assert client.reached, "the Lend sent after the first cancel was never cancelled"
    assert _client.client_for("memfd", 0).status()["loan"] is None


HOLDER = textwrap.dedent("""
    import sys, torch, sublet
    t = sublet.empty(2, 65536, dtype=torch.uint8, device="cpu")
    with sublet.lend(t, keep=[]):
        print("lent", flush=True)
        sys.stdin.readline()
""")


def test_an_offer_waits_its_turn():
    socket = _client.client_for("memfd", 0).path
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE,
                              env=dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV))
    assert holder.stdout.readline() == "lent\n"
    cache = sublet.empty(4, 65536, dtype=torch.uint8, device="cpu")
    with pytest.raises(sublet.SubletTimeoutError, match="nothing was lent"):
        sublet.offer(cache, name="later", timeout=0.2)
    with pytest.raises(sublet.BusyError, match="lend with a timeout"):
        sublet.offer(cache, name="later", timeout=0)
    go(holder)  # it ends its loan while the offer below waits
    with sublet.offer(cache, name="later", timeout=30) as offer:
        assert not offer.done
    assert offer.done  # withdrawn
    holder.wait(timeout=30)
