"""GPU tests of releases by need (issue 42): sublet.release(what, keep, need=N) gives the CUDA
driver only the pages the need takes beyond the device's free memory, the cheapest to give
(few kept bytes in few runs); their kept bytes move on the GPU into the holes of the pages that stay and
only what those cannot hold goes to the host. A plain PyTorch process and a cudaMalloc process
(ctypes on libcudart), neither knowing sublet, allocate their stated need during the release
of a 100 %-kept tensor and of a 30 %-kept pool tag; kept bits compared over cycles whose keeps
and needs change; an incremental need (Release.need) releases more while the taker holds what
it got. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_release_need.py -m gpu -s    # -s: the figures
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sublet

from test_gpu import cuda_daemon, page, random_fill, settled_free_memory  # noqa: F401
from test_gpu_pool import bits, same_bits
from test_gpu_release import (Consumer, _releases, pool_layers,  # noqa: F401 (the fixture)
                              releases_resumed_and_pools_emptied)
from gpu_memory import free_now

GiB, MiB = 1024 ** 3, 1024 ** 2
BLOCK = 64 * 1024
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


def release(what, keep=None, need=None):
    """sublet.release by need, remembered so that a failing test leaves nothing released."""
    rel = sublet.release(what, keep=keep, need=need)
    _releases.append(rel)
    return rel


def host_limit(kept: int, stayed_bytes: int) -> int:
    """The bytes no hole of a staying page can take: they cross the host link."""
    return max(0, kept - stayed_bytes)


def thirty_percent(nblocks: int) -> torch.Tensor:
    return torch.tensor([b for b in range(nblocks) if b % 10 < 3])


def subject(what: str):
    """(the thing to release, its keep, a thunk of the kept bits, the kept bytes, total)."""
    if what == "tensor":  # 100 % kept: every byte of it
        t = random_fill(sublet.empty(4 * GiB, dtype=torch.uint8, device="cuda"), 3)
        return t, [t], lambda: [bits(t)], t.nbytes, t.nbytes
    caches = pool_layers("need-pool", 64, 1024, seed=7)   # 4 GiB of 64 KiB blocks
    ids = thirty_percent(1024)
    keep = sublet.blocks(caches, ids, dim=1)
    kept = len(caches) * len(ids) * BLOCK
    return "need-pool", keep, lambda: [bits(c[:, ids]) for c in caches], kept, 4 * GiB


@pytest.mark.parametrize("kind", ["torch", "cudart"])
@pytest.mark.parametrize("what", ["tensor", "pool"])
def test_a_process_without_sublet_allocates_its_need(kind, what, page):
    """The GPU made nearly full; the consumer's need (a quarter of the 4 GiB beyond what is
    free) does not fit before the release and fits during it; about a quarter goes to the
    driver, not all of it, and the host gets exactly the limit."""
    target, keep, kept_now, kept, total = subject(what)
    before = kept_now()
    consumer = Consumer(kind)
    try:
        filler = torch.empty(settled_free_memory() - 512 * MiB, dtype=torch.uint8,
                             device="cuda")
        torch.cuda.synchronize()
        need = free_now() + total // 4
        assert consumer.ask(f"alloc {need}") == "oom", "it fits before the release"
        rel = release(target, keep=keep, need=need)
        stayed = rel.stayed_bytes
        assert rel.released_bytes < total // 2, "by need, not the whole tag"
        assert rel.copied_bytes == host_limit(kept, stayed)
        assert rel.moved_bytes + rel.copied_bytes <= min(kept, rel.released_bytes)
        assert consumer.ask(f"alloc {need}") == "ok", \
            f"{kind}: the need of {need / GiB:.2f} GiB did not fit (released " \
            f"{rel.released_bytes / GiB:.2f} GiB, free {free_now() / GiB:.2f})"
        assert consumer.ask("free") == "freed"
        rel.resume()
        del filler
    finally:
        consumer.close()
    assert all(same_bits(a, b) for a, b in zip(kept_now(), before)), f"{kind} {what}"
    print(f"\n{kind}, {what}: need {need / GiB:.2f} GiB; released "
          f"{rel.released_bytes / GiB:.2f} GiB, stayed {stayed / GiB:.2f}, moved "
          f"{rel.moved_bytes / GiB:.2f}, to the host {rel.copied_bytes / GiB:.2f}")


@pytest.mark.parametrize("what", ["tensor", "pool"])
def test_cycles_with_changing_keeps_and_needs_keep_every_bit(what, page):
    """Four releases by need of one 4 GiB subject, the owner writing and a new keep and need
    each time (10 to 100 % of it beyond what is free); a consumer allocates the need; every
    kept bit back after each resume, the host bytes the limit each time."""
    rng = np.random.default_rng(11)
    if what == "tensor":
        t = sublet.empty(4 * GiB, dtype=torch.uint8, device="cuda")
        rows = t.view(2048, 2 * MiB)
    else:
        caches = pool_layers("need-cycles", 64, 1024, seed=9)
    consumer = Consumer("torch")
    try:
        for cycle in range(4):
            if what == "tensor":
                random_fill(t, 100 + cycle)
                ids = torch.from_numpy(np.sort(rng.choice(2048, int(rng.integers(1, 2048)),
                                                          replace=False)))
                keep = [rows[int(i)] for i in ids]
                kept, total, target = len(ids) * 2 * MiB, t.nbytes, t
                kept_now = lambda: [bits(rows[ids])]  # noqa: E731
            else:
                for c in caches:
                    random_fill(c, 200 + cycle)
                ids = torch.from_numpy(np.sort(rng.choice(1024, int(rng.integers(1, 1024)),
                                                          replace=False)))
                keep = sublet.blocks(caches, ids, dim=1)
                kept, total, target = 64 * len(ids) * BLOCK, 4 * GiB, "need-cycles"
                kept_now = lambda: [bits(c[:, ids]) for c in caches]  # noqa: E731
            before = kept_now()
            gc.collect()
            torch.cuda.synchronize()
            need = free_now() + int(total * float(rng.choice([0.1, 0.25, 0.5, 0.9]))) - page
            rel = release(target, keep=keep, need=need)
            assert rel.copied_bytes == host_limit(kept, rel.stayed_bytes), cycle
            assert consumer.ask(f"alloc {need}") == "ok", cycle
            assert consumer.ask("free") == "freed"
            rel.resume()
            assert all(same_bits(a, b) for a, b in zip(kept_now(), before)), cycle
    finally:
        consumer.close()


@pytest.mark.parametrize("what", ["tensor", "pool"])
def test_an_incremental_need_releases_more_while_the_taker_holds_the_first(what, page):
    """The taker (cudaMalloc, no sublet) needs an eighth of the subject beyond what is free and
    allocates it; then it needs a quarter more, which does not fit until Release.need (the need
    in all) gives more pages, nothing resumed meanwhile; the host gets the limit after each
    step; one resume brings every kept bit back."""
    target, keep, kept_now, kept, total = subject(what)
    before = kept_now()
    consumer = Consumer("cudart")
    try:
        filler = torch.empty(settled_free_memory() - 512 * MiB, dtype=torch.uint8,
                             device="cuda")
        torch.cuda.synchronize()
        first, more = free_now() + total // 8, total // 4
        rel = release(target, keep=keep, need=first)
        released_first = rel.released_bytes
        assert consumer.ask(f"alloc {first}") == "ok"
        assert consumer.ask(f"alloc {more}") == "oom", "the second need fits before it is asked"
        rel.need(first + more)
        assert released_first < rel.released_bytes < total
        assert rel.copied_bytes == host_limit(kept, rel.stayed_bytes)
        assert consumer.ask(f"alloc {more}") == "ok", \
            f"released {rel.released_bytes / GiB:.2f} GiB, free {free_now() / GiB:.2f}"
        assert consumer.ask("free") == "freed"
        rel.resume()
        del filler
    finally:
        consumer.close()
    assert all(same_bits(a, b) for a, b in zip(kept_now(), before)), what
    print(f"\n{what}: needs {first / GiB:.2f} then {(first + more) / GiB:.2f} GiB; released "
          f"{released_first / GiB:.2f} then {rel.released_bytes / GiB:.2f} GiB, moved "
          f"{rel.moved_bytes / GiB:.2f}, to the host {rel.copied_bytes / GiB:.2f}")
