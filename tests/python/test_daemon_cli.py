"""subletd as a service runs it: SIGHUP is harmless, journald's <N> prefixes are written only
when stderr is the journal, and --device takes a GPU UUID as nvidia-smi prints it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.daemon

UUID = "GPU-4b3a1f0e-8c3d-11ee-b962-0242ac120002"


def start(native, tmp_path, *args: str, stderr=None, env=None) -> subprocess.Popen:
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket", str(sock),
                             *args], stderr=stderr or subprocess.PIPE, text=True,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M", **(env or {})))
    deadline = time.monotonic() + 30  # a hang guard
    while not sock.exists():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "exited"
        assert time.monotonic() < deadline, "subletd did not listen within 30 s"
        time.sleep(0.01)
    return proc


def test_sighup_is_logged_and_ignored(native, tmp_path):
    proc = start(native, tmp_path)
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    assert proc.poll() is None, "SIGHUP killed subletd"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "SIGHUP received: ignored" in err


def test_sighup_while_pinning_is_ignored(native, tmp_path):
    # Pinning 256 MiB at 256 MiB/s takes a second (as tens of GiB take on a GPU machine); a
    # SIGHUP then, before the loop's handler exists, must not kill subletd. The daemon is
    # stopped while the SIGHUP is sent, so that where it is is known, not guessed from a time:
    # not listening yet (it listens once pinned), so the loop's handler does not exist yet.
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket", str(sock),
                             "--pin", "256M"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M",
                                     SUBLET_MEMFD_PIN="256M"))
    try:
        assert "pinning 256.0 MiB of host memory" in proc.stderr.readline()
        proc.send_signal(signal.SIGSTOP)
        assert not sock.exists(), "subletd was done pinning before the SIGHUP could be sent"
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGCONT)
        line = proc.stderr.readline()
        assert "pinned 256.0 MiB" in line, line
        deadline = time.monotonic() + 30  # a hang guard
        while not sock.exists():
            assert proc.poll() is None, f"SIGHUP during --pin killed subletd ({proc.returncode})"
            assert time.monotonic() < deadline, "subletd did not listen within 30 s"
            time.sleep(0.01)
        from sublet._lib import Client
        Client.open(str(sock)).close()  # it serves
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert "SIGHUP received" not in err, "the SIGHUP reached the loop's handler, not before it"
    finally:
        if proc.poll() is None:  # a failed check leaves no daemon behind
            proc.kill()
            proc.wait()


def test_sigterm_as_soon_as_the_socket_appears_is_a_clean_stop(native, tmp_path):
    # A supervisor (or a test) may signal the moment the socket exists: the handler must be in
    # place by then (CI once saw subletd die of SIGTERM's default action there).
    for i in range(20):
        sock = tmp_path / f"d{i}.sock"
        proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                                 str(sock)], stderr=subprocess.DEVNULL,
                                env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M"))
        try:
            deadline = time.monotonic() + 30  # a hang guard
            while not sock.exists():
                assert proc.poll() is None and time.monotonic() < deadline
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, f"start {i}: exit {proc.returncode}"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_failing(native, tmp_path, stderr_file, journal_stream: str) -> str:
    """Runs subletd so that it logs an error and exits (its socket's directory is missing)."""
    with open(stderr_file, "w") as f:
        rc = subprocess.run([str(native.subletd), "--backend", "memfd", "--socket",
                             str(tmp_path / "missing" / "d.sock")], stderr=f, timeout=30,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M",
                                     JOURNAL_STREAM=journal_stream)).returncode
    assert rc == 1
    return stderr_file.read_text()


def test_journald_prefixes_only_when_stderr_is_the_journal(native, tmp_path):
    log = tmp_path / "stderr.log"
    log.touch()
    st = os.stat(log)
    as_journal = run_failing(native, tmp_path, log, f"{st.st_dev}:{st.st_ino}")
    assert as_journal.startswith("<6>") and "\n<3>cannot listen on" in as_journal
    # Inherited from a service whose stderr went to a file: plain lines, no prefixes.
    elsewhere = run_failing(native, tmp_path, log, f"{st.st_dev}:{st.st_ino + 1}")
    assert elsewhere.startswith("subletd: info: ") and "subletd: error: cannot listen on" in elsewhere
    assert "<" not in elsewhere.split(":", 1)[0]


