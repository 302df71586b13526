"""GPU tests of the daemon's death (issue 9): a 16 GiB owner, a borrower process that trains
(after writing over the kept pages it was lent), and subletd SIGKILLed mid-loan. The owner's
library restores the kept bytes from the host save area (DaemonDiedError); they must be intact
bit for bit. Skipped without CUDA.

The test starts a subletd of its own (cuda backend) at a socket of its own, so that it can
kill it; another one (a system or private daemon) is left alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
import torch

import sublet
from sublet import _client

from test_gpu import free_memory_left, random_fill
from test_gpu_service import start_borrower  # allocates big GiB, trains, says "trained"

GiB = 1024 ** 3
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


@pytest.fixture
def own_daemon(native, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = str(tmp_path / "gpu.sock")
    proc = subprocess.Popen([os.environ["SUBLETD"], "--device", str(torch.cuda.current_device()),
                             "--socket", path, "--log-level", "info"])
    for _ in range(3000):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            break
        except OSError:
            time.sleep(0.01)
    monkeypatch.delenv("SUBLET_BACKEND", raising=False)
    monkeypatch.setenv("SUBLET_SOCKET", path)
    monkeypatch.setattr(_client, "_clients", {})  # other modules' connections: back afterwards
    yield proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait()


def test_daemon_killed_mid_loan_loses_no_kept_byte(own_daemon, capsys):
    cache = random_fill(sublet.empty(16, GiB, dtype=torch.uint8), seed=91)  # rows of 1 GiB
    before = cache[::2].clone()  # the kept rows: 8 GiB
    with free_memory_left(3 * GiB):  # the daemon keeps 1 GiB back: about 2 GiB fresh
        offer = sublet.offer(cache, keep=cache[::2], name="kv16")
        child = start_borrower("kv16", 14, "hang")  # 8 unkept + ~2 fresh + ~4 kept GiB
        try:
            line = child.stdout.readline()
            assert line.startswith("trained"), child.stderr.read()
            own_daemon.send_signal(signal.SIGKILL)
            own_daemon.wait()
            t0 = time.monotonic()
            with pytest.raises(sublet.DaemonDiedError) as died:
                offer.wait(timeout=300)
            seconds = time.monotonic() - t0
        finally:
            child.kill()
            _, err = child.communicate(timeout=120)
    assert torch.equal(cache[::2], before)  # uint8: bit for bit
    stats = died.value.stats
    assert stats.daemon_died and stats.copied_in_bytes > 2 * GiB
    with capsys.disabled():
        print(f"\n  subletd SIGKILLed mid-loan (pid {child.pid} had trained): the owner restored "
              f"{stats.copied_in_bytes / GiB:.2f} GiB from the save area in {seconds:.2f} s "
              f"(waiting for the borrower to let go included); kept rows intact.\n"
              f"  told: {died.value}\n  the borrower's last words: "
              f"{err.strip().splitlines()[-1] if err.strip() else '(none)'}")
    del cache
