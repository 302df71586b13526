"""sublet.pin_ahead on the memfd backend (no GPU), against a daemon of the test's own (the
session's user daemon keeps save areas from earlier tests, which would hide what a pin does):
an owner that knows what it will keep pins its loans' save area, or with release=True a spare
for its next release, before the first one; the daemon bounds the pin by the user's regions;
the loan or release that follows pins nothing more and keeps every bit.
tests/integration/test_pin.c times it (a first save after a pin ahead waits for no pinning)
and checks its refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import sublet

from conftest import CHILD_ENV, REPO

pytestmark = pytest.mark.daemon

PIECE = 256 << 20  # the save area is pinned in pieces of this size (pool.c's SL_HOST_PIECE)

# The owner: a 1 MiB tensor of random bytes, a pin ahead of far more (bounded by the region),
# then a loan (or a release) that saves all of it. Prints what the daemon said at each step.
OWNER = r"""
import json, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[2])
import sublet
from sublet import _memory
from pool_helpers import bits, fill_loan, random_bytes
client = _memory.resolve_device("cpu")[1]
def settled():
    while (st := client.status()).get("pin") is not None:
        time.sleep(0.01)
    return st
release = sys.argv[1] == "release"
cache = random_bytes(sublet.empty(1 << 20, dtype=torch.uint8, device="cpu"), 3)
before = bits(cache)
out = {"host_before": client.status()["host_bytes"]}
sublet.pin_ahead(1 << 40, device="cpu", release=release)
out["target"] = (client.status().get("pin") or {}).get("target_bytes")
out["host_pinned"] = settled()["host_bytes"]
if release:
    rel = sublet.release(cache, keep=None, stay=0)
    out["copied"] = rel.copied_bytes
    rel.resume()
else:
    with sublet.lend(cache) as loan:
        fill_loan(loan, seed=4)
    out["copied"] = loan.stats.copied_out_bytes
out["intact"] = bool(np.array_equal(bits(cache), before))
out["host_after"] = settled()["host_bytes"]
print(json.dumps(out))
"""


@pytest.fixture
def own_daemon(native, tmp_path):
    sock = tmp_path / "d.sock"
    # Pinning paced as on a GPU (a piece in 0.5 s), so that the pin is seen running.
    env = dict(os.environ, SUBLET_MEMFD_TOTAL="64M", SUBLET_MEMFD_PAGE_SIZE="64K",
               SUBLET_MEMFD_PIN="512M")
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket", str(sock)],
                            env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "subletd did not listen"
        time.sleep(0.01)
    yield dict(env, **CHILD_ENV, SUBLET_SOCKET=str(sock), SUBLET_BACKEND="memfd")
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("what", ["lend", "release"])
def test_a_pin_ahead_is_what_the_first_save_uses(own_daemon, what):
    r = subprocess.run([sys.executable, "-c", OWNER, what, str(REPO / "tests" / "python")],
                       capture_output=True, text=True, timeout=120, env=own_daemon)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["host_before"] == 0                  # a daemon of its own: nothing pinned yet
    assert out["target"] == PIECE                   # the region's MiB, in a whole piece
    assert out["host_pinned"] == PIECE
    assert out["copied"] == 1 << 20                 # the save happened, into that piece
    assert out["intact"]
    assert out["host_after"] == PIECE               # and pinned nothing more


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, True, "1G"])
def test_a_pin_ahead_takes_a_byte_count(bad):
    with pytest.raises(ValueError, match="byte count"):
        sublet.pin_ahead(bad, device="cpu")
