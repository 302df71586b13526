#!/usr/bin/env python3
"""The host link from each kind of host memory sublet could copy through (issue 22).

On the H200 a resume at 100 % kept copied its 64 GiB back at 48.7 GB/s, from subletd's save
area (a memfd mapped MAP_SHARED, its pages made with MADV_HUGEPAGE and MADV_POPULATE_WRITE,
then cuMemHostRegister), while the same run measured 55.4 GB/s from torch's pinned memory
(cudaHostAlloc) and the save itself went out at 55 GB/s: 0.16 s a cycle, more than all that
sublet's resume costs beyond torch_memory_saver's. This measures, in one process, 1 GiB
copies each way between device memory and:

  cudaHostAlloc       torch.empty(pin_memory=True): what torch_memory_saver and the bench's
                      link figure use
  anon                mmap(MAP_PRIVATE | MAP_ANONYMOUS), made, registered
  memfd               memfd, mmap(MAP_SHARED), made, registered: subletd's save area
  memfd-nothp         the same without MADV_HUGEPAGE
  memfd-hugetlb       memfd_create(MFD_HUGETLB): only where the kernel has huge pages reserved

and, for each, one copy of 1 GiB against 256 MiB pieces (subletd's piece), best of --reps.
It prints the kernel's transparent huge page settings beside the figures, and each host
memory's share of huge pages (AnonHugePages / ShmemHugePages of /proc/self/smaps_rollup).

    python3 bench/bench_host_link.py [--size-mib 1024] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
from pathlib import Path

MiB = 1 << 20
PIECE = 256 * MiB
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23
MFD_HUGETLB = 0x0004
CU_MEMHOSTREGISTER_PORTABLE = 0x01


def cuda() -> ctypes.CDLL:
    """The driver, in the context torch made current (its primary one)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_void_p]
    lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                                         ctypes.c_void_p]
    return lib


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


class HostMemory:
    """size bytes of one kind, made and pinned; .addr its address."""

    def __init__(self, kind: str, size: int, drv: ctypes.CDLL):
        import torch
        self.kind, self.size, self.drv, self.registered, self.map = kind, size, drv, False, None
        self.tensor = None
        if kind == "cudaHostAlloc":
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
            self.addr = self.tensor.data_ptr()
            return
        if kind == "anon":
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            flags = os.MFD_CLOEXEC | (MFD_HUGETLB if kind == "memfd-hugetlb" else 0)
            fd = os.memfd_create(f"bench-{kind}", flags)
            try:
                os.ftruncate(fd, size)
                self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
        self.map.madvise(MADV_NOHUGEPAGE if kind == "memfd-nothp" else MADV_HUGEPAGE)
        try:
            self.map.madvise(MADV_POPULATE_WRITE)
        except OSError:
            self.map.write(b"\1" * size)
        view = (ctypes.c_char * size).from_buffer(self.map)
        self.addr = ctypes.addressof(view)
        del view  # the mapping's export ends: close() may unmap it
        check(drv.cuMemHostRegister_v2(self.addr, size, CU_MEMHOSTREGISTER_PORTABLE),
              f"cuMemHostRegister ({kind})")
        self.registered = True

    def close(self) -> None:
        if self.registered:
            self.drv.cuMemHostUnregister(self.addr)
        self.tensor = None
        if self.map is not None:
            self.map.close()


def huge_pages_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"):
            out[key] = int(rest.split()[0])
    return out


def thp_settings() -> dict[str, str]:
    base = Path("/sys/kernel/mm/transparent_hugepage")
    out = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            out[name] = (base / name).read_text().strip()
        except OSError:
            out[name] = "?"
    try:
        out["HugePages_Free"] = next(l.split()[1] for l in Path("/proc/meminfo").read_text()
                                     .splitlines() if l.startswith("HugePages_Free"))
    except (OSError, StopIteration):
        out["HugePages_Free"] = "?"
    return out


def timed_copies(drv, dev_ptr: int, host: int, size: int, piece: int, to_device: bool,
                 reps: int) -> float:
    """Bytes per second of the best of reps: size bytes in pieces of piece, one stream."""
    import torch
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for off in range(0, size, piece):
            n = min(piece, size - off)
            if to_device:
                check(drv.cuMemcpyHtoDAsync_v2(dev_ptr + off, host + off, n, stream), "HtoD")
            else:
                check(drv.cuMemcpyDtoHAsync_v2(host + off, dev_ptr + off, n, stream), "DtoH")
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return size / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("bench_host_link.py needs a CUDA GPU", file=sys.stderr)
        return 2
    size = args.size_mib * MiB
    dev = torch.empty(size, dtype=torch.uint8, device="cuda").fill_(2)
    drv = cuda()
    doc = {"schema": "sublet-bench-host-link/1", "gpu": torch.cuda.get_device_name(),
           "size": size, "thp": thp_settings(), "kinds": {}}
    print(f"GPU {doc['gpu']}; {args.size_mib} MiB each way, best of {args.reps}; THP "
          f"{doc['thp']}")
    for kind in ("cudaHostAlloc", "anon", "memfd", "memfd-nothp", "memfd-hugetlb"):
        try:
            mem = HostMemory(kind, size, drv)
        except (OSError, RuntimeError) as e:
            print(f"  {kind:14s} not available: {e}")
            doc["kinds"][kind] = {"error": str(e)}
            continue
        row = {"huge_kib": huge_pages_kib()}
        for piece, label in ((size, "one"), (PIECE, "pieces")):
            row[f"h2d_{label}"] = timed_copies(drv, dev.data_ptr(), mem.addr, size, piece, True,
                                               args.reps)
            row[f"d2h_{label}"] = timed_copies(drv, dev.data_ptr(), mem.addr, size, piece,
                                               False, args.reps)
        mem.close()
        doc["kinds"][kind] = row
        print(f"  {kind:14s} in {row['h2d_one'] / 1e9:5.1f} GB/s ({row['h2d_pieces'] / 1e9:5.1f}"
              f" in 256 MiB pieces), out {row['d2h_one'] / 1e9:5.1f} GB/s "
              f"({row['d2h_pieces'] / 1e9:5.1f}); huge pages mapped {row['huge_kib']}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
