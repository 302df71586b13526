"""The first save on a default daemon (no --pin) against later ones, with the save area pinned
ahead from the Lend (daemon/pins.c). GPU only; about a minute on an H200.

Each case runs in a fresh process against a fresh private subletd (no --pin): a tensor of
SIZE GiB from sublet.empty, 30% kept (a slice), the rest of the GPU filled but 2 GiB, and a
job that fills a tensor of SIZE GiB inside sublet.lend (so about a fifth of the kept bytes
go to the host). Case "now": the job allocates at once after the Lend (the pin ahead has had
no time: the save pins what it reaches itself). Case "wait": the job allocates once the
daemon's status shows no pin in progress (a borrower that takes as long to start as the pin
takes). Printed: the first cycle, the later ones, and the wait.

    python3 -m pytest tests/python/test_gpu_pin_ahead.py -q -s      (SIZE: $PIN_AHEAD_GIB, 16)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CHILD_ENV

pytestmark = pytest.mark.gpu
GiB = 1 << 30


def child(case: str, size_gib: float, sock: str) -> None:
    import torch
    import sublet
    from sublet._status import query

    size = int(size_gib * GiB)
    t = sublet.empty(size, dtype=torch.uint8, device="cuda")
    t.random_(0, 256)
    keep = t[: int(size * 0.3)]
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(0, free - 2 * GiB), dtype=torch.uint8, device="cuda")
    before = keep.clone().cpu()
    cycles, waits = [], []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sublet.lend(t, keep=keep):
            w0 = time.perf_counter()
            while case == "wait" and query(sock).get("pin"):
                time.sleep(0.01)
            waits.append(time.perf_counter() - w0)
            job = torch.empty(size, dtype=torch.uint8, device="cuda")
            job.fill_(1)
            torch.cuda.synchronize()
            del job
        cycles.append(time.perf_counter() - t0 - waits[-1])
    assert torch.equal(keep.cpu(), before)
    del filler
    print(json.dumps({"case": case, "first_s": cycles[0], "later_s": sum(cycles[1:]) / 3,
                      "pin_wait_s": waits[0], "host_bytes": query(sock)["host_bytes"]}))


def run_case(case: str, size_gib: float) -> dict:
    from sublet._lib import find_native
    subletd = find_native("subletd", "SUBLETD")
    with tempfile.TemporaryDirectory() as tmp:
        sock = str(Path(tmp) / "gpu.sock")
        daemon = subprocess.Popen([str(subletd), "--socket", sock], stderr=subprocess.DEVNULL)
        try:
            for _ in range(500):
                if os.path.exists(sock):
                    break
                time.sleep(0.02)
            env = dict(os.environ, **CHILD_ENV, SUBLET_SOCKET=sock)
            out = subprocess.run([sys.executable, __file__, case, str(size_gib), sock], env=env,
                                 check=True, capture_output=True, text=True, timeout=300)
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)


def test_first_save_costs_a_later_one_once_pinned_ahead():
    size = float(os.environ.get("PIN_AHEAD_GIB", "16"))
    now, wait = run_case("now", size), run_case("wait", size)
    for r in (now, wait):
        print(f"\n{r['case']}: first {r['first_s']:.3f} s, later {r['later_s']:.3f} s "
              f"({r['first_s'] / r['later_s']:.1f} x), waited {r['pin_wait_s']:.3f} s for the "
              f"pin ahead, {r['host_bytes'] / GiB:.2f} GiB pinned")
    assert wait["host_bytes"] <= int(size * 0.3 * GiB) + (256 << 20)  # the kept bytes, no more
    assert wait["first_s"] < 1.5 * wait["later_s"] + 0.05


if __name__ == "__main__":
    child(sys.argv[1], float(sys.argv[2]), sys.argv[3])
