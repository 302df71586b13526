"""The daemon's death loses nothing, through the Python API (memfd backend, no GPU).

A subletd of this module's own, at a socket of its own ($SUBLET_SOCKET), is SIGKILLed in the
middle of things: the owner's kept bytes come back from the save area (DaemonDiedError says
how many), a restarted daemon serves new work on a new connection, and tensors of the dead
daemon's regions go quietly.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import sublet
from sublet import _client

from conftest import REPO
from test_memfd_e2e import BORROWER  # fills the loan, says "filled", sleeps

pytestmark = pytest.mark.daemon


class Daemon:
    """A subletd on the memfd backend at path, started and killed at will."""

    def __init__(self, path: str):
        self.path = path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, SUBLET_MEMFD_PAGE_SIZE="64K", SUBLET_MEMFD_TOTAL="16M")
        self.proc = subprocess.Popen([os.environ["SUBLETD"], "--backend", "memfd", "--socket",
                                      self.path, "--log-level", "warn"], env=env)
        for _ in range(500):
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(self.path)
                return
            except OSError:
                time.sleep(0.01)
        raise RuntimeError(f"subletd did not start at {self.path}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


@pytest.fixture
def daemon(native, tmp_path, monkeypatch):
    d = Daemon(str(tmp_path / "gpu0.sock"))
    d.start()
    monkeypatch.setenv("SUBLET_BACKEND", "memfd")
    monkeypatch.setenv("SUBLET_SOCKET", d.path)
    monkeypatch.setattr(_client, "_clients", {})  # other modules' connections: back afterwards
    yield d
    d.stop()


def patterned(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = sublet.empty(n, dtype=torch.uint8, device="cpu")
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
    return t, t.clone()


def fill(loan: sublet.Loan) -> list[torch.Tensor]:
    tensors = []
    while True:
        try:
            tensors.append(loan.empty(65536, dtype=torch.uint8).fill_(0xEE))
        except sublet.SubletOutOfMemoryError:
            return tensors


def test_lend_survives_the_daemon_killed_mid_loan(daemon):
    cache, before = patterned(8 << 20, seed=1)
    keep = [cache[:1 << 20], cache[5 << 20:6 << 20]]
    with pytest.raises(sublet.DaemonDiedError) as caught:
        with sublet.lend(cache, keep=keep) as loan:
            tensors = fill(loan)  # every kept page saved, then overwritten
            assert loan.copied_bytes == 2 << 20
            daemon.kill()
            time.sleep(0.2)  # the library lets go of the loan's memory: tensors are gone
    del tensors
    assert "kept data restored from the save area: 2.00 MiB" in str(caught.value)
    assert torch.equal(cache[:1 << 20], before[:1 << 20])
    assert torch.equal(cache[5 << 20:6 << 20], before[5 << 20:6 << 20])


def test_a_restarted_daemon_serves_new_work(daemon, monkeypatch):
    dead_regions = [sublet.empty(1 << 20, dtype=torch.uint8, device="cpu") for _ in range(3)]
    daemon.kill()
    daemon.start()
    fresh, before = patterned(1 << 20, seed=2)  # a new connection, to the new daemon
    with sublet.lend(fresh, keep=fresh[:4096]) as loan:
        fill(loan)
    assert torch.equal(fresh[:4096], before[:4096])
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    del dead_regions
    gc.collect()
    assert unraisable == []  # a dead daemon's tensors go quietly


def test_offer_survives_the_daemon_killed_mid_loan(daemon):
    cache, before = patterned(4 << 20, seed=3)
    offer = sublet.offer(cache, name="kv")
    child = subprocess.Popen([sys.executable, "-c", BORROWER, "kv", "hang"],
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert child.stdout.readline().startswith("filled")
        daemon.kill()
        with pytest.raises(sublet.DaemonDiedError) as caught:
            offer.wait(timeout=300)  # the borrower let go of its pages: the owner restores
        assert caught.value.stats.copied_in_bytes == 4 << 20
        assert torch.equal(cache, before)
    finally:
        child.kill()
        child.wait()
