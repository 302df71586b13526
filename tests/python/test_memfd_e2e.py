"""End to end on the memfd backend (no GPU): a private subletd, real sockets, fd passing,
mapping and copies, through the public Python API with CPU tensors.

Needs the built subletd and libsublet.so (skipped with the reason when they are missing).
The daemon gets 64 KiB pages and 64 MiB in all, so a loan is easy to fill completely.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import sublet
from sublet._keep import kept_bytes_in_pages, kept_pages

from conftest import CHILD_ENV, PAGE, TOTAL, kept_ranges_of

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


def patterned(*size, dtype=torch.uint8, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublet tensor filled with random bytes, and a copy of them."""
    t = sublet.empty(*size, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return t, t.clone()


def kept_mask(t: torch.Tensor, keep) -> np.ndarray:
    """One bool per byte of t: the bytes `keep` asks back."""
    mask = np.zeros(t.untyped_storage().nbytes(), dtype=bool)
    if keep is None:
        mask[:] = True
        return mask
    for off, length in kept_ranges_of(t, keep).tolist():
        mask[off:off + length] = True
    return mask


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return torch.tensor([], dtype=torch.uint8).set_(t.untyped_storage()).numpy()


def assert_kept_intact(t: torch.Tensor, before: torch.Tensor, keep) -> None:
    mask = kept_mask(t, keep)
    now, then = as_bytes(t), as_bytes(before)
    bad = np.flatnonzero((now != then) & mask)
    assert len(bad) == 0, f"{len(bad)} kept bytes changed, first at offset {bad[0]}"


def fill_loan(loan: sublet.Loan, seed: int = 1) -> list[torch.Tensor]:
    """Loan.empty() pages until the loan is full, each written with random bytes."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (7, PAGE), dtype=torch.uint8, generator=g)
    tensors = []
    while True:
        try:
            x = loan.empty(PAGE, dtype=torch.uint8)
        except sublet.SubletOutOfMemoryError:
            return tensors
        tensors.append(x.copy_(noise[len(tensors) % len(noise)]))


KEEPS = {
    "default": lambda c: None,
    "nothing": lambda c: [],
    "one view": lambda c: c[3],
    "list": lambda c: [c[0], c[5], c[6]],
    "odd rows": lambda c: c[1::2],
    "columns": lambda c: c[:, 2:5],
    "scattered 1 KiB": lambda c: [c[i, j * 1024:(j + 1) * 1024]
                                  for i, j in [(0, 3), (2, 60), (2, 61), (9, 0), (15, 63)]],
    "row indices": lambda c: torch.tensor([9, 0, 5, 6, 15]),
    "row mask": lambda c: torch.arange(16) % 3 == 0,
}


@pytest.mark.parametrize("keep_name", list(KEEPS))
def test_keep_variants_fill_everything_and_restore(keep_name):
    cache, before = patterned(16, 65536)
    keep = KEEPS[keep_name](cache)
    with sublet.lend(cache, keep=keep) as loan:
        tensors = fill_loan(loan)
        assert len(tensors) * PAGE == TOTAL - (len(sublet_regions_pages()) - 16) * PAGE
        del tensors
    assert_kept_intact(cache, before, keep)
    expected = kept_bytes_in_pages(kept_ranges_of(cache, keep), PAGE)
    assert loan.copied_bytes == expected == loan.copied_in_bytes
    assert loan.stats.served_kept_bytes == PAGE * len(kept_pages(kept_ranges_of(cache, keep),
                                                                  PAGE))


def test_long_keep_lists_in_sequence_restore_every_kept_bit():
    """A KV cache's live list, long (over 65,536 ranges: libsublet sends it in a memfd) and
    changing from loan to loan, a loan repeating the last one's list too (its layout is then
    not sent again): after every loan, filled to the last page, every kept bit is what it was
    before that loan (the bytes a loan did not keep were the borrower's to overwrite)."""
    cache, _ = patterned(524288, 32, seed=13)  # 16 MiB of 32-byte blocks
    rng = np.random.default_rng(13)
    lists = [np.sort(rng.choice(524288, size=n, replace=False)) for n in (150_000, 200_000)]
    for rows in (lists[0], lists[1], lists[1], lists[0]):
        keep, before = torch.from_numpy(rows), cache.clone()
        assert len(kept_ranges_of(cache, keep)) > 65536
        with sublet.lend(cache, keep=keep) as loan:
            del_all(fill_loan(loan, seed=len(rows)))
        assert_kept_intact(cache, before, keep)
        assert loan.copied_bytes == len(rows) * 32  # every page was reached: all of it saved


def sublet_regions_pages() -> list[int]:
    """Pages of all regions alive in this process (they are not free memory for a loan)."""
    from sublet import _memory
    regions = [ref() for ref in _memory._registry.values()]
    return [0] * sum(r.size // PAGE for r in regions if r is not None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64,
                                   torch.complex64])
