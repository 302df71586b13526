"""The GPU soak (issue 8): hundreds of loans in a row of a KV-cache-like tensor, each with a new
random keep set and a random realistic borrower, half in the owner's process (sublet.lend),
half in another process (sublet.offer / sublet.borrow), verify on. After every loan every kept
byte is compared bitwise with a copy taken on the host before it (as integers: a NaN that came
back is unchanged). GPU memory, host RSS and fds must not grow after the warm-up (every
borrower once in each process).

    tests/gpu LOGDIR -k soak                     # on a GPU machine; or directly:
    SUBLETD=build/subletd SUBLET_LIB=build/libsublet.so python3 -m pytest \\
        tests/python/test_gpu_soak.py -m gpu -s

    SUBLET_SOAK_LOANS   loans (default 200, about 3 to 4 minutes on an H200)
    SUBLET_SOAK_SEED    the random seed (default 8)
    SUBLET_SOAK_GIB     the tensor's size (default 4); SUBLET_SOAK_FREE_GIB: free GPU memory
                        left beside it (default 2), so that borrowers spill into kept pages

It prints one line beginning "soak:" with the loans, the bytes checked, the changed bits and
the growth.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import sublet

import soak_workloads as work
from conftest import CHILD_ENV, kept_ranges_of
from test_gpu import cuda_daemon, settled_free_memory  # noqa: F401 (fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

GiB, MiB = 1 << 30, 1 << 20
LOANS = int(os.environ.get("SUBLET_SOAK_LOANS", "200"))
SEED = int(os.environ.get("SUBLET_SOAK_SEED", "8"))
CACHE_BYTES = int(float(os.environ.get("SUBLET_SOAK_GIB", "4")) * GiB)
FREE_BYTES = int(float(os.environ.get("SUBLET_SOAK_FREE_GIB", "2")) * GiB)
BLOCK_SHAPE = (2, 16, 8, 128)  # K and V, heads, block positions, head dim: 64 KiB of bf16
GRAIN = 256                    # every keep below is whole 256-byte pieces: the mask's unit
SLAB = (128 * MiB) // GRAIN    # pieces gathered at a time when comparing
WEIGHTS = {"train_eager": 2, "train_compiled": 2, "small_allocations": 2, "streams": 2,
           "thread": 2, "exception": 1, "out_of_memory": 1, "leak": 0.5}
HERE = Path(__file__).resolve().parent

BORROWER = """
import json, os, random, sys
sys.path.insert(0, sys.argv[1])
import torch, sublet, soak_workloads as work

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
torch.empty(1, device=device)
print("ready", flush=True)
for line in sys.stdin:
    kind, seed, spill = line.split()
    leaked, outcome = None, "ok"
    try:
        with sublet.borrow(name="soak", timeout=600):
            leaked = work.run(kind, random.Random(int(seed)), device, int(spill))
    except work.PlannedError:
        outcome = "exception"
    except sublet.LeakError:
        outcome = "leak"
    leaked = None  # dropped unread: its memory is the owner's again
    torch.cuda.empty_cache()
    print(json.dumps({"outcome": outcome, "rss": rss(),
                      "fds": len(os.listdir("/proc/self/fd"))}), flush=True)
