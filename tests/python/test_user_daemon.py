"""The user's own subletd, started on demand (memfd backend, no GPU): processes with nothing
set up meet at it, two starting at once end with one, it leaves when idle, another user gets
their own and cannot reach it. And the README's cross-process example, run as written.

Each test has a runtime directory of its own ($XDG_RUNTIME_DIR): a new user, as far as sublet
can tell, with no daemon running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from conftest import CHILD_ENV, REPO, stop_user_daemons

pytestmark = pytest.mark.daemon


@pytest.fixture
def fresh_user(native, monkeypatch):
    """A runtime directory with no daemon in it; the daemons started there stop at the end.
    This process's connections (one per device) are new ones too, for the test's time."""
    from sublet import _client
    path = Path(tempfile.mkdtemp(prefix="sl-"))  # short: socket paths are 107 bytes at most
    monkeypatch.setattr(_client, "_clients", {})
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    monkeypatch.delenv("SUBLET_SOCKET", raising=False)
    for name in ("SUBLET_MEMFD_PAGE_SIZE", "SUBLET_MEMFD_TOTAL", "SUBLET_IDLE_EXIT"):
        monkeypatch.delenv(name, raising=False)
    yield path / "sublet"
    stop_user_daemons(path / "sublet")


def env(**extra: str) -> dict[str, str]:
    return dict(os.environ, **CHILD_ENV, **extra)


def subletd_pids(directory: Path) -> list[int]:
    """The running subletd processes that serve a socket in directory."""
    from sublet._daemon import _alive
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and argv[0].endswith(b"subletd") and \
                any(a.startswith(str(directory).encode()) for a in argv) and _alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def test_readme_example_runs_as_written(fresh_user):
    """examples/owner.py and examples/borrower.py, two processes, no $SUBLET_SOCKET, no system
    daemon: they meet, the borrower trains in the loan, the owner's kept bytes come back. On
    memfd the borrower takes more than the device has free: kept bytes move and go to the
    host, and still compare equal. (3 training steps, not the example's 20: seconds saved.)"""
    # The daemon the owner starts has 512 MiB: its 256 MiB cache leaves 256 MiB free, and the
    # borrower takes that and 192 MiB of the cache's pages, half of each kept.
    owner = subprocess.Popen([sys.executable, str(REPO / "examples" / "owner.py")],
                             env=env(SUBLET_MEMFD_TOTAL="512M"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        assert line.startswith("offered"), owner.stderr.read()
        borrower = subprocess.run([sys.executable, str(REPO / "examples" / "borrower.py"), "3"],
                                  env=env(), capture_output=True, text=True, timeout=120)
        assert borrower.returncode == 0, borrower.stderr
        assert "trained 3 steps in the loan" in borrower.stdout
        out, err = owner.communicate(timeout=60)
    finally:
        owner.kill()
    assert owner.returncode == 0, err
    assert "data intact: True" in out
    moved = re.search(r"([0-9.]+) MiB of kept bytes moved on the device", out)
    copied = re.search(r"([0-9.]+) MiB went to the host and back", out)
    assert moved and copied, out
    # Not on a GPU (the examples' GPU sizes leave the kept pages alone where memory is free).
    import torch
    if not torch.cuda.is_available():
        assert float(moved.group(1)) > 0 and float(copied.group(1)) > 0, out
        # The borrower saw the same loan.
        assert (f"{moved.group(1)} MiB moved on the device, {copied.group(1)} MiB copied to "
                f"the host") in borrower.stdout, borrower.stdout
    assert len(subletd_pids(fresh_user)) == 1  # the one the first of them started


RACER = textwrap.dedent("""
    import sys, torch, sublet, sublet._memory   # everything imported before the race
    print("ready", flush=True)
    sys.stdin.readline()                  # everyone is ready: go
    print(sublet.info("cpu").client_id, flush=True)
    sys.stdin.readline()                  # hold the connection until told
""")


def test_processes_starting_at_once_end_with_one_daemon(fresh_user):
    racers = [subprocess.Popen([sys.executable, "-c", RACER], env=env(), text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE) for _ in range(6)]
    try:
        for r in racers:
            assert r.stdout.readline().startswith("ready"), r.stderr.read()
        for r in racers:
            r.stdin.write("go\n")
            r.stdin.flush()
        ids = [int(r.stdout.readline() or "0") for r in racers]
        # One daemon numbers its clients: with one daemon each, every id would be 1.
        assert len(set(ids)) == len(racers) and 0 not in ids, \
            [r.stderr.read() for r in racers if r.poll() is not None]
        assert len(subletd_pids(fresh_user)) == 1
    finally:
        for r in racers:
            r.kill()
            r.wait()


def test_daemon_leaves_when_idle(fresh_user, monkeypatch):
    from sublet import _daemon
    from sublet._daemon import _alive
    monkeypatch.setenv("SUBLET_IDLE_EXIT", "1")
    client = _daemon.connect(0, "memfd")
    sock = Path(client.path)
    pid = int(sock.with_suffix(".pid").read_text())
    region = client.region_create(1 << 20)
    time.sleep(2.5)  # a client, a region: it stays
    assert _alive(pid)
    client.region_release(region)
    client.close()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the idle daemon did not leave"
    assert not sock.exists()
    assert not sock.with_suffix(".pid").exists(), "the idle daemon left its .pid behind"
    assert "--idle-exit" in sock.with_suffix(".log").read_text()
    assert _daemon.connect(0, "memfd").info.client_id == 1  # the next comes up anew


def test_daemon_that_cannot_start_says_why(fresh_user, monkeypatch):
    from sublet import _daemon
    monkeypatch.setenv("SUBLET_MEMFD_PAGE_SIZE", "3K")  # not a power of two: subletd refuses
    with pytest.raises(_daemon.DaemonUnavailableError, match="exited at start") as caught:
        _daemon.connect(0, "memfd")
    assert "page" in str(caught.value).lower()  # the daemon's own words, from its log


def test_directory_of_another_owner_or_mode_is_refused(fresh_user):
    from sublet import _daemon
    fresh_user.mkdir(mode=0o755)
    os.chmod(fresh_user, 0o755)
    with pytest.raises(_daemon.DaemonUnavailableError, match="mode 0700"):
        _daemon.connect(0, "memfd")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user in a child")
def test_another_user_gets_their_own_daemon_and_cannot_reach_ours(fresh_user):
    from sublet import _daemon, _lib
    ours = _daemon.connect(0, "memfd")
    theirs_dir = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chown(theirs_dir, 65534, 65534)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: nobody
        os.close(read)
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.environ.update(XDG_RUNTIME_DIR=str(theirs_dir), HOME=str(theirs_dir))
            mine = _daemon.connect(0, "memfd")
            reached_ours = True
            try:
                _lib.Client.open(ours.path).close()
            except _lib.DaemonUnavailableError:
                reached_ours = False
            os.environ["XDG_RUNTIME_DIR"] = os.path.dirname(os.path.dirname(ours.path))
            try:
                _daemon.user_dir()  # ours, by their $XDG_RUNTIME_DIR: refused, not used
                took_ours = True
            except _lib.DaemonUnavailableError:
                took_ours = False
            os.write(write, f"{mine.path} {reached_ours} {took_ours}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    report = os.read(read, 4096).decode()
    _, status = os.waitpid(pid, 0)
    try:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        their_socket, reached_ours, took_ours = report.split()
        assert their_socket.startswith(str(theirs_dir / "sublet"))
        assert (reached_ours, took_ours) == ("False", "False")
        assert len(subletd_pids(theirs_dir)) == 1
        assert os.stat(theirs_dir / "sublet").st_uid == 65534
        assert ours.get_info().client_id  # ours still serves us
    finally:
        stop_user_daemons(theirs_dir / "sublet")
        ours.close()


def test_status_finds_the_users_daemon_and_imports_no_torch(fresh_user):
    from sublet import _daemon
    client = _daemon.connect(0, "memfd")
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "sublet", "status",
                          "--json"], env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not re.search(r"\|\s+torch(\.|$)", out.stderr, re.MULTILINE), "torch was imported"
    [status] = json.loads(out.stdout)
    assert status["socket"] == client.path and status["backend"] == "memfd"
    version = subprocess.run([sys.executable, "-m", "sublet", "--version"], env=env(),
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"sublet {sublet_version()}"
    client.close()


def sublet_version() -> str:
    import sublet
    return sublet.__version__


def test_loan_names_any_text_but_no_nul(fresh_user):
    """A name is UTF-8 text without NUL (the daemon checks every byte: tests/integration's
    "loan names"); Python refuses a NUL as the daemon would instead of cutting the name."""
    from sublet import _daemon, _lib
    client = _daemon.connect(0, "memfd")
    region = client.region_create(1 << 20)
    with pytest.raises(_lib.SubletError, match="NUL") as caught:
        client.lend(region, None, "kv\0x")
    assert caught.value.code_name == "EINVAL"
    name = "kv-\u00fc-\u65e5\u672c-\U0001f642"
    loan, _ = client.lend(region, None, name)
    out = subprocess.run([sys.executable, "-m", "sublet", "status", "--socket", client.path],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f'loan {loan} "{name}": offered' in out.stdout
    client.withdraw(loan)
    client.region_release(region)
    client.close()


NEXT_OFFER = textwrap.dedent("""
    import sys, torch, sublet
    print("waiting", flush=True)
    try:
        with sublet.borrow(device="cpu", timeout=15) as loan:   # no name: the next offer
            loan.empty(65536, dtype=torch.uint8).fill_(1)
        print("got it", flush=True)
    except sublet.NoOfferError:
        print("no offer", flush=True)
""")


def test_the_next_offer_goes_to_exactly_one_waiting_borrower(fresh_user):
    import torch

    import sublet
    borrowers = [subprocess.Popen([sys.executable, "-c", NEXT_OFFER], env=env(), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(3)]
    try:
        for b in borrowers:
            assert b.stdout.readline().startswith("waiting"), b.stderr.read()
        time.sleep(1)  # into their Borrow: one that came later would only find none
        cache = sublet.empty(4, 65536, dtype=torch.uint8, device="cpu").fill_(9)
        with sublet.offer(cache, keep=cache[:1]) as offer:
            offer.wait(timeout=30)
        said = sorted(b.communicate(timeout=60)[0].strip() for b in borrowers)
    finally:
        for b in borrowers:
            b.kill()
    assert said == ["got it", "no offer", "no offer"]
    assert int(cache[:1].min()) == int(cache[:1].max()) == 9
