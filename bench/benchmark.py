#!/usr/bin/env python3
"""Lending against copying everything out and back, and against torch_memory_saver, on one
CUDA GPU (issues 4 and 10).

A tensor of S bytes made with sublet.empty sits on the GPU with only F bytes of free memory
beside it (a ballast allocated outside sublet takes the rest). A fraction of it (30%) holds
data the owner keeps, in one of these patterns:

  rows        rows of 1 GiB, every third one kept (one strided view)
  blocks      64 KiB blocks, 30% of them chosen at random with a fixed seed, kept as row
              indices of the tensor viewed by blocks, the way a paged KV cache holds its live
              blocks: nearly every 2 MiB page holds some
  slice       one contiguous slice of 30%
  runs        64 KiB blocks whose 30% live ones come in runs (3 MiB on average, between
              geometric free gaps), as an engine's free list and eviction leave them: about
              half the 2 MiB pages hold no kept byte
  blocks-new  blocks, with a new live set every cycle (seeded by the seed and the cycle)
  runs-new    runs, with a new live set every cycle

A job allocates one tensor of 25%, 75% or 100% of S with torch.empty and fills it with random
numbers, or (the fourth case) runs one training step of a small transformer. A cycle makes
room for the job, runs it and gets the owner's data back:

  copy-all  copy the whole tensor (a plain torch tensor here, so that it can be freed) to a
            pinned host buffer, free it, run the job, allocate it again and copy it back; the
            first cycle also pins the host buffer
  tms       torch_memory_saver at its best: the kept 30% in a tensor of its own, paused with a
            CPU backup kept between cycles, the rest paused without one (scattered blocks
            cannot be split off like this: the best case for it)
  sublet    with sublet.lend(tensor, keep=...): job()

copy-all and tms run all their jobs in one process each (the host buffer is pinned once);
every sublet (pattern, job) runs in a fresh process of this script (--child): its first cycle
is the "first" figure, its next --cycles cycles the "later" ones. Beside every figure: the bytes
copied each way, the bytes sublet moved on the GPU, and the physical limit (least_displaced):
the job alone (timed on plain torch memory), plus the least kept bytes any choice of pages
could displace, moved on the GPU there and back at the device-to-device speed, plus what of
them cannot fit in the holes of the other pages, over the pinned link each way. A job of J
bytes beside F free needs m = ceil(max(0, J - F) / page) of the region's pages; the least
displaced is the sum of the m smallest kept bytes per page; the host part is max(0, displaced
- the other pages' holes). All measured in the same run; the ratio figure / limit. Targets,
PASS/MISS beside each sublet case: later cycles within 1.25 x the limit, the first within
1.5 x the later ones. The kept bytes are digested on the GPU (every bit, position-weighted)
after every cycle; a changing live set is written with contents computed from each word's
place and the cycle before its loan and compared with them bit for bit after it. A change
fails the case, and the run exits 1.

With the default --daemon shared, the sublet processes use one subletd started for the run
(as a system service would be); by default it pins nothing ahead (--daemon-pin 0), as the
daemon a user gets on demand: host memory is pinned at a loan's first save.
--daemon-pin ahead pins the kept fraction of S ahead, as earlier runs did; --daemon-pin owner
starts the daemon so too, but each owner calls sublet.pin_ahead(its kept bytes) once its
tensor is made (an engine that knows its keep), waited for and timed apart. The client
processes are fresh for every first cycle all the same. --daemon private lets each process
start its own daemon (the package's default with no service set up).

    python3 bench/benchmark.py            # the full run
    python3 bench/benchmark.py --quick    # the whole table at S = 64 GiB, fewer cycles
    python3 bench/benchmark.py --size max --methods sublet --append  # ... and at the most
    python3 bench/benchmark.py --quick --phases   # ... with where each case's time goes
    python3 bench/benchmark.py --report   # the table and targets again, from the JSON
    python3 bench/plot.py                 # the chart, from the JSON

Nothing touches the GPU at import time, and the parent process never creates a CUDA context:
every GPU measurement runs in a child, so that the children see the GPU's memory as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
if (REPO / "sublet" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark this checkout's package

GiB = 1 << 30
MiB = 1 << 20
BLOCK = 64 << 10               # a KV-cache block
ROW = GiB                      # a row of the "rows" pattern
PATTERNS = ("rows", "blocks", "slice", "runs", "blocks-new", "runs-new")
CHANGING = {"blocks-new": "blocks", "runs-new": "runs"}  # a new live set every cycle
RUN_BLOCKS = 48                # the runs patterns' mean live run: 3 MiB of 64 KiB blocks
METHODS = ("copy-all", "tms", "sublet")
JOBS = ("fill", "train")       # fill a tensor of the job's size; one transformer training step
ANY_PATTERN = "any"            # copy-all's pattern: it copies everything whatever is kept
HOST_SHARE = 0.9               # copy-all's pinned buffer may take 90% of MemAvailable
CONTEXT_HEADROOM = GiB         # GPU memory left for the CUDA contexts of a child and subletd
RESULT_MARK = "BENCH-RESULT "  # a child's last stdout line: this mark, then its JSON
NO_GPU = "benchmark.py needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
SCHEMA = "sublet-benchmark/1"

TARGET_LIMIT_RATIO = 1.25      # later cycles: sublet within 1.25 x the physical limit
TARGET_TMS_SPEEDUP = {0.25: 10.0, 0.75: 10.0, 1.0: 1.8}  # later cycles: x faster than tms
TARGET_FIRST_RATIO = 1.5       # first cycle within 1.5 x sublet's own later cycles
DIGEST_CHUNK = 256 * MiB       # kept bytes are digested on the GPU this much at a time

# --------------------------------------------------------------------------- progress

_T0 = time.monotonic()
_log_prefix = "bench"


def now() -> float:
    return time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr (stdout carries only results)."""
    print(f"[{_log_prefix} +{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def step(what: str, every: float = 10.0) -> Iterator[None]:
    """Logs the start and end of a long step, and a line every `every` seconds meanwhile."""
    log(f"{what} ...")
    t0, done = now(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            log(f"  ... {what}: {now() - t0:.0f} s so far")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log(f"{what}: done in {now() - t0:.2f} s")


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes % GiB else f"{nbytes // GiB:.0f} GiB"


def pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


# --------------------------------------------------------------------------- host facts

def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _command_output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cuda_driver_api_version() -> str | None:
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def machine_info() -> dict[str, Any]:
    """The GPU, its driver, torch, CUDA and the host: what a reader needs to compare runs."""
    import torch
    props = torch.cuda.get_device_properties(0)
    smi = _command_output(["nvidia-smi", "-i", "0", "--query-gpu=driver_version,pci.bus_id",
                           "--format=csv,noheader"])
    mem = meminfo()
    try:
        import sublet
        sublet_version = sublet.__version__
    except Exception:  # the package is not needed to describe the machine
        sublet_version = None
    return {
        "gpu": props.name,
        "gpu_memory_bytes": props.total_memory,
        "gpu_count": torch.cuda.device_count(),
        "driver": smi.split(",")[0].strip() if smi else None,
        "cuda_driver_api": _cuda_driver_api_version(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "host_memory_bytes": mem.get("MemTotal"),
        "host_available_bytes": mem.get("MemAvailable"),
        "sublet": sublet_version,
        "commit": _command_output(["git", "-C", str(REPO), "describe", "--always", "--dirty"]),
    }


# --------------------------------------------------------------------------- pinned memory

def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded into this process, if it is a shared library."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class HostBuffer:
    """Exactly nbytes of pinned host memory as a CPU uint8 tensor (`.tensor`).

    Allocated with cudaHostAlloc, the call behind pin_memory() and torch.empty(pin_memory=True),
    but without their power-of-two rounding (PyTorch's caching host allocator rounds 65 GiB up
    to 128 GiB, which does not fit in a 125 GiB host). The driver's cuMemHostAlloc stands in
    where the runtime is not a shared library.
    """

    def __init__(self, nbytes: int):
        import torch
        self.nbytes = nbytes
        lib = _loaded_cudart()
        alloc, self._free = (("cudaHostAlloc", "cudaFreeHost") if lib is not None else
                             ("cuMemHostAlloc", "cuMemFreeHost"))
        self._lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        ptr = ctypes.c_void_p()
        rc = getattr(self._lib, alloc)(ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                                       ctypes.c_uint(0))
        if rc != 0 or not ptr.value:
            raise MemoryError(f"{alloc} of {gib(nbytes)} of pinned host memory failed "
                              f"(error {rc}): not enough host memory?")
        self.ptr = ptr.value
        buffer = (ctypes.c_uint8 * nbytes).from_address(self.ptr)
        self.tensor = torch.frombuffer(buffer, dtype=torch.uint8)

    def free(self) -> None:
        if self.ptr:
            del self.tensor
            getattr(self._lib, self._free)(ctypes.c_void_p(self.ptr))
            self.ptr = 0


# --------------------------------------------------------------------------- GPU helpers

def init_cuda() -> "torch.device":
    """CUDA device 0 with its context made; exits with NO_GPU where there is no GPU."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda:0")
    return torch.device("cuda", 0)


def sync() -> None:
    import torch
    torch.cuda.synchronize()


def free_gpu_bytes() -> int:
    import torch
    sync()
    return torch.cuda.mem_get_info()[0]


def job_bytes(size: int, fraction: float) -> int:
    """The job's tensor: fraction x S, whole 2 MiB (PyTorch's segment granularity)."""
    return max(2 * MiB, int(size * fraction) // (2 * MiB) * (2 * MiB))


def run_job(nbytes: int, release: bool) -> None:
    """The borrower's work: one tensor of nbytes filled with random numbers, then dropped.
    release: also hand PyTorch's cached memory back to the device (copy-all needs the room)."""
    import torch
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    x.view(torch.float32).uniform_()
    sync()
    del x
    if release:
        torch.cuda.empty_cache()


def train_batch(nbytes: int) -> int:
    """The training step's batch, so that its memory is about nbytes (0.6 GiB per sample is
    this model's activations at fp32 with PyTorch's efficient attention; the peak is
    measured and reported)."""
    return max(1, round(nbytes / (0.6 * GiB)))


def run_train_step(nbytes: int, release: bool) -> None:
    """The borrower's work as a training job: a small transformer (8 layers, d 1024, 64M
    weights) made, one forward, backward and Adam step on random tokens, then dropped."""
    import torch
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True,
                                             norm_first=True, device="cuda")
    model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(train_batch(nbytes), 1024, 1024, device="cuda")
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    sync()
    del model, optimizer, layer, x
    if release:
        torch.cuda.empty_cache()


def run_any_job(kind: str, nbytes: int, release: bool) -> None:
    if kind == "train":
        run_train_step(nbytes, release)
    else:
        run_job(nbytes, release)


def fill_random(tensor: "torch.Tensor") -> None:
    import torch
    tensor.view(-1).view(torch.float32).uniform_()
    sync()


def wrapping_sum(t: "torch.Tensor") -> int:
    """A checksum of a view whose last dimension is contiguous whole 8-byte words."""
    import torch
    return int(t.view(torch.int64).sum().item())


def digest(pieces: "Iterator[torch.Tensor]") -> int:
    """A digest of every bit of the kept bytes, on the GPU: the sum of each 8-byte word times
    an odd weight that depends on its position (mod 2**64), so that any changed bit changes
    it, and so do swapped words. pieces: contiguous uint8 tensors, in a fixed order."""
    import torch
    total, index = 0, 0
    for piece in pieces:
        words = piece.view(torch.int64)
        for part in words.split(DIGEST_CHUNK // 8):
            weights = torch.arange(index, index + part.numel(), device=part.device,
                                   dtype=torch.int64).mul_(2).add_(1).mul_(0x7E3779B97F4A7C15)
            total = (total + int(weights.mul_(part).sum().item())) % (1 << 64)
            index += part.numel()
            del weights
    return total


def make_ballast(free_bytes: int) -> tuple["torch.Tensor | None", int]:
    """Allocates (outside sublet) all free GPU memory but free_bytes; returns the ballast and
    the free memory measured after it."""
    import torch
    torch.cuda.empty_cache()
    size = (free_gpu_bytes() - free_bytes) // (2 * MiB) * (2 * MiB)
    if size <= 0:
        log(f"warning: only {gib(free_gpu_bytes())} is free, less than F = {gib(free_bytes)}: "
            f"no ballast")
        return None, free_gpu_bytes()
    ballast = torch.empty(size, dtype=torch.uint8, device="cuda")
    return ballast, free_gpu_bytes()


# --------------------------------------------------------------------------- keep patterns

def page_kept_hist(offsets: Any, lengths: Any, size: int, page: int) -> list[list[int]]:
    """Kept bytes per page of a tensor of `size` bytes, as [[kept bytes, pages], ...] by kept
    bytes (at most a few dozen rows: what the limit needs, small enough for the JSON).
    offsets, lengths: the kept ranges (numpy-like), disjoint; a range may span pages."""
    import numpy as np
    off = np.asarray(offsets, dtype=np.int64)
    end = off + np.asarray(lengths, dtype=np.int64)
    npages = -(-size // page)
    kept = np.zeros(npages + 1, dtype=np.int64)
    first, last = off // page, (end - 1) // page
    one = first == last
    np.add.at(kept, first[one], (end - off)[one])
    many = ~one  # a range over pages: its two ends in part, the pages between whole
    np.add.at(kept, first[many], (first[many] + 1) * page - off[many])
    np.add.at(kept, last[many], end[many] - last[many] * page)
    between = np.zeros(npages + 1, dtype=np.int64)
    np.add.at(between, first[many] + 1, 1)
    np.add.at(between, last[many], -1)
    kept += np.cumsum(between) * page
    values, counts = np.unique(kept[:npages], return_counts=True)
    return [[int(v), int(c)] for v, c in zip(values, counts)]


def uniform_ids(nblocks: int, fraction: float, rng: Any) -> Any:
    """round(nblocks x fraction) block ids chosen at random, sorted."""
    import numpy as np
    return np.sort(rng.choice(nblocks, size=round(nblocks * fraction), replace=False))


def run_ids(nblocks: int, fraction: float, rng: Any) -> Any:
    """Block ids that come in runs, as an engine's free list and eviction leave them: live
    runs of RUN_BLOCKS blocks on average between free gaps of RUN_BLOCKS x (1 - f) / f, both
    geometric, so that about f of the blocks are live and, at 30%, about half the 2 MiB pages
    hold none (a gap mostly spans several pages)."""
    import numpy as np
    gap = RUN_BLOCKS * (1 - fraction) / fraction
    n = int(nblocks / (RUN_BLOCKS + gap) * 1.5) + 16
    lengths = np.empty(2 * n, dtype=np.int64)
    lengths[0::2] = rng.geometric(1 / gap, n)          # free, then live, alternately
    lengths[1::2] = rng.geometric(1 / RUN_BLOCKS, n)
    live = np.repeat(np.tile([False, True], n), lengths)[:nblocks]
    return np.flatnonzero(live)


CHOOSERS = {"blocks": uniform_ids, "runs": run_ids}


@dataclass
class KeepPattern:
    """What one case keeps: a fixed set, checked by its digest after every loan."""
    lent: Any                      # what is lent: the tensor, or a view of it by blocks
    keep: Any                      # what sublet.lend(keep=...) gets: a view, or row indices
    kept_bytes: int
    views: int
    pieces: Callable[[], Iterator["torch.Tensor"]]  # the kept bytes, contiguous, in order
    page_kept: Callable[[int], list[list[int]]]     # page size -> page_kept_hist
    before: int | None = None      # the digest taken at the first begin()

    def digest(self) -> int:
        return digest(self.pieces())

    def begin(self, i: int) -> None:
        """Before cycle i's loan (untimed): the kept bytes' digest, once."""
        if self.before is None:
            self.before = self.digest()

    def check(self, i: int) -> None:
        """After cycle i's loan: the kept bytes are what they were, every bit."""
        check_kept(self.digest(), self.before or 0, i)


@dataclass
class ChangingBlocks(KeepPattern):
    """Blocks whose live set is new every cycle (seeded by (seed, cycle): reproducible). Before
    each loan the cycle's live blocks are written with contents that depend on the block, the
    word and the cycle (an engine writes its new blocks); after it, every kept byte is
    compared with them, bit for bit. No copy is kept: the contents are computed again."""
    blocks: Any = None             # the tensor viewed as [blocks, BLOCK]
    choose: Callable[[int], Any] | None = None      # cycle -> sorted block ids
    on_gpu: Any = None             # this cycle's ids on the device
    seed: int = 0
    begun: int = -1                # the cycle whose live set is written

    def begin(self, i: int) -> None:
        import torch
        if i == self.begun:
            return
        self.begun = i
        ids = self.choose(i)
        self.keep = torch.from_numpy(ids)
        self.on_gpu = self.keep.to(self.blocks.device)
        self.kept_bytes, self.views = len(ids) * BLOCK, len(ids)
        self.page_kept = lambda page, ids=ids: page_kept_hist(ids * BLOCK, BLOCK, self.lent
                                                              .numel(), page)
        words = self.blocks.view(torch.int64)
        for part in self.on_gpu.split(DIGEST_CHUNK // BLOCK):
            words[part] = block_contents(part, i, self.seed)
        if self.blocks.is_cuda:  # written before the timed loan starts
            sync()

    def check(self, i: int) -> None:
        import torch
        words = self.blocks.view(torch.int64)
        for part in self.on_gpu.split(DIGEST_CHUNK // BLOCK):
            wrong = int((words[part] != block_contents(part, i, self.seed)).sum().item())
            if wrong:
                raise KeptDataChanged(f"KEPT DATA CHANGED after cycle {i}: {wrong} words of "
                                      f"its live blocks differ from what was written")


def block_contents(ids: "torch.Tensor", cycle: int, seed: int) -> "torch.Tensor":
    """The 8-byte words of blocks `ids` in `cycle`: [len(ids), BLOCK / 8] int64, a mix of each
    word's position, the cycle and the seed (integer ops on the device, wrapping)."""
    import torch
    per = BLOCK // 8
    x = (ids.to(torch.int64).unsqueeze(1) * per
         + torch.arange(per, device=ids.device, dtype=torch.int64))
    salt = ((cycle + 1) * 0x3C6EF372FE94F82B + seed * 0x1B873593A5C2E4F1) % (1 << 64)
    x = x * 0x7E3779B97F4A7C15 + (salt - (1 << 64) if salt >> 63 else salt)  # as an int64
    x ^= x >> 31
    x *= 0x2545F4914F6CDD1D
    return x ^ (x >> 29)


def keep_pattern(tensor: "torch.Tensor", pattern: str, kept_fraction: float,
                 seed: int) -> KeepPattern:
    """The kept part of a flat uint8 tensor for one of PATTERNS."""
    size = tensor.numel()
    if pattern == "rows":
        nrows = size // ROW
        if nrows == 0:
            raise ValueError("the rows pattern needs a tensor of at least 1 GiB")
        stride = max(1, round(1 / kept_fraction))  # 30% -> every third row
        kept = tensor[: nrows * ROW].view(nrows, ROW)[0::stride]
        starts = [r * ROW for r in range(0, nrows, stride)]
        return KeepPattern(tensor, kept, kept.numel(), 1, lambda: iter(kept.unbind(0)),
                           lambda page: page_kept_hist(starts, ROW, size, page))
    if pattern == "slice":
        n = int(size * kept_fraction) // BLOCK * BLOCK
        kept = tensor[:n]
        return KeepPattern(tensor, kept, n, 1, lambda: iter([kept]),
                           lambda page: page_kept_hist([0], [n], size, page))
    if pattern in CHOOSERS:
        return _blocks_pattern(tensor, CHOOSERS[pattern], kept_fraction, seed)
    if pattern in CHANGING:
        return _changing_pattern(tensor, CHOOSERS[CHANGING[pattern]], kept_fraction, seed)
    raise ValueError(f"unknown pattern {pattern!r}: use one of {', '.join(PATTERNS)}")


def _blocks_pattern(tensor: "torch.Tensor", choose: Callable[..., Any], kept_fraction: float,
                    seed: int) -> KeepPattern:
    """64 KiB blocks chosen once, kept as row indices of the tensor viewed by blocks
    (sublet's fast form: no Python object per block)."""
    import numpy as np
    import torch
    nblocks = tensor.numel() // BLOCK
    blocks = tensor[: nblocks * BLOCK].view(nblocks, BLOCK)
    chosen = choose(nblocks, kept_fraction, np.random.default_rng(seed))
    index = torch.from_numpy(chosen)
    on_gpu = index.to(tensor.device)

    def pieces() -> Iterator["torch.Tensor"]:  # gathered 256 MiB at a time
        for part in on_gpu.split(DIGEST_CHUNK // BLOCK):
            yield blocks[part].view(-1)

    return KeepPattern(blocks, index, len(chosen) * BLOCK, len(chosen), pieces,
                       lambda page: page_kept_hist(chosen * BLOCK, BLOCK, tensor.numel(),
                                                   page))


def _changing_pattern(tensor: "torch.Tensor", choose: Callable[..., Any],
                      kept_fraction: float, seed: int) -> ChangingBlocks:
    """Blocks chosen anew each cycle by `choose`, from the generator of (seed, cycle)."""
    import numpy as np
    nblocks = tensor.numel() // BLOCK
    blocks = tensor[: nblocks * BLOCK].view(nblocks, BLOCK)
    pattern = ChangingBlocks(blocks, None, 0, 0, lambda: iter(()), lambda page: [],
                             blocks=blocks, seed=seed, choose=lambda i: choose(
                                 nblocks, kept_fraction, np.random.default_rng([seed, i])))
    pattern.begin(0)  # the first cycle's live set: its size for the log
    return pattern


# --------------------------------------------------------------------------- child: probe

def plan_sizes(free_bytes: int, mem_available: int, size_gib: float | str | None,
               free_gib: float, uncapped_sublet: bool) -> dict[str, Any]:
    """S for copy-all and sublet from the GPU's free memory and the host's available memory.

    Default S: all free GPU memory but F (less headroom for CUDA contexts), capped so that
    copy-all's pinned buffer fits in HOST_SHARE of MemAvailable. size_gib 'max' takes the
    uncapped size (copy-all is then skipped if it does not fit)."""
    free_target = int(free_gib * GiB)
    uncapped = (free_bytes - free_target - CONTEXT_HEADROOM) // GiB * GiB
    host_cap = int(HOST_SHARE * mem_available) // GiB * GiB
    if uncapped < GiB:
        raise SystemExit(f"only {gib(free_bytes)} of GPU memory is free: no room for a tensor "
                         f"beside F = {gib(free_target)}; lower --free")
    if size_gib is None:
        size = min(uncapped, host_cap)
    elif size_gib == "max":
        size = uncapped
    else:
        size = int(float(size_gib) * GiB) // (2 * MiB) * (2 * MiB)
        if size > uncapped:
            raise SystemExit(f"--size {gib(size)} does not fit: {gib(free_bytes)} of GPU "
                             f"memory is free, so at most {gib(uncapped)} beside F = "
                             f"{gib(free_target)}")
    sublet_sizes = [size] + ([uncapped] if uncapped_sublet and uncapped > size else [])
    return {
        "gpu_free_bytes": free_bytes,
        "host_available_bytes": mem_available,
        "uncapped_bytes": uncapped,
        "host_cap_bytes": host_cap,
        "size_bytes": size,
        "capped": size_gib is None and uncapped > host_cap,
        "free_bytes": free_target,
        "copy_all_sizes": [size] if size <= host_cap else [],
        "sublet_sizes": sublet_sizes,
    }


def measure_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Pinned host link bandwidth each way: best of reps copies of nbytes."""
    import torch
    host = HostBuffer(nbytes)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.fill_(1)
    times: dict[str, list[float]] = {"d2h": [], "h2d": []}
    pinned = bool(host.tensor.is_pinned())
    for _ in range(reps):
        times["d2h"].append(_timed_copy(host.tensor, device))
        times["h2d"].append(_timed_copy(device, host.tensor))
    del device
    torch.cuda.empty_cache()
    host.free()
    return {"bytes": nbytes, "reps": reps, "pinned": pinned, "d2h_seconds": times["d2h"],
            "h2d_seconds": times["h2d"], "d2h_bytes_per_s": nbytes / min(times["d2h"]),
            "h2d_bytes_per_s": nbytes / min(times["h2d"])}


def _timed_copy(dst: "torch.Tensor", src: "torch.Tensor") -> float:
    sync()
    t0 = now()
    dst.copy_(src)
    sync()
    return now() - t0


def job_key(kind: str, nbytes: int) -> str:
    return str(nbytes) if kind == "fill" else f"{kind}:{nbytes}"


def measure_job_alone(nbytes: int, reps: int, kind: str = "fill") -> dict[str, Any]:
    """The job on plain torch memory: one warm-up, then the median of reps (the allocator's
    cache is warm, so this is the job's own work); with the peak it reserved."""
    import torch
    run_any_job(kind, nbytes, release=False)
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(reps):
        t0 = now()
        run_any_job(kind, nbytes, release=False)
        seconds.append(now() - t0)
    peak = torch.cuda.max_memory_reserved()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "kind": kind, "seconds": seconds, "peak_bytes": peak,
            "median_s": statistics.median(seconds)}


def measure_d2d(nbytes: int, reps: int) -> dict[str, Any]:
    """Device-to-device copy speed (an SM kernel, as sublet's moves): best of reps copies of
    nbytes; bytes copied per second."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    best = min(_timed_copy(dst, src) for _ in range(reps))
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "reps": reps, "bytes_per_s": nbytes / best}


def child_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Machine, sizes, link bandwidth and the job alone, for the parent's plan."""
    init_cuda()
    import torch
    free_bytes = torch.cuda.mem_get_info()[0]
    plan = plan_sizes(free_bytes, meminfo()["MemAvailable"], spec["size_gib"],
                      spec["free_gib"], spec["uncapped_sublet"])
    machine = machine_info()
    with step(f"host link bandwidth: {gib(spec['bandwidth_bytes'])} pinned, "
              f"{spec['bandwidth_reps']} copies each way"):
        bandwidth = measure_bandwidth(spec["bandwidth_bytes"], spec["bandwidth_reps"])
    log(f"pinned link: device to host {bandwidth['d2h_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"host to device {bandwidth['h2d_bytes_per_s'] / 1e9:.1f} GB/s")
    bandwidth["d2d"] = measure_d2d(spec["bandwidth_bytes"], spec["bandwidth_reps"])
    log(f"device to device: {bandwidth['d2d']['bytes_per_s'] / 1e9:.0f} GB/s copied")
    job_alone: dict[str, dict[str, Any]] = {}
    for size in sorted(set(plan["sublet_sizes"] + plan["copy_all_sizes"])):
        for kind, fraction in spec["jobs"]:
            n = job_bytes(size, fraction)
            with step(f"the {kind} job alone: {gib(n)} ({pct(fraction)} of {gib(size)}), "
                      f"{spec['job_reps']} times"):
                job_alone[job_key(kind, n)] = measure_job_alone(n, spec["job_reps"], kind)
    return {"machine": machine, "plan": plan, "bandwidth": bandwidth, "job_alone": job_alone}


# --------------------------------------------------------------------------- child: cases

def run_cycles(count: int, cycle: Callable[[int], dict[str, Any]]
               ) -> tuple[list[dict[str, Any]], str | None]:
    """Runs cycle(0..count-1); a failing cycle ends the run but keeps the cycles before it."""
    cycles = []
    for i in range(count):
        try:
            cycles.append(cycle(i))
        except Exception as e:  # reported with the result, not lost with the process
            log(f"cycle {i} failed: {traceback.format_exc()}")
            return cycles, f"cycle {i}: {type(e).__name__}: {e}"
        log(f"cycle {i} ({'first' if i == 0 else 'later'}): {cycles[-1]['seconds']:.3f} s, "
            f"copied {gib(cycles[-1]['out_bytes'])} out, {gib(cycles[-1]['in_bytes'])} in")
    return cycles, None


class KeptDataChanged(RuntimeError):
    pass


def check_kept(digest_now: int, before: int, i: int) -> None:
    """After every cycle: the kept bytes must be what they were, every bit."""
    if digest_now != before:
        raise KeptDataChanged(f"KEPT DATA CHANGED after cycle {i}: digest {digest_now:#x}, "
                              f"was {before:#x}")


def run_jobs(spec: dict[str, Any], cycle_for: Callable[[str, int], Callable[[int], dict]]
             ) -> list[dict[str, Any]]:
    """For each (job kind, fraction) of the spec, 1 + cycles cycles in this process."""
    parts = []
    for kind, fraction in spec["jobs"]:
        n_job = job_bytes(spec["size_bytes"], fraction)
        if kind == "train":  # a trainer is warm: kernels loaded, autograd and Adam set up
            with step("warming the training step up (batch 1, outside any loan)"):
                run_train_step(0, release=True)
        log(f"{kind} job of {gib(n_job)} ({pct(fraction)} of S)")
        cycles, error = run_cycles(1 + spec["cycles"], cycle_for(kind, n_job))
        parts.append({"job": kind, "fraction": fraction, "job_bytes": n_job,
                      "cycles": cycles, "error": error,
                      "kept_intact": error is None or "KEPT DATA" not in error})
    return parts


def child_copy_all(spec: dict[str, Any]) -> dict[str, Any]:
    """copy-all: out to pinned host memory, free, job, allocate again, back in. One process
    runs every job of the spec: the host buffer is pinned once, in the first cycle."""
    init_cuda()
    import torch
    size = spec["size_bytes"]
    with step(f"allocating and filling the {gib(size)} tensor (torch.empty)"):
        state: dict[str, Any] = {"tensor": torch.empty(size, dtype=torch.uint8, device="cuda"),
                                 "host": None}
        fill_random(state["tensor"])
        before = digest([state["tensor"]])
    ballast, free_measured = make_ballast(spec["free_bytes"])  # held until the end
    log(f"{gib(free_measured)} of GPU memory free beside the tensor")

    def cycle_for(kind: str, n_job: int) -> Callable[[int], dict[str, Any]]:
        def cycle(i: int) -> dict[str, Any]:
            t0 = now()
            if state["host"] is None:
                with step(f"pinning {gib(size)} of host memory (the first cycle's cost)"):
                    state["host"] = HostBuffer(size)
            host = state["host"].tensor
            t_pin = now()
            host.copy_(state["tensor"])
            sync()
            t_out = now()
            state["tensor"] = None
            torch.cuda.empty_cache()
            t_free = now()
            run_any_job(kind, n_job, release=True)
            t_job = now()
            state["tensor"] = torch.empty(size, dtype=torch.uint8, device="cuda")
            t_alloc = now()
            state["tensor"].copy_(host)
            sync()
            t_in = now()
            check_kept(digest([state["tensor"]]), before, i)
            return {"seconds": t_in - t0, "out_bytes": size, "in_bytes": size, "phases": {
                "pin": t_pin - t0, "copy_out": t_out - t_pin, "free": t_free - t_out,
                "job": t_job - t_free, "alloc": t_alloc - t_job, "copy_in": t_in - t_alloc}}
        return cycle

    parts = run_jobs(spec, cycle_for)
    return {"free_bytes_measured": free_measured, "kept_bytes": size, "keep_views": 0,
            "parts": parts}


_NEVER_FREED: list[Any] = []


def child_tms(spec: dict[str, Any]) -> dict[str, Any]:
    """torch_memory_saver at its best: the kept bytes in a tensor of their own, paused with a
    CPU backup that is kept between cycles (pinned once), the rest paused without one; the job
    runs while both are paused. Scattered kept blocks cannot be split off like this: this is
    the best case for it."""
    init_cuda()
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    size = spec["size_bytes"]
    kept = int(size * spec["kept_fraction"]) // BLOCK * BLOCK
    tms.hook_mode = "torch"
    with step(f"allocating {gib(kept)} kept + {gib(size - kept)} discarded with "
              f"torch_memory_saver"):
        with tms.region(tag="kept", enable_cpu_backup=True):
            kept_t = torch.empty(kept, dtype=torch.uint8, device="cuda")
        with tms.region(tag="rest"):
            rest_t = torch.empty(size - kept, dtype=torch.uint8, device="cuda")
        fill_random(kept_t)
        fill_random(rest_t)
        tms.retain_cpu_backup = True
        before = digest([kept_t])
    ballast, free_measured = make_ballast(spec["free_bytes"])
    log(f"{gib(free_measured)} of GPU memory free beside the tensors")

    def cycle_for(kind: str, n_job: int) -> Callable[[int], dict[str, Any]]:
        def cycle(i: int) -> dict[str, Any]:
            t0 = now()
            tms.pause()
            sync()
            t_pause = now()
            run_any_job(kind, n_job, release=True)
            t_job = now()
            tms.resume()
            sync()
            t_resume = now()
            check_kept(digest([kept_t]), before, i)
            return {"seconds": t_resume - t0, "out_bytes": kept, "in_bytes": kept, "phases": {
                "pause": t_pause - t0, "job": t_job - t_pause, "resume": t_resume - t_job}}
        return cycle

    parts = run_jobs(spec, cycle_for)
    # Never freed: torch_memory_saver's torch hook aborts on a free outside a region ("only
    # support interesting region"), so they live until child_main leaves with os._exit.
    _NEVER_FREED.extend([kept_t, rest_t, ballast])
    return {"free_bytes_measured": free_measured, "kept_bytes": kept, "keep_views": 1,
            "parts": parts}


def child_sublet(spec: dict[str, Any]) -> dict[str, Any]:
    """sublet: `with sublet.lend(tensor, keep=...): job()`, timed whole and in phases."""
    t_start = now()
    init_cuda()
    import torch
    import sublet
    size = spec["size_bytes"]
    with step(f"creating and filling the {gib(size)} tensor (sublet.empty)"):
        t0 = now()
        tensor = sublet.empty(size, dtype=torch.uint8)
        empty_s = now() - t0
        fill_random(tensor)
    log(f"sublet.empty: {empty_s:.3f} s ({empty_s / (size / GiB):.4f} s per GiB)")
    with step(f"building the {spec['pattern']} keep pattern"):
        pattern = keep_pattern(tensor, spec["pattern"], spec["kept_fraction"], spec["seed"])
        pattern.begin(0)
    page = sublet.info().page_size
    log(f"keeping {gib(pattern.kept_bytes)} in {pattern.views} block(s) or view(s)")
    # What a serving process has done long before it lends (cuBLAS's workspace made): done
    # here before the ballast, or free memory shrinks after the first loan and the next loan's
    # window is laid out anew.
    from sublet import _torch
    _torch.warm_up_cublas(torch.cuda.current_device())
    ballast, free_measured = make_ballast(spec["free_bytes"])
    log(f"{gib(free_measured)} of GPU memory free beside the tensor")
    pin_ahead_s = owner_pins_ahead(pattern.kept_bytes) if spec.get("pin_ahead") else None

    def cycle_for(kind: str, n_job: int) -> Callable[[int], dict[str, Any]]:
        def cycle(i: int) -> dict[str, Any]:
            pattern.begin(i)  # untimed: a changing live set is chosen and written
            t0 = now()
            loan = sublet.lend(pattern.lent, keep=pattern.keep)  # keep -> kept ranges
            t_lend = now()
            with loan:
                t_enter = now()
                run_any_job(kind, n_job, release=False)
                t_job = now()
            t_exit = now()
            pattern.check(i)
            stats = asdict(loan.stats)
            return {"seconds": t_exit - t0, "out_bytes": stats["copied_out_bytes"],
                    "in_bytes": stats["copied_in_bytes"], "moved_bytes": stats["moved_bytes"],
                    "kept_bytes": pattern.kept_bytes, "page_bytes": page,
                    "page_kept": pattern.page_kept(page), "stats": stats, "phases": {
                        "lend_call": t_lend - t0, "enter": t_enter - t_lend,
                        "job": t_job - t_enter, "exit": t_exit - t_job,
                        "daemon_move": stats["move_seconds"],
                        "daemon_copy_out": stats["copy_out_seconds"],
                        "daemon_copy_in": stats["copy_in_seconds"],
                        "map": stats["map_seconds"]}}
        return cycle

    parts = run_jobs(spec, cycle_for)
    kept_bytes, views = pattern.kept_bytes, pattern.views
    del ballast
    torch.cuda.empty_cache()
    release_t0 = now()
    del tensor, pattern
    gc_collect()
    release_s = now() - release_t0
    log(f"release of the {gib(size)} tensor: {release_s:.3f} s")
    return {"free_bytes_measured": free_measured, "kept_bytes": kept_bytes,
            "keep_views": views, "parts": parts, "empty_s": empty_s,
            "release_s": release_s, "process_s": now() - t_start, "pin_ahead_s": pin_ahead_s}


def owner_pins_ahead(kept: int, release: bool = False) -> float:
    """--daemon-pin owner (and bench_release.py --pin-ahead, release=True): sublet.pin_ahead
    of the kept bytes, waited for (an engine serving meanwhile would not notice); its seconds,
    off the cycles."""
    import sublet
    from sublet import _memory
    t0 = now()
    sublet.pin_ahead(kept, release=release)
    client = _memory.resolve_device(None)[1]
    while client.status().get("pin") is not None:
        time.sleep(0.05)
    seconds = now() - t0
    log(f"pinned ahead for {gib(kept)} kept in {seconds:.3f} s (sublet.pin_ahead)")
    return seconds


def gc_collect() -> None:
    import gc
    gc.collect()


def child_main(mode: str, spec: dict[str, Any]) -> int:
    global _log_prefix
    _log_prefix = spec.get("label", mode)
    if mode == "probe":
        result = child_probe(spec)
    elif spec["method"] == "copy-all":
        result = child_copy_all(spec)
    elif spec["method"] == "tms":
        result = child_tms(spec)
        emit_result(result)
        os._exit(0)  # no teardown: torch_memory_saver's hook aborts on frees outside regions
    else:
        result = child_sublet(spec)
    emit_result(result)
    return 0


def emit_result(result: dict[str, Any]) -> None:
    """A child's result: the last line of its stdout."""
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- parent: children

class ChildFailed(RuntimeError):
    pass


def _pump(stream: IO[str], sink: Callable[[str], None]) -> None:
    for line in stream:
        sink(line)


def run_child(mode: str, spec: dict[str, Any], env: dict[str, str],
              timeout: float) -> dict[str, Any]:
    """Runs this script with --child in a fresh process and returns its result."""
    return run_script([str(SCRIPT), "--child", mode, "--spec", json.dumps(spec)], env, timeout)


def run_script(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Runs `python3 args...` in a fresh process: its stderr streams through, its result is the
    JSON after RESULT_MARK on stdout. Raises ChildFailed."""
    argv = [sys.executable, *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    out: list[str] = []
    tail: deque[str] = deque(maxlen=30)

    def err_line(line: str) -> None:
        tail.append(line)
        sys.stderr.write(line)

    def out_line(line: str) -> None:
        out.append(line) if line.startswith(RESULT_MARK) else err_line(line)

    pumps = [threading.Thread(target=_pump, args=(proc.stdout, out_line), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, err_line), daemon=True)]
    for pump in pumps:
        pump.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise ChildFailed(f"timed out after {timeout:.0f} s") from None
    finally:
        for pump in pumps:
            pump.join(timeout=10)
    if proc.returncode != 0 or not out:
        last = "".join(tail).strip().splitlines()[-1:] or ["(no output)"]
        raise ChildFailed(f"exit status {proc.returncode}: {last[0]}")
    return json.loads(out[-1][len(RESULT_MARK):])


# --------------------------------------------------------------------------- parent: subletd

@dataclass
class Daemon:
    """A subletd this script started for the run (or None fields where it uses another)."""
    mode: str                      # shared | private | external
    env: dict[str, str] = field(default_factory=dict)
    pin_bytes: int = 0
    process: subprocess.Popen | None = None
    workdir: str | None = None
    log_text: str = ""             # its log, kept when it stops

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "pin_bytes": self.pin_bytes,
                "socket": self.env.get("SUBLET_SOCKET"), "log": self.log_text[-20000:]}


def _daemon_answers(socket: str) -> bool:
    from sublet import _lib
    client = ctypes.c_void_p()
    if _lib.lib().sublet_connect(socket.encode(), ctypes.byref(client)) != 0:
        return False
    _lib.lib().sublet_disconnect(client)
    return True


DAEMON_LOG: Path | None = None  # --daemon-log


def start_daemon(pin_bytes: int, timeout: float = 300.0) -> Daemon:
    """Starts subletd for device 0 (the backend sublet would use: cuda, or memfd where
    $SUBLET_BACKEND says so), pinning pin_bytes of host memory ahead; waits until it answers."""
    from sublet import _daemon, _lib
    binary = _lib.find_native("subletd", "SUBLETD")
    workdir = tempfile.mkdtemp(prefix="sublet-bench-")
    socket = os.path.join(workdir, "gpu0.sock")
    # F is the benchmark's own: the daemon holds back only a little headroom beside it.
    argv = [str(binary), "--device", "0", "--socket", socket, "--backend",
            _daemon.requested_backend(), "--parent-pid", str(os.getpid()), "--reserve", "256M"]
    if pin_bytes > 0:
        argv += ["--pin", f"{math.ceil(pin_bytes / GiB)}G"]
    if DAEMON_LOG is not None:
        argv += ["--log-level", "debug"]
    log_path = os.path.join(workdir, "subletd.log")
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=log_file, start_new_session=True)
    daemon = Daemon("shared", {"SUBLET_SOCKET": socket}, pin_bytes, process, workdir)
    try:
        with step(f"starting subletd ({' '.join(argv[1:])})"):
            deadline = time.monotonic() + timeout
            while not (os.path.exists(socket) and _daemon_answers(socket)):
                if process.poll() is not None or time.monotonic() > deadline:
                    text = Path(log_path).read_text(errors="replace")[-3000:]
                    raise SystemExit(f"subletd did not come up ({' '.join(argv)}):\n{text}")
                time.sleep(0.05)
    except BaseException:
        stop_daemon(daemon)
        raise
    return daemon


def stop_daemon(daemon: Daemon) -> None:
    if daemon.process is not None and daemon.process.poll() is None:
        daemon.process.send_signal(signal.SIGTERM)
        try:
            daemon.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait()
    if daemon.workdir:
        with contextlib.suppress(OSError):
            daemon.log_text = Path(daemon.workdir, "subletd.log").read_text(errors="replace")
            if DAEMON_LOG is not None:
                DAEMON_LOG.write_text(daemon.log_text)
        shutil.rmtree(daemon.workdir, ignore_errors=True)


@contextlib.contextmanager
def daemon_for_run(mode: str, pin_bytes: int) -> Iterator[Daemon]:
    """The subletd the sublet processes use: one started here (shared), theirs (private), or
    the one $SUBLET_SOCKET names (external)."""
    if os.environ.get("SUBLET_SOCKET"):
        yield Daemon("external", {"SUBLET_SOCKET": os.environ["SUBLET_SOCKET"]})
        return
    if mode == "private":
        yield Daemon("private")
        return
    daemon = start_daemon(pin_bytes)
    try:
        yield daemon
    finally:
        stop_daemon(daemon)


# --------------------------------------------------------------------------- parent: results

def summarize(cycles: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not cycles:
        return None
    seconds = [c["seconds"] for c in cycles]
    limit = statistics.fmean(c["limit_s"] for c in cycles)
    phases = {k: statistics.fmean(c["phases"].get(k, 0.0) for c in cycles)
              for k in cycles[0].get("phases", {})}
    return {"n": len(cycles), "seconds": statistics.fmean(seconds), "seconds_min": min(seconds),
            "seconds_max": max(seconds),
            "out_bytes": statistics.fmean(c["out_bytes"] for c in cycles),
            "in_bytes": statistics.fmean(c["in_bytes"] for c in cycles),
            "moved_bytes": statistics.fmean(c.get("moved_bytes", 0) for c in cycles),
            "limit_moved_bytes": statistics.fmean(c.get("limit_moved_bytes", 0)
                                                  for c in cycles),
            "limit_s": limit, "ratio": statistics.fmean(seconds) / limit, "phases": phases}


def least_displaced(page_kept: list[list[int]], page: int, job: int, free: int
                    ) -> tuple[int, int]:
    """The least a job of `job` bytes must displace from a region of pages holding
    page_kept ([[kept bytes, pages], ...]) with `free` bytes of free memory beside it:
    (bytes moved on the GPU, bytes over the host link, each way).

    The job needs m = ceil(max(0, job - free) / page) of the region's pages; whatever pages
    it takes, their kept bytes must leave them, so the least displaced is the sum of the m
    smallest kept bytes per page. What of that fits in the holes of the pages left (their
    unkept bytes) moves on the GPU; the rest, max(0, displaced - holes), crosses the host
    link (the same for any choice of pages: max(0, kept - pages left x page))."""
    pages = sum(n for _, n in page_kept)
    m = min(pages, -(-max(0, job - free) // page))
    displaced, left = 0, m
    for kept, n in sorted(page_kept):
        take = min(n, left)
        displaced += take * kept
        left -= take
    total = sum(kept * n for kept, n in page_kept)
    holes = (pages - m) * page - (total - displaced)
    host = max(0, displaced - holes)
    return displaced - host, host


def physical_limit(job_s: float, host: float, moved: float, bandwidth: dict[str, Any]) -> float:
    """The job alone, plus `host` bytes over the measured pinned link each way, plus `moved`
    bytes moved on the GPU (there and back) at the measured device-to-device speed."""
    d2d = bandwidth.get("d2d", {}).get("bytes_per_s")
    return (job_s + host / bandwidth["d2h_bytes_per_s"] + host / bandwidth["h2d_bytes_per_s"]
            + (2 * moved / d2d if d2d else 0.0))


def cycle_least(result: dict[str, Any], cycle: dict[str, Any], job: int) -> tuple[int, int]:
    """(moved on the GPU, over the host link) at the least for one cycle: from the pages'
    kept bytes where the cycle has them (sublet), else (copy-all, tms, results of older
    runs) only the kept bytes that cannot stay on the GPU, max(0, kept + job - (S + F))."""
    if cycle.get("page_kept"):
        return least_displaced(cycle["page_kept"], cycle["page_bytes"], job,
                               result["free_bytes"])
    return 0, max(0, result["kept_bytes_limit"] + job - (result["size_bytes"] +
                                                         result["free_bytes"]))


def add_limits(result: dict[str, Any], bandwidth: dict[str, Any], job_alone: dict[str, Any]
               ) -> None:
    """The physical limit of each cycle (cycle_least, physical_limit; the job's size is its
    measured peak for the training step); then the first and later summaries."""
    job_s = job_alone["median_s"]
    job = job_alone.get("peak_bytes", result["job_bytes"]) if result.get("job") == "train" \
        else result["job_bytes"]
    for cycle in result["cycles"]:
        moved, host = cycle_least(result, cycle, job)
        cycle["limit_moved_bytes"], cycle["limit_host_bytes"] = moved, host
        cycle["limit_s"] = physical_limit(job_s, host, moved, bandwidth)
        cycle["ratio"] = cycle["seconds"] / cycle["limit_s"]
    result["job_alone_s"] = job_s
    result["first"] = summarize(result["cycles"][:1])
    result["later"] = summarize(result["cycles"][1:])


def case_key(result: dict[str, Any]) -> tuple:
    return (result["method"], result["pattern"], result.get("job", "fill"), result["fraction"],
            result["size_bytes"])


def upsert(doc: dict[str, Any], result: dict[str, Any]) -> None:
    doc["results"] = [r for r in doc["results"] if case_key(r) != case_key(result)]
    doc["results"].append(result)


def save(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise SystemExit(f"{path} is not a {SCHEMA} results file")
    return doc


# --------------------------------------------------------------------------- parent: the run

@dataclass
class Settings:
    size_gib: float | str | None
    free_gib: float
    kept_fraction: float
    fractions: list[float]
    cycles: int
    sublet_cycles: int  # sublet's later cycles take milliseconds: --quick keeps 3 of them
    patterns: list[str]
    methods: list[str]
    json_path: Path
    append: bool
    uncapped_sublet: bool
    daemon: str
    daemon_pin_gib: float | str | None
    seed: int
    bandwidth_gib: float
    job_reps: int
    child_timeout: float | None
    train_fraction: float
    phases: bool


def all_jobs(s: Settings) -> list[tuple[str, float]]:
    """(kind, fraction): the fill job at every fraction, the training step at its own."""
    return [("fill", f) for f in s.fractions] + \
        ([("train", s.train_fraction)] if s.train_fraction else [])


def plan_cases(s: Settings, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The processes to run, copy-all and tms first (before subletd pins host memory).
    copy-all and tms run all their jobs in one process each (their host buffer is pinned
    once); sublet runs every (pattern, job) in a fresh process, whose first cycle is the
    first figure. The training step runs with the blocks pattern."""
    cases = []
    common = {"free_bytes": plan["free_bytes"], "kept_fraction": s.kept_fraction,
              "cycles": s.cycles, "seed": s.seed}
    for method in ("copy-all", "tms"):
        if method in s.methods:
            for size in plan["copy_all_sizes"] if method == "copy-all" else plan["sublet_sizes"]:
                cases.append({**common, "method": method, "pattern": ANY_PATTERN,
                              "jobs": all_jobs(s), "size_bytes": size})
    if "sublet" in s.methods:
        for size in plan["sublet_sizes"]:
            for p in s.patterns:
                for kind, f in all_jobs(s):
                    if kind == "fill" or p == "blocks":
                        cases.append({**common, "cycles": s.sublet_cycles, "method": "sublet",
                                      "pattern": p, "jobs": [(kind, f)], "size_bytes": size,
                                      "pin_ahead": s.daemon_pin_gib == "owner"})
    for case in cases:
        what = ", ".join(f"{k} {pct(f)}" for k, f in case["jobs"])
        case["label"] = f"{case['method']} {case['pattern']} {what} {gib(case['size_bytes'])}"
    return cases


def log_plan(plan: dict[str, Any], s: Settings) -> None:
    log(f"GPU: {gib(plan['gpu_free_bytes'])} free; host: {gib(plan['host_available_bytes'])} "
        f"available")
    if plan["capped"]:
        log(f"S capped at {gib(plan['size_bytes'])}: copy-all's pinned buffer must fit in "
            f"{HOST_SHARE:.0%} of the host's available memory (uncapped S would be "
            f"{gib(plan['uncapped_bytes'])}"
            + ("; sublet also runs at that size)" if len(plan["sublet_sizes"]) > 1 else
               "; --uncapped-sublet also runs sublet there)"))
    if "copy-all" in s.methods and not plan["copy_all_sizes"]:
        log(f"copy-all skipped: its {gib(plan['size_bytes'])} pinned buffer would not fit in "
            f"{gib(plan['host_cap_bytes'])} ({HOST_SHARE:.0%} of the host's available memory)")
    log(f"S = {gib(plan['size_bytes'])}, F = {gib(plan['free_bytes'])}, kept "
        f"{pct(s.kept_fraction)}, jobs {', '.join(pct(f) for f in s.fractions)} of S")


def size_note(size: int, plan: dict[str, Any]) -> str:
    """Why S is what it is, for the table and the chart."""
    if plan["capped"] and size == plan["size_bytes"]:
        return "capped: copy-all's pinned buffer must fit in host memory"
    if size > plan["host_cap_bytes"]:
        return "uncapped: too large for copy-all's pinned buffer"
    return ""


def child_timeout(s: Settings, case: dict[str, Any]) -> float:
    """Generous: pinning S at 0.7 s/GiB plus (cycles + 1) cycles of copies per job, plus
    start-up."""
    if s.child_timeout:
        return s.child_timeout
    return 300 + case["size_bytes"] / GiB * (0.7 + 0.2 * (case["cycles"] + 1) * len(case["jobs"]))


def run_benchmark(s: Settings) -> int:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    started = time.time()
    probe_spec = {"label": "probe", "size_gib": s.size_gib, "free_gib": s.free_gib,
                  "uncapped_sublet": s.uncapped_sublet, "jobs": all_jobs(s),
                  "bandwidth_bytes": int(s.bandwidth_gib * GiB), "bandwidth_reps": 5,
                  "job_reps": s.job_reps}
    log("probing: free memory, host link bandwidth, the job alone (a fresh process)")
    probe = run_child("probe", probe_spec, {}, timeout=900)
    plan = probe["plan"]
    log_plan(plan, s)
    doc = load(s.json_path) if s.append and s.json_path.exists() else \
        {"schema": SCHEMA, "runs": [], "results": []}
    doc["machine"] = probe["machine"]
    run_id = max((r["id"] for r in doc["runs"]), default=-1) + 1
    run = {"id": run_id, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z",
                                                  time.localtime(started)),
           "argv": sys.argv[1:], "settings": {k: str(v) if isinstance(v, Path) else v
                                              for k, v in asdict(s).items()},
           "plan": plan, "bandwidth": probe["bandwidth"], "job_alone": probe["job_alone"]}
    doc["runs"].append(run)
    save(doc, s.json_path)

    cases = plan_cases(s, plan)
    copy_cases = [c for c in cases if c["method"] != "sublet"]
    sublet_cases = [c for c in cases if c["method"] == "sublet"]
    done = 0
    for case in copy_cases:
        done += 1
        run_case(case, done, len(cases), {}, probe, run_id, plan, doc, s)
    if sublet_cases:
        pin = s.kept_fraction * max(plan["sublet_sizes"]) if s.daemon_pin_gib == "ahead" \
            else 0.0 if s.daemon_pin_gib == "owner" \
            else (s.daemon_pin_gib or 0) * GiB  # default 0: the daemon a user gets
        with daemon_for_run(s.daemon, int(pin)) as daemon:
            run["daemon"] = daemon.describe()
            for case in sublet_cases:
                done += 1
                run_case(case, done, len(cases), daemon.env, probe, run_id, plan, doc, s)
        run["daemon"] = daemon.describe()  # with the log of a daemon started here
    run["elapsed_s"] = time.time() - started
    save(doc, s.json_path)
    log(f"done in {run['elapsed_s']:.0f} s; results in {s.json_path}")
    print_report(doc, phases=s.phases)
    changed = [r for r in doc["results"] if r.get("run") == run_id and
               not r.get("kept_intact", True)]
    if changed:
        log(f"FAILED: the kept data changed in {len(changed)} case(s)")
    return 1 if changed else 0


def run_case(case: dict[str, Any], index: int, total: int, env: dict[str, str],
             probe: dict[str, Any], run_id: int, plan: dict[str, Any], doc: dict[str, Any],
             s: Settings) -> None:
    """One (method, pattern, fraction, size) in a fresh process; its result goes into doc and
    the JSON file at once, so that an interrupted run keeps what it measured."""
    log(f"case {index}/{total}: {case['label']} (fresh process)")
    base = {k: case[k] for k in ("method", "pattern", "size_bytes", "free_bytes",
                                 "kept_fraction")}
    base.update(run=run_id, size_note=size_note(case["size_bytes"], plan))
    try:
        child = run_child("case", case, env, child_timeout(s, case))
    except ChildFailed as e:
        log(f"case {case['label']} failed: {e}")
        for kind, fraction in case["jobs"]:
            upsert(doc, {**base, "job": kind, "fraction": fraction, "error": str(e)})
        save(doc, s.json_path)
        return
    common = {k: v for k, v in child.items() if k != "parts"}
    for part in child["parts"]:
        result = {**base, **common, **part}
        result["kept_bytes_limit"] = child["kept_bytes"] if case["method"] == "sublet" else \
            int(case["kept_fraction"] * case["size_bytes"])
        key = job_key(part["job"], part["job_bytes"])
        add_limits(result, probe["bandwidth"], probe["job_alone"][key])
        if result["error"]:
            log(f"case {case['label']}: {result['error']}")
        upsert(doc, result)
    save(doc, s.json_path)


# --------------------------------------------------------------------------- report

def _fmt_row(label: str, cycle: str, summary: dict[str, Any] | None, job_s: float,
             verdict: str = "") -> str:
    """One table row; later rows are means, with the spread of the cycles after them; verdict:
    the row's target, PASS or MISS with what it asks."""
    if summary is None:
        return f"  {label:<24} {cycle:<6} (no cycles)"
    spread = "" if summary["n"] < 2 else \
        f"  ({summary['seconds_min']:.3f}-{summary['seconds_max']:.3f}, n={summary['n']})"
    return (f"  {label:<24} {cycle:<6} {summary['seconds']:>9.3f} "
            f"{summary['out_bytes'] / GiB:>8.2f} {summary['in_bytes'] / GiB:>8.2f} "
            f"{summary.get('moved_bytes', 0) / GiB:>8.2f} "
            f"{summary.get('limit_moved_bytes', 0) / GiB:>8.2f} "
            f"{job_s:>8.3f} {summary['limit_s']:>9.3f} {summary['ratio']:>8.2f}x"
            f"{'  ' + verdict if verdict else ''}{spread}")


def row_verdicts(r: dict[str, Any]) -> tuple[str, str]:
    """(first, later) targets of a sublet case beside its rows: the first within
    TARGET_FIRST_RATIO x its later cycles, the later within TARGET_LIMIT_RATIO x the limit."""
    if r["method"] != "sublet" or not r.get("later"):
        return "", ""
    first = r["first"]["seconds"] / r["later"]["seconds"]
    return (f"{'PASS' if first <= TARGET_FIRST_RATIO else 'MISS'} {first:.2f}x later "
            f"(<= {TARGET_FIRST_RATIO:g})",
            f"{'PASS' if r['later']['ratio'] <= TARGET_LIMIT_RATIO else 'MISS'} "
            f"(<= {TARGET_LIMIT_RATIO:g}x limit)")


def _phase_line(cycle: str, summary: dict[str, Any] | None) -> str | None:
    phases = (summary or {}).get("phases")
    if not phases:
        return None
    return (f"  {'':<24} {cycle} phases (s): "
            + ", ".join(f"{k} {v:.4f}" for k, v in phases.items()))


def _job_label(r: dict[str, Any]) -> str:
    size = r["size_bytes"]
    if r.get("job") == "train":
        return f" training step of a small transformer, about {pct(r['fraction'])} of S"
    return f" job {pct(r['fraction'])} of S ({gib(job_bytes(size, r['fraction']))})"


def table_lines(doc: dict[str, Any], phases: bool = False) -> list[str]:
    """The results as a table: per size and job, copy-all, tms, then sublet per pattern."""
    lines = []
    for run in doc["runs"]:
        bw = run["bandwidth"]
        d2d = bw.get("d2d", {}).get("bytes_per_s")
        lines.append(f"run {run['id']} ({run['started']}): pinned link D2H "
                     f"{bw['d2h_bytes_per_s'] / 1e9:.1f} GB/s, H2D "
                     f"{bw['h2d_bytes_per_s'] / 1e9:.1f} GB/s (best of {bw['reps']} x "
                     f"{gib(bw['bytes'])})"
                     + (f", device to device {d2d / 1e9:.0f} GB/s" if d2d else "")
                     + f"; daemon: {run.get('daemon', {}).get('mode', '-')}")
    results = doc["results"]
    for size in sorted({r["size_bytes"] for r in results}):
        at_size = [r for r in results if r["size_bytes"] == size]
        note = next((r["size_note"] for r in at_size if r.get("size_note")), "")
        free = at_size[0]["free_bytes"]
        lines.append("")
        lines.append(f"S = {gib(size)}{f' ({note})' if note else ''}, F = {gib(free)}, "
                     f"kept {pct(at_size[0]['kept_fraction'])}")
        lines.append(f"  {'case':<24} {'cycle':<6} {'seconds':>9} {'out GiB':>8} "
                     f"{'in GiB':>8} {'moved':>8} {'least':>8} {'job s':>8} {'limit s':>9} "
                     f"{'x limit':>9}  target")
        for job in sorted({(r.get("job", "fill"), r["fraction"]) for r in at_size}):
            group = [r for r in at_size if (r.get("job", "fill"), r["fraction"]) == job]
            lines.append(_job_label(group[0]))
            for r in sorted(group, key=lambda r: (METHODS.index(r["method"]),
                                                  _pattern_order(r["pattern"]))):
                lines += _case_lines(r, phases)
    return lines


def _pin_note(daemon: dict[str, Any]) -> str:
    if daemon.get("mode") != "shared":
        return ""
    pinned = daemon.get("pin_bytes", 0)
    return f", pinned ahead {gib(pinned)}" if pinned else ", nothing pinned ahead (as a " \
        "user's daemon starts)"


def _case_lines(r: dict[str, Any], phases: bool) -> list[str]:
    label, lines = _case_label(r), []
    if r.get("first"):
        first, later = row_verdicts(r)
        lines.append(_fmt_row(label, "first", r["first"], r["job_alone_s"], first))
        lines.append(_fmt_row("", "later", r["later"], r["job_alone_s"], later))
        if phases:
            lines += [p for p in (_phase_line("first", r["first"]),
                                  _phase_line("later", r["later"])) if p]
    if r.get("error"):
        lines.append(f"  {'' if r.get('first') else label:<24} failed: {r['error']}")
    if not r.get("kept_intact", True):
        lines.append(f"  {'':<24} KEPT DATA NOT INTACT: the run fails")
    if r.get("pin_ahead_s") is not None:
        lines.append(f"  {'':<24} pinned ahead in {r['pin_ahead_s']:.3f} s before the first "
                     f"cycle (sublet.pin_ahead, --daemon-pin owner)")
    if phases and r.get("empty_s") is not None:
        lines.append(f"  {'':<24} sublet.empty {r['empty_s'] / (r['size_bytes'] / GiB):.4f} "
                     f"s/GiB, release {r['release_s'] / (r['size_bytes'] / GiB):.4f} s/GiB")
    return lines


def _case_label(r: dict[str, Any]) -> str:
    """'copy-all', 'tms', or 'sublet rows 34%' with the share of S actually kept."""
    if r["method"] != "sublet":
        return r["method"] + (" (split kept)" if r["method"] == "tms" else "")
    kept = f" {r['kept_bytes'] / r['size_bytes']:.0%}" if r.get("kept_bytes") else ""
    return f"sublet {r['pattern']}{kept}"


def _pattern_order(pattern: str) -> int:
    return PATTERNS.index(pattern) if pattern in PATTERNS else -1


@dataclass
class Target:
    name: str
    case: str
    met: bool
    detail: str


def evaluate_targets(results: list[dict[str, Any]]) -> list[Target]:
    """Issue 10's targets for every sublet case: later cycles within 1.25 x the limit, the
    first within 1.5 x the later ones, faster than torch_memory_saver by 10 x at 25% and 75%
    and 1.8 x at 100% (the fill job)."""
    ok = [r for r in results if not r.get("error") and r.get("later")]
    tms = {(r["size_bytes"], r.get("job", "fill"), r["fraction"]): r for r in ok
           if r["method"] == "tms"}
    targets = []
    for r in sorted((r for r in ok if r["method"] == "sublet"),
                    key=lambda r: (r["size_bytes"], _pattern_order(r["pattern"]),
                                   r.get("job", "fill"), r["fraction"])):
        job = r.get("job", "fill")
        case = f"{r['pattern']} {job} {pct(r['fraction'])} S={gib(r['size_bytes'])}"
        later = r["later"]
        targets.append(Target(
            f"sublet later <= {TARGET_LIMIT_RATIO} x limit", case,
            later["ratio"] <= TARGET_LIMIT_RATIO,
            f"{later['seconds']:.3f} s vs limit {later['limit_s']:.3f} s = "
            f"{later['ratio']:.2f}x"))
        other = tms.get((r["size_bytes"], job, r["fraction"]))
        want = next((v for f, v in TARGET_TMS_SPEEDUP.items()
                     if math.isclose(f, r["fraction"])), None)
        if other and want and job == "fill":
            speedup = other["later"]["seconds"] / later["seconds"]
            targets.append(Target(
                "sublet later faster than torch_memory_saver (10x at 25/75%, 1.8x at 100%)",
                case, speedup >= want,
                f"tms {other['later']['seconds']:.3f} s / sublet {later['seconds']:.3f} s = "
                f"{speedup:.1f}x (target {want:g}x)"))
        first_ratio = r["first"]["seconds"] / later["seconds"]
        targets.append(Target(
            f"sublet first <= {TARGET_FIRST_RATIO:g} x its later", case,
            first_ratio <= TARGET_FIRST_RATIO,
            f"{r['first']['seconds']:.3f} s vs {later['seconds']:.3f} s = {first_ratio:.2f}x"))
    return targets


def target_lines(results: list[dict[str, Any]]) -> list[str]:
    targets = evaluate_targets(results)
    if not targets:
        return ["targets: no sublet case with later cycles to judge"]
    lines = [f"targets: {sum(t.met for t in targets)} of {len(targets)} met"]
    for name in dict.fromkeys(t.name for t in targets):
        lines.append(f" {name}")
        for t in (t for t in targets if t.name == name):
            lines.append(f"  {'PASS' if t.met else 'MISS'}  {t.case:<36} {t.detail}")
    return lines


def print_report(doc: dict[str, Any], phases: bool = False) -> None:
    machine = doc.get("machine", {})
    print(f"sublet benchmark: {machine.get('gpu')} (driver {machine.get('driver')}, CUDA "
          f"{machine.get('cuda_runtime')}), torch {machine.get('torch')}, host "
          f"{gib(machine.get('host_memory_bytes') or 0)}")
    print("figures are seconds per cycle (make room, run the job, get the data back); limit = "
          "the job alone + the least kept bytes any choice of the pages the job needs "
          "displaces (the m = ceil((job - F) / page) pages holding the fewest), moved on the "
          "GPU there and back at the device-to-device speed, less what cannot fit in the "
          "other pages' holes, which crosses the pinned link each way; moved = GiB sublet "
          "moved on the GPU each way, least = the limit's")
    for line in table_lines(doc, phases) + [""] + target_lines(doc["results"]):
        print(line)


# --------------------------------------------------------------------------- arguments

def _float_list(text: str) -> list[float]:
    values = [float(v.strip().rstrip("%")) for v in text.split(",") if v.strip()]
    return [v / 100 if v > 1 else v for v in values]  # 25 and 0.25 both mean 25%


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)}: choose from "
                                             f"{', '.join(allowed)}")
        return values
    return parse


def _size(text: str) -> float | str:
    return "max" if text == "max" else float(text)


def _pin(text: str) -> float | str:
    return text if text in ("ahead", "owner") else float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="sublet against copy-all on one CUDA GPU: seconds per cycle, bytes copied, "
                    "the physical limit; a table on stdout and a JSON file (bench/plot.py "
                    "draws it). A full run at S = 64 GiB takes about 7 minutes on an H200 with "
                    "the three first patterns and about 10 with all six (estimated: "
                    "copy-all's first cycles pin host memory at about 0.6 s/GiB, each case "
                    "is a fresh process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=_size, default=None, metavar="GiB",
                        help="S, the lent tensor's size in GiB; 'max': all free GPU memory but "
                             "F, uncapped (copy-all then runs only if it fits in host memory). "
                             "Default: all free GPU memory but F, capped so that copy-all's "
                             "pinned buffer fits in 90%% of MemAvailable")
    parser.add_argument("--free", type=float, default=None, metavar="GiB",
                        help="F, free GPU memory left beside the tensor (default 8)")
    parser.add_argument("--kept-fraction", type=float, default=0.3,
                        help="the share of the tensor the owner keeps")
    parser.add_argument("--fractions", type=_float_list, default=[0.25, 0.75, 1.0],
                        help="job sizes as fractions of S, comma-separated (25 or 0.25)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="later cycles per case, after the first (default 3; quick: 1 "
                             "for copy-all and tms, 3 for sublet)")
    parser.add_argument("--patterns", type=_choices(PATTERNS), default=list(PATTERNS),
                        help="keep patterns, comma-separated: rows (every third 1 GiB row), "
                             "blocks (30%% of 64 KiB blocks at random), slice (the first "
                             "30%%), runs (blocks in runs: about half the 2 MiB pages hold no "
                             "kept byte), blocks-new and runs-new (a new live set every "
                             "cycle, checked bit for bit)")
    parser.add_argument("--methods", type=_choices(METHODS), default=list(METHODS),
                        help="methods, comma-separated")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results.json",
                        help="where to write all results")
    parser.add_argument("--append", action="store_true",
                        help="add to the results already in --json (a run split in parts) "
                             "instead of starting a new file; a case measured again replaces "
                             "the old one")
    parser.add_argument("--uncapped-sublet", action="store_true",
                        help="when S is capped by host memory, also run sublet at the "
                             "uncapped size, where copy-all cannot run")
    parser.add_argument("--daemon", choices=("shared", "private"), default="shared",
                        help="shared: one subletd started for the run serves every sublet "
                             "process (as a system service would); private: each process "
                             "starts its own. $SUBLET_SOCKET, when set, wins over both")
    parser.add_argument("--daemon-pin", type=_pin, default=0.0, metavar="GiB",
                        help="host memory the shared subletd pins ahead (--pin): 0, the "
                             "default, starts it as a user gets it (host memory pinned at a "
                             "loan's first save); 'ahead': the kept fraction of the largest S, "
                             "as earlier runs of this benchmark did; 'owner': 0, and each owner "
                             "calls sublet.pin_ahead(its kept bytes) before its first cycle, "
                             "timed apart")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the block patterns (the changing ones: with the cycle)")
    parser.add_argument("--bandwidth-size", type=float, default=None, metavar="GiB",
                        help="pinned buffer for the bandwidth measurement (default 4, quick 1)")
    parser.add_argument("--job-reps", type=int, default=None,
                        help="timed repetitions of the job alone, the median is taken "
                             "(default 5, quick 2)")
    parser.add_argument("--train", type=float, default=0.25, metavar="FRACTION",
                        help="the training-step job, sized to about this fraction of S (0: "
                             "no training case)")
    parser.add_argument("--daemon-log", type=Path, default=None, metavar="FILE",
                        help="run the shared subletd with --log-level debug (what each "
                             "request took on its loop, each copy and move off it) and write "
                             "its whole log to FILE")
    parser.add_argument("--phases", action="store_true",
                        help="print each case's phases too (mean seconds of the later "
                             "cycles): where the time goes")
    parser.add_argument("--child-timeout", type=float, default=None, metavar="S",
                        help="seconds before a case's process is killed (default: from S)")
    parser.add_argument("--quick", action="store_true",
                        help="the whole table fast (about 6 minutes on an H200 with the three "
                             "first patterns, 8 to 9 with all six, estimated): S = 64 "
                             "GiB, 1 later cycle of copy-all and tms (seconds each; sublet's "
                             "take milliseconds and keep 3, so that one slow exit does not "
                             "make the figure), a 1 GiB bandwidth buffer, 2 repetitions of the "
                             "job alone (options given explicitly still win)")
    parser.add_argument("--report", action="store_true",
                        help="print the table and targets of --json and exit (no GPU needed)")
    parser.add_argument("--child", choices=("probe", "case"), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    quick = args.quick
    size = args.size if args.size is not None else (64.0 if quick else None)
    return Settings(
        size_gib=size, free_gib=args.free if args.free is not None else 8.0,
        kept_fraction=args.kept_fraction, fractions=args.fractions,
        cycles=args.cycles if args.cycles is not None else (1 if quick else 3),
        sublet_cycles=args.cycles if args.cycles is not None else 3,
        patterns=args.patterns, methods=args.methods, json_path=args.json.resolve(),
        append=args.append, uncapped_sublet=args.uncapped_sublet, daemon=args.daemon,
        daemon_pin_gib=args.daemon_pin, seed=args.seed,
        bandwidth_gib=args.bandwidth_size or (1.0 if quick else 4.0),
        job_reps=args.job_reps if args.job_reps is not None else (2 if quick else 5),
        child_timeout=args.child_timeout, train_fraction=args.train, phases=args.phases)


def main(argv: list[str] | None = None) -> int:
    global DAEMON_LOG
    args = build_parser().parse_args(argv)
    DAEMON_LOG = args.daemon_log.resolve() if args.daemon_log else None
    if args.child:
        return child_main(args.child, json.loads(args.spec))
    if args.report:
        print_report(load(args.json), phases=args.phases)
        return 0
    settings = settings_from(args)
    if not 0 < settings.kept_fraction < 1:
        raise SystemExit("--kept-fraction must lie between 0 and 1")
    if settings.cycles < 1:
        raise SystemExit("--cycles must be at least 1 (the later cycles after the first)")
    return run_benchmark(settings)


if __name__ == "__main__":
    sys.exit(main())
