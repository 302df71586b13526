"""GPU tests of pools (issue 21): ordinary PyTorch tensors made inside `with sublet.pool(tag)`,
lent by tag to realistic borrowers, loans in sequence with changing keeps, every kept bit and
every byte of what is not lent compared after every loan. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_pool.py -m gpu -s    # -s shows the figures
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import sublet
from sublet._pool import arena_of

from conftest import CHILD_ENV
from pool_helpers import fill_until_full, pools_emptied  # noqa: F401 (fixture, autouse)
from test_gpu import cuda_daemon, free_memory_left, random_fill  # noqa: F401 (fixture)

GiB, MiB = 1024 ** 3, 1024 ** 2
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor's bits (int16 for bf16: a NaN is equal to itself as bits)."""
    return t.contiguous().view(torch.uint8).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def kv_layers(n: int, blocks: int, seed: int) -> list[torch.Tensor]:
    """A vLLM-like cache: n per-layer (2, blocks, 16, 8, 128) bf16 tensors (64 KiB blocks,
    32 KiB of keys and 32 KiB of values each), made by plain PyTorch calls."""
    out = []
    for layer in range(n):
        t = torch.empty(2, blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        out.append(random_fill(t, seed + layer))
    return out


def train_steps(steps: int = 3) -> float:
    """A borrower as a trainer is: a model, AdamW, autograd, bf16, a side stream, a thread,
    many allocations and frees."""
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.GELU(),
                                torch.nn.Linear(8192, 2048)).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    side = torch.cuda.Stream()
    loss = torch.zeros((), device="cuda")
    for _ in range(steps):
        x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
        loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.cuda.stream(side):
            junk = [torch.empty(int(s), dtype=torch.uint8, device="cuda").fill_(0x5A)
                    for s in np.random.default_rng(0).integers(1, 64 * MiB, 32)]
            del junk
        t = threading.Thread(target=lambda: torch.full((4096, 4096), 7.0, device="cuda").sum())
        t.start()
        t.join()
    torch.cuda.synchronize()
    value = float(loss)
    del model, opt, x, loss
    return value


def fill_memory(chunk: int = 256 * MiB) -> int:
    """Takes all the loan can give, writing it; returns the bytes."""
    held = fill_until_full(lambda size: torch.empty(size, dtype=torch.uint8, device="cuda"),
                           [chunk], torch.OutOfMemoryError, lambda t: t.fill_(0xEE))
    torch.cuda.synchronize()
    n = len(held) * chunk
    del held
    return n


# --------------------------------------------------------------------------- routing

def test_pool_routes_every_thread_and_stream_and_nothing_outside():
    inside = {}
    with sublet.pool("route") as pool:
        inside["main"] = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            inside["stream"] = torch.empty(3 * MiB, device="cuda")
        t = threading.Thread(target=lambda: inside.__setitem__(
            "thread", torch.empty(5 * MiB, device="cuda")))
        t.start()
        t.join()
        lin = torch.nn.Linear(512, 512, device="cuda")
        lin(torch.randn(8, 512, device="cuda")).sum().backward()
        inside["grad"] = lin.weight.grad
    outside = torch.empty(10 * MiB, dtype=torch.uint8, device="cuda")
    for name, tensor in inside.items():
        assert arena_of(tensor) is pool.arena, name
    assert arena_of(outside) is None
    assert pool.nbytes >= 18 * MiB
    print(f"\n{pool!r}")


