"""GPU tests of lending across processes (issue 5): an owner with a 16 GiB tensor, a borrower
process that trains a small model, and a borrower killed mid-loan. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import sublet

from conftest import CHILD_ENV
from test_gpu import cuda_daemon, free_memory_left, random_fill  # noqa: F401 (fixture)

GiB = 1024 ** 3
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

# Allocates `big` GiB first (more than the unkept pages and free memory: it spills into kept
# pages), then trains a small model for a few steps: backward runs on autograd's threads.
BORROWER = textwrap.dedent("""
    import sys, time, torch, sublet
    name, big, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with sublet.borrow(name=name, timeout=60) as loan:
        x = torch.empty(big * 1024**3, dtype=torch.uint8, device="cuda").fill_(0xEE)
        model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(),
                                    torch.nn.Linear(4096, 10)).cuda()
        opt = torch.optim.Adam(model.parameters())
        for step in range(5):
            data = torch.randn(512, 2048, device="cuda")
            loss = torch.nn.functional.cross_entropy(model(data),
                                                     torch.randint(0, 10, (512,), device="cuda"))
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        print("trained", float(loss), flush=True)
        if mode == "hang":
            time.sleep(300)
        del x, model, opt, data, loss
    print("copied", loan.copied_bytes, flush=True)
""")


def start_borrower(name: str, big_gib: int, mode: str) -> subprocess.Popen:
    from sublet import _client
    socket = _client.client_for("cuda", torch.cuda.current_device()).path
    env = dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV)
    return subprocess.Popen([sys.executable, "-c", BORROWER, name, str(big_gib), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sublet_status(*args: str) -> str:
    from sublet import _client
    socket = _client.client_for("cuda", torch.cuda.current_device()).path
    return subprocess.run([sys.executable, "-m", "sublet", "status", "--socket", socket, *args],
                          env=dict(os.environ, **CHILD_ENV), capture_output=True,
                          text=True, timeout=60, check=True).stdout


def daemon_status() -> dict:
    return json.loads(sublet_status("--json"))[0]


@pytest.fixture
def cache():
    t = random_fill(sublet.empty(16, GiB, dtype=torch.uint8), seed=31)  # 16 GiB, rows of 1 GiB
    yield t
    del t


def test_owner_and_a_training_borrower_in_two_processes(cache, capsys):
    before = cache[::2].clone()  # the kept rows: 8 GiB
    with free_memory_left(3 * GiB):  # the daemon keeps 1 GiB back: about 2 GiB of fresh memory
        with sublet.offer(cache, keep=cache[::2], name="kv16") as offer:
            child = start_borrower("kv16", 12, "normal")  # 8 unkept + ~2 fresh + ~2 kept
            stats = offer.wait(timeout=300)
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert torch.equal(cache[::2], before)
    # Whole kept rows: every byte of each kept page handed out went out of the way first, to
    # the host or (moved) on the GPU, and came back.
    assert stats.copied_out_bytes == stats.copied_in_bytes
    assert stats.copied_out_bytes + stats.moved_bytes == stats.served_kept_bytes > 0
    with capsys.disabled():
        print(f"\n  borrower: {out.strip()}; owner: {stats.copied_out_bytes / GiB:.2f} GiB "
              f"saved and restored (served {stats.served_unkept_bytes / GiB:.2f} GiB unkept, "
              f"{stats.served_fresh_bytes / GiB:.2f} GiB fresh, "
              f"{stats.served_kept_bytes / GiB:.2f} GiB kept), kept rows intact")


def test_borrower_killed_mid_loan_on_the_gpu(cache, capsys):
    before = cache[::2].clone()
    torch.cuda.empty_cache()
    with free_memory_left(3 * GiB):
        offer = sublet.offer(cache, keep=cache[::2], name="kill16")
        child = start_borrower("kill16", 12, "hang")
        line = child.stdout.readline()
        assert line.startswith("trained"), child.stderr.read()
        during = daemon_status()
        printout = sublet_status()
        child.send_signal(signal.SIGKILL)
        child.wait()
        with pytest.raises(sublet.BorrowerDiedError) as died:
            offer.wait(timeout=300)
    assert torch.equal(cache[::2], before)
    after = daemon_status()
    assert during["loan"]["state"] == "active" and during["loan"]["borrower_pid"] == child.pid
    assert after["loan"] is None and after["totals"]["borrowers_died"] >= 1
    with capsys.disabled():
        print("\n  `sublet status` during the loan:\n" + printout)
        s = died.value.stats
        print(f"\n  killed borrower pid {child.pid} mid-loan: {s.copied_in_bytes / GiB:.2f} GiB "
              f"of kept bytes restored, kept rows intact; daemon: loan "
              f"{after['loan']}, borrowers died {after['totals']['borrowers_died']}")
