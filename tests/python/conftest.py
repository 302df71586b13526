"""Shared pytest setup for sublet's Python tests.

- The package is imported from this checkout (no install needed), or, with
  SUBLET_TEST_INSTALLED=1, from wherever it is installed (CI's wheel test: run pytest from
  outside the checkout so that the checkout's sublet/ is not on the path). Child processes get
  CHILD_ENV, which points them at the same package.
- `gpu` tests skip cleanly without CUDA.
- `native` finds build/subletd and build/libsublet.so (built by CMake; nothing is built here)
  and skips the tests that need them, with the reason, when they are missing.
- `memfd_daemon` gives a module a user daemon on the memfd backend (no GPU) with PAGE-byte
  pages and TOTAL bytes in all, so that a loan is easy to fill completely: a module asks for
  it with `pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]`.
- The session has a runtime directory of its own ($XDG_RUNTIME_DIR): the user's daemons that
  sublet starts on demand are the session's, shared with no other session nor with the real
  user's, and they are stopped at its end.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# torch_memory_saver's own test/ tree, verbatim (its conftest.py among it): not collected here,
# where its conftest would shadow this one; test_compat_tms_upstream.py runs it in a child.
collect_ignore = ["tms_upstream"]

REPO = Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("SUBLET_TEST_INSTALLED") == "1"
CHILD_ENV: dict[str, str] = {} if INSTALLED else {"PYTHONPATH": str(REPO)}
if not INSTALLED:
    sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Native:
    subletd: Path
    libsublet: Path


def find_native() -> Native | None:
    """The built daemon and library: $SUBLETD / $SUBLET_LIB, else the repo's build/ (the
    installed package's own when testing the installed package)."""
    if INSTALLED:
        from sublet import _lib
        return Native(_lib.find_native("subletd", "SUBLETD"),
                      _lib.find_native("libsublet.so", "SUBLET_LIB"))
    subletd = Path(os.environ.get("SUBLETD", REPO / "build" / "subletd"))
    lib = Path(os.environ.get("SUBLET_LIB", REPO / "build" / "libsublet.so"))
    return Native(subletd, lib) if subletd.is_file() and lib.exists() else None


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def stop_user_daemons(directory: Path) -> None:
    """SIGTERMs the daemons started in a user directory (their .pid files) and waits for them."""
    from sublet._daemon import _alive
    pids = []
    for pidfile in directory.glob("*.pid"):
        try:  # a daemon removes its .pid as it leaves: it may go between glob and read
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(scope="session", autouse=True)
def own_runtime_dir():
    path = Path(tempfile.mkdtemp(prefix="sl-"))  # short: a socket path has 107 bytes at most
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(path))
        yield path
    stop_user_daemons(path / "sublet")
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def native() -> Native:
    found = find_native()
    if found is None:
        pytest.skip("needs the built subletd and libsublet.so: run "
                    "`cmake -S . -B build -G Ninja && cmake --build build` (or set $SUBLETD "
                    "and $SUBLET_LIB)")
    os.environ.setdefault("SUBLETD", str(found.subletd))
    os.environ.setdefault("SUBLET_LIB", str(found.libsublet))
    return found


PAGE = 64 * 1024            # the memfd daemon's page: SUBLET_MEMFD_PAGE_SIZE=64K
TOTAL = 64 * 1024 * 1024    # and its memory in all: SUBLET_MEMFD_TOTAL=64M


@pytest.fixture(scope="module")
def memfd_daemon(native):
    """The module's environment points sublet at a memfd daemon of PAGE-byte pages and TOTAL
    bytes (SUBLET_SOCKET unset, so the session's user daemon for that backend is started on
    demand); yields its sublet.info("cpu"). Module-scoped: the environment is restored when
    the module ends."""
    import sublet
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SUBLET_BACKEND", "memfd")
        mp.setenv("SUBLET_MEMFD_PAGE_SIZE", "64K")
        mp.setenv("SUBLET_MEMFD_TOTAL", "64M")
        mp.delenv("SUBLET_SOCKET", raising=False)
        info = sublet.info("cpu")
        assert (info.backend, info.page_size, info.total_bytes) == ("memfd", PAGE, TOTAL)
        yield info


def kept_ranges_of(t, keep):
    """The kept byte ranges of `t` for `keep` (None: all of it), as sublet computes them."""
    import numpy as np
    from sublet._keep import keep_ranges
    storage = t.untyped_storage()
    if keep is None:
        return np.array([[0, storage.nbytes()]], dtype=np.uint64)
    return keep_ranges(keep, storage.data_ptr(), storage.nbytes(), t)


def memfd_free_bytes() -> int:
    """The memfd daemon's free bytes now (sublet.info asks it)."""
    import sublet
    return sublet.info("cpu").free_bytes