"""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _gpu_free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


# --------------------------------------------------------------------------- keep sets

def pick_keep(rng: random.Random, cache: torch.Tensor):
    """A random keep set of the kinds an inference engine has, and its name."""
    n = cache.shape[0]
    kind = rng.choice(["blocks", "block indices", "rows", "strided", "V halves", "heads",
                       "nothing", "all"])
    if kind == "blocks":  # one view per live block, scattered
        return kind, [cache[j] for j in rng.sample(range(n), int(n * rng.uniform(0.05, 0.4)))]
    if kind == "block indices":
        return kind, torch.tensor(sorted(rng.sample(range(n), n // 3)), dtype=torch.long)
    if kind == "rows":
        a = rng.randrange(n)
        return kind, cache[a:rng.randrange(a, n) + 1]
    if kind == "strided":
        return kind, cache[rng.randrange(3)::rng.randint(2, 5)]
    if kind == "V halves":
        return kind, cache[:, 1]
    if kind == "heads":
        h = rng.randrange(15)
        return kind, cache[:, :, h:h + 2]
    return kind, [] if kind == "nothing" else None


# --------------------------------------------------------------------------- the kept bytes

class KeptBytes:
    """The kept bytes of the tensor, gathered on the GPU in 256-byte pieces and held on the
    host between the start of a loan and its end."""

    def __init__(self, cache: torch.Tensor):
        storage = cache.untyped_storage()
        self.raw = torch.tensor([], dtype=torch.uint8, device=cache.device).set_(storage)
        self.pieces = self.raw.view(-1, GRAIN)
        self.host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        self.popcount = torch.tensor([bin(i).count("1") for i in range(256)],
                                     dtype=torch.int64, device=cache.device)
        self.mask = None
        self.nbytes = 0

    def take(self, ranges: np.ndarray) -> int:
        """Copies the kept bytes of ranges (region offsets) to the host; returns how many."""
        assert (ranges % GRAIN == 0).all(), "the soak's keeps must be whole 256-byte pieces"
        n = self.pieces.shape[0]
        edges = torch.zeros(n + 1, dtype=torch.int32, device=self.raw.device)
        ones = torch.ones(len(ranges), dtype=torch.int32, device=self.raw.device)
        starts = torch.from_numpy((ranges[:, 0] // GRAIN).astype(np.int64)).to(self.raw.device)
        ends = torch.from_numpy(((ranges[:, 0] + ranges[:, 1]) // GRAIN).astype(np.int64))
        edges.index_add_(0, starts, ones)
        edges.index_add_(0, ends.to(self.raw.device), -ones)
        self.mask = edges.cumsum(0, dtype=torch.int32)[:-1] > 0
        self.nbytes = 0
        for first, kept in self._slabs():
            self.host[self.nbytes:self.nbytes + kept.numel()].copy_(kept)
            self.nbytes += kept.numel()
        return self.nbytes

    def changed_bits(self) -> int:
        """Bits of the kept bytes that differ from what take() copied (0 when intact)."""
        at, bits = 0, 0
        for first, kept in self._slabs():
            then = self.host[at:at + kept.numel()].to(kept.device)
            at += kept.numel()
            if not torch.equal(kept.view(torch.int64), then.view(torch.int64)):
                bits += int(self.popcount[torch.bitwise_xor(kept, then).long()].sum())
        assert at == self.nbytes
        self.mask = None
        return bits

    def _slabs(self):
        for first in range(0, self.pieces.shape[0], SLAB):
            yield first, self.pieces[first:first + SLAB][self.mask[first:first + SLAB]].view(-1)


# --------------------------------------------------------------------------- the two borrowers

def lend_here(cache, keep, kind: str, seed: int, spill: int) -> str:
    leaked, outcome = None, "ok"
    try:
        with sublet.lend(cache, keep=keep, verify=True):
            leaked = work.run(kind, random.Random(seed), cache.device, spill)
    except work.PlannedError:
        outcome = "exception"
    except sublet.LeakError:
        outcome = "leak"
    del leaked  # dropped unread: its memory is the owner's again
    return outcome


class OtherProcess:
    """The borrower process: takes one offer named "soak" per line it reads."""

    def __init__(self):
        from sublet import _client
        socket = _client.client_for("cuda", torch.cuda.current_device()).path
        self.proc = subprocess.Popen([sys.executable, "-c", BORROWER, str(HERE)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV))
        assert self.proc.stdout.readline().strip() == "ready"
        self.last: dict = {}

    def lend(self, cache, keep, kind: str, seed: int, spill: int) -> str:
        offer = sublet.offer(cache, keep=keep, name="soak", verify=True)
        self.proc.stdin.write(f"{kind} {seed} {spill}\n")
        self.proc.stdin.flush()
        offer.wait(timeout=600)
        self.last = json.loads(self.proc.stdout.readline())
        return self.last["outcome"]

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


def expected_outcome(kind: str) -> str:
    return {"exception": "exception", "leak": "leak"}.get(kind, "ok")


# --------------------------------------------------------------------------- the soak

def test_soak():
    assert LOANS >= 2 * len(work.KINDS), "the warm-up alone runs every borrower in each process"
    rng = random.Random(SEED)
    other = OtherProcess()
    cache = sublet.empty(CACHE_BYTES // (64 * 1024), *BLOCK_SHAPE, dtype=torch.bfloat16)
    cache.view(torch.int16).random_(-32768, 32767)  # random bits: NaN patterns included
    kept = KeptBytes(cache)
    plan = [(k, False) for k in work.KINDS] + [(k, True) for k in work.KINDS]
    checked = changed = local = 0
    kinds = list(WEIGHTS)
    start, baseline = time.monotonic(), None
    free = settled_free_memory()
    hog = torch.empty(max(0, free - FREE_BYTES), dtype=torch.uint8, device=cache.device)
    try:
        for i in range(LOANS):
            kind, across = plan[i] if i < len(plan) else (
                rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0], rng.random() < 0.5)
            keep_name, keep = pick_keep(rng, cache)
            checked += kept.take(kept_ranges_of(cache, keep))
            spill = int(CACHE_BYTES * rng.uniform(0.1, 0.7))
            seed = rng.randrange(1 << 30)
            torch.cuda.empty_cache()
            lend = other.lend if across else lend_here
            outcome = lend(cache, keep, kind, seed, spill)
            local += not across
            bits = kept.changed_bits()
            changed += bits
            where = "another process" if across else "the owner's process"
            assert bits == 0, f"loan {i} ({kind} in {where}, keep {keep_name}): {bits} bits"
            assert outcome == expected_outcome(kind), f"loan {i} ({kind}): {outcome}"
            if i == len(plan) - 1:
                baseline = (_gpu_free(), _rss(), _fds(), dict(other.last))
        gpu, rss, fds = _gpu_free(), _rss(), _fds()  # beside the hog, as the baseline was
    finally:
        del hog
        torch.cuda.empty_cache()  # the hog's memory goes back to the device, for later tests
        other.close()
    grew = (baseline[0] - gpu, rss - baseline[1], fds - baseline[2],
            other.last["rss"] - baseline[3]["rss"], other.last["fds"] - baseline[3]["fds"])
    print(f"\nsoak: {LOANS} loans ({local} in the owner's process, {LOANS - local} in another "
          f"process), verify on, {checked / GiB:.2f} GiB of kept bytes compared bitwise, "
          f"{changed} changed bits; growth after the warm-up: GPU memory {grew[0] / MiB:+.1f} "
          f"MiB, RSS {grew[1] / MiB:+.1f} MiB (borrower process {grew[3] / MiB:+.1f} MiB), "
          f"fds {grew[2]:+d} ({grew[4]:+d}); {time.monotonic() - start:.0f} s, seed {SEED}")
    assert changed == 0
    assert grew[0] <= 64 * MiB, "GPU memory in use grew"
    assert grew[1] <= 256 * MiB and grew[3] <= 256 * MiB, "host RSS grew"
    assert grew[2] <= 2 and grew[4] <= 2, "fds grew"