def test_a_cuda_graph_captured_in_a_pool_replays_from_its_own_graph_pool():
    with sublet.pool("graph") as pool:
        static = torch.zeros(1 << 20, device="cuda")
        g = torch.cuda.CUDAGraph()
        warm = torch.cuda.Stream()
        with torch.cuda.stream(warm):
            (static * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(warm)
        with torch.cuda.graph(g):
            out = (static * 2 + 1)
    static.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(out == 7)
    # On torch 2.11 a capture serves the graph from its own pool, before any pool entered
    # earlier (seen on the H200): the graph's memory is PyTorch's, the rest the pool's.
    assert arena_of(static) is pool.arena and arena_of(out) is None
    del g, out, static


def test_pools_and_loans_do_not_nest():
    cache = sublet.empty(4 * MiB, dtype=torch.uint8)
    with sublet.pool("outer"):
        torch.empty(1, device="cuda")
        with pytest.raises(RuntimeError, match="do not nest"):
            with sublet.pool("inner"):
                pass
        with pytest.raises(RuntimeError, match="not start inside a pool"):
            with sublet.lend(cache):
                pass
    with sublet.lend(cache):
        with pytest.raises(RuntimeError, match="inside a loan"):
            with sublet.pool("outer"):
                pass


# --------------------------------------------------------------------------- lending

def test_a_64_layer_cache_lent_by_tag_to_training_loans_in_sequence():
    """64 layers of 96 MiB (6 GiB) and a "weights" tag beside them. Four loans of "kv", each
    keeping a new live set of blocks in every layer (runs and scattered), to a trainer that
    also takes all the memory the loan has; free memory held to 2 GiB so that the loan reaches
    the kept pages. After each: the kept blocks' bits and the weights' bits unchanged."""
    nblocks = 1536
    with sublet.pool("kv"):
        caches = kv_layers(64, nblocks, seed=1)
    with sublet.pool("weights"):
        weights = [random_fill(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"), 900 + i)
                   for i in range(4)]
    weights_before = [bits(w) for w in weights]
    rng = np.random.default_rng(3)
    for loan_no, live in enumerate(_live_sets(rng, nblocks)):
        ids = torch.from_numpy(live)
        kept_before = [bits(c[:, ids]) for c in caches]
        with free_memory_left(2 * GiB):
            with sublet.lend("kv", keep=sublet.blocks(caches, ids, dim=1)) as loan:
                loss = train_steps()
                filled = fill_memory()
        assert np.isfinite(loss) and filled > 0
        for layer, (c, before) in enumerate(zip(caches, kept_before)):
            assert same_bits(c[:, ids], before), f"loan {loan_no}: layer {layer} lost kept bits"
        assert all(same_bits(w, b) for w, b in zip(weights, weights_before))
        s = loan.stats
        print(f"\nloan {loan_no}: {len(live)} live blocks, unkept {s.served_unkept_bytes / GiB:.2f}"
              f" GiB, fresh {s.served_fresh_bytes / GiB:.2f}, kept pages "
              f"{s.served_kept_bytes / GiB:.2f}; moved {s.moved_bytes / GiB:.2f} GiB, to the "
              f"host {s.copied_out_bytes / GiB:.3f} GiB; map {s.map_seconds:.3f} s")
        assert s.served_unkept_bytes > 0
    del caches, weights


def _live_sets(rng: np.random.Generator, nblocks: int) -> list[np.ndarray]:
    """Live sets as engines leave them: scattered, in runs, few, many; one repeated."""
    scattered = np.sort(rng.choice(nblocks, nblocks * 3 // 10, replace=False))
    runs = np.concatenate([np.arange(s, min(s + 40, nblocks))
                           for s in range(0, nblocks, 160)])
    few = np.sort(rng.choice(nblocks, 20, replace=False))
    return [scattered, runs, few, scattered]


def test_a_list_of_pool_tensors_lends_them_and_keeps_the_rest():
    with sublet.pool("mixed"):
        a = random_fill(torch.empty(512 * MiB, dtype=torch.uint8, device="cuda"), 1)
        b = random_fill(torch.empty(512 * MiB, dtype=torch.uint8, device="cuda"), 2)
        c = random_fill(torch.empty(512 * MiB, dtype=torch.uint8, device="cuda"), 3)
    b_before, c_head = bits(b), bits(c[:100 * MiB])
    with free_memory_left(1 * GiB):
        with sublet.lend([a, c], keep=c[:100 * MiB], verify=True) as loan:
            fill_memory(64 * MiB)
    assert same_bits(b, b_before) and same_bits(c[:100 * MiB], c_head)
    assert loan.stats.served_unkept_bytes >= 900 * MiB
    del a, b, c


# Another process borrows the owner's pool tag: the owner offers "kv-x" and waits.
BORROWER = textwrap.dedent("""
    import torch, sublet
    for i in range(2):
        with sublet.borrow(name="pool-x", timeout=120) as loan:
            x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").fill_(0xAB)
            m = torch.nn.Linear(4096, 4096, device="cuda")
            m(torch.randn(512, 4096, device="cuda")).sum().backward()
            torch.cuda.synchronize()
            del x, m
        print(f"loan {i}: kept {loan.stats.served_kept_bytes} unkept "
              f"{loan.stats.served_unkept_bytes}", flush=True)
""")


def test_a_tag_offered_to_another_process():
    with sublet.pool("kv-x"):
        caches = kv_layers(8, 2048, seed=40)   # 8 x 128 MiB
    env = dict(os.environ, **CHILD_ENV)
    env.pop("SUBLET_SOCKET", None)
    child = subprocess.Popen([sys.executable, "-c", BORROWER], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        for i, live in enumerate([np.arange(0, 2048, 3), np.arange(100, 900)]):
            ids = torch.from_numpy(live)
            before = [bits(c[:, ids]) for c in caches]
            with free_memory_left(1 * GiB):
                with sublet.offer("kv-x", keep=sublet.blocks(caches, ids, dim=1),
                                  name="pool-x") as offer:
                    offer.wait(timeout=300)
            assert all(same_bits(c[:, ids], b) for c, b in zip(caches, before)), f"loan {i}"
        out, err = child.communicate(timeout=120)
    finally:
        child.kill()
    assert child.returncode == 0, err
    print("\n" + out.strip())
    del caches


def test_allocating_a_64_layer_cache_in_a_pool_costs_about_sublet_empty():
    """Issue 21's 1.2 x target, printed (timings are the benchmark's to judge: this only
    checks both work and prints them)."""
    layer = 2 * 4096 * 16 * 8 * 128 * 2            # 256 MiB: 64 layers are 16 GiB
    torch.cuda.synchronize()
    start = time.perf_counter()
    one = sublet.empty(64 * layer, dtype=torch.uint8)
    torch.cuda.synchronize()
    empty_s = time.perf_counter() - start
    del one
    gc.collect()
    start = time.perf_counter()
    with sublet.pool("timing"):
        caches = [torch.empty(layer, dtype=torch.uint8, device="cuda") for _ in range(64)]
    torch.cuda.synchronize()
    pool_s = time.perf_counter() - start
    print(f"\n64 layers of 256 MiB in a pool: {pool_s:.3f} s; sublet.empty of 16 GiB: "
          f"{empty_s:.3f} s ({pool_s / empty_s:.2f} x)")
    assert len(caches) == 64
    del caches