def test_device_takes_a_gpu_uuid(native, tmp_path):
    proc = start(native, tmp_path, "--device", UUID)  # memfd has no UUIDs to match: accepted
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    for bad in ("GPU-4b3a1f0e", "GPU-" + "g" * 32, "4b3a1f0e-8c3d-11ee-b962-0242ac120002", "-1"):
        r = subprocess.run([str(native.subletd), "--device", bad], capture_output=True, text=True)
        assert r.returncode == 2, bad
        assert "a device number or a GPU UUID (GPU-xxxxxxxx-...)" in r.stderr


@pytest.mark.gpu
def test_device_by_uuid_serves_that_gpu(native, tmp_path):
    import torch
    from sublet import _lib
    last = torch.cuda.device_count() - 1
    uuid = bytes(torch.cuda.get_device_properties(last).uuid.bytes)
    sock = tmp_path / "d.sock"
    proc = subprocess.Popen([str(native.subletd), "--device", _lib.format_uuid(uuid), "--socket",
                             str(sock), "--reserve", "0"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            try:
                client = _lib.Client.open(str(sock))
                break
            except _lib.SubletError:
                time.sleep(0.05)
        assert client.info.device_uuid == _lib.format_uuid(uuid)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    wrong = subprocess.run([str(native.subletd), "--device", _lib.format_uuid(bytes(16)),
                            "--socket", str(tmp_path / "w.sock")], capture_output=True, text=True,
                           timeout=60)
    assert wrong.returncode == 1 and "nvidia-smi -L" in wrong.stderr


def test_pin_extends_systemds_start_timeout_until_ready(native, tmp_path):
    # --pin runs before READY=1; under systemd's start timeout (90 s by default) a large pin
    # would fail the start, so each step of it asks for more time (EXTEND_TIMEOUT_USEC). The
    # notify socket is one of ours: 768 MiB pinned at 1 GiB/s, three steps of 256 MiB.
    import socket
    import tempfile
    short = Path(tempfile.mkdtemp(prefix="sl-notify-"))  # tmp_path may outgrow sun_path
    notify_path = short / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(10)
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                             str(tmp_path / "d.sock"), "--pin", "768M"],
                            stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M",
                                     SUBLET_MEMFD_PIN="1G", NOTIFY_SOCKET=str(notify_path)))
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(listener.recv(4096).decode())
        extends = [m for m in messages if "EXTEND_TIMEOUT_USEC=" in m]
        assert len(extends) == 3, messages
        assert messages[-1].startswith("READY=1") and len(messages) == 4, messages
        usec = int(re.search(r"EXTEND_TIMEOUT_USEC=(\d+)", extends[0]).group(1))
        assert usec >= 30_000_000, usec  # room for a slow step, not a hair's breadth
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        listener.close()
        notify_path.unlink()
        short.rmdir()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ready_reaches_an_abstract_notify_socket(native, tmp_path):
    # systemd may name an abstract socket ("@name"): its address is the name's length, not
    # padded with zeros (READY=1 once went to a padded name nobody listened on).
    import socket
    name = f"sl-notify-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)
    listener.settimeout(10)
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                             str(tmp_path / "d.sock")], stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M",
                                     NOTIFY_SOCKET="@" + name))
    try:
        assert listener.recv(4096).decode().startswith("READY=1")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        listener.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_man_page_lists_every_option_of_help(native):
    from conftest import REPO
    helptext = subprocess.run([str(native.subletd), "--help"], capture_output=True, text=True,
                              check=True).stdout
    options = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z-]*)", helptext, re.M))
    assert {"--pin", "--idle-exit", "--max-connections", "--check", "--version"} <= options
    # roff writes a '-' in an option's name as '\-'.
    man = (REPO / "man" / "subletd.8").read_text().replace("\\-", "-")
    section = man.split("\n.SH OPTIONS\n", 1)[1].split("\n.SH ", 1)[0]
    # An option is listed when it heads an entry: the line after a .TP.
    heads = re.findall(r"^\.TP\n(.*)$", section, re.M)
    listed = {o for head in heads for o in re.findall(r"--[a-z][a-z-]*", head)}
    assert options - listed == set(), "in subletd --help but not in man/subletd.8"
