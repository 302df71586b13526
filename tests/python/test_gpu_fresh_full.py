"""GPU: a borrower of another user that took the whole device, returned and exited gives the
owner its kept bytes back at the first Reclaim (issue 41 item 2, the owner's side).

The owner (root) offers a tensor of 70% of the device's free memory keeping one 64th-row in
16 (a KV cache, most of the device). The borrower (uid 3000, in the allowed group; libsublet
and the driver through ctypes, no torch) takes the whole device: every unkept page of the
tensor and all free memory, writes it, frees it, returns, and exits. The end of the loan needs
a fresh page for each page the borrower was granted, about 15/16 of the tensor: more than the
device holds beside it. subletd lets go of its own hold of the old pages, but on CUDA their
memory is freed only once every process has let go, and the owner's own process still maps
them: its Reclaim is told that the end waits for fresh pages (Error.awaits_fresh_pages), its
library lets go of them and asks again. The kept rows come back bit for bit (compared as
bytes, on the host) at the same address, at the first wait(). Before: SubletOutOfMemoryError
at every wait until subletd restarted. Skipped without CUDA, or without root (to become
another user).

    python3 -m pytest tests/python/test_gpu_fresh_full.py -m gpu -s
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from gpu_other_user import end, offered, other_user_daemon, start_borrower, start_owner

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

# The owner waits for the test's word (the borrower has exited) before its first Reclaim, so
# that nothing but its own mapping holds the old pages then.
OWNER = textwrap.dedent("""
    import sys, time, torch, sublet
    page = sublet.info().page_size
    free, _ = torch.cuda.mem_get_info()
    size = int(free * 0.7) // (64 * page) * (64 * page)
    cache = sublet.empty(size, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(41)
    cache.random_(0, 256, generator=g)
    rows = cache.view(64, -1)
    kept = rows[::16]
    before, ptr = kept.cpu(), cache.data_ptr()
    torch.cuda.synchronize()
    offer = sublet.offer(cache, keep=kept, name="full")
    print(f"offered {size} bytes, pages of {page}", flush=True)
    sys.stdin.readline()                        # the borrower has returned and exited
    free_now, _ = torch.cuda.mem_get_info()     # what the end has beside the old pages
    t0 = time.monotonic()
    stats = offer.wait(timeout=120)             # the first Reclaim
    took = time.monotonic() - t0
    intact = bool(torch.equal(kept.cpu(), before)) and cache.data_ptr() == ptr
    print(f"reclaimed replaced_pages {stats.replaced_pages} free_before {free_now} "
          f"in {took:.3f} s intact {intact}", flush=True)
""")

# After BORROWER_HEAD (gpu_other_user.py), which took every unkept page and all free memory
# (ptrs): written, freed, returned; then the process exits.
BORROWER = textwrap.dedent("""
    for q in ptrs:
        ok(cu.cuMemsetD8_v2(c_ulonglong(q), c_ubyte(0xB0), c_size_t(page)), "cuMemsetD8")
    ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    for q in ptrs:
        ok(sl.sublet_free(c, c_void_p(q)), "sublet_free")
    ok(sl.sublet_return(c, 0, None, None, 0, None), "sublet_return")
    sl.sublet_disconnect(c)
    print(f"returned {len(ptrs)} pages as uid {os.getuid()}", flush=True)
""")


@pytest.fixture
def shared_daemon(native):
    """A cuda subletd that another user may reach (--allow-group) and that lends free memory
    too; its log in a file (the stall is asserted from it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.geteuid() != 0:
        pytest.skip("needs root to run the borrower as another user")
    with other_user_daemon(native.subletd) as (sock, log):
        yield sock, log


def test_whole_device_borrower_returns_and_exits_kept_bytes_at_first_reclaim(shared_daemon,
                                                                             native):
    sock, log = shared_daemon
    owner, env = start_owner(OWNER, sock)
    borrower = None
    try:
        words = offered(owner)
        size, page = int(words[1]), int(words[-1])
        borrower = start_borrower(BORROWER, page, "full", env, native.libsublet)
        out, err = borrower.communicate(timeout=300)
        assert borrower.returncode == 0 and out.startswith("returned"), err
        taken = int(out.split()[1]) * page
        owner.stdin.write("reclaim\n")
        owner.stdin.flush()
        reclaimed = owner.stdout.readline()
        print(f"\n  tensor {size / 2**30:.1f} GiB; borrower: {out.strip()} "
              f"({taken / 2**30:.1f} GiB)\n  owner: {reclaimed.strip()}")
        assert reclaimed.startswith("reclaimed"), owner.stderr.read()
        replaced, free_after = int(reclaimed.split()[2]), int(reclaimed.split()[4])
        intact = reclaimed.split()[-1]
        assert taken >= size * 15 // 16, "the borrower did not take every unkept page"
        # The case in point: the fresh pages did not fit beside the owner's old ones.
        assert replaced * page > free_after, (replaced, page, free_after)
        assert "its kept bytes wait" in log.read_text(), "the end never waited for memory"
        assert intact == "True", reclaimed
    finally:
        end(owner, borrower)
