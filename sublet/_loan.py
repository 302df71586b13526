"""Loans: sublet.lend() in one process, sublet.offer() / sublet.borrow() across processes.

A Loan is the borrower's side of one loan: while it is active, every PyTorch allocation of the
process on that CUDA device is served from it (see _torch), and Loan.empty() allocates from it
directly. Ending it stops the routing, checks what the borrower left alive, and returns the
loan; the daemon then restores the owner's kept bytes.

Waits on the daemon (reclaim, borrow) run in short slices, so Ctrl-C is seen between them.

Locking: who routes a device (a pool entered, a loan borrowed) and what of the pools is lent
are decided under the one lock of the process's pools and loans, sublet._pool._lock, which is
taken before libsublet's (its pools' lock, then the client's), never inside them. A loan of
the pools holds them (libsublet refuses pool allocations from then on) before it reads which
pages it lends and pins: a tensor made before that is pinned, one asked for after it refused.
The loans borrowed, by device, are _pool.loans: kept one floor down, where a pool about to be
entered reads them.

Floor: the top of the lending side, beside _release: imports _errors, _lib, _client, _memory,
_torch, _keep, _pool, _lent, _verify, _wait and _units, all below it; only the package's
__init__ imports it (tests/python/test_import_floors.py keeps it so).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import torch

from . import _keep, _lent, _lib, _pool, _verify, _wait
from ._client import Client, LoanStats, ReturnResult
from ._errors import (BorrowerDiedError, BusyError, DaemonDiedError, DaemonUnavailableError,
                      LeakError, NoOfferError, OwnerGoneError, SubletError, SubletTimeoutError)
from ._memory import Region, as_dtype, nbytes_of, parse_size, resolve_device, wrap
from ._torch import LeakedBlock, PoolRouter, prepare_routing, release_cached
from ._units import human

_ELEAK = _lib.ERROR_CODES["ELEAK"]
_EOWNERGONE = _lib.ERROR_CODES["EOWNERGONE"]
_EBORROWERDIED = _lib.ERROR_CODES["EBORROWERDIED"]
_EDAEMONDIED = _lib.ERROR_CODES["EDAEMONDIED"]


class Loan:
    """A loan this process borrows; use it as a context manager (sublet.lend / sublet.borrow).

    copied_bytes: the owner's kept bytes that were saved to host memory because the borrower
    used their pages and no unlent page of the tensor could hold them (the same bytes are
    copied back at the end, so the host link carries twice this); moved_bytes: those that
    moved on the GPU instead. stats: the full LoanStats, live during the loan and final after it.
    """

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self._client: Client | None = None
        self._router: PoolRouter | None = None
        self._live: set[int] = set()          # Loan.empty allocations whose tensors are alive
        self._to_free: list[int] = []         # ... whose tensors died: freed at a safe point
        self._returned = False
        self._final_stats: LoanStats | None = None
        self.leaks: list[LeakedBlock | tuple[int, int]] = []
        self._failure: BaseException | None = None  # raised by _finish before the Return

    def __repr__(self) -> str:
        return f"<sublet.{type(self).__name__}{self._described()}: {self._state()}>"

    def _described(self) -> str:
        """What the loan is of and where, for repr: each kind of loan says its own."""
        return f" on {self.device or '?'}"

    def _state(self) -> str:
        if self.active:
            return "active"
        if not self._returned:
            return "not started"
        stats = self._final_stats
        if stats is None:  # the return itself failed
            return "returned"
        return (f"returned, {human(stats.copied_out_bytes)} to the host, "
                f"{human(stats.moved_bytes)} moved")

    # ---------------------------------------------------------------- results
    @property
    def active(self) -> bool:
        return self._client is not None and not self._returned

    @property
    def stats(self) -> LoanStats:
        if self._final_stats is not None:
            return self._final_stats
        if self._client is None:
            raise RuntimeError("the loan has not started: use it in a `with` block")
        return self._client.loan_stats()

    @property
    def copied_bytes(self) -> int:
        """Kept bytes saved to the host (and restored): see the class docstring."""
        return self.stats.copied_out_bytes

    @property
    def moved_bytes(self) -> int:
        """Kept bytes moved on the GPU instead of to the host (and moved back)."""
        return self.stats.moved_bytes

    @property
    def copied_out_bytes(self) -> int:
        return self.stats.copied_out_bytes

    @property
    def copied_in_bytes(self) -> int:
        return self.stats.copied_in_bytes

    # ---------------------------------------------------------------- explicit allocations
    def empty(self, *size, dtype: torch.dtype | type | None = None) -> torch.Tensor:
        """A tensor allocated from the loan itself (sublet_alloc); its memory goes back to the
        loan when the tensor dies. It must not outlive the loan. dtype: as for torch.empty
        (None: torch.get_default_dtype())."""
        if not self.active:
            raise RuntimeError("Loan.empty() works only while the loan is active")
        shape = parse_size(size)
        dtype = as_dtype(dtype)
        nbytes = nbytes_of(shape, dtype)
        self._free_dead_allocations()
        ptr = self._client.alloc(nbytes)
        self._live.add(ptr)
        return wrap(ptr, nbytes, self.device, _Allocation(self, ptr), shape, dtype)

    def _allocation_died(self, ptr: int) -> None:
        # Runs wherever the tensor died (any thread, inside the GC).
        self._live.discard(ptr)
        if self.active:
            self._to_free.append(ptr)  # freed at the next safe point (after a synchronize)
        elif self._client is not None:
            # A leak outliving its loan: the library drops its forfeit mapping (a later loan
            # of the region is laid out away from it, so the address is this one's alone).
            try:
                self._client.free(ptr)
            except SubletError:
                pass  # the daemon or the client went: the forfeit mapping went with it

    def _free_dead_allocations(self) -> None:
        if not self._to_free:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # queued kernels may still use that memory
        while self._to_free:
            ptr = self._to_free.pop()
            try:
                self._client.free(ptr)
            except SubletError:
                if self._client.connected:
                    raise  # with the daemon gone, the library let go of the loan's memory

    # ---------------------------------------------------------------- borrowing mechanics
    def _check_unused(self) -> None:
        if self._client is not None:
            raise RuntimeError("this loan was already used in a `with` block: a loan object "
                               "serves one loan; call sublet.lend() or sublet.borrow() again "
                               "for the next")

    def _claim_device(self, device: torch.device) -> None:
        """The device's routing is this loan's from here on: no loan is borrowed and no pool
        entered on it, and no pool is entered until the loan ends (Pool._check_can_enter)."""
        with _pool._lock:
            _check_device_free(device)
            _check_no_pool_entered(device)
            _pool.loans[device] = self

    def _drop_device(self, device: torch.device) -> None:
        with _pool._lock:
            if _pool.loans.get(device) is self:
                del _pool.loans[device]

    def _start(self, client: Client, device: torch.device) -> None:
        """Starts routing PyTorch into the loan (CUDA); the device is claimed already."""
        self._client, self.device = client, device
        try:
            if device.type == "cuda":
                client.torch_bind(device.index, True)
                self._router = PoolRouter(device.index, _lib.library_path())
                self._router.begin()
        except BaseException:
            self._unbind()
            raise

    def _finish(self) -> ReturnResult:
        """Stops routing, frees what can be freed, returns the loan (by force when something
        is still alive, so that the owner's kept data comes back all the same). A failure
        before the Return does not keep the loan from being returned: it is raised after."""
        failure: BaseException | None = None
        torch_leaks: list[LeakedBlock] = []
        try:
            try:
                torch_leaks = self._router.end() if self._router is not None else []
                if self._live:
                    gc.collect()  # tensors held only by reference cycles are not leaks
                self._free_dead_allocations()
            except BaseException as error:  # noqa: BLE001 - raised once the loan is back
                failure = error
            force = bool(torch_leaks) or failure is not None
            result = self._client.return_loan(force=force)
            if result.code == _ELEAK and not force:
                result = self._client.return_loan(force=True)
            self._returned = True
            self.leaks = list(torch_leaks) + ([] if torch_leaks else result.leaks)
            self._failure = failure
            return result
        finally:
            self._unbind()

    def _unbind(self) -> None:
        if self.device is not None and self.device.type == "cuda" and self._client:
            self._client.torch_bind(self.device.index, False)
        self._router = None
        self._drop_device(self.device)

    def _leak_error(self, stats: LoanStats) -> LeakError:
        described = [leak.describe() if isinstance(leak, LeakedBlock)
                     else f"{leak[1]} bytes (sublet allocation {leak[0]})" for leak in self.leaks]
        return LeakError(
            f"the borrower left {len(self.leaks)} allocation(s) alive at the end of the loan:\n"
            + "\n".join(f"  - {d}" for d in described)
            + "\nThe owner's kept data was restored. The memory of those tensors is no longer "
              "theirs: drop them without reading them, and free what the loan allocates "
              "before the `with` block ends.", _ELEAK, list(self.leaks), stats)


def _prepare(device: torch.device, routing: bool) -> None:
    """Before the daemon measures the free memory of a loan on a CUDA device: the borrower's
    side (routing) or the owner's of an offer (PyTorch's cache given back only)."""
    if device.type == "cuda":
        (prepare_routing if routing else release_cached)(device.index)


def _check_no_pool_entered(device: torch.device) -> None:
    """A loan routed here does not start inside a pool: PyTorch serves the pool entered first,
    and the pool's new segments would be the loan's memory (the caller holds _pool._lock)."""
    entered = _pool.entered(device)
    if entered is not None:
        raise RuntimeError(f"sublet.pool({entered.tag!r}) is entered on {device}: a loan does "
                           f"not start inside a pool; leave the `with sublet.pool(...)` block "
                           f"first")


def _check_entered_pool_pinned(arena: _pool.Arena) -> None:
    """An offer of the pools may start while a pool is entered (another thread's engine) only
    if the loan pins every page of its tag: PyTorch's cached blocks of that pool are served
    during the loan, and a block in a page the loan lends or keeps would be the borrower's too
    (the caller holds _pool._lock, and the arena's plan is made)."""
    entered = _pool.entered(arena.device)
    if entered is not None and entered.arena is arena and not arena.spares(entered.tag_id):
        raise RuntimeError(f"sublet.pool({entered.tag!r}) is entered on {arena.device}, and "
                           f"the loan lends or keeps pages of that tag: its tensors there "
                           f"would be the borrower's; leave the `with sublet.pool(...)` block "
                           f"first")


def _check_device_free(device: torch.device) -> None:
    if device in _pool.loans:
        raise BusyError(f"a loan is already active on {device} in this process: one loan per "
                        f"device at a time; end it before starting another")


class _Allocation:
    """Owner of one Loan.empty() allocation: its death hands the allocation back."""

    def __init__(self, loan: Loan, ptr: int):
        weakref.finalize(self, loan._allocation_died, ptr).atexit = False


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


# --------------------------------------------------------------------------- sublet.lend

class LocalLoan(Loan):
    """sublet.lend(): the process lends its own tensor's memory to its own work."""

    def __init__(self, what: _lent.Lendable, keep: _keep.Keep = None,
                 verify: bool | None = None, timeout: float | None = None):
        super().__init__()
        self.tensor = what  # what is lent, as given (a tensor, a tag, a list)
        self._keep = keep
        self._timeout = timeout
        self._region = _lent.resolve(what).region
        # Errors in what or keep show here, not at the `with`; the plan is made again there
        # if the pools' pages changed since.
        self._lent, self._ranges, self._layout = _plan(what, keep, self._region)
        self._loan_id = 0
        self._verify = _verify.enabled(verify)
        self._snapshot: _verify.Snapshot | None = None

    def _described(self) -> str:
        lent = int(self._lent.spans[:, 1].sum())
        return f" of {self._lent.what} ({human(lent)}) on {self._region.device}"

    def __enter__(self) -> "LocalLoan":
        region, client = self._region, self._region.client
        self._check_unused()
        with _pool._lock:
            self._claim_device(region.device)
            try:
                layout = _claim(region)
            except BaseException:
                self._drop_device(region.device)
                raise
            try:
                # Held now: a pool allocation made since sublet.lend() (the layout moved) may
                # have taken a page the plan lent; decided again, that page is pinned.
                if layout is not None and layout != self._layout:
                    self._lent, self._ranges, self._layout = _plan(self.tensor, self._keep,
                                                                   region)
                _publish(region, self._lent)
            except BaseException:
                _unclaim(region)
                self._drop_device(region.device)
                raise
        try:
            # After the claims, which refuse a loan inside a pool: made inside one, the cuBLAS
            # workspaces that routing makes ahead would be the pool's memory.
            _prepare(region.device, routing=True)
            if self._verify:
                self._snapshot = _verify.Snapshot(region, self._lent.tensor, self._ranges)
            # One request: the loan is never on offer, so no borrow() elsewhere can take it.
            self._loan_id = _wait.lend_local(client, region.handle, self._ranges,
                                             self._timeout, self._lent.pinned)
        except BaseException:
            _unclaim(region)
            self._drop_device(region.device)
            raise
        try:
            self._start(client, region.device)
        except BaseException:
            client.return_loan(force=True)
            client.reclaim(self._loan_id, -1)
            _unclaim(region)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            returned = self._finish()
            if returned.code < 0 and returned.code != _ELEAK and self._client.connected:
                raise _lib.error_for(returned.code, returned.message)
            # With the daemon gone, reclaim restores the kept bytes here (DaemonDiedError).
            # The owner's view has the copies; mapping is timed on the borrower's side.
            self._final_stats = dataclasses.replace(
                self._region.client.reclaim(self._loan_id, -1),
                map_seconds=returned.stats.map_seconds)
        finally:
            _unclaim(self._region)
        leak = self._leak_error(self._final_stats) if self.leaks else None
        if self._snapshot is not None:
            try:
                self._snapshot.check()
            except _lib.VerifyError as error:
                if leak is not None:
                    _add_note(error, str(leak))
                raise  # the block's own exception, if any, is its __context__
        if self._failure is not None:  # the loan came back all the same
            raise self._failure
        if leak is not None:
            if exc is None:
                raise leak
            _add_note(exc, str(leak))


def _plan(what: _lent.Lendable, keep: _keep.Keep, region: Region | _pool.Arena
          ) -> tuple[_lent.Lent, object, int | None]:
    """What a loan of `what` (in region) lends, pins and keeps, decided from the pools'
    segments as they are now: (the Lent, the Lend's keep list, the arena's layout id they were
    read at, None for a sublet.empty() region). Raises TypeError/ValueError naming the fix."""
    layout = region.client.pool_layout() if isinstance(region, _pool.Arena) else None
    lent = _lent.resolve(what)  # the segments, read after the layout id
    if lent.region is not region:
        raise RuntimeError(f"{lent.what} is no longer in the memory it was in when the loan "
                           f"was made (its daemon restarted): lend it again")
    return lent, _lent.keep_ranges(lent, keep), layout


def _claim(region: Region | _pool.Arena) -> int | None:
    """Marks the region lent (the caller holds _pool._lock). The pools' arena is held too:
    libsublet refuses every pool allocation from here until _unclaim, so that the pages read
    after this call are those the loan lends and pins. Returns the arena's layout id then
    (None for a sublet.empty() region)."""
    if region.lent:
        raise BusyError("this memory is already lent: one loan of a region (a sublet.empty() "
                        "tensor, or the pools of a device) at a time")
    layout = region.hold() if isinstance(region, _pool.Arena) else None
    region.lent = True
    return layout


def _publish(region: Region | _pool.Arena, lent: _lent.Lent) -> None:
    """The plan's pinned pages, for the pools entered during the loan (the caller holds
    _pool._lock)."""
    if isinstance(region, _pool.Arena):
        region.pinned = lent.pinned


def _unclaim(region: Region | _pool.Arena) -> None:
    """The loan is over (or was never made): the region is the owner's, its pools serve
    allocations again."""
    with _pool._lock:
        region.lent = False
        if isinstance(region, _pool.Arena):
            region.let_go()


# --------------------------------------------------------------------------- across processes

class Offer:
    """sublet.offer(): lends a tensor to another process and waits for it to come back.

    The offer is made at once; wait() blocks until a borrower has returned it (or died), and
    the tensor is the owner's again. As a context manager, leaving the block withdraws an
    offer nobody took, or waits for the borrower to return it.
    """

    def __init__(self, what: _lent.Lendable, keep: _keep.Keep = None, name: str | None = None,
                 verify: bool | None = None, timeout: float | None = None):
        self.tensor = what  # what is lent, as given (a tensor, a tag, a list)
        self.name = name
        self._region = region = _lent.resolve(what).region
        lent, ranges, planned = _plan(what, keep, region)  # errors in keep before anything
        _prepare(region.device, routing=False)
        with _pool._lock:
            layout = _claim(region)
            try:
                # Held: a pool allocation since the plan (the layout moved) may have taken a
                # page it lends; decided again, from pages no allocation can change now.
                if layout is not None and layout != planned:
                    lent, ranges, _ = _plan(what, keep, region)
                if isinstance(region, _pool.Arena):
                    _publish(region, lent)
                    _check_entered_pool_pinned(region)
            except BaseException:
                _unclaim(region)
                raise
        self._what = f"{lent.what} ({human(int(lent.spans[:, 1].sum()))})"  # for repr
        try:
            self._snapshot = (_verify.Snapshot(region, lent.tensor, ranges)
                              if _verify.enabled(verify) else None)
            self.loan_id, self.token = _wait.lend(region.client, region.handle,
                                                  ranges, name, timeout, lent.pinned)
        except BaseException:
            _unclaim(region)
            raise
        self.stats: LoanStats | None = None

    def __repr__(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        return (f"<sublet.Offer {name}loan {self.loan_id} of {self._what} on "
                f"{self._region.device}: {self._state()}>")

    def _state(self) -> str:
        if not self.done:
            return "lent"
        if self.stats is None:
            return "withdrawn"
        return (f"back, {human(self.stats.copied_out_bytes)} to the host, "
                f"{human(self.stats.moved_bytes)} moved")

    @property
    def done(self) -> bool:
        return not self._region.lent

    def wait(self, timeout: float | None = None) -> LoanStats:
        """Blocks until the loan has ended and the kept bytes are back; returns its stats.
        Raises SubletTimeoutError after `timeout` seconds (the offer stands: wait again),
        BorrowerDiedError when the borrower died (the kept data is back all the same),
        SubletOutOfMemoryError when another user borrowed it and the device lacks the memory
        for the fresh pages its end needs (the kept data waits, safe: free memory and wait
        again), and with verify, VerifyError when kept bytes did not come back as they were."""
        if self.done:
            if self.stats is None:
                raise RuntimeError("the offer was withdrawn: there is nothing to wait for")
            return self.stats
        code, message, stats = _wait.in_slices(
            lambda ms: self._reclaim_slice(ms), timeout,
            f"the loan {self.name or self.loan_id} did not come back within {timeout} s")
        self.stats = stats
        _unclaim(self._region)
        if self._snapshot is not None:
            self._snapshot.check()  # the kept data is back, the borrower died or not
        if code == _EDAEMONDIED:
            raise DaemonDiedError(message, code, stats)
        if stats.borrower_died:  # subletd sends no EBORROWERDIED: the stats say so
            raise BorrowerDiedError(
                message or "the borrower died during the loan; the kept data was restored",
                _EBORROWERDIED, stats)
        return stats

    def _reclaim_slice(self, timeout_ms: int) -> tuple[int, str, LoanStats]:
        code, message, stats = self._region.client.reclaim_raw(self.loan_id, timeout_ms)
        if code < 0 and code != _EDAEMONDIED:
            raise _lib.error_for(code, message)
        return code, message, stats

    def withdraw(self) -> None:
        """Takes back an offer nobody has borrowed (raises if a borrower has it)."""
        self._region.client.withdraw(self.loan_id)
        _unclaim(self._region)

    def close(self) -> None:
        if self.done:
            return
        try:
            self.withdraw()
        except SubletError:  # borrowed meanwhile, or the daemon is gone: it must come back
            self.wait()        # (then from the save area: DaemonDiedError)

    def __enter__(self) -> "Offer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


class BorrowedLoan(Loan):
    """sublet.borrow(): borrows, in this process, a loan another process offered."""

    def __init__(self, name: str | None = None, device: torch.device | str | int | None = None,
                 timeout: float | None = None, loan_id: int = 0, token: bytes | None = None):
        super().__init__()
        self.name, self._want_device, self._timeout = name, device, timeout
        self._loan_id, self._token = loan_id, token

    def _described(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        device = self.device or self._want_device
        return f"{name} on {device if device is not None else 'the current device'}"

    def __enter__(self) -> "BorrowedLoan":
        self._check_unused()
        device, client = resolve_device(self._want_device)
        self._claim_device(device)
        what = f"named {self.name!r}" if self.name else "(any)"
        try:
            _prepare(device, routing=True)
            _wait.in_slices(lambda ms: self._borrow_slice(client, ms), self._timeout,
                            f"no loan {what} was offered on {device} within {self._timeout} s",
                            NoOfferError)
        except BaseException:
            self._drop_device(device)
            raise
        try:
            self._start(client, device)
        except BaseException:
            client.return_loan(force=True)
            raise
        return self

    def _borrow_slice(self, client: Client, timeout_ms: int) -> None:
        try:
            client.borrow(self._loan_id, self._token, self.name, timeout_ms)
        except NoOfferError:
            if timeout_ms == 0:
                raise
            raise SubletTimeoutError("no offer yet", _lib.ERROR_CODES["ETIMEDOUT"])

    def __exit__(self, exc_type, exc, tb) -> None:
        result = self._finish()
        self._final_stats = result.stats
        if self._failure is not None:  # the loan went back all the same
            raise self._failure
        if exc is not None:
            if self.leaks:
                _add_note(exc, str(self._leak_error(result.stats)))
            return
        if self.leaks:
            raise self._leak_error(result.stats)
        if result.code == _EOWNERGONE or result.stats.owner_gone:
            raise OwnerGoneError(result.message or "the owner went away during the loan; your "
                                 "work ran, but the loan's memory is gone", _EOWNERGONE)
        if result.code < 0:
            raise _lib.error_for(result.code, result.message)
