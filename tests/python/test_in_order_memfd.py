"""Loans in order (daemon/books/books.h): after a region's first loan no loan maps a page, whatever
its keep and however it changes from one loan to the next, in the owner's process and in
another one; and the borrower is served from the region's pages first (kept bytes moved out of
the way on the device), then from free memory, and only then at the cost of host copies.

On the memfd backend (no GPU): a private subletd with 64 KiB pages and 64 MiB in all. Every
loan checks every kept byte against the tensor's bytes before it, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import sublet

from conftest import CHILD_ENV, PAGE, TOTAL, kept_ranges_of

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

PAGES = 128
BLOCK = 4096  # a KV cache block: 16 of them to a page


def live_blocks(kind: str, seed: int) -> list[int]:
    """Block indices kept: uniform, in runs that leave about half the pages empty, or rows."""
    rng = np.random.default_rng(seed)
    nblocks = PAGES * PAGE // BLOCK
    if kind == "uniform":
        return sorted(rng.choice(nblocks, nblocks * 3 // 10, replace=False).tolist())
    if kind == "runs":
        out, at = [], 0
        while at < nblocks:
            run = int(rng.integers(8, 40))
            out += range(at, min(at + run, nblocks))
            at += run + int(rng.integers(20, 100))
        return out
    if kind == "rows":
        row = int(rng.integers(2, 9))
        return [b for b in range(nblocks) if (b // 16) % row == 0]
    return []


def keep_of(t: torch.Tensor, kind: str, seed: int):
    blocks = t.view(-1, BLOCK)
    if kind == "nothing":
        return []
    if kind == "everything":
        return None
    return [blocks[b] for b in live_blocks(kind, seed)]


def kept_mask(t: torch.Tensor, keep) -> np.ndarray:
    mask = np.zeros(t.numel(), dtype=bool)
    if keep is None:
        mask[:] = True
    for off, length in (kept_ranges_of(t, keep).tolist() if keep is not None else []):
        mask[off:off + length] = True
    return mask


def borrow_some(loan, npages: int, seed: int) -> list[torch.Tensor]:
    """npages in allocations of 1 to 8 pages, each written; then a fifth of them freed and
    made again in the holes they left, as a training step's tensors come and go. (They were
    granted in address order: the span grows up from the first page.)"""
    rng = np.random.default_rng(seed)
    held, got = [], 0
    while got < npages:
        n = min(int(rng.integers(1, 9)), npages - got)
        held.append(loan.empty(n * PAGE, dtype=torch.uint8).fill_(0xA5))
        got += n
    gone = sorted(rng.choice(len(held), len(held) // 5, replace=False).tolist())
    sizes = [held[i].numel() for i in gone]
    for i in reversed(gone):
        del held[i]
    # lowest hole first: each fits its own hole exactly (first fit), so the span stays full
    held += [loan.empty(n, dtype=torch.uint8).fill_(0x5A) for n in sizes]
    return held


SEQUENCE = ["uniform", "runs", "rows", "nothing", "runs", "everything", "uniform", "rows"]


def test_no_loan_maps_a_page_in_the_owners_process_whatever_the_keep():
    """Keeps that change every loan, pages with nothing kept among them: every loan, the first
    included, is served on the region's own mapping (mapped_pages 0) inside the address space
    the region reserved; a borrower that takes no more than the pages the kept bytes leave
    free needs neither free memory nor the host."""
    t = sublet.empty(PAGES * PAGE, dtype=torch.uint8, device="cpu")
    lo, hi = t.data_ptr() - TOTAL - PAGE, t.data_ptr() + PAGES * PAGE
    for i, kind in enumerate(SEQUENCE):
        t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(i)))
        before, keep = t.clone(), keep_of(t, kind, seed=i)
        mask = kept_mask(t, keep)
        free_pages = PAGES - -(-int(mask.sum()) // PAGE)  # ceil: pages the kept bytes fill
        with sublet.lend(t, keep=keep) as loan:
            held = borrow_some(loan, free_pages, seed=i)
            assert all(lo <= x.data_ptr() and x.data_ptr() + x.numel() <= hi for x in held)
            del held
        s = loan.stats
        assert s.mapped_pages == 0, f"loan {i} ({kind}) mapped {s.mapped_pages} pages"
        assert s.copied_out_bytes == 0 and s.served_fresh_bytes == 0, f"loan {i} ({kind}): {s}"
        now = t.numpy()
        bad = np.flatnonzero((now != before.numpy()) & mask)
        assert len(bad) == 0, f"loan {i} ({kind}): {len(bad)} kept bytes changed"


def test_a_borrower_past_the_free_pages_takes_free_memory_before_the_host():
    """Past the pages the kept bytes leave free, the fresh zone comes next, and only once it is
    gone do kept bytes cross to the host: exactly what cannot stay on the device."""
    t = sublet.empty(PAGES * PAGE, dtype=torch.uint8, device="cpu")
    t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(5)))
    before, keep = t.clone(), keep_of(t, "runs", seed=5)
    mask = kept_mask(t, keep)
    kept = int(mask.sum())
    free_pages = PAGES - -(-kept // PAGE)
    with sublet.lend(t, keep=keep) as loan:
        held = borrow_some(loan, free_pages, seed=1)
        more = [loan.empty(PAGE, dtype=torch.uint8).fill_(1)]
        assert loan.stats.served_fresh_bytes == PAGE and loan.stats.copied_out_bytes == 0
        while True:
            try:
                more.append(loan.empty(PAGE, dtype=torch.uint8).fill_(2))
            except sublet.SubletOutOfMemoryError:
                break
        fresh = loan.stats.served_fresh_bytes
        del held, more
    s = loan.stats
    assert fresh > PAGE and s.copied_out_bytes == kept, s  # the whole device taken at the end
    assert np.array_equal(t.numpy()[mask], before.numpy()[mask])


BORROWER = textwrap.dedent("""
    import sys, torch, sublet
    for i in range(int(sys.argv[2])):
        with sublet.borrow(name=sys.argv[1], device="cpu", timeout=300) as loan:
            held = [loan.empty(int(sys.argv[3]), dtype=torch.uint8).fill_(0xAB)]
            held.append(loan.empty(3 * 65536, dtype=torch.uint8).fill_(0xCD))
            del held
        print("mapped", loan.stats.mapped_pages, flush=True)
