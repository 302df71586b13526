"""GPU tests of a borrower in another process, with nothing set up (issue 11): the README's
two example scripts, and mapping paid once across processes. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_xproc.py -m gpu -s    # -s shows the timings
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import sublet

from conftest import CHILD_ENV, REPO
from test_gpu import cuda_daemon, free_memory_left, random_fill  # noqa: F401 (fixture)

GiB = 1024 ** 3
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


def env() -> dict[str, str]:
    """The children find the daemon as any process would: no $SUBLET_SOCKET."""
    e = dict(os.environ, **CHILD_ENV)
    e.pop("SUBLET_SOCKET", None)
    return e


def test_readme_example_scripts_on_cuda():
    owner = subprocess.Popen([sys.executable, str(REPO / "examples" / "owner.py"), "4"],
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout.readline().startswith("offered"), owner.stderr.read()
        borrower = subprocess.run([sys.executable, str(REPO / "examples" / "borrower.py")],
                                  env=env(), capture_output=True, text=True, timeout=300)
        assert borrower.returncode == 0, borrower.stderr
        out, err = owner.communicate(timeout=120)
    finally:
        owner.kill()
    print(f"\nowner: {out.strip()}\nborrower: {borrower.stdout.strip()}")
    assert owner.returncode == 0, err
    assert "data intact: True" in out


# Three loans in a row of the same region: 14 GiB of its 15 GiB of unkept pages, then a few
# training steps. The first loan imports and maps the pages; the next ones find them mapped.
TRAINER = textwrap.dedent("""
    import sys, torch, sublet
    for i in range(3):
        with sublet.borrow(name="xproc", timeout=120) as loan:
            x = torch.empty(14 * 1024**3, dtype=torch.uint8, device="cuda").fill_(0xEE)
            model = torch.nn.Linear(4096, 4096, device="cuda")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(5):
                loss = model(torch.randn(1024, 4096, device="cuda")).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
            del x, model, opt, loss
        s = loan.stats
        print(f"loan {i + 1}: mapped_pages {s.mapped_pages} map_seconds {s.map_seconds:.4f} unkept "
              f"{s.served_unkept_bytes} fresh {s.served_fresh_bytes} kept "
              f"{s.served_kept_bytes}", flush=True)
    print("idle", flush=True)
    sys.stdin.read()    # idle, calling nothing, while the owner frees the region
""")


def test_cross_process_borrower_maps_once_over_three_loans():
    """... and when the owner frees the region, the idle borrower lets go of the pages it kept
    at once (the daemon tells it): the GPU's free memory comes back, all 16 GiB of it."""
    cache = random_fill(sublet.empty(16, GiB, dtype=torch.uint8), seed=21)
    keep = cache[:1]                                   # 1 GiB kept, 15 GiB unkept
    before = keep.clone()
    # Little free memory beside the region: the loans' layout is the same each time.
    with free_memory_left(3 * GiB):
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER], env=env(),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        lines = []
        try:
            for _ in range(3):
                with sublet.offer(cache, keep=keep, name="xproc") as offer:
                    offer.wait(timeout=300)
                assert torch.equal(keep, before)          # uint8: equal values, equal bits
                lines.append(trainer.stdout.readline().strip())
            assert trainer.stdout.readline().strip() == "idle"
        except BaseException:
            trainer.kill()
            raise
    try:
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        del cache, keep, offer                      # the region is released
        gc.collect()
        start = time.monotonic()
        while (torch.cuda.mem_get_info()[0] < free_before + 15 * GiB
               and time.monotonic() - start < 10):
            time.sleep(0.01)
        took, freed = time.monotonic() - start, torch.cuda.mem_get_info()[0] - free_before
        out, err = trainer.communicate(input="", timeout=120)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err
    print("\n" + "\n".join(lines))
    print(f"region freed: {freed / GiB:.2f} GiB of GPU memory back within {took:.3f} s, the "
          f"borrower still running")
    assert freed >= 15 * GiB                          # its kept 14 GiB too, not only the rest
    mapped = [int(line.split()[3]) for line in lines]
    assert mapped[0] >= 14 * GiB // (2 * 1024 ** 2)   # 14 GiB imported and mapped once ...
    assert mapped[1:] == [0, 0]                       # ... and not again
