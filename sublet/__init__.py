"""sublet: lend a GPU tensor's memory to other PyTorch work.

    cache = sublet.empty(16, 1024**3, dtype=torch.uint8)  # memory that sublet manages
    with sublet.lend(cache, keep=cache[1::2]) as loan:    # any PyTorch code inside
        run_anything()
    loan.copied_bytes                                      # kept bytes that went to the host

The borrower's allocations are served, cheapest first, from the pages of the tensor it does
not keep, from free GPU memory, and from kept pages whose kept bytes are saved to the host first
and restored bit-identical at the end. Across processes: the owner calls sublet.offer(...) and
waits; another process runs `with sublet.borrow(name=...)`.

Inside a loan, every CUDA allocation of the process on that device goes to the loan: any
thread, any stream, autograd's backward. Not routed: CUDA graph capture pools (and
torch.compile's reduce-overhead graphs), symmetric memory, NCCL's internal buffers, user
MemPools nested in the loan. The owner must not use the lent tensor during the loan.
"""

from __future__ import annotations

# Floor: the top of the package: it serves every public name, from the modules below it
# (_errors, _lib, and the lending modules on first use); only the CLI (_status, __main__)
# stands above it (tests/python/test_import_floors.py keeps it so).
from typing import TYPE_CHECKING, Literal, overload

from ._errors import (BorrowerDiedError, BusyError, DaemonDiedError, DaemonPermissionError,
                      DaemonUnavailableError, InvalidArgumentError, LeakError, NeedTooLargeError,
                      NoOfferError, OwnerGoneError, ProtocolError, SubletError,
                      SubletOutOfMemoryError, SubletTimeoutError, VerifyError)
from ._lib import DaemonInfo, LoanStats, ReleaseStats

if TYPE_CHECKING:
    import torch

    from ._keep import Blocks, Keep, blocks
    from ._loan import BorrowedLoan, Loan, LocalLoan, Offer
    from ._lent import Lendable
    from ._memory import empty
    from ._pool import Pool, pool
    from ._release import Release, ReleaseOffer, release
    from ._take import Taken, take
    from ._torch import LeakedBlock

    __version__: str


# Every name served below (module globals and _LAZY's) is here: mypy --strict takes __all__
# as what the package exports, so a name left out is an error for its users' type checks.
__all__ = [
    "empty", "pool", "Pool", "lend", "offer", "borrow", "Loan", "LocalLoan", "BorrowedLoan",
    "Offer", "LoanStats",
    "DaemonInfo", "blocks", "Blocks", "release", "Release", "ReleaseStats", "ReleaseOffer",
    "take", "Taken",
    "LeakedBlock", "SubletError", "LeakError", "NoOfferError", "OwnerGoneError",
    "BorrowerDiedError", "DaemonUnavailableError", "DaemonPermissionError", "DaemonDiedError",
    "ProtocolError", "BusyError", "InvalidArgumentError",
    "SubletTimeoutError", "SubletOutOfMemoryError", "NeedTooLargeError", "VerifyError", "info",
    "pin_ahead",
]

# What needs torch is imported on first use, so that `sublet status` (and `import sublet`)
# does not pay for importing torch.
_LAZY = {"empty": "._memory", "pool": "._pool", "Pool": "._pool", "Loan": "._loan",
         "Offer": "._loan", "LocalLoan": "._loan",
         "BorrowedLoan": "._loan", "LeakedBlock": "._torch", "blocks": "._keep",
         "Blocks": "._keep", "release": "._release", "Release": "._release",
         "ReleaseOffer": "._release", "take": "._take", "Taken": "._take"}
# A process that makes sublet memory is about to lend it: the lending modules load with
# sublet.empty, not in the first loan's time (their imports' figure: docs/benchmarks.md).
_LOADED_WITH = {"empty": ("._loan",), "pool": ("._loan",)}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# Hidden from type checkers: a module __getattr__ would let `sublet.emtpy` pass as Any; the
# names it serves are declared above for them instead.
if not TYPE_CHECKING:
    def __getattr__(name: str):
        if name == "__version__":
            # CMakeLists.txt's, compiled into libsublet (sublet_version()): one source for the
            # daemon, the C library and this package, installed or run from a checkout.
            from . import _lib
            return _lib.lib().sublet_version().decode()
        if name not in _LAZY:
            raise AttributeError(f"module 'sublet' has no attribute {name!r}")
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        for module in _LOADED_WITH.get(name, ()):
            importlib.import_module(module, __name__)
        globals()[name] = value
        return value


