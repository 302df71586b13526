"""One connection to subletd per device and backend, with a Pythonic wrapper of each C call.

Every method returns Python values and raises sublet's typed exceptions; raw ctypes stays in
here and in _lib. A connection is shared by everything the process does on that device (its
regions, its loans): the daemon's books are per client.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from ctypes import byref, c_size_t, c_uint64, c_void_p
from dataclasses import dataclass, fields

import numpy as np

from . import _daemon, _lib
from ._lib import CLeak, CLoanStats, check

TOKEN_BYTES = 16


@dataclass(frozen=True)
class DaemonInfo:
    """What subletd said about itself and its device (struct sublet_info)."""
    daemon_version: str
    backend: str
    device_name: str
    device_uuid: bytes
    device_ordinal: int
    page_size: int
    total_bytes: int
    free_bytes: int
    client_id: int


@dataclass(frozen=True)
class LoanStats:
    """Where a loan's memory came from and what crossed the host link. Bytes are exact.

    copied_out_bytes: kept bytes saved to host memory because the borrower used their pages;
    copied_in_bytes: the same bytes restored (equal to copied_out_bytes once the loan ended).
    moved_bytes: kept bytes moved on the GPU, into unkept bytes of kept pages the borrower did
    not use, instead of to the host (and moved back at the end).
    map_seconds is the client's (importing and mapping pages), the copy times the daemon's.
    """
    loan_id: int
    copied_out_bytes: int
    copied_in_bytes: int
    served_unkept_bytes: int
    served_fresh_bytes: int
    served_kept_bytes: int
    peak_bytes: int
    allocations: int
    map_seconds: float
    copy_out_seconds: float
    copy_in_seconds: float
    borrower_died: bool
    owner_gone: bool
    moved_bytes: int
    move_seconds: float

    @classmethod
    def from_c(cls, c: CLoanStats) -> "LoanStats":
        values = {f.name: getattr(c, f.name) for f in fields(cls)}
        values["borrower_died"] = bool(values["borrower_died"])
        values["owner_gone"] = bool(values["owner_gone"])
        return cls(**values)


@dataclass(frozen=True)
class ReturnResult:
    code: int                  # 0, or a negative SUBLET_E* code (ELEAK, EOWNERGONE...)
    message: str
    stats: LoanStats
    leaks: list[tuple[int, int]]  # (alloc id, size) of allocations alive at the return


class Client:
    """A sublet_client: one connection to the daemon of one device."""

    def __init__(self, handle: c_void_p, backend: str, device_index: int):
        self.handle = handle
        self.backend = backend
        self.device_index = device_index
        self.info = self.get_info()

    def get_info(self) -> DaemonInfo:
        info = _lib.Info()
        check(_lib.lib().sublet_get_info(self.handle, byref(info)))
        return DaemonInfo(
            info.daemon_version.decode(), info.backend.decode(), info.device_name.decode(),
            bytes(info.device_uuid), info.device_ordinal, info.page_size, info.total_bytes,
            info.free_bytes, info.client_id)

    def close(self) -> None:
        _lib.lib().sublet_disconnect(self.handle)
        self.handle = None

    # ---- regions
    def region_create(self, size: int) -> c_void_p:
        region = c_void_p()
        check(_lib.lib().sublet_region_create(self.handle, size, byref(region)))
        return region

    # ---- owner's side
    def lend(self, region: c_void_p, ranges: np.ndarray | None, name: str | None
             ) -> tuple[int, bytes]:
        """Offers a region; ranges None keeps all of it. Returns (loan id, token)."""
        loan_id, token = c_uint64(), _lib.TOKEN()
        keep_all = ranges is None
        ranges = np.empty((0, 2), np.uint64) if keep_all else np.ascontiguousarray(ranges,
                                                                                  np.uint64)
        check(_lib.lib().sublet_lend(
            region, ranges.ctypes.data if len(ranges) else None, len(ranges), int(keep_all),
            name.encode() if name else None, byref(loan_id), token))
        return loan_id.value, bytes(token)

    def reclaim(self, loan_id: int, timeout_ms: int) -> LoanStats:
        stats = CLoanStats()
        check(_lib.lib().sublet_reclaim(self.handle, loan_id, timeout_ms, byref(stats)))
        return LoanStats.from_c(stats)

    def reclaim_raw(self, loan_id: int, timeout_ms: int) -> tuple[int, str, LoanStats]:
        """Like reclaim, but returns the code, so that a died borrower's stats are kept."""
        stats = CLoanStats()
        rc = _lib.lib().sublet_reclaim(self.handle, loan_id, timeout_ms, byref(stats))
        return rc, (_lib.last_error() if rc < 0 else ""), LoanStats.from_c(stats)

    def withdraw(self, loan_id: int) -> None:
        check(_lib.lib().sublet_withdraw(self.handle, loan_id))

    # ---- borrower's side
    def borrow(self, loan_id: int = 0, token: bytes | None = None, name: str | None = None,
               timeout_ms: int = 0) -> None:
        if token is not None and len(token) != TOKEN_BYTES:
            raise ValueError(f"a loan token is {TOKEN_BYTES} bytes, not {len(token)}")
        ctoken = _lib.TOKEN.from_buffer_copy(token) if token is not None else None
        check(_lib.lib().sublet_borrow(self.handle, loan_id, ctoken,
                                       name.encode() if name else None, timeout_ms))

    def alloc(self, size: int) -> int:
        ptr = c_void_p()
        check(_lib.lib().sublet_alloc(self.handle, size, byref(ptr)))
        return ptr.value or 0

    def free(self, ptr: int) -> None:
        check(_lib.lib().sublet_free(self.handle, c_void_p(ptr)))

    def return_loan(self, force: bool, max_leaks: int = 256) -> ReturnResult:
        stats, leaks, nleaks = CLoanStats(), (CLeak * max_leaks)(), c_size_t()
        rc = _lib.lib().sublet_return(self.handle, int(force), byref(stats), leaks, max_leaks,
                                      byref(nleaks))
        message = _lib.last_error() if rc < 0 else ""
        alive = [(leaks[i].alloc_id, leaks[i].size) for i in range(min(nleaks.value,
                                                                        max_leaks))]
        return ReturnResult(rc, message, LoanStats.from_c(stats), alive)

    def loan_stats(self) -> LoanStats:
        stats = CLoanStats()
        check(_lib.lib().sublet_loan_stats(self.handle, byref(stats)))
        return LoanStats.from_c(stats)

    def status(self) -> dict:
        """The daemon's status (device, regions, the loan in progress, totals) as parsed JSON."""
        text = c_void_p()
        check(_lib.lib().sublet_status_json(self.handle, byref(text)))
        try:
            return json.loads(ctypes.string_at(text.value).decode())
        finally:
            _lib.lib().sublet_string_free(text)

    def torch_bind(self, cuda_index: int, bound: bool) -> None:
        """Routes (or stops routing) the PyTorch hooks of a CUDA device index to this client."""
        check(_lib.lib().sublet_torch_bind(cuda_index, self.handle if bound else None))


_clients: dict[tuple[str, int], Client] = {}
_clients_lock = threading.Lock()


def client_for(backend: str, device_index: int) -> Client:
    """The process's connection to the daemon of this device, made on first use."""
    with _clients_lock:
        key = (backend, device_index)
        if key not in _clients:
            _clients[key] = Client(_daemon.connect(device_index, backend), backend,
                                   device_index)
        return _clients[key]


def _forget_after_fork() -> None:
    _clients.clear()  # the parent's connections are not the child's to use


os.register_at_fork(after_in_child=_forget_after_fork)
