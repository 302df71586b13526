"""GPU tests of release loans (issue 22, docs/design/release.md): sublet.release gives a pool
tag's pages back to the CUDA driver, so that anyone can allocate them (a PyTorch process that
knows nothing of sublet, a cudaMalloc as NCCL makes), and resume brings every kept bit back at
the same addresses. Skipped without CUDA.

What each test would catch: memory that is not really the driver's during the release (the
other process's allocation fails; mem_get_info does not grow), a kept byte lost or put back
in the wrong place (bits compared after every resume, after the freed memory was scribbled
over), a released page mapped at the wrong address or twice (writes to the unkept blocks
after resume must not reach the kept ones; a CUDA graph replays on the resumed memory), a dead
owner's pages never given back, a failed resume that leaks the pages it made.

    python3 -m pytest tests/python/test_gpu_release.py -m gpu -s    # -s shows the figures
"""

from __future__ import annotations

import ctypes.util
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import sublet
from sublet import _client
from sublet import _pool as sublet_pool

from conftest import CHILD_ENV
from test_gpu import cuda_daemon, page, random_fill, settled_free_memory  # noqa: F401 (fixtures)
from test_gpu_pool import bits, same_bits
from gpu_memory import free_now, scribble

GiB, MiB = 1024 ** 3, 1024 ** 2
BLOCK = 64 * 1024                   # a block of pool_layers: [:, b] of a (2, N, 16, 8, 128) bf16
# mem_get_info during a release may fall short of the released bytes by what the daemon
# itself allocates meanwhile (a staging buffer for saves); a release that frees nothing misses
# by gigabytes.
SLACK = 1 * GiB
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

_releases: list = []                # every release a test made: resumed at its end if live


def release(what, keep=None, stay=None):
    """sublet.release, remembered so that a failing test does not leave its memory released
    for the next test."""
    rel = sublet.release(what, keep=keep, stay=stay)
    _releases.append(rel)
    return rel


@pytest.fixture(autouse=True)
def releases_resumed_and_pools_emptied():
    yield
    gc.collect()
    torch.cuda.empty_cache()
    while _releases:
        rel = _releases.pop()
        if rel.active:
            try:
                rel.resume()
            except sublet.SubletError as e:
                print(f"\n(teardown: resume failed: {e})")
    for pool in list(sublet_pool._pools.values()):
        pool.empty_cache()
    torch.cuda.empty_cache()


def kept_bits(caches: list[torch.Tensor], ids) -> list[torch.Tensor]:
    """The bits of the kept blocks of every layer (ids None: all of each layer)."""
    return [bits(c if ids is None else c[:, ids]) for c in caches]


def assert_kept(caches, ids, before, what: str) -> None:
    for layer, (c, b) in enumerate(zip(caches, before)):
        assert same_bits(c if ids is None else c[:, ids], b), f"{what}: layer {layer} lost " \
                                                               f"kept bits"


def write_unkept_and_recheck(caches, ids, before, what: str) -> None:
    """Writes 0x3FC0 (bf16 1.5) over every unkept block, then checks the kept blocks again and
    reads the written ones back: a released page mapped at the wrong address, or one physical
    page behind two addresses, shows here."""
    unkept = torch.from_numpy(np.setdiff1d(np.arange(caches[0].shape[1]), ids.numpy()))
    for c in caches:
        c.index_fill_(1, unkept.cuda(), 1.5)
    torch.cuda.synchronize()
    assert_kept(caches, ids, before, what + ", after writing the unkept blocks")
    for layer, c in enumerate(caches):
        assert bool((c[:, unkept].view(torch.int16) == 0x3FC0).all()), \
            f"{what}: layer {layer}'s unkept blocks do not read back as written"