""")


def test_another_process_maps_only_at_its_first_loan_whatever_the_keep():
    """A borrower in another process keeps its window: the region's pages it reached at the
    first loan stay mapped, and the next loans, with other keeps, map none (they reach no
    further). The owner checks every kept byte after each loan."""
    from sublet import _client
    t = sublet.empty(PAGES * PAGE, dtype=torch.uint8, device="cpu")
    loans = 5
    env = dict(os.environ, SUBLET_SOCKET=_client.client_for("memfd", 0).path, **CHILD_ENV)
    child = subprocess.Popen([sys.executable, "-c", BORROWER, "inorder", str(loans),
                              str(40 * PAGE)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for i, kind in enumerate(["uniform", "runs", "rows", "nothing", "runs"][:loans]):
        t.copy_(torch.randint(0, 256, (t.numel(),), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(10 + i)))
        before, keep = t.clone(), keep_of(t, kind, seed=10 + i)
        mask = kept_mask(t, keep)
        with sublet.offer(t, keep=keep, name="inorder") as offer:
            offer.wait(timeout=300)
        assert np.array_equal(t.numpy()[mask], before.numpy()[mask]), f"loan {i} ({kind})"
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    mapped = [int(line.split()[1]) for line in out.splitlines() if line.startswith("mapped")]
    assert len(mapped) == loans and mapped[0] >= 43, out
    assert mapped[1:] == [0] * (loans - 1), out
