"""ctypes binding of libsublet.so, the C client library: the one module of the package that
touches ctypes.

Why ctypes and not an extension module: PyTorch's ``CUDAPluggableAllocator`` loads the
allocator's alloc/free pair (``sublet_torch_alloc`` / ``sublet_torch_free``) by dlopen()ing a
shared library *by path*. Loading that very same file here with ctypes gives one copy of the
library in the process, so the state that ``sublet_torch_bind()`` sets from Python is the state
the hooks read when PyTorch calls them. An extension module would have to share that state
across two libraries, and would have to be built against each Python and torch ABI; ctypes needs
neither. The hooks are plain C and never call back into Python.

Every function of include/sublet.h is declared here with its prototype. ``check()`` turns a
negative SUBLET_E* code into the matching Python exception carrying sublet_last_error()'s text.
``Client`` wraps one sublet_client (a connection to one daemon): each method is one C call that
takes and returns Python values. Nothing here imports torch: `sublet status` uses it alone.

Floor: above _units and _errors, the only modules of sublet it imports; below everything else
(tests/python/test_import_floors.py keeps it so). The exception types and codes are _errors';
they are named here too, as _lib.X, for the modules and tests that reach them through _lib.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from dataclasses import dataclass, fields
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_int, c_size_t,
                    c_ssize_t, c_uint8, c_uint32, c_uint64, c_void_p)
from pathlib import Path
from typing import Any

from ._errors import (CODE_NAMES, ERROR_CODES, BorrowerDiedError, BusyError,  # noqa: F401
                      DaemonDiedError, DaemonPermissionError, DaemonUnavailableError,
                      InvalidArgumentError, LeakError, NeedTooLargeError, NoOfferError,
                      OwnerGoneError, ProtocolError, SubletError, SubletOutOfMemoryError,
                      SubletTimeoutError, VerifyError, error_for, join_torch_out_of_memory)
from ._units import human


def format_uuid(uuid: bytes) -> str:
    """GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi and `sublet status` write it."""
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# --------------------------------------------------------------------------- C structs

class Info(Structure):
    _fields_ = [
        ("daemon_version", c_char * 32),
        ("backend", c_char * 16),
        ("device_name", c_char * 96),
        ("device_uuid", c_uint8 * 16),
        ("device_ordinal", c_uint32),
        ("page_size", c_uint64),
        ("total_bytes", c_uint64),
        ("free_bytes", c_uint64),
        ("client_id", c_uint64),
    ]


class CLoanStats(Structure):
    _fields_ = [
        ("loan_id", c_uint64),
        ("copied_out_bytes", c_uint64),
        ("copied_in_bytes", c_uint64),
        ("served_unkept_bytes", c_uint64),
        ("served_fresh_bytes", c_uint64),
        ("served_kept_bytes", c_uint64),
        ("peak_bytes", c_uint64),
        ("allocations", c_uint64),
        ("map_seconds", c_double),
        ("copy_out_seconds", c_double),
        ("copy_in_seconds", c_double),
        ("borrower_died", c_int),
        ("owner_gone", c_int),
        ("moved_bytes", c_uint64),
        ("move_seconds", c_double),
        ("daemon_died", c_int),
        ("replaced_pages", c_uint64),
        ("mapped_pages", c_uint64),
    ]


class CReleaseStats(Structure):
    _fields_ = [
        ("release_id", c_uint64),
        ("released_pages", c_uint64),
        ("stayed_pages", c_uint64),
        ("kept_bytes", c_uint64),
        ("moved_bytes", c_uint64),
        ("copied_out_bytes", c_uint64),
        ("copied_in_bytes", c_uint64),
        ("seconds", c_double),
        ("move_seconds", c_double),
        ("copy_seconds", c_double),
        ("map_seconds", c_double),
        ("daemon_died", c_int),
        ("allocations", c_uint64),
        ("held_pages", c_uint64),
    ]


RESUME_PAGES = 1  # SUBLET_RESUME_PAGES
# enum sublet_offer_state: where a release offer is
OFFER_STATES = {1: "offered", 2: "taken", 3: "released", 4: "returning", 5: "ended",
                6: "more"}
OFFER_RELEASED, OFFER_ENDED = 3, 5
STAY_ANY = 2**64 - 1  # SUBLET_STAY_ANY: as many kept pages stay as the kept bytes need
NEED_ALL = 2**64 - 1  # SUBLET_NEED_ALL: not a release by need


class CLeak(Structure):
    _fields_ = [("alloc_id", c_uint64), ("size", c_uint64), ("ptr", c_void_p)]


TOKEN_BYTES = 16  # SUBLET_TOKEN_SIZE in include/sublet.h
TOKEN = c_uint8 * TOKEN_BYTES

# name: (restype, argtypes). Opaque handles (sublet_client *, sublet_region *) are c_void_p.
_PROTOTYPES: dict[str, tuple[object, list]] = {
    "sublet_version": (c_char_p, []),
    "sublet_strerror": (c_char_p, [c_int]),
    "sublet_last_error": (c_char_p, []),
    "sublet_connect": (c_int, [c_char_p, POINTER(c_void_p)]),
    "sublet_disconnect": (None, [c_void_p]),
    "sublet_connected": (c_int, [c_void_p]),
    "sublet_get_info": (c_int, [c_void_p, POINTER(Info)]),
    "sublet_set_timeout": (c_int, [c_void_p, c_int]),
    "sublet_region_create": (c_int, [c_void_p, c_uint64, POINTER(c_void_p)]),
    "sublet_region_addr": (c_void_p, [c_void_p]),
    "sublet_region_size": (c_uint64, [c_void_p]),
    "sublet_region_id": (c_uint64, [c_void_p]),
    "sublet_region_release": (c_int, [c_void_p]),
    "sublet_region_create_growable": (c_int, [c_void_p, c_uint64, POINTER(c_void_p)]),
    "sublet_region_grow": (c_int, [c_void_p, c_uint64]),
    "sublet_region_checksum": (c_int, [c_void_p, c_void_p, c_size_t, c_void_p]),
    "sublet_rows_ranges": (c_int, [c_void_p, c_size_t, c_uint64, c_uint64, c_uint64, c_void_p,
                                   POINTER(c_size_t)]),
    "sublet_blocks_ranges": (c_int, [c_void_p, c_size_t, c_uint64, c_void_p, c_size_t, c_uint64,
                                     c_void_p, c_size_t, POINTER(c_size_t)]),
    "sublet_lend": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_char_p,
                            POINTER(c_uint64), TOKEN]),
    "sublet_lend_local": (c_int, [c_void_p, c_void_p, c_size_t, c_int, POINTER(c_uint64)]),
    "sublet_lend_wait": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_char_p, c_int,
                                 POINTER(c_uint64), TOKEN]),
    "sublet_lend_local_wait": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int,
                                       POINTER(c_uint64)]),
    "sublet_lend_pinned": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_size_t,
                                   c_int, c_char_p, c_int, POINTER(c_uint64), TOKEN]),
    "sublet_release": (c_int, [c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, c_int,
                               c_uint64, POINTER(c_uint64), POINTER(CReleaseStats)]),
    "sublet_release_need": (c_int, [c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, c_int,
                                    c_uint64, c_uint64, POINTER(c_uint64),
                                    POINTER(CReleaseStats)]),
    "sublet_release_more": (c_int, [c_void_p, c_uint64, c_uint64, POINTER(CReleaseStats)]),
    "sublet_resume": (c_int, [c_void_p, c_uint64, c_int, POINTER(CReleaseStats)]),
    "sublet_offer_release": (c_int, [c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, c_int,
                                     c_uint64, c_char_p, POINTER(c_void_p)]),
    "sublet_release_offer_id": (c_uint64, [c_void_p]),
    "sublet_release_offer_state": (c_int, [c_void_p]),
    "sublet_release_offer_wait": (c_int, [c_void_p, c_int, POINTER(CReleaseStats),
                                          POINTER(CReleaseStats)]),
    "sublet_release_offer_withdraw": (c_int, [c_void_p]),
    "sublet_release_offer_free": (None, [c_void_p]),
    "sublet_take": (c_int, [c_void_p, c_char_p, c_int, POINTER(c_uint64)]),
    "sublet_take_wait": (c_int, [c_void_p, c_uint64, c_int, POINTER(c_int),
                                 POINTER(CReleaseStats)]),
    "sublet_give_back": (c_int, [c_void_p, c_uint64]),
    "sublet_take_need": (c_int, [c_void_p, c_char_p, c_uint64, c_int, POINTER(c_uint64)]),
    "sublet_take_more": (c_int, [c_void_p, c_uint64, c_uint64, POINTER(c_int)]),
    "sublet_cancel": (c_int, [c_void_p]),
    "sublet_pin_ahead": (c_int, [c_void_p, c_uint64, c_uint32]),
    "sublet_reclaim": (c_int, [c_void_p, c_uint64, c_int, POINTER(CLoanStats)]),
    "sublet_withdraw": (c_int, [c_void_p, c_uint64]),
    "sublet_borrow": (c_int, [c_void_p, c_uint64, c_void_p, c_char_p, c_int]),
    "sublet_alloc": (c_int, [c_void_p, c_uint64, POINTER(c_void_p)]),
    "sublet_free": (c_int, [c_void_p, c_void_p]),
    "sublet_return": (c_int, [c_void_p, c_int, POINTER(CLoanStats), POINTER(CLeak), c_size_t,
                              POINTER(c_size_t)]),
    "sublet_loan_stats": (c_int, [c_void_p, POINTER(CLoanStats)]),
    "sublet_status_json": (c_int, [c_void_p, POINTER(c_void_p)]),
    "sublet_string_free": (None, [c_void_p]),
    "sublet_torch_bind": (c_int, [c_int, c_void_p]),
    "sublet_torch_alloc": (c_void_p, [c_ssize_t, c_int, c_void_p]),
    "sublet_torch_free": (None, [c_void_p, c_ssize_t, c_int, c_void_p]),
    "sublet_torch_bind_pool": (c_int, [c_int, c_void_p, c_uint32]),
    "sublet_pool_alloc": (c_int, [c_void_p, c_uint32, c_uint64, POINTER(c_void_p)]),
    "sublet_pool_free": (c_int, [c_void_p, c_void_p]),
    "sublet_pool_set_margin": (c_int, [c_void_p, c_uint64]),
    "sublet_pool_owns": (c_int, [c_void_p, c_void_p]),
    "sublet_pool_region": (c_void_p, [c_void_p]),
    "sublet_pool_hold": (c_int, [c_void_p, POINTER(c_uint64)]),
    "sublet_pool_unhold": (c_int, [c_void_p]),
    "sublet_pool_layout": (c_uint64, [c_void_p]),
    "sublet_pool_segments": (c_int, [c_void_p, c_uint32, c_void_p, c_size_t,
                                     POINTER(c_size_t)]),
}

# --------------------------------------------------------------------------- loading

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PACKAGE_DIR.parent
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def native_candidates(name: str, env: str) -> list[Path]:
    """Where to look for a native file: $env, beside $SUBLET_LIB (a build of one's own: its
    preload library and subletd are of the same build, not the repo's older one), the package's
    _native/, then ./build of the repo."""
    found = [Path(os.environ[env])] if os.environ.get(env) else []
    if env != "SUBLET_LIB" and os.environ.get("SUBLET_LIB"):
        found.append(Path(os.environ["SUBLET_LIB"]).parent / name)
    return found + [_PACKAGE_DIR / "_native" / name, _REPO_ROOT / "build" / name]


def find_native(name: str, env: str) -> Path:
    """The first existing candidate for a native file, or FileNotFoundError saying the fix."""
    candidates = native_candidates(name, env)
    if os.environ.get(env):  # an explicit choice is not second-guessed
        candidates = candidates[:1]
    for path in candidates:
        if path.is_file():
            return path.resolve()
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"{name} not found (tried {tried}). Install sublet with `pip install .`, build it with "
        f"`cmake -S . -B build -G Ninja && cmake --build build`, or set ${env} to its path.")


def library_path() -> str:
    """The resolved path of libsublet.so: the one path both ctypes and PyTorch load."""
    lib()
    assert _lib_path is not None
    return _lib_path


def lib() -> ctypes.CDLL:
    """libsublet.so, loaded once with every prototype declared."""
    global _lib, _lib_path
    with _lock:
        if _lib is None:
            path = str(find_native("libsublet.so", "SUBLET_LIB"))
            handle = ctypes.CDLL(path)
            for name, (restype, argtypes) in _PROTOTYPES.items():
                fn = getattr(handle, name)
                fn.restype, fn.argtypes = restype, argtypes
            _lib, _lib_path = handle, path
        return _lib


def text(value: bytes | None) -> str:
    """A string from the library or the daemon: whatever its bytes, it prints."""
    return value.decode(errors="replace") if value else ""


def last_error() -> str:
    """The calling thread's last error message from the library."""
    return text(lib().sublet_last_error())


def check(rc: int) -> int:
    """Returns rc when it is not negative; raises the exception for the code otherwise."""
    if rc < 0:
        raise error_for(rc, last_error())
    return rc



# --------------------------------------------------------------------------- one connection


@dataclass(frozen=True)
class DaemonInfo:
    """What subletd said about itself and its device (struct sublet_info)."""
    daemon_version: str
    backend: str
    device_name: str
    device_uuid: str            # GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi writes it
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
    daemon_died: bool = False  # the owner's library restored the kept bytes itself
    # pages a borrower of another user was granted, given fresh pages at the end (the tensor's
    # addresses stay); 0 for a borrower of the owner's own user
    replaced_pages: int = 0
    # region pages the borrower's process mapped for this loan (its fresh chunks aside): 0
    # once a window is kept or served in place, whatever the keep
    mapped_pages: int = 0

    def __repr__(self) -> str:
        flags = [name for name, on in (("borrower died", self.borrower_died),
                                       ("owner gone", self.owner_gone),
                                       ("daemon died", self.daemon_died)) if on]
        if self.replaced_pages:
            flags.append(f"{self.replaced_pages} pages replaced")
        return (f"<sublet.LoanStats of loan {self.loan_id}: served "
                f"{human(self.served_unkept_bytes)} unkept, {human(self.served_fresh_bytes)} "
                f"fresh, {human(self.served_kept_bytes)} kept (peak {human(self.peak_bytes)}, "
                f"{self.allocations} allocations); {human(self.copied_out_bytes)} to the host, "
                f"{human(self.copied_in_bytes)} back, {human(self.moved_bytes)} moved; "
                f"{self.map_seconds:.3f} s mapping ({self.mapped_pages} pages), "
                f"{self.copy_out_seconds:.3f} s copying out, "
                f"{self.copy_in_seconds:.3f} s in, {self.move_seconds:.3f} s moving"
                + "".join(f"; {flag}" for flag in flags) + ">")

    @classmethod
    def from_c(cls, c: CLoanStats) -> "LoanStats":
        values = {f.name: getattr(c, f.name) for f in fields(cls)}
        for flag in ("borrower_died", "owner_gone", "daemon_died"):
            values[flag] = bool(values[flag])
        return cls(**values)


@dataclass(frozen=True)
class ReleaseStats:
    """What a release did (and, after the resume, what its end did). Bytes are exact.

    released_pages went back to the driver; stayed_pages are kept pages that stayed on the GPU,
    holding the kept bytes (compacted: moved_bytes of them moved there on the GPU, and back at
    the resume); copied_out_bytes went to the host (what the pages that stay could not hold),
    copied_in_bytes came back. seconds: the call, end to end; map_seconds the client's share
    (unmapping, or mapping the new pages); move and copy seconds the daemon's.
    """
    release_id: int
    released_pages: int
    stayed_pages: int
    kept_bytes: int
    moved_bytes: int
    copied_out_bytes: int
    copied_in_bytes: int
    seconds: float
    move_seconds: float
    copy_seconds: float
    map_seconds: float
    daemon_died: bool = False  # the resume was this process's own: subletd had died
    allocations: int = 0  # resume: the allocations the pages came back as (groups, or pages)
    held_pages: int = 0  # of stayed_pages, those held whole with a page group that stays

    def __repr__(self) -> str:
        died = "; resumed by this process (subletd had died)" if self.daemon_died else ""
        return (f"<sublet.ReleaseStats of release {self.release_id}: "
                f"{self.released_pages} pages released, {self.stayed_pages} stayed holding "
                f"{human(self.kept_bytes)} kept ({human(self.moved_bytes)} moved); "
                f"{human(self.copied_out_bytes)} to the host, {human(self.copied_in_bytes)} "
                f"back; {self.seconds:.3f} s ({self.move_seconds:.3f} s moving, "
                f"{self.copy_seconds:.3f} s copying, {self.map_seconds:.3f} s mapping){died}>")

    @classmethod
    def from_c(cls, c: CReleaseStats) -> "ReleaseStats":
        values = {f.name: getattr(c, f.name) for f in fields(cls)}
        values["daemon_died"] = bool(values["daemon_died"])
        return cls(**values)


@dataclass(frozen=True)
class ReturnResult:
    code: int                  # 0, or a negative SUBLET_E* code (ELEAK, EOWNERGONE...)
    message: str
    stats: LoanStats
    leaks: list[tuple[int, int]]  # (alloc id, size) of allocations alive at the return


@dataclass(frozen=True)
class RegionHandle:
    """A sublet_region of this process: the C handle and where it is mapped."""
    handle: c_void_p
    addr: int
    size: int  # whole pages
    id: int


def _pinned(pinned: Any) -> Any:
    """Pinned byte ranges for C: an (n, 2) C-contiguous uint64 array (empty for None)."""
    import numpy as np  # here: the ctypes layer loads without it

    if pinned is None or len(pinned) == 0:
        return np.zeros((0, 2), np.uint64)
    pins = np.ascontiguousarray(pinned, np.uint64)
    if pins.ndim != 2 or pins.shape[1] != 2:
        raise ValueError(f"pinned is (offset, length) byte ranges, an (n, 2) array, not shape "
                         f"{pins.shape}: pass one row per range of whole pages")
    return pins


def _data(ranges: Any) -> int | None:
    return ranges.ctypes.data if len(ranges) else None


def _name(name: str | None) -> bytes | None:
    """A loan name for C: None is no name; "" goes as given, for the daemon to refuse as it
    refuses a name of 0 bytes (1 to 63 bytes). A C string cannot hold a NUL, so such a name is
    refused here as the daemon refuses it (rather than being cut short)."""
    if name is None:
        return None
    if "\0" in name:
        raise error_for(ERROR_CODES["EINVAL"], f"loan name {name!r} holds a NUL character: "
                        f"use a name without one")
    return name.encode()


class Client:
    """A sublet_client: one connection to one daemon, at socket `path`. info is what the daemon
    said at connection."""

    def __init__(self, handle: c_void_p, path: str):
        self.handle = handle
        self.path = path
        self.info = self.get_info()

    @classmethod
    def open(cls, path: str) -> "Client":
        """Connects to the daemon at path; DaemonUnavailableError when nobody answers."""
        handle = c_void_p()
        check(lib().sublet_connect(path.encode(), ctypes.byref(handle)))
        try:
            return cls(handle, path)
        except BaseException:
            lib().sublet_disconnect(handle)
            raise

    def get_info(self) -> DaemonInfo:
        info = Info()
        check(lib().sublet_get_info(self.handle, ctypes.byref(info)))
        return DaemonInfo(
            text(info.daemon_version), text(info.backend), text(info.device_name),
            format_uuid(bytes(info.device_uuid)), info.device_ordinal, info.page_size,
            info.total_bytes, info.free_bytes, info.client_id)

    @property
    def connected(self) -> bool:
        """False once subletd died or closed the connection: new work needs a new Client."""
        return self.handle is not None and bool(lib().sublet_connected(self.handle))

    def close(self) -> None:
        lib().sublet_disconnect(self.handle)
        self.handle = None

    # ---- regions
    def region_create(self, size: int) -> RegionHandle:
        region, l = c_void_p(), lib()
        check(l.sublet_region_create(self.handle, size, ctypes.byref(region)))
        return RegionHandle(region, l.sublet_region_addr(region), l.sublet_region_size(region),
                            l.sublet_region_id(region))

    def region_create_growable(self, size: int) -> RegionHandle:
        """A region that region_grow can make larger in place (its address stays)."""
        region, l = c_void_p(), lib()
        check(l.sublet_region_create_growable(self.handle, size, ctypes.byref(region)))
        return RegionHandle(region, l.sublet_region_addr(region), l.sublet_region_size(region),
                            l.sublet_region_id(region))

    @staticmethod
    def region_grow(region: RegionHandle, size: int) -> int:
        """Grows a growable region to size bytes in all (rounded up to pages); returns its new
        size. The handle's size stays the old one (it is frozen): use the result."""
        l = lib()
        check(l.sublet_region_grow(region.handle, size))
        return int(l.sublet_region_size(region.handle))

    @staticmethod
    def region_release(region: RegionHandle) -> None:
        check(lib().sublet_region_release(region.handle))

    # ---- owner's side
    def lend(self, region: RegionHandle, ranges: Any, name: str | None,
             timeout_ms: int = 0, pinned: Any = None) -> tuple[int, bytes]:
        """Offers a region; ranges (a C-contiguous (n, 2) uint64 numpy array: a row has the
        layout of struct sublet_range) None keeps all of it. pinned: byte ranges of whole
        pages the loan never touches (the same kind of array), or None. Waits up to
        timeout_ms (-1: forever; 0: BusyError at once) for the device. Returns (loan id,
        token)."""
        loan_id, token = c_uint64(), TOKEN()
        keep_all = ranges is None
        n = 0 if keep_all else len(ranges)
        pins = _pinned(pinned)  # held here: C reads it during the call
        check(lib().sublet_lend_pinned(region.handle, ranges.ctypes.data if n else None, n,
                                       int(keep_all), _data(pins), len(pins), 0, _name(name),
                                       timeout_ms, ctypes.byref(loan_id), token))
        return loan_id.value, bytes(token)

    def lend_local(self, region: RegionHandle, ranges: Any, timeout_ms: int = 0,
                   pinned: Any = None) -> int:
        """Lends a region to this client itself in one step (never on offer) and borrows it;
        ranges, timeout_ms and pinned as for lend. Returns the loan id."""
        loan_id = c_uint64()
        keep_all = ranges is None
        n = 0 if keep_all else len(ranges)
        pins = _pinned(pinned)  # held here: C reads it during the call
        check(lib().sublet_lend_pinned(region.handle, ranges.ctypes.data if n else None, n,
                                       int(keep_all), _data(pins), len(pins), 1, None, timeout_ms,
                                       ctypes.byref(loan_id), TOKEN()))
        return loan_id.value

    @staticmethod
    def release(region: RegionHandle, pages: Any, ranges: Any, stay_pages: int,
                need: int | None = None) -> ReleaseStats:
        """Gives pages of region (byte ranges of whole pages as for lend's pinned; None: all of
        it) back to the driver, keeping ranges (None: all of it) on the GPU in at most
        stay_pages kept pages (STAY_ANY: as many as they need), the rest on the host. need:
        bytes a taker needs (sublet_release_need: subletd releases only the pages that the
        need takes beyond the device's free bytes); None: every page the stay allows."""
        stats = CReleaseStats()
        keep_all = ranges is None
        n = 0 if keep_all else len(ranges)
        spans = _pinned(pages)  # held here: C reads them during the call
        check(lib().sublet_release_need(region.handle, _data(spans), len(spans),
                                        ranges.ctypes.data if n else None, n, int(keep_all),
                                        stay_pages, NEED_ALL if need is None else need, None,
                                        ctypes.byref(stats)))
        return ReleaseStats.from_c(stats)

    @staticmethod
    def release_more(region: RegionHandle, release_id: int, need: int) -> ReleaseStats:
        """More of a live release made by need: the taker now needs `need` bytes in all
        (sublet_release_more); returns the release's stats in all."""
        stats = CReleaseStats()
        check(lib().sublet_release_more(region.handle, release_id, need, ctypes.byref(stats)))
        return ReleaseStats.from_c(stats)

    @staticmethod
    def resume(region: RegionHandle, release_id: int,
               groups: bool = True) -> tuple[int, str, ReleaseStats]:
        """Ends a release; returns the code (EDAEMONDIED: done by this library) with the
        message and the stats. groups False: a page each (SUBLET_RESUME_PAGES)."""
        stats = CReleaseStats()
        rc = lib().sublet_resume(region.handle, release_id, 0 if groups else RESUME_PAGES,
                                 ctypes.byref(stats))
        return rc, (last_error() if rc < 0 else ""), ReleaseStats.from_c(stats)

    # ---- release offers (the owner's side: a thread of the library steps each offer)
    @staticmethod
    def offer_release(region: RegionHandle, pages: Any, ranges: Any, stay_pages: int,
                      name: str | None) -> c_void_p:
        """Offers a release of region (pages, ranges and stay_pages as for release) for a
        scheduler to take; returns the offer's handle (release_offer_free frees it)."""
        offer = c_void_p()
        keep_all = ranges is None
        n = 0 if keep_all else len(ranges)
        spans = _pinned(pages)  # the library copies the lists
        check(lib().sublet_offer_release(region.handle, _data(spans), len(spans),
                                         ranges.ctypes.data if n else None, n, int(keep_all),
                                         stay_pages, _name(name), ctypes.byref(offer)))
        return offer

    @staticmethod
    def release_offer_id(offer: c_void_p) -> int:
        return int(lib().sublet_release_offer_id(offer))

    @staticmethod
    def release_offer_state(offer: c_void_p) -> str:
        """"offered", "taken", "released", "returning" or "ended"."""
        return OFFER_STATES.get(lib().sublet_release_offer_state(offer), "ended")

    @staticmethod
    def release_offer_wait(offer: c_void_p, timeout_ms: int
                           ) -> tuple[int, str, ReleaseStats, ReleaseStats]:
        """Waits up to timeout_ms (-1: forever) for the offer to be over: the code (0,
        ETIMEDOUT: not yet, EBORROWERDIED, EDAEMONDIED, ECANCELED: withdrawn, or a failure),
        its message, and the release's and the resume's stats."""
        released, resumed = CReleaseStats(), CReleaseStats()
        rc = lib().sublet_release_offer_wait(offer, timeout_ms, ctypes.byref(released),
                                             ctypes.byref(resumed))
        return (rc, last_error() if rc < 0 else "", ReleaseStats.from_c(released),
                ReleaseStats.from_c(resumed))

    @staticmethod
    def release_offer_withdraw(offer: c_void_p) -> None:
        """Ends an untaken offer; BusyError once taken."""
        check(lib().sublet_release_offer_withdraw(offer))

    @staticmethod
    def release_offer_free(offer: c_void_p) -> None:
        """Withdraws the offer or waits until it is over, then frees it."""
        lib().sublet_release_offer_free(offer)

    # ---- release offers (the scheduler's side)
    def take(self, name: str | None, timeout_ms: int, need: int | None = None) -> int:
        """Takes a release offer (by name; None: the oldest this user may take), waiting up
        to timeout_ms (0: at once, NoOfferError or BusyError); returns its id. need: the
        taker's need in bytes, which the owner releases by (sublet_take_need)."""
        offer = c_uint64()
        if need is None:
            check(lib().sublet_take(self.handle, _name(name), timeout_ms, ctypes.byref(offer)))
        else:
            check(lib().sublet_take_need(self.handle, _name(name), need, timeout_ms,
                                         ctypes.byref(offer)))
        return offer.value

    def take_more(self, offer: int, need: int) -> str:
        """The taker of an offer taken by need now needs `need` bytes in all
        (sublet_take_more): "released" (nothing to do) or "more" (take_wait waits for it)."""
        state = c_int()
        check(lib().sublet_take_more(self.handle, offer, need, ctypes.byref(state)))
        return OFFER_STATES.get(state.value, "ended")

    def take_wait(self, offer: int, timeout_ms: int) -> tuple[str, ReleaseStats]:
        """Waits until the taken offer is released (or, given back, over): its state and the
        release's (or the resume's) stats. SubletTimeoutError changes nothing."""
        state, stats = c_int(), CReleaseStats()
        check(lib().sublet_take_wait(self.handle, offer, timeout_ms, ctypes.byref(state),
                                     ctypes.byref(stats)))
        return OFFER_STATES.get(state.value, "ended"), ReleaseStats.from_c(stats)

    def give_back(self, offer: int) -> None:
        """Gives a taken offer back: its owner resumes (take_wait waits for that)."""
        check(lib().sublet_give_back(self.handle, offer))

    def cancel(self) -> None:
        """Gives up the call of another thread that waits in the daemon (ECANCELED there)."""
        check(lib().sublet_cancel(self.handle))

    def pin_ahead(self, nbytes: int, release: bool = False) -> None:
        """Starts pinning the save area of this user's loans (release: of its next release)
        toward nbytes (sublet_pin_ahead)."""
        check(lib().sublet_pin_ahead(self.handle, nbytes, 1 if release else 0))

    @staticmethod
    def checksum(region: RegionHandle, ranges: Any, sums: Any) -> None:
        """Fills sums (a uint64 numpy array, one per row of ranges, as for lend) with the
        checksums of the ranges, computed on the device."""
        if len(ranges):
            check(lib().sublet_region_checksum(region.handle, ranges.ctypes.data, len(ranges),
                                               sums.ctypes.data))

    def reclaim(self, loan_id: int, timeout_ms: int) -> LoanStats:
        rc, message, stats = self.reclaim_raw(loan_id, timeout_ms)
        if rc < 0:
            raise error_for(rc, message)
        return stats

    def reclaim_raw(self, loan_id: int, timeout_ms: int) -> tuple[int, str, LoanStats]:
        """Like reclaim, but returns the code: EDAEMONDIED comes with the stats of the loan
        this library restored itself, which the caller keeps."""
        stats = CLoanStats()
        rc = lib().sublet_reclaim(self.handle, loan_id, timeout_ms, ctypes.byref(stats))
        return rc, (last_error() if rc < 0 else ""), LoanStats.from_c(stats)

    def withdraw(self, loan_id: int) -> None:
        check(lib().sublet_withdraw(self.handle, loan_id))

    # ---- borrower's side
    def borrow(self, loan_id: int = 0, token: bytes | None = None, name: str | None = None,
               timeout_ms: int = 0) -> None:
        if token is not None and len(token) != TOKEN_BYTES:
            raise ValueError(f"a loan token is {TOKEN_BYTES} bytes, not {len(token)}")
        ctoken = TOKEN.from_buffer_copy(token) if token is not None else None
        check(lib().sublet_borrow(self.handle, loan_id, ctoken, _name(name), timeout_ms))

    def alloc(self, size: int) -> int:
        ptr = c_void_p()
        check(lib().sublet_alloc(self.handle, size, ctypes.byref(ptr)))
        return ptr.value or 0

    def free(self, ptr: int) -> None:
        check(lib().sublet_free(self.handle, c_void_p(ptr)))

    def return_loan(self, force: bool, max_leaks: int = 256) -> ReturnResult:
        stats, leaks, nleaks = CLoanStats(), (CLeak * max_leaks)(), c_size_t()
        rc = lib().sublet_return(self.handle, int(force), ctypes.byref(stats), leaks, max_leaks,
                                 ctypes.byref(nleaks))
        message = last_error() if rc < 0 else ""
        alive = [(leaks[i].alloc_id, leaks[i].size) for i in range(min(nleaks.value,
                                                                        max_leaks))]
        return ReturnResult(rc, message, LoanStats.from_c(stats), alive)

    def loan_stats(self) -> LoanStats:
        stats = CLoanStats()
        check(lib().sublet_loan_stats(self.handle, ctypes.byref(stats)))
        return LoanStats.from_c(stats)

    def status(self) -> dict:
        """The daemon's status (device, regions, the loan in progress, totals) as parsed JSON
        (always valid UTF-8: libsublet replaces bytes that are not, from an older daemon)."""
        out = c_void_p()
        check(lib().sublet_status_json(self.handle, ctypes.byref(out)))
        try:
            return json.loads(ctypes.string_at(out.value))
        finally:
            lib().sublet_string_free(out)

    def torch_bind(self, cuda_index: int, bound: bool) -> None:
        """Routes (or stops routing) the PyTorch hooks of a CUDA device index to this client."""
        check(lib().sublet_torch_bind(cuda_index, self.handle if bound else None))

    # ---- pools (one growable region per client, its arena, sub-allocated by tag)
    def torch_bind_pool(self, cuda_index: int, tag: int) -> None:
        """Routes the PyTorch hooks of a CUDA device index to this client's pool of tag (0:
        none), while no loan is bound."""
        check(lib().sublet_torch_bind_pool(cuda_index, self.handle, tag))

    def pool_alloc(self, tag: int, size: int) -> int:
        ptr = c_void_p()
        check(lib().sublet_pool_alloc(self.handle, tag, size, ctypes.byref(ptr)))
        return ptr.value or 0

    def pool_free(self, ptr: int) -> None:
        check(lib().sublet_pool_free(self.handle, c_void_p(ptr)))

    def pool_set_margin(self, nbytes: int) -> None:
        """Pool allocations that grow the arena fail (SubletOutOfMemoryError) unless nbytes
        stay free on the device after them (0: no check)."""
        check(lib().sublet_pool_set_margin(self.handle, nbytes))

    def pool_hold(self) -> int:
        """Switches on the refusal of this client's pool allocations (BusyError) for a loan of
        its arena, to be planned from here on; returns the arena's layout id
        (sublet_pool_hold). BusyError when held already."""
        layout = c_uint64()
        check(lib().sublet_pool_hold(self.handle, ctypes.byref(layout)))
        return layout.value

    def pool_unhold(self) -> None:
        """Pool allocations are served again: the loan of the arena is over."""
        check(lib().sublet_pool_unhold(self.handle))

    def pool_layout(self) -> int:
        """The arena's layout id now: it changes whenever an allocation takes pages."""
        return int(lib().sublet_pool_layout(self.handle))

    def pool_region(self) -> RegionHandle | None:
        """The arena as it is now (it grows), or None before the first pool allocation."""
        l = lib()
        region = l.sublet_pool_region(self.handle)
        if not region:
            return None
        region = c_void_p(region)
        return RegionHandle(region, l.sublet_region_addr(region), l.sublet_region_size(region),
                            l.sublet_region_id(region))

    def pool_segments(self, tag: int) -> Any:
        """The live allocations of tag (0: every tag) as an (n, 2) uint64 array of (offset,
        length) byte ranges of the arena, ascending; a tag's with the free pages of the page
        groups they cut (sublet_pool_segments)."""
        import numpy as np
        count = c_size_t()
        while True:
            out = np.empty((max(count.value, 16), 2), np.uint64)
            check(lib().sublet_pool_segments(self.handle, tag, out.ctypes.data, len(out),
                                             ctypes.byref(count)))
            if count.value <= len(out):
                return out[:count.value]


def rows_ranges(rows_addr: int, n: int, nrows: int, base: int, row_bytes: int,
                out_addr: int) -> int:
    """sublet_rows_ranges over the int64 rows at rows_addr into the ranges at out_addr (room
    for n): how many it wrote."""
    nout = c_size_t()
    check(lib().sublet_rows_ranges(rows_addr, n, nrows, base, row_bytes, out_addr,
                                   ctypes.byref(nout)))
    return nout.value


def blocks_ranges(rows_addr: int, n: int, nrows: int, bases_addr: int, nbases: int,
                  row_bytes: int, out_addr: int, cap: int) -> int:
    """sublet_blocks_ranges: the int64 rows at rows_addr of the tables at the nbases uint64
    bases at bases_addr, sorted and merged, into the ranges at out_addr (room for cap): how
    many it wrote. cap too small: SubletError (E2BIG); blocks_ranges_count says how many."""
    nout = c_size_t()
    check(lib().sublet_blocks_ranges(rows_addr, n, nrows, bases_addr, nbases, row_bytes,
                                     out_addr, cap, ctypes.byref(nout)))
    return nout.value


def blocks_ranges_count(rows_addr: int, n: int, nrows: int, bases_addr: int, nbases: int,
                        row_bytes: int) -> int:
    """How many ranges blocks_ranges writes for these rows and bases (checking them)."""
    nout = c_size_t()
    rc = lib().sublet_blocks_ranges(rows_addr, n, nrows, bases_addr, nbases, row_bytes, None, 0,
                                    ctypes.byref(nout))
    if rc == ERROR_CODES["E2BIG"]:
        return nout.value
    check(rc)
    return nout.value


def host_bytes(addr: int, nbytes: int) -> ctypes.Array:
    """nbytes of this process's memory at addr as a writable buffer (torch.frombuffer's)."""
    return (ctypes.c_uint8 * nbytes).from_address(addr)