def pool_layers(tag: str, n: int, blocks: int, seed: int) -> list[torch.Tensor]:
    """A vLLM-like cache in pool `tag`: n per-layer (2, blocks, 16, 8, 128) bf16 tensors (64
    KiB blocks: 32 KiB of keys, 32 KiB of values), filled outside the pool, so that the tag
    holds these tensors' segments and nothing else (a fill's temporary made inside would stay
    in the tag, cached)."""
    with sublet.pool(tag):
        out = [torch.empty(2, blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
               for _ in range(n)]
    return [random_fill(t, seed + i) for i, t in enumerate(out)]


def pool_tensors(tag: str, n: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    """n uint8 tensors of nbytes in pool `tag`, filled outside it (as pool_layers)."""
    with sublet.pool(tag):
        out = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(n)]
    return [random_fill(t, seed + i) for i, t in enumerate(out)]


def kept_bytes_of(caches, ids) -> int:
    return sum(c.nbytes for c in caches) if ids is None else len(caches) * len(ids) * BLOCK


# --------------------------------------------------------------------------- anyone allocates

# A process that knows nothing of sublet: PyTorch alone, or the CUDA runtime through ctypes
# (as NCCL allocates its buffers: cudaMalloc, outside PyTorch's allocator). It makes its
# context first (before the GPU is made nearly full), then answers "alloc N" with ok/oom
# (written over and synchronised: the memory is really usable) and "free" with freed.
CONSUMER = textwrap.dedent("""
    import sys
    kind = sys.argv[1]
    held = []
    if kind == "torch":
        import torch
        torch.empty(1, device="cuda")
        def alloc(n):
            try:
                held.append(torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xAB))
            except torch.OutOfMemoryError:
                return False
            torch.cuda.synchronize()
            return True
        def free():
            held.clear()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    else:
        import ctypes
        rt = ctypes.CDLL(sys.argv[2])
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        rt.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        rt.cudaFree.argtypes = [ctypes.c_void_p]
        assert rt.cudaFree(None) == 0              # makes the context
        def alloc(n):
            p = ctypes.c_void_p()
            err = rt.cudaMalloc(ctypes.byref(p), n)
            if err == 2:                           # cudaErrorMemoryAllocation
                rt.cudaGetLastError()
                return False
            assert err == 0, f"cudaMalloc: error {err}"
            assert rt.cudaMemset(p, 0xAB, n) == 0 and rt.cudaDeviceSynchronize() == 0
            held.append(p)
            return True
        def free():
            for p in held:
                assert rt.cudaFree(p) == 0
            held.clear()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "alloc":
            print("ok" if alloc(int(arg[0])) else "oom", flush=True)
        elif cmd == "free":
            free()
            print("freed", flush=True)
""")


def libcudart() -> str:
    """The CUDA runtime this process loaded (torch's), else one the loader finds."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    found = ctypes.util.find_library("cudart")
    if not found:
        pytest.skip("no libcudart to cudaMalloc with (torch links it statically here)")
    return found


class Consumer:
    """The CONSUMER process, driven line by line."""

    def __init__(self, kind: str):
        argv = [sys.executable, "-c", CONSUMER, kind] + ([libcudart()] if kind == "cudart"
                                                         else [])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.ask(None) == "ready"

    def ask(self, command: str | None) -> str:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        if not line:
            raise AssertionError(f"the consumer died: {self.proc.stderr.read()}")
        return line

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("kind", ["torch", "cudart"])
def test_a_process_that_knows_nothing_of_sublet_allocates_the_released_memory(kind, page):
    """4 GiB in 64 layers, every 10th block kept (every page holds some: the kept blocks are
    compacted into a tenth of the pages). The GPU made nearly full first: the consumer's
    allocation of most of what the release will free fails before the release and succeeds
    during it; after it frees, resume brings the kept blocks back."""
    caches = pool_layers("rel-any", 64, 1024, seed=5)
    ids = torch.arange(0, 1024, 10)
    before = kept_bits(caches, ids)
    keep = sublet.blocks(caches, ids, dim=1)
    total, kept = sum(c.nbytes for c in caches), kept_bytes_of(caches, ids)
    will_free = total - math.ceil(kept / page) * page
    want = int(will_free * 0.75) // (2 * MiB) * (2 * MiB)
    consumer = Consumer(kind)
    try:
        filler = torch.empty(settled_free_memory() - 1 * GiB, dtype=torch.uint8, device="cuda")
        assert free_now() < want - 1 * GiB, "the GPU is not full enough for the test to mean"
        assert consumer.ask(f"alloc {want}") == "oom", "it fits before the release"
        rel = release("rel-any", keep=keep)
        assert consumer.ask(f"alloc {want}") == "ok", \
            f"{kind}: {want / GiB:.2f} GiB did not fit during the release " \
            f"(released {rel.released_bytes / GiB:.2f} GiB, free {free_now() / GiB:.2f})"
        assert consumer.ask("free") == "freed"
        rel.resume()
        del filler
    finally:
        consumer.close()
    assert_kept(caches, ids, before, kind)
    write_unkept_and_recheck(caches, ids, before, kind)
    print(f"\n{kind}: {want / GiB:.2f} GiB allocated by a process without sublet during the "
          f"release; released {rel.released_bytes / GiB:.2f} GiB, stayed "
          f"{rel.stayed_bytes / GiB:.2f}, moved {rel.moved_bytes / GiB:.2f}, to the host "
          f"{rel.copied_bytes}")
    del caches


# --------------------------------------------------------------------------- in sequence

def _keeps(rng: np.random.Generator, nblocks: int) -> list[tuple[str, str, object, int | None]]:
    """(name, kind, kept block ids, stay) in the order the test runs them: new scattered live
    sets, runs (whole pages), nothing, everything to the host, scattered to the host. kind:
    'blocks' (the ids), 'nothing' (keep=[]) or 'all' (keep=None)."""
    def scattered():
        return np.sort(rng.choice(nblocks, nblocks * 3 // 10, replace=False))
    runs = np.concatenate([np.arange(s, min(s + 64, nblocks)) for s in range(0, nblocks, 256)])
    return [("scattered", "blocks", scattered(), None),
            ("scattered, a new live set", "blocks", scattered(), None),
            ("runs of whole pages", "blocks", runs, None),
            ("nothing", "nothing", None, None),
            ("everything, stay=0", "all", None, 0),
            ("scattered, stay=0", "blocks", scattered(), 0),
            ("scattered once more", "blocks", scattered(), None)]


def owner_works(caches: list[torch.Tensor], rng: np.random.Generator) -> None:
    """What a serving engine does between pauses: new tokens written into blocks (some kept
    next time, some not), and the cache read."""
    nblocks = caches[0].shape[1]
    written = torch.from_numpy(rng.choice(nblocks, 96, replace=False)).cuda()
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    for c in caches:
        c[:, written] = torch.randn(c[:, written].shape, device="cuda", generator=g,
                                    dtype=torch.bfloat16)
        c[:, :64].float().sum()
    torch.cuda.synchronize()


def check_release_stats(rel, name: str, ids, stay, total: int, kept: int, page: int,
                        freed: int) -> None:
    """What the contract says of a live release's figures (docs/design/release.md)."""
    assert rel.released_bytes > 0, name
    assert freed >= rel.released_bytes - SLACK, \
        f"{name}: released {rel.released_bytes} bytes, but only {freed} came free on the device"
    kept_bytes = rel.stats.kept_bytes
    assert kept_bytes == kept, f"{name}: kept bytes"
    if stay is None:
        assert rel.copied_bytes == 0, f"{name}: the keep fits in the pages that stay"
        # After a resume in page groups a group one of whose pages stays stays whole (its
        # other pages held): more may stay than the kept bytes fill, never less.
        need = math.ceil(kept / page) * page
        held = rel.stats.held_pages * page
        assert rel.stayed_bytes - held == need, \
            f"{name}: {rel.stayed_bytes} bytes stayed ({held} held) for {need} the kept bytes fill"
    else:
        assert rel.copied_bytes == kept, f"{name}: stay=0 saves every kept byte"
        assert rel.stayed_bytes == 0, name
    assert rel.released_bytes + rel.stayed_bytes == total, \
        f"{name}: the tag's pages are {total} bytes, released and stayed " \
        f"{rel.released_bytes + rel.stayed_bytes}"


def test_releases_in_sequence_with_changing_keeps_keep_every_bit(page):
    """64 layers of 96 MiB (6 GiB) in pool "seq". Seven releases, each with its own keep, the
    owner writing its cache between them; the freed memory scribbled over during each release.
    After each resume: every kept bit, and writes to the unkept blocks reach no kept byte."""
    nblocks = 1536
    caches = pool_layers("seq", 64, nblocks, seed=11)
    total = sum(c.nbytes for c in caches)
    rng = np.random.default_rng(12)
    for name, kind, live, stay in _keeps(rng, nblocks):
        ids = None if live is None else torch.from_numpy(live)
        keep = {"nothing": [], "all": None}[kind] if ids is None else \
            sublet.blocks(caches, ids, dim=1)
        before = [] if kind == "nothing" else kept_bits(caches, ids)
        kept = 0 if kind == "nothing" else kept_bytes_of(caches, ids)
        free0 = free_now()
        rel = release("seq", keep=keep, stay=stay)
        freed = free_now() - free0
        assert rel.active
        check_release_stats(rel, name, ids, stay, total, kept, page, freed)
        release_s = rel.stats.seconds
        scribble(freed)
        rel.resume()
        assert not rel.active
        assert rel.stats.copied_in_bytes == rel.copied_bytes, name
        if kind == "nothing":
            for layer, c in enumerate(caches):
                random_fill(c, 100 + layer)  # an engine refills what it did not keep
        else:
            assert_kept(caches, ids, before, name)
        if ids is not None:
            write_unkept_and_recheck(caches, ids, before, name)
        print(f"\n{name}: released {rel.released_bytes / GiB:.2f} GiB ({freed / GiB:.2f} came "
              f"free), stayed {rel.stayed_bytes / GiB:.2f}, kept {kept / GiB:.2f}, moved "
              f"{rel.moved_bytes / GiB:.2f}, to the host {rel.copied_bytes / GiB:.2f}; release "
              f"{release_s:.3f} s, resume {rel.stats.seconds:.3f} s as "
              f"{rel.stats.allocations} allocations; {rel.stats.held_pages} pages held")
        owner_works(caches, rng)
    del caches


# --------------------------------------------------------------------------- several tags

def test_three_tags_paused_one_by_one_and_resumed_in_the_other_order_as_sglang_does():
    """kv_cache (live blocks kept on the GPU), weights (all of it, to the host) and cuda_graph
    (a graph's static input and output; the input kept): pause kv, weights, graph; resume graph
    (the graph replays on its resumed memory while the others are still released), weights,
    kv. Meanwhile the region is busy: releasing a tag again and lending are refused."""
    caches = pool_layers("kv_cache", 32, 1024, seed=21)                # 2 GiB
    weights = pool_tensors("weights", 8, 128 * MiB, seed=300)          # 1 GiB
    with sublet.pool("cuda_graph"):
        x = torch.empty(16 * MiB, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
    random_fill(x, 7)
    graph = capture(x, y)
    expected_y = bits(torch.mul(x, 2).add_(1))
    ids = torch.from_numpy(np.sort(np.random.default_rng(22).choice(1024, 200, replace=False)))
    kv_before, w_before, x_before = kept_bits(caches, ids), [bits(w) for w in weights], bits(x)

    free0 = free_now()
    r_kv = release("kv_cache", keep=sublet.blocks(caches, ids, dim=1))
    r_w = release("weights", stay=0)
    r_g = release("cuda_graph", keep=x)
    freed = free_now() - free0
    released = sum(r.released_bytes for r in (r_kv, r_w, r_g))
    assert freed >= released - SLACK
    assert r_w.copied_bytes == sum(w.nbytes for w in weights)
    assert r_kv.copied_bytes == 0 and r_g.copied_bytes == 0
    with pytest.raises(sublet.BusyError):
        release("weights")
    with pytest.raises(sublet.BusyError):
        with sublet.lend("kv_cache"):
            pass
    scribble(freed)

    r_g.resume()
    assert same_bits(x, x_before)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(y, expected_y), "the graph did not replay on its resumed memory"
    r_w.resume()
    assert all(same_bits(w, b) for w, b in zip(weights, w_before))
    assert r_w.stats.copied_in_bytes == r_w.copied_bytes
    r_kv.resume()
    assert_kept(caches, ids, kv_before, "kv_cache")
    write_unkept_and_recheck(caches, ids, kv_before, "kv_cache")
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(y, expected_y)
    print(f"\nkv {r_kv.released_bytes / GiB:.2f} GiB, weights "
          f"{r_w.released_bytes / GiB:.2f} GiB ({r_w.copied_bytes / GiB:.2f} to the "
          f"host), graph {r_g.released_bytes / GiB:.3f} GiB released; {freed / GiB:.2f} "
          f"GiB came free")
    del graph, caches, weights, x, y


def capture(x: torch.Tensor, y: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph computing y = x * 2 + 1 in place (no memory of its own to release: only x and
    y, which live in pool cuda_graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.mul(x, 2, out=y).add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(x, 2, out=y).add_(1)
    y.zero_()
    torch.cuda.synchronize()
    return graph


# --------------------------------------------------------------------------- the owner dies

# The owner: 16 GiB in pool "doomed", released with every byte to the host (a job of seconds:
# subletd pins host memory for it at its first save), killed mid-release or while released.
OWNER = textwrap.dedent("""
    import sys, torch, sublet
    with sublet.pool("doomed"):
        layers = [torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda") for _ in range(64)]
    for layer in layers:
        layer.random_(0, 256)
    torch.cuda.synchronize()
    print("made", flush=True)
    sys.stdin.readline()
    print("releasing", flush=True)
    rel = sublet.release("doomed", stay=0)
    print("released", flush=True)
    sys.stdin.readline()
""")


def regions_of(status: dict, pid: int) -> list[dict]:
    return [r for r in status["regions"] if r["owner_pid"] == pid]


@pytest.mark.parametrize("when", ["mid-release", "while released"])
def test_the_owner_killed_mid_release_gives_every_page_back(when):
    client = _client.client_for("cuda", torch.cuda.current_device())
    free_base = settled_free_memory()
    uptime = client.status()["uptime_seconds"]
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=dict(os.environ, **CHILD_ENV),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "made", owner.stderr.read()
        assert sum(r["bytes"] for r in regions_of(client.status(), owner.pid)) >= 16 * GiB
        owner.stdin.write("\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "releasing"
        if when == "mid-release":
            time.sleep(0.2)
        else:
            assert owner.stdout.readline().strip() == "released", owner.stderr.read()
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    finally:
        owner.kill()
    gone = wait_for(lambda: not regions_of(client.status(), owner.pid), 60)
    assert gone, f"the dead owner's regions: {regions_of(client.status(), owner.pid)}"
    assert client.connected, "subletd died with the owner"
    after = client.status()
    assert after["uptime_seconds"] > uptime, "not the same daemon"
    back = wait_for(lambda: torch.cuda.mem_get_info()[0] >= free_base - SLACK, 60)
    free_after = torch.cuda.mem_get_info()[0]
    assert back, f"device memory not back: {free_base / GiB:.2f} GiB free before the owner, " \
                 f"{free_after / GiB:.2f} GiB after its death"
    still_serves()
    print(f"\nowner killed {when}: its regions gone, {free_after / GiB:.2f} GiB free "
          f"({free_base / GiB:.2f} before it), the daemon serves on")


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def still_serves() -> None:
    """A release and resume of this process after the other's death."""
    t = pool_tensors("after-death", 1, 4 * 64 * MiB, seed=9)[0].view(4, 64 * MiB)
    before = bits(t[::2])
    rel = release("after-death", keep=t[::2])
    rel.resume()
    assert same_bits(t[::2], before)
    del t


# --------------------------------------------------------------------------- memory taken

def test_resume_while_the_memory_is_taken_fails_then_succeeds_once_it_is_freed():
    """The freed memory taken by a plain allocation: resume raises SubletOutOfMemoryError (all
    or none: the pages it could make go back to the device), again on a second try; once the
    allocation is freed, resume succeeds and every kept bit is there."""
    caches = pool_layers("taken", 32, 1024, seed=31)
    ids = torch.arange(0, 1024, 4)
    before = kept_bits(caches, ids)
    rel = release("taken", keep=sublet.blocks(caches, ids, dim=1))
    assert rel.released_bytes > 1 * GiB
    hog = torch.empty(free_now() - 256 * MiB, dtype=torch.uint8, device="cuda").fill_(0xEE)
    for attempt in (1, 2):
        free0 = free_now()
        with pytest.raises(sublet.SubletOutOfMemoryError):
            rel.resume()
        assert rel.active, "the release goes on after a failed resume"
        assert free_now() >= free0 - 64 * MiB, f"attempt {attempt} kept pages it made"
    del hog
    torch.cuda.empty_cache()
    rel.resume()
    assert not rel.active
    assert_kept(caches, ids, before, "after the failed resumes")
    write_unkept_and_recheck(caches, ids, before, "after the failed resumes")
    assert rel.copied_bytes == 0
    del caches