def lend(what: Lendable, keep: Keep = None, verify: bool | None = None,
         timeout: float | None = None) -> LocalLoan:
    """Lends memory to this process's work in a `with` block; returns the Loan.

    what: a tensor from sublet.empty(), a pool's tag ("kv": every tensor made inside
    `with sublet.pool("kv")`) or Pool, a tensor of a pool, or a list of those. One loan lends
    one region: one sublet.empty() tensor, or the pools of one device (all their tags share
    it). What the region holds beside what is lent is kept.

    keep: what the owner gets back: None (default) all of it; [] nothing; a view of the tensor
    (cache[3], cache[1::2], cache[:, 2:5]) or a list of views; or rows along dim 0 as integer
    indices (a 1-D tensor, array or list) or a boolean mask (the fast form for many blocks);
    or sublet.blocks(tensors, ids, dim): the same rows of many tensors, as a pool's per-layer
    KV caches (sublet.blocks(layers, live, dim=1) keeps every layer's cache[:, live]), alone or
    in a list with views.
    A page is kept when any kept byte lies in it, and only its kept bytes are copied. A lent view
    (cache[8:]) lends its own bytes only: the rest of its memory is kept. Anything the work
    leaves alive at the end raises LeakError, after the kept data is restored.

    Pools: which pages are lent and which pinned (the other tags') is read when the `with` is
    entered, once no pool allocation can take a page any more: a tensor made after lend()
    returned is the owner's, pinned. From the `with` to its end no pool allocation of any tag
    is served on the device: Pool.empty() raises BusyError, and PyTorch inside
    `with sublet.pool(tag)` raises torch.OutOfMemoryError when it needs a new segment.

    verify: checksum the kept bytes on the device before the loan and after it, and raise
    VerifyError naming the ranges that changed (bits, not values). None: $SUBLET_VERIFY=1.

    timeout: one loan per device; while another runs, entering the block waits for the device
    in a line served in arrival order, up to `timeout` seconds (None: as long as it takes; 0:
    BusyError at once), then SubletTimeoutError and nothing is lent. Ctrl-C works meanwhile.
    """
    from ._loan import LocalLoan
    return LocalLoan(what, keep, verify, timeout)


@overload
def offer(what: Lendable, keep: Keep = None, name: str | None = None,
          verify: bool | None = None, timeout: float | None = None, *,
          release: Literal[False] = False, stay: int | None = None) -> Offer: ...
@overload
def offer(what: Lendable, keep: Keep = None, name: str | None = None,
          verify: bool | None = None, timeout: float | None = None, *,
          release: Literal[True], stay: int | None = None) -> ReleaseOffer: ...


def offer(what: Lendable, keep: Keep = None, name: str | None = None,
          verify: bool | None = None, timeout: float | None = None, *,
          release: bool = False, stay: int | None = None) -> Offer | ReleaseOffer:
    """Offers memory (what: as for lend()) to another process (which calls sublet.borrow(name=...))
    and returns an Offer as soon as it is made; Offer.wait() blocks until it comes back. In a
    `with` block, leaving it withdraws an untaken offer or waits for the borrower to finish.
    name: what a borrower asks for it by: UTF-8 text of 1 to 63 bytes without control
    characters, or None for no name; subletd refuses any other (`""` too) with EINVAL, raised
    as a SubletError. verify: as for lend(), checked when wait() sees the loan back. timeout:
    as for lend(), the wait for the device while another loan runs on it. Pools: as for
    lend(), from this call until the offer is back or withdrawn no pool allocation is served
    on the device; a pool whose tag the offer pins whole may be entered meanwhile (its cached
    blocks serve).

    release=True: a release offer instead (a ReleaseOffer), for a scheduler that calls
    sublet.take(name=...): when it takes the offer this process's library releases the memory
    to the CUDA driver (as sublet.release(what, keep, stay) would: for any process to
    allocate), and when it gives it back resumes it. verify and timeout do not apply."""
    if release:
        if verify or timeout is not None:
            raise ValueError("verify and timeout are a routed offer's: a release offer takes "
                             "what, keep, name and stay")
        from ._release import ReleaseOffer
        return ReleaseOffer(what, keep, name, stay)
    from ._loan import Offer
    return Offer(what, keep, name, verify, timeout)


def borrow(name: str | None = None, device: torch.device | str | int | None = None,
           timeout: float | None = None, *, loan_id: int = 0,
           token: bytes | None = None) -> BorrowedLoan:
    """Borrows, in a `with` block, a loan offered by another process on `device` (default:
    the current CUDA device): the one named `name`, the one given by loan_id and token, or,
    with neither, the next offer: the oldest one on the device that this user may borrow
    (the owner's own user, root, or a member of the daemon's --allow-group). Each offer goes
    to exactly one borrower. Waits up to `timeout` seconds (None: forever) for it, else
    NoOfferError. name: as for offer() (None: no name; `""` is refused, EINVAL)."""
    from ._loan import BorrowedLoan
    return BorrowedLoan(name, device, timeout, loan_id, token)


def pin_ahead(nbytes: int, device: torch.device | str | int | None = None,
              release: bool = False) -> None:
    """Pins host memory for the saves of this user's loans on `device` ahead of the first
    lend, in the background: an owner that knows how much it will keep (nbytes, at most its
    regions' bytes together) calls it once its memory is made, so that a loan's first save
    finds the host memory made instead of waiting for the kernel to make it (slower than the
    link: docs/benchmarks.md; a lend starts the same pin, but a borrower that fills the GPU at
    once outruns it). Returns
    at once; `sublet status` shows the pin. What is pinned stays for later loans and goes when
    the user has had no region for the daemon's --pin-keep. BusyError while the loans' save
    area is another user's. release=True: for this user's next sublet.release instead
    (a save area of its own, which that release takes and gives back pinned for the next;
    torch_memory_saver's compat pins its CPU-backup tags so)."""
    from ._memory import resolve_device
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < 1 << 64:
        raise ValueError(f"pin_ahead: nbytes must be a byte count (an int >= 0), not {nbytes!r}")
    _, client = resolve_device(device)
    client.pin_ahead(nbytes, release=bool(release))


def info(device: torch.device | str | int | None = None) -> DaemonInfo:
    """What the daemon serving `device` (default: the current CUDA device) says about itself:
    backend, page size, total and free memory."""
    from ._memory import resolve_device
    _, client = resolve_device(device)
    return client.get_info()
