"""PyTorch's conventions kept by sublet, end to end on the memfd backend (no GPU): running out
is a torch.OutOfMemoryError (in this process and in a fresh one that imports torch and sublet
as a user does), sublet.empty takes torch.empty's arguments, and loans, offers and releases
print their sizes as people read them. The checks that need no daemon are in
test_api_errors.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import sublet
from conftest import CHILD_ENV, PAGE, TOTAL
from pool_helpers import fill_loan

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

# "0 B", "64.00 KiB", "1.50 MiB": what _units.human writes
SIZE = r"\d+(?:\.\d\d)? (?:B|KiB|MiB|GiB|TiB)"


# --------------------------------------------------------------------------- out of memory

def test_sublet_empty_out_of_memory_is_torch_out_of_memory():
    with pytest.raises(torch.OutOfMemoryError) as caught:
        sublet.empty(2 * TOTAL, dtype=torch.uint8, device="cpu")
    assert isinstance(caught.value, sublet.SubletOutOfMemoryError)
    assert isinstance(caught.value, torch.cuda.OutOfMemoryError)  # the same class, older name


def test_loan_empty_out_of_memory_is_torch_out_of_memory():
    t = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    with sublet.lend(t, keep=[]) as loan:
        with pytest.raises(torch.OutOfMemoryError):
            loan.empty(2 * TOTAL, dtype=torch.uint8)


def test_a_fresh_process_catches_sublet_running_out_as_torch_does():
    # The order a user's script imports in; sublet's class joins torch's when sublet's torch
    # side loads, which must come before anything of sublet can run out.
    code = ("import torch, sublet\n"
            "try:\n"
            f"    sublet.empty({2 * TOTAL}, dtype=torch.uint8, device='cpu')\n"
            "except torch.OutOfMemoryError as e:\n"
            "    print('caught', type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **CHILD_ENV})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["caught", "SubletOutOfMemoryError"]


# --------------------------------------------------------------------------- sublet.empty

def test_sublet_empty_takes_torch_empty_arguments():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        t = sublet.empty(size=(3, 4), device=torch.device("cpu"), requires_grad=True)
    finally:
        torch.set_default_dtype(previous)
    assert (t.shape, t.dtype, t.requires_grad, t.device) == ((3, 4), torch.float64, True,
                                                            torch.device("cpu"))
    assert sublet.empty(5, dtype=int, device="cpu").dtype == torch.int64  # as torch.empty
    assert sublet.empty(torch.Size([2, 2]), device="cpu:0").device == torch.device("cpu")


def test_sublet_empty_size_given_twice_names_the_fix():
    with pytest.raises(TypeError, match="positionally or as size="):
        sublet.empty(3, size=(3,), device="cpu")


# --------------------------------------------------------------------------- reprs

def test_loan_and_offer_reprs_give_sizes_as_people_read_them():
    t = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    what = r"a tensor of shape \(262144,\) \(256\.00 KiB\) on cpu"
    loan = sublet.lend(t, keep=t[:PAGE // 2])
    assert re.fullmatch(rf"<sublet\.LocalLoan of {what}: not started>", repr(loan)), repr(loan)
    with loan:
        assert repr(loan).endswith(": active>"), repr(loan)
        fill_loan(loan, seed=1)  # to the kept page: its kept half goes to the host
    assert re.fullmatch(rf"<sublet\.LocalLoan of {what}: returned, 32\.00 KiB to the host, "
                        rf"0 B moved>", repr(loan)), repr(loan)
    assert re.match(rf"<sublet\.LoanStats of loan \d+: served 192\.00 KiB unkept, {SIZE} "
                    rf"fresh, 64\.00 KiB kept", repr(loan.stats)), repr(loan.stats)
    with sublet.offer(t, name="repr-kv") as offer:
        assert re.fullmatch(rf"<sublet\.Offer 'repr-kv', loan \d+ of {what}: lent>",
                            repr(offer)), repr(offer)
        offer.withdraw()
    assert repr(offer).endswith(": withdrawn>"), repr(offer)


def test_release_repr_gives_sizes_as_people_read_them():
    t = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    with sublet.release(t, keep=t[:PAGE // 2]) as rel:
        assert repr(rel) == ("<sublet.Release of a tensor of shape (262144,): released, "
                             "192.00 KiB to the driver, 64.00 KiB stayed on the device, 0 B to "
                             "the host>"), repr(rel)
    assert ": resumed, 192.00 KiB to the driver" in repr(rel), repr(rel)
    assert re.match(r"<sublet\.ReleaseStats of release \d+: 3 pages released, 1 stayed "
                    r"holding 32\.00 KiB kept", repr(rel.stats)), repr(rel.stats)
