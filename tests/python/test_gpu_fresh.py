"""GPU: a borrower of another user cannot touch the owner's memory after the loan (issue 9).

The owner (root) offers a 1 GiB tensor keeping every other 16 MiB row, on a daemon of its own
that lends no free memory (--reserve), so that the borrower's allocation takes the tensor's
pages themselves. The borrower is another user (uid 3000, in the allowed group). It keeps
every page it was granted alive past the loan, as an attacker would, with
cuMemRetainAllocationHandle (a reference to the physical memory that nothing can revoke).
After the owner has reclaimed, it maps those pages again and writes every byte of them. The
owner's kept bytes are the same, bit for bit, at the same address: the end of the loan gave
the owner fresh pages. Skipped without CUDA, or without root (to become another user).

    python3 -m pytest tests/python/test_gpu_fresh.py -m gpu -s
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import CHILD_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

GiB = 1024 ** 3
MEMBER, GROUP = 3000, 4242

OWNER = textwrap.dedent("""
    import sys, torch, sublet
    cache = sublet.empty(1 << 30, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(9)
    cache.copy_(torch.randint(0, 256, cache.shape, dtype=torch.uint8, device="cuda",
                              generator=g))
    rows = cache.view(64, -1)
    before, ptr = rows[::2].clone(), cache.data_ptr()
    def intact():
        return bool(torch.equal(rows[::2], before)) and cache.data_ptr() == ptr
    with sublet.offer(cache, keep=rows[::2], name="fresh") as offer:
        print("offered", flush=True)
        stats = offer.wait(timeout=300)
    print(f"reclaimed replaced_pages {stats.replaced_pages} intact {intact()}", flush=True)
    sys.stdin.readline()                     # the borrower's old pages have been written
    torch.cuda.synchronize()
    print(f"after the write intact {intact()}", flush=True)
""")

BORROWER = textwrap.dedent("""
    import ctypes, sys, torch, sublet
    cu = ctypes.CDLL("libcuda.so.1")
    def ok(rc, what):
        if rc != 0:
            sys.exit(f"{what}: CUDA error {rc}")
    page = sublet.info().page_size
    held = []
    with sublet.borrow(name="fresh", timeout=120) as loan:
        x = torch.empty((1 << 30) - (32 << 20), dtype=torch.uint8, device="cuda").fill_(0xB0)
        torch.cuda.synchronize()
        for off in range(0, x.numel(), page):    # every page granted, kept alive past the loan
            h = ctypes.c_ulonglong()
            ok(cu.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(x.data_ptr() + off)),
               "cuMemRetainAllocationHandle")
            held.append(h.value)
        del x
    print(f"returned holding {len(held)} pages", flush=True)
    sys.stdin.readline()
    size = len(held) * page
    va = ctypes.c_ulonglong()
    ok(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(page),
                              ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
    for i, h in enumerate(held):
        ok(cu.cuMemMap(ctypes.c_ulonglong(va.value + i * page), ctypes.c_size_t(page),
                       ctypes.c_size_t(0), ctypes.c_ulonglong(h), ctypes.c_ulonglong(0)), "cuMemMap")
    desc = (ctypes.c_int * 3)(1, torch.cuda.current_device(), 3)  # device location, read-write
    ok(cu.cuMemSetAccess(va, ctypes.c_size_t(size), desc, ctypes.c_size_t(1)), "cuMemSetAccess")
    ok(cu.cuMemsetD8_v2(va, ctypes.c_ubyte(0xEE), ctypes.c_size_t(size)), "cuMemsetD8")
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    print(f"wrote {size} bytes of the old pages", flush=True)
""")


@pytest.fixture
def shared_daemon(native):
    """A cuda subletd that another user may reach (--allow-group), lending no free memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.geteuid() != 0:
        pytest.skip("needs root to run the borrower as another user")
    directory = Path(tempfile.mkdtemp(prefix="sublet-fresh-"))
    directory.chmod(0o755)
    sock = directory / "gpu.sock"
    daemon = subprocess.Popen([str(native.subletd), "--device", "0", "--socket", str(sock),
                               "--allow-group", str(GROUP), "--reserve", "1T"],
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if sock.exists() or daemon.poll() is not None:
                break
            time.sleep(0.05)
        assert sock.exists(), daemon.stderr.read() if daemon.poll() is not None else "no socket"
        sock.chmod(0o666)
        yield sock
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_other_users_borrower_cannot_write_the_owner_after_the_loan(shared_daemon):
    env = dict(os.environ, **CHILD_ENV, SUBLET_SOCKET=str(shared_daemon))
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, **pipes)
    borrower = None
    try:
        assert owner.stdout.readline().startswith("offered"), owner.stderr.read()
        borrower = subprocess.Popen([sys.executable, "-c", BORROWER],
                                    env=dict(env, HOME="/tmp"), user=MEMBER,
                                    group=MEMBER, extra_groups=[GROUP], cwd="/", **pipes)
        held = borrower.stdout.readline()
        assert held.startswith("returned holding"), borrower.stderr.read()
        reclaimed = owner.stdout.readline()
        print(f"\n  borrower: {held.strip()}\n  owner: {reclaimed.strip()}")
        assert "intact True" in reclaimed and "replaced_pages 0 " not in reclaimed, \
            owner.stderr.read()
        borrower.stdin.write("attack\n")
        borrower.stdin.flush()
        wrote = borrower.stdout.readline()
        assert wrote.startswith("wrote"), borrower.stderr.read()
        owner.stdin.write("check\n")
        owner.stdin.flush()
        after = owner.stdout.readline()
        print(f"  borrower: {wrote.strip()}\n  owner: {after.strip()}")
        assert after.strip() == "after the write intact True", owner.stderr.read()
    finally:
        for p in (owner, borrower):
            if p is not None:
                p.kill()
                p.wait()