def test_dtypes_and_non_contiguous_views(dtype):
    cache, before = patterned(8, 4, 4096 // dtype.itemsize, dtype=dtype, seed=3)
    keep = [cache[1::3, :, 7:100], cache[4, 2]]
    with sublet.lend(cache, keep=keep) as loan:
        del_all(fill_loan(loan))
    assert_kept_intact(cache, before, keep)
    assert loan.copied_bytes == kept_bytes_in_pages(kept_ranges_of(cache, keep), PAGE)


def del_all(tensors: list) -> None:
    tensors.clear()


def test_kept_bytes_move_on_the_device_until_no_unlent_page_can_hold_them():
    """A loan in order hands the region's pages out from the first one up, each kept page's
    kept bytes moving into the holes of the last page while it is not lent; then the free
    memory; and only reaching that last page copies to the host: then all kept bytes, and
    only those."""
    cache, before = patterned(32, 65536, seed=5)
    keep = [cache[i, 100:300] for i in range(0, 32, 3)]
    ranges = kept_ranges_of(cache, keep)
    pages = kept_pages(ranges, PAGE).tolist()
    with sublet.lend(cache, keep=keep) as loan:
        tensors, region = [], 0
        while region < 32:
            tensors.append(loan.empty(PAGE, dtype=torch.uint8).fill_(0xEE))
            s = loan.stats
            region = (s.served_kept_bytes + s.served_unkept_bytes) // PAGE
            if region < 32:
                assert s.moved_bytes == kept_bytes_in_pages(ranges, PAGE,
                                                            [p for p in pages if p < region])
                assert s.copied_out_bytes == 0
                assert s.served_fresh_bytes == 0 or region == 31  # fresh after the 31 free
            else:
                assert s.served_fresh_bytes > 0 and s.copied_out_bytes == 11 * 200
        del tensors
    assert loan.copied_bytes == kept_bytes_in_pages(ranges, PAGE) == 11 * 200
    assert loan.stats.moved_bytes == 11 * 200
    assert_kept_intact(cache, before, keep)


def test_leak_error_restores_the_kept_data():
    cache, before = patterned(16, 65536, seed=7)
    with pytest.raises(sublet.LeakError, match="alive") as caught:
        with sublet.lend(cache) as loan:
            tensors = fill_loan(loan)
            leaked = tensors[-1]
            del tensors
    assert len(caught.value.leaks) == 1 and caught.value.leaks[0][1] == PAGE
    assert_kept_intact(cache, before, None)
    del leaked  # frees the forfeit allocation; must not crash
    with sublet.lend(cache, keep=[]) as loan:  # the device is usable again
        loan.empty(PAGE)


def test_a_leak_dying_in_the_next_loan_frees_nothing_of_it():
    """A Loan.empty() tensor left alive at a loan's end (LeakError) that dies during the next
    loan of the region. The first loan was served in place, so the leak has an address of the
    region's own mapping; the library frees by address. The next loan is laid out away from
    it, so the leak's death frees none of that loan's allocations, and that loan ends without
    a LeakError."""
    cache, before = patterned(16, 65536, seed=31)
    with pytest.raises(sublet.LeakError):
        with sublet.lend(cache, keep=[]) as loan:
            first = loan.empty(PAGE, dtype=torch.uint8)
            leaked = first.fill_(7)
    in_place = leaked.data_ptr()
    with sublet.lend(cache, keep=[]) as loan:
        mine = fill_loan(loan, seed=32)
        assert not any(t.data_ptr() == in_place for t in mine), "laid out away from the leak"
        copies = [t.clone() for t in mine]
        del first, leaked
        gc.collect()
        assert fill_loan(loan, seed=33) == [], "nothing of this loan was freed"
        assert all(torch.equal(t, c) for t, c in zip(mine, copies))
        del_all(mine)
    with sublet.lend(cache, keep=[]) as loan:  # the region lends on
        del_all(fill_loan(loan, seed=34))
    assert_kept_intact(cache, before, [])


def test_a_failure_before_the_return_still_returns_the_loan(monkeypatch):
    """Freeing a dead Loan.empty() allocation fails at the end of the block: the loan goes
    back all the same (the kept bytes are restored, the device is free), then it is raised."""
    from sublet import _client
    cache, before = patterned(16, 65536, seed=34)
    with pytest.raises(sublet.SubletError, match="injected"):
        with sublet.lend(cache, keep=cache[:4]) as loan:
            tensors = fill_loan(loan, seed=35)
            monkeypatch.setattr(_client.Client, "free", lambda self, ptr: (_ for _ in ()).throw(
                sublet.SubletError("injected", -5)))
            del tensors  # freed at the block's end, where the first free fails
    monkeypatch.undo()
    assert_kept_intact(cache, before, cache[:4])
    with sublet.lend(cache, keep=[]) as loan:  # returned: the device is free
        loan.empty(PAGE)


def test_a_loan_object_serves_one_loan():
    cache, _ = patterned(4, 65536, seed=36)
    loan = sublet.lend(cache, keep=[])
    with loan:
        pass
    with pytest.raises(RuntimeError, match="one loan"):
        with loan:
            pass
    with sublet.lend(cache, keep=[]):  # the tensor was not left lent
        pass


def test_a_lent_view_lends_only_its_own_bytes():
    """Lending cache[8:] lends rows 8 on: rows 0 to 7 are kept whatever keep says (keep
    speaks of the view's rows), through a loan filled to its last page. A view with gaps
    cannot be lent with a keep: its bytes are not one block."""
    cache, before = patterned(16, 65536, seed=37)
    for keep, kept_rows in (([], range(8)), (torch.tensor([0, 1]), range(10)),
                            (lambda v: v[3], [*range(8), 11])):
        lent = cache[8:]
        with sublet.lend(lent, keep=keep(lent) if callable(keep) else keep) as loan:
            del_all(fill_loan(loan, seed=38))
        assert_kept_intact(cache, before, [cache[r] for r in kept_rows])
        before = cache.clone()
    with pytest.raises(ValueError, match="one block"):
        sublet.lend(cache[:, :4096], keep=[])
    for lent, outside in ((cache[8:12], cache[7:9]), (cache[8:12], cache[11:13]),
                          (cache[4:8], [cache[5], cache[3, 1:2]])):
        with pytest.raises(ValueError, match="does not lend"):  # keep names unlent bytes
            sublet.lend(lent, keep=outside)
    with sublet.lend(cache.t(), keep=[]):  # every byte, in another order: one block
        pass


def test_keep_indices_are_one_dimension_and_not_uint8():
    """An integer tensor of more than one dimension (cache[[0, 5]] of an integer cache is a
    copy of rows) or a uint8 one (PyTorch reads it as a mask) is refused, naming the fix; a
    list of row indices keeps what the same indices as a tensor keep."""
    cache, before = patterned(16, 16384, dtype=torch.int32, seed=39)
    for keep, words in ((cache[[0, 5]], "copies the rows"),
                        (torch.tensor([3, 7], dtype=torch.uint8), "bool mask"),
                        (np.array([[1, 2]]), "one dimension")):
        with pytest.raises(TypeError, match=words):
            sublet.lend(cache, keep=keep)
    with pytest.raises(IndexError, match="out of range"):
        sublet.lend(cache, keep=np.array([2**64 - 1], dtype=np.uint64))
    assert kept_ranges_of(cache, [9, 0, 5]).tolist() == \
        kept_ranges_of(cache, torch.tensor([9, 0, 5])).tolist()
    with sublet.lend(cache, keep=[9, 0, 5]) as loan:
        del_all(fill_loan(loan, seed=40))
    assert_kept_intact(cache, before, [cache[9], cache[0], cache[5]])


def test_an_exception_in_the_block_still_restores():
    cache, before = patterned(4, 65536, seed=8)
    with pytest.raises(KeyError):
        with sublet.lend(cache) as loan:
            x = fill_loan(loan)
            raise KeyError("boom")
    del x
    assert_kept_intact(cache, before, None)


def test_one_loan_at_a_time():
    a, _ = patterned(2, 65536)
    b, _ = patterned(2, 65536)
    with sublet.lend(a, keep=[]):
        with pytest.raises(sublet.BusyError, match="one loan"):
            with sublet.lend(b):
                pass
    loan = sublet.lend(a)
    with loan:
        with pytest.raises(sublet.BusyError):
            with sublet.lend(a):
                pass
    with pytest.raises(RuntimeError, match="only while the loan is active"):
        loan.empty(16)


def free_bytes() -> int:
    """The daemon's free memory now (a new connection's welcome says it)."""
    from sublet import _daemon
    client = _daemon.connect(0, "memfd")
    try:
        return client.info.free_bytes
    finally:
        client.close()


def test_freeing_the_tensor_releases_its_region():
    free_before = free_bytes()
    t = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    assert free_bytes() == free_before - 4 * PAGE
    view = t[PAGE:]
    del t
    assert free_bytes() == free_before - 4 * PAGE  # the view keeps it
    del view
    assert free_bytes() == free_before


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_fifty_loans_in_a_row_do_not_grow():
    cache, before = patterned(64, 65536, seed=9)
    keep = cache[::4]
    sizes = []
    for i in range(50):
        with sublet.lend(cache, keep=keep) as loan:
            del_all(fill_loan(loan, seed=i))
        assert loan.copied_bytes == 16 * PAGE
        if i in (0, 49):
            gc.collect()  # earlier tests' garbage closes its fds now, not mid-loop
            sizes.append((_open_fds(), _rss_bytes(), free_bytes()))
    (fds0, rss0, free0), (fds1, rss1, free1) = sizes
    assert fds1 == fds0 and free1 == free0
    assert rss1 - rss0 < 16 * 1024 * 1024, f"RSS grew by {(rss1 - rss0) >> 20} MiB"
    assert_kept_intact(cache, before, keep)


def test_a_known_layout_with_less_free_memory_is_laid_out_again():
    """The same keep list is the same layout (not sent again), but a region made between two
    loans leaves less free memory, so a smaller fresh zone: the window is laid out anew from
    its own copy of the layout, gathered (rows kept here and there) as in place (bytes of
    every page kept). Once that region is freed the zone stays as it is (books.c,
    steady_fresh). Every kept bit comes back each time."""
    keeps = {"rows": lambda c: c[::3], "every page": lambda c: c.view(-1, PAGE)[:, :64]}
    for name, keep_of in keeps.items():
        cache, _ = patterned(16, 16 * PAGE, seed=14)  # rows of 16 pages, a region of its own
        keep, extra, got = keep_of(cache), None, []
        for step in ("as it is", "less free", "more free", "as it is"):
            if step == "less free":
                extra = sublet.empty(64 * PAGE, dtype=torch.uint8, device="cpu")
            elif step == "more free":
                del extra
                gc.collect()
            before = cache.clone()
            with sublet.lend(cache, keep=keep) as loan:
                tensors = fill_loan(loan, seed=len(step))
                got.append(len(tensors))
                del_all(tensors)
            assert_kept_intact(cache, before, keep)
        others = len(sublet_regions_pages()) - 256
        assert got == [1024 - others, 1024 - others - 64, 1024 - others - 64,
                       1024 - others - 64], name
        del cache, keep, loan  # the loan holds the tensor: its region goes with all three
        gc.collect()


# --------------------------------------------------------------------------- two processes

BORROWER = textwrap.dedent("""
    import sys, time, torch, sublet
    name, mode = sys.argv[1], sys.argv[2]
    with sublet.borrow(name=name, device="cpu", timeout=300) as loan:
        tensors = []
        while True:
            try:
                tensors.append(loan.empty(65536, dtype=torch.uint8).fill_(0xAB))
            except sublet.SubletOutOfMemoryError:
                break
        print("filled", len(tensors), flush=True)
        if mode == "hang":
            time.sleep(60)
        tensors.clear()
    print("copied", loan.copied_bytes, flush=True)
""")


def start_borrower(name: str, mode: str) -> subprocess.Popen:
    from sublet import _client
    socket = _client.client_for("memfd", 0).path
    env = dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV)
    return subprocess.Popen([sys.executable, "-c", BORROWER, name, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_offer_and_borrow_across_processes():
    cache, before = patterned(16, 65536, seed=11)
    keep = cache[::2, :4096]
    with sublet.offer(cache, keep=keep, name="kv") as offer:
        child = start_borrower("kv", "normal")
        stats = offer.wait(timeout=300)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert "filled" in out
    assert_kept_intact(cache, before, keep)
    assert stats.copied_out_bytes == stats.copied_in_bytes == 8 * 4096


def test_borrower_killed_mid_loan():
    cache, before = patterned(16, 65536, seed=12)
    offer = sublet.offer(cache, name="kill-me")
    child = start_borrower("kill-me", "hang")
    assert child.stdout.readline().startswith("filled")
    child.send_signal(signal.SIGKILL)
    child.wait()
    with pytest.raises(sublet.BorrowerDiedError) as caught:
        offer.wait(timeout=300)
    assert caught.value.stats is not None and caught.value.stats.borrower_died
    assert_kept_intact(cache, before, None)
    with sublet.lend(cache, keep=[]):  # the tensor is the owner's again
        pass


# A borrower that keeps its window: two loans of one region, then it sits idle, calling
# nothing, until its stdin closes.
KEEPER = textwrap.dedent("""
    import os, sys, torch, sublet
    def memfd_pages():
        fds = sum(os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:sublet-page")
                  for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))
        with open("/proc/self/maps") as maps:
            return fds, sum("/memfd:sublet-page" in line for line in maps)
    for i in range(2):
        with sublet.borrow(name=sys.argv[1], device="cpu", timeout=300) as loan:
            loan.empty(int(sys.argv[2]), dtype=torch.uint8).fill_(0xAB)
        print("held", *memfd_pages(), flush=True)
    sys.stdin.read()
""")


def memfd_pages_of(pid: int) -> tuple[int, int]:
    """The memfd pages (fds, mappings) a process holds."""
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:sublet-page")
        except FileNotFoundError:
            pass
    with open(f"/proc/{pid}/maps") as maps:
        return fds, sum("/memfd:sublet-page" in line for line in maps)


def start_keeper(name: str, nbytes: int) -> subprocess.Popen:
    from sublet import _client
    socket = _client.client_for("memfd", 0).path
    return subprocess.Popen([sys.executable, "-c", KEEPER, name, str(nbytes)],
                            env=dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def held_by(pid: int) -> int:
    """Bytes of gone regions that pid still holds, as `sublet status --json` says."""
    status = json.loads(sublet_status("--json").stdout)
    return sum(h["bytes"] for d in status for h in d["held"] if h["holder_pid"] == pid)


def test_idle_borrower_lets_go_when_the_region_is_freed():
    """The owner frees a region whose window an idle borrower in another process kept: the
    borrower lets go of its pages at once (no fd, no mapping left), so that a region of the
    same size fits again; while it cannot (stopped), status counts them as held by it."""
    size = 40 * 1024 * 1024                     # two do not fit in the daemon's 64 MiB
    cache, before = patterned(size // 65536, 65536, seed=31)
    child = start_keeper("kept", size)
    try:
        for _ in range(2):
            with sublet.offer(cache, keep=cache[:1], name="kept") as offer:
                offer.wait(timeout=300)
            assert torch.equal(cache[:1], before[:1])
        first, second = (child.stdout.readline().split() for _ in range(2))
        assert first[0] == "held" and int(first[1]) >= size // PAGE - 1
        assert second == first                  # the second loan imported and mapped nothing
        child.send_signal(signal.SIGSTOP)
        while open(f"/proc/{child.pid}/stat").read().split(")")[1].split()[0] != "T":
            time.sleep(0.001)
        del cache, before, offer                # the region is released
        gc.collect()
        assert held_by(child.pid) == size       # by the stopped borrower, which cannot let go
        assert "still held by pid %d" % child.pid in sublet_status().stdout
        with pytest.raises(sublet.SubletOutOfMemoryError):
            sublet.empty(size, dtype=torch.uint8, device="cpu")
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30  # a hang guard
        while memfd_pages_of(child.pid) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert memfd_pages_of(child.pid) == (0, 0)
        while held_by(child.pid) != 0 and time.monotonic() < deadline:
            time.sleep(0.01)                    # Dropped comes a moment after the unmapping
        assert held_by(child.pid) == 0
        again = sublet.empty(size, dtype=torch.uint8, device="cpu")
        del again
    finally:
        child.kill()
        child.wait()


def test_offer_not_taken():
    cache, _ = patterned(2, 65536)
    with sublet.offer(cache, name="nobody") as offer:
        with pytest.raises(sublet.SubletTimeoutError):
            offer.wait(timeout=0.3)
    assert offer.done  # leaving the block withdrew it
    with sublet.lend(cache):
        pass


def test_borrow_without_offer():
    with pytest.raises(sublet.NoOfferError):
        with sublet.borrow(name="absent", device="cpu", timeout=0.3):
            pass


def test_system_daemon_is_found_by_gpu_uuid(native, tmp_path, monkeypatch):
    """A daemon whose socket number differs from our device number (CUDA_VISIBLE_DEVICES) is
    still ours when its GPU UUID is; one with another UUID is not."""
    from sublet import _daemon
    socket = tmp_path / "gpu3.sock"
    daemon = subprocess.Popen([str(native.subletd), "--device", "3", "--backend", "memfd",
                               "--socket", str(socket), "--parent-pid", str(os.getpid())],
                              stderr=subprocess.PIPE)
    try:
        _daemon._wait_until_answering(socket, daemon.pid, tmp_path / "none.log",
                                      "subletd").close()
        monkeypatch.setattr(_daemon, "SYSTEM_SOCKET_DIR", tmp_path)
        theirs = b"sublet-memfd" + (3).to_bytes(4, "big")
        monkeypatch.setattr(_daemon, "_cuda_uuid", lambda device: theirs)
        client = _daemon._system_daemon(0)
        assert client is not None and client.info.device_uuid == _daemon.format_uuid(theirs)
        client.close()
        monkeypatch.setattr(_daemon, "_cuda_uuid", lambda device: bytes(16))
        assert _daemon._system_daemon(0) is None
    finally:
        daemon.terminate()
        daemon.wait()


def sublet_status(*args: str) -> subprocess.CompletedProcess:
    from sublet import _client
    socket = _client.client_for("memfd", 0).path
    return subprocess.run([sys.executable, "-m", "sublet", "status", "--socket", socket, *args],
                          env=dict(os.environ, **CHILD_ENV), capture_output=True,
                          text=True, timeout=60)


def test_status_during_a_loan_in_every_form():
    """`sublet status` shows the loan in progress (borrower, sources, bytes copied) as text,
    JSON and Prometheus text, while another process borrows."""
    cache, before = patterned(16, 65536, seed=21)
    offer = sublet.offer(cache, keep=cache[:4], name="watched")
    child = start_borrower("watched", "hang")
    try:
        assert child.stdout.readline().startswith("filled")
        as_json = sublet_status("--json")
        as_text = sublet_status()
        as_prom = sublet_status("--prometheus")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert as_json.returncode == as_text.returncode == as_prom.returncode == 0, as_json.stderr
    (status,) = json.loads(as_json.stdout)
    loan = status["loan"]
    assert status["backend"] == "memfd" and status["page_size"] == PAGE
    assert loan["state"] == "active" and loan["name"] == "watched"
    assert loan["borrower_pid"] == child.pid
    assert loan["kept_pages"] == 4 and loan["copied_out_bytes"] == 4 * 65536
    assert loan["served_kept_bytes"] == 4 * PAGE and loan["live_bytes"] > 0
    assert any(r["loan"] == loan["id"] and r["owner_pid"] == os.getpid()
               for r in status["regions"])
    assert f"loan {loan['id']} \"watched\": active" in as_text.stdout
    assert f"borrowed by pid {child.pid}" in as_text.stdout
    assert "256.00 KiB to the host" in as_text.stdout
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
               for line in as_prom.stdout.splitlines() if not line.startswith("#")
               and "source=" not in line}
    assert metrics["sublet_loan_active"] == 1
    assert metrics["sublet_loan_copied_out_bytes"] == 4 * 65536
    assert metrics["sublet_memory_total_bytes"] == TOTAL
    with pytest.raises(sublet.BorrowerDiedError):
        offer.wait(timeout=300)
    assert_kept_intact(cache, before, cache[:4])


def test_status_exit_codes(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "sublet", "status", "--socket",
                              str(tmp_path / "none.sock")], env=dict(os.environ,
                             **CHILD_ENV), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3 and "cannot reach subletd" in missing.stderr
    usage = subprocess.run([sys.executable, "-m", "sublet", "status", "--bogus"],
                           env=dict(os.environ, **CHILD_ENV), capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == 2
    unwritable = sublet_status("--output", str(tmp_path / "no" / "such" / "dir" / "f.prom"))
    assert unwritable.returncode == 4 and "cannot write" in unwritable.stderr
    assert "Traceback" not in unwritable.stderr
    no_lib = dict(os.environ, **CHILD_ENV, SUBLET_LIB=str(tmp_path / "none.so"))
    helped = subprocess.run([sys.executable, "-m", "sublet", "--help"], env=no_lib,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "exit status" in helped.stdout
    version = subprocess.run([sys.executable, "-m", "sublet", "--version"], env=no_lib,
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 4 and "SUBLET_LIB" in version.stderr
    assert "Traceback" not in version.stderr


OWNER = textwrap.dedent("""
    import sys, time, torch, sublet
    cache = sublet.empty(16, 65536, dtype=torch.uint8, device="cpu").fill_(5)
    offer = sublet.offer(cache, name=sys.argv[1])
    print("offered", flush=True)
    time.sleep(120)
""")


def test_owner_killed_mid_loan_is_told_to_the_borrower():
    from sublet import _client
    socket = _client.client_for("memfd", 0).path
    free_before = sublet.info("cpu").free_bytes
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "orphan"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV))
    try:
        assert owner.stdout.readline().startswith("offered"), owner.stderr.read()
        # Told at the next allocation, and again when the loan is returned (cleanly).
        with pytest.raises(sublet.OwnerGoneError, match="owner went away"):
            with sublet.borrow(name="orphan", device="cpu", timeout=300) as loan:
                held = loan.empty(4 * 65536, dtype=torch.uint8).fill_(1)
                owner.send_signal(signal.SIGKILL)
                owner.wait()
                time.sleep(0.1)
                with pytest.raises(sublet.OwnerGoneError, match="owner"):
                    loan.empty(65536, dtype=torch.uint8)
                assert int(held.sum()) == 4 * 65536  # usable until the loan is returned
                del held
        assert loan.stats.owner_gone
        assert sublet.info("cpu").free_bytes == free_before  # the dead owner's region is freed
    finally:
        owner.kill()
        owner.wait()


# --------------------------------------------------------------------------- local lends

WAITER = textwrap.dedent("""
    import sys, torch, sublet
    print("waiting", flush=True)
    with sublet.borrow(device="cpu", timeout=120) as loan:  # the next offer, whatever it is
        taken = loan.stats.loan_id
    print("took", taken, flush=True)
""")


def test_local_lends_are_never_offers():
    """A same-user process waits in sublet.borrow() for the next offer while the owner lends
    locally 100 times: it takes none of them, none fails, and it takes the one real offer."""
    from sublet import _client
    socket = _client.client_for("memfd", 0).path
    cache, _ = patterned(16, 65536, seed=31)
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV))
    try:
        assert waiter.stdout.readline().startswith("waiting"), waiter.stderr.read()
        time.sleep(0.5)  # its Borrow is parked in the daemon by now
        local_ids = set()
        for i in range(100):
            keep, before = cache[i % 16], cache.clone()
            with sublet.lend(cache, keep=keep) as loan:
                loan.empty(3 * PAGE, dtype=torch.uint8).fill_(i)
                if i == 0:
                    (status,) = json.loads(sublet_status("--json").stdout)
                    assert status["loan"]["local"] and status["loan"]["state"] == "active"
                    assert "a local lend of pid" in sublet_status().stdout
            local_ids.add(loan.stats.loan_id)
            assert_kept_intact(cache, before, keep)
        assert waiter.poll() is None, waiter.communicate()
        with sublet.offer(cache, keep=cache[:2]) as offer:
            offer.wait(timeout=60)
        out, err = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
        waiter.wait()
    assert waiter.returncode == 0, err
    assert out.split() == ["took", str(offer.loan_id)] and offer.loan_id not in local_ids
    assert len(local_ids) == 100


# --------------------------------------------------------------------------- verify

def test_verify_passes_when_the_kept_bytes_come_back():
    cache, before = patterned(16, 65536, dtype=torch.uint8, seed=41)
    keep = [cache[1], cache[4, 100:9000], cache[9:12]]
    for _ in range(3):  # the borrower takes everything: every kept page is saved and restored
        with sublet.lend(cache, keep=keep, verify=True) as loan:
            del_all(fill_loan(loan))
        assert loan.copied_bytes > 0
    assert_kept_intact(cache, before, keep)


def test_verify_names_the_range_that_changed():
    """The owner writes to a kept page nobody borrowed (the one thing sublet cannot undo):
    verify catches it and says where, in bytes and in the tensor's terms."""
    cache, _ = patterned(16, 65536, dtype=torch.uint8, seed=42)
    with pytest.raises(sublet.VerifyError) as caught:
        with sublet.lend(cache, keep=[cache[2], cache[7]], verify=True) as loan:
            loan.empty(PAGE, dtype=torch.uint8).fill_(1)  # an unkept page: kept ones untouched
            cache[7, 300] ^= 0x40  # one bit of a kept byte
    assert caught.value.changed == [(7 * 65536, 65536)]
    assert "index [7, 0]" in str(caught.value) and "1 of 2 kept ranges" in str(caught.value)


def test_sublet_verify_env_turns_it_on(monkeypatch):
    cache, _ = patterned(4, 65536, dtype=torch.uint8, seed=43)
    with sublet.lend(cache, keep=cache[1]):
        cache[1, 0] ^= 1  # not verified: nothing said
    monkeypatch.setenv("SUBLET_VERIFY", "1")
    with pytest.raises(sublet.VerifyError):
        with sublet.lend(cache, keep=cache[1]):
            cache[1, 0] ^= 1
    with sublet.lend(cache, keep=cache[1], verify=False):
        cache[1, 0] ^= 1  # an explicit False wins over the environment


def test_verify_compares_bits_not_values():
    """bf16 NaNs kept through loans whose keep sets change: bits came back, so verify is quiet
    (a value comparison would call NaN != NaN a change)."""
    cache = sublet.empty(16, 32768, dtype=torch.bfloat16, device="cpu")
    cache.view(torch.int16).fill_(0x7FC1)  # a NaN pattern
    for i in range(4):
        with sublet.lend(cache, keep=cache[i::4], verify=True) as loan:
            del_all(fill_loan(loan, seed=i))


def test_verify_an_offer_across_processes():
    cache, before = patterned(16, 65536, seed=44)
    keep = cache[::3]
    with sublet.offer(cache, keep=keep, name="checked", verify=True) as offer:
        child = start_borrower("checked", "normal")
        offer.wait(timeout=120)
    assert child.wait(timeout=120) == 0
    assert_kept_intact(cache, before, keep)
    offer = sublet.offer(cache, keep=cache[:2], name="spoilt", verify=True)
    cache[1, 10] ^= 1  # the owner writes during its own offer
    child = start_borrower("spoilt", "normal")
    with pytest.raises(sublet.VerifyError) as caught:
        offer.wait(timeout=120)
    assert caught.value.changed == [(0, 2 * 65536)]
    assert child.wait(timeout=120) == 0


def test_checksum_refuses_ranges_outside_the_region():
    from sublet._memory import region_of
    cache, _ = patterned(2, 65536)
    region = region_of(cache)
    with pytest.raises(sublet.SubletError, match="past the end of the region"):
        region.client.checksum(region.handle, np.array([[region.size - 8, 9]], np.uint64),
                               np.empty(1, np.uint64))


def _fill_loan(loan: sublet.Loan) -> list[torch.Tensor]:
    """Loan.empty() allocations of 4 pages, then of 1, until the loan is full, each written."""
    out = []
    for size in (4 * PAGE, PAGE):
        while True:
            try:
                out.append(loan.empty(size, dtype=torch.uint8).fill_(len(out) % 250 + 1))
            except sublet.SubletError:
                break
    return out


@pytest.mark.parametrize("offset", [0, 8192, 40000])
def test_a_loan_keeping_bytes_of_every_page_is_served_in_place(offset):
    """A loan that keeps some bytes of every page (a paged KV cache's live blocks) is served on
    the owner's own mapping: its kept pages where they are, its fresh zone right below them,
    so that nothing is mapped but fresh chunks, at the first loan as at the next. Every
    allocation lies in the address space the region reserved; every kept byte comes back."""
    pages = 128
    t, before = patterned(pages * PAGE, seed=offset)
    keep = t.view(pages, PAGE)[:, offset:offset + 2000]   # 2000 bytes of every page
    mask = kept_mask(t, keep)
    lo, hi = t.data_ptr() - TOTAL - PAGE, t.data_ptr() + pages * PAGE   # the reservation
    for i in range(3):
        with sublet.lend(t, keep=keep) as loan:
            held = _fill_loan(loan)
            assert held and all(lo <= x.data_ptr() and x.data_ptr() + x.numel() <= hi
                                for x in held), "an allocation outside the region's space"
            del held
        s = loan.stats
        assert s.served_kept_bytes == pages * PAGE and s.served_unkept_bytes == 0
        assert np.array_equal(t.numpy()[mask], before.numpy()[mask]), f"loan {i}"
        t.view(pages, PAGE)[:, :offset].fill_(i)          # the owner writes unkept bytes


@pytest.mark.parametrize("head_pages", [1, 40, 127])
def test_a_loan_keeping_the_head_is_served_in_place_from_the_unkept_tail_on(head_pages):
    """A tensor that keeps its head (a KV cache whose live blocks are packed at the start):
    its unkept tail is the region's own mapping, and the fresh and kept zones follow right
    after the region's last page, in the address space it reserved above itself. So one
    allocation larger than the tail starts in the tail itself and runs on into fresh memory
    with nothing but the fresh chunk mapped; every allocation lies in the region's space; every
    kept byte comes back, loan after loan."""
    pages = 128
    t, before = patterned(pages * PAGE, seed=head_pages)
    keep = t[: head_pages * PAGE - 100]
    mask = kept_mask(t, keep)
    tail = pages - head_pages
    lo = t.data_ptr() + head_pages * PAGE
    hi = t.data_ptr() + (2 * pages + TOTAL // PAGE + 1) * PAGE   # the trailing reservation
    for i in range(3):
        with sublet.lend(t, keep=keep) as loan:
            big = loan.empty((tail + 16) * PAGE, dtype=torch.uint8).fill_(0xEE)
            assert big.data_ptr() == lo, "not served from the tail of the region's mapping"
            held = [big] + _fill_loan(loan)
            assert all(t.data_ptr() <= x.data_ptr() and x.data_ptr() + x.numel() <= hi
                       for x in held), "an allocation outside the region's space"
            assert loan.stats.served_kept_bytes == head_pages * PAGE
            del held, big
        assert np.array_equal(t.numpy()[mask], before.numpy()[mask]), f"loan {i}"
        t[head_pages * PAGE:].fill_(i)                      # the owner writes unkept bytes


@pytest.mark.parametrize("name", ["", "a\x1b[2Jb"])
def test_a_loan_name_of_no_bytes_or_with_a_control_character_is_refused(name):
    """name="" is a name of 0 bytes, not None (no name): the daemon refuses it as it refuses a
    name with a control character, and the tensor is untouched."""
    t, before = patterned(2 * PAGE)
    with pytest.raises(sublet.SubletError) as refused:
        with sublet.offer(t, name=name):
            pytest.fail("a loan was offered under an invalid name")
    assert refused.value.code_name == "EINVAL" and "1 to 63 bytes" in str(refused.value)
    assert torch.equal(t, before)
