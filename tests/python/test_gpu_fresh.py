"""GPU: a borrower of another user cannot touch the owner's memory after the loan (issue 9).

The owner (root) offers a 1 GiB tensor keeping every other 16 MiB row, on a daemon of its own
that lends no free memory (--reserve), so that the borrower's allocation takes the tensor's
pages themselves. The borrower is another user (uid 3000, in the allowed group). It keeps
every page it was granted alive past the loan, as an attacker would, with
cuMemRetainAllocationHandle (a reference to the physical memory that nothing can revoke),
through libsublet and the driver API alone (ctypes).
After the owner has reclaimed, it maps those pages again and writes every byte of them. The
owner's kept bytes are the same, bit for bit, at the same address: the end of the loan gave
the owner fresh pages. Skipped without CUDA, or without root (to become another user).

    python3 -m pytest tests/python/test_gpu_fresh.py -m gpu -s
"""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch

from gpu_other_user import end, offered, other_user_daemon, start_borrower, start_owner

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

GiB = 1024 ** 3

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
        print("offered, pages of", sublet.info().page_size, flush=True)
        stats = offer.wait(timeout=300)
    print(f"reclaimed replaced_pages {stats.replaced_pages} intact {intact()}", flush=True)
    sys.stdin.readline()                     # the borrower's old pages have been written
    torch.cuda.synchronize()
    print(f"after the write intact {intact()}", flush=True)
""")

# After BORROWER_HEAD (gpu_other_user.py): it has taken the whole window (ptrs).
BORROWER = textwrap.dedent("""
    held = []
    for q in ptrs:                               # every page granted, kept alive past the loan
        ok(cu.cuMemsetD8_v2(c_ulonglong(q), c_ubyte(0xB0), c_size_t(page)), "cuMemsetD8")
        h = c_ulonglong()
        ok(cu.cuMemRetainAllocationHandle(byref(h), c_void_p(q)), "cuMemRetainAllocationHandle")
        held.append(h.value)
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    for q in ptrs:
        ok(sl.sublet_free(c, c_void_p(q)), "sublet_free")
    ok(sl.sublet_return(c, 0, None, None, 0, None), "sublet_return")
    print(f"returned holding {len(held)} pages as uid {os.getuid()}", flush=True)
    sys.stdin.readline()
    size = len(held) * page
    va = c_ulonglong()
    ok(cu.cuMemAddressReserve(byref(va), c_size_t(size), c_size_t(page), c_ulonglong(0),
                              c_ulonglong(0)), "cuMemAddressReserve")
    for i, h in enumerate(held):
        ok(cu.cuMemMap(c_ulonglong(va.value + i * page), c_size_t(page), c_size_t(0),
                       c_ulonglong(h), c_ulonglong(0)), "cuMemMap")
    desc = (c_int * 3)(1, dev.value, 3)          # on the device, read-write
    ok(cu.cuMemSetAccess(va, c_size_t(size), desc, c_size_t(1)), "cuMemSetAccess")
    ok(cu.cuMemsetD8_v2(va, c_ubyte(0xEE), c_size_t(size)), "cuMemsetD8")
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
    with other_user_daemon(native.subletd, "--reserve", "1T") as (sock, _):
        yield sock


def test_other_users_borrower_cannot_write_the_owner_after_the_loan(shared_daemon, native):
    owner, env = start_owner(OWNER, shared_daemon)
    borrower = None
    try:
        page = int(offered(owner)[-1])
        borrower = start_borrower(BORROWER, page, "fresh", env, native.libsublet)
        held = borrower.stdout.readline()
        returned = time.monotonic()
        assert held.startswith("returned holding"), borrower.stderr.read()
        reclaimed = owner.stdout.readline()
        took = time.monotonic() - returned  # restore, fresh pages, the owner's remapping
        print(f"\n  borrower: {held.strip()}\n  owner: {reclaimed.strip()}, {took:.3f} s "
              f"after the return")
        assert reclaimed.startswith("reclaimed"), owner.stderr.read()
        assert int(reclaimed.split()[2]) > 0 and reclaimed.split()[-1] == "True", reclaimed
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
        end(owner, borrower)
