"""Releases end to end on the memfd backend (no GPU): memory given back to the daemon's
device (its free bytes grow, and another client can take them), kept bits back after every
resume with keeps that change each time, several tags released at once, pool allocations
during a release, the refusals, the resume that finds the memory taken, and the owner or the
daemon killed while memory is released.

CPU tensors come from Pool.empty() and sublet.empty(device="cpu"); on a GPU
test_gpu_release.py does the same with real CUDA memory and plain consumers.
"""

from __future__ import annotations

import gc
import signal
import threading

import numpy as np
import pytest
import torch

import sublet
from conftest import PAGE, memfd_free_bytes as free_bytes
from pool_helpers import (bits, fill_loan, free_after_kill, layers, owner_process, random_bytes,
                          resume_without_daemon)
from test_survive import daemon  # noqa: F401 (the fixture: a subletd of the test's own)

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


def keep_blocks(caches, live):
    """Every layer's blocks `live` (dim 1 of a (2, blocks, ...) cache)."""
    return [c[:, b] for c in caches for b in live]


def test_release_gives_the_memory_back_and_keeps_bits():
    kv = sublet.pool("rel-kv", device="cpu")
    caches = layers(kv, 8, (2, 16, 1024), seed=1)         # 8 layers of one 64 KiB page
    live = [3, 9]
    keep = keep_blocks(caches, live)
    before = [bits(v) for v in keep]
    gc.collect()  # what earlier tests left in reference cycles frees its memory now, not below
    free0 = free_bytes()
    with sublet.release("rel-kv", keep=keep) as rel:
        assert rel.active
        # 8 KiB kept in each page, 64 KiB in all: one page holds them, 7 go back, and the
        # kept bytes of those 7 moved into the one that stays
        assert rel.stats.stayed_pages == 1 and rel.stats.released_pages == 7
        assert rel.released_bytes == 7 * PAGE and rel.copied_bytes == 0
        assert rel.moved_bytes == 7 * 8192 and rel.stats.kept_bytes == PAGE
        assert free_bytes() == free0 + 7 * PAGE
        taken = sublet.empty(7 * PAGE, dtype=torch.uint8, device="cpu")  # someone takes it
        taken.fill_(0xEE)
        del taken
        gc.collect()
    assert not rel.active and rel.stats.copied_in_bytes == 0
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    assert free_bytes() == free0
    del caches, keep


@pytest.mark.parametrize("stay", [None, 0, PAGE])
def test_releases_in_sequence_with_changing_keeps(stay):
    """Five releases of one tag, a new live set each time and the owner writing between them:
    every kept bit back after each; with stay=0 every kept byte crossed the host link."""
    kv = sublet.pool(f"seq-{stay}", device="cpu")
    caches = layers(kv, 4, (2, 32, 1024), seed=2)       # 4 layers of 32 blocks, 2 pages
    rng = np.random.default_rng(0 if stay is None else stay + 1)
    for round_ in range(5):
        live = sorted(rng.choice(32, size=int(rng.integers(1, 20)), replace=False).tolist())
        for c in caches:                                 # the owner's work between loans
            c[:, live[0]].copy_(random_bytes(torch.empty_like(c[:, live[0]]), seed=round_))
        keep = keep_blocks(caches, live)
        before = [bits(v) for v in keep]
        rel = sublet.release(kv, keep=keep, stay=stay)
        kept = rel.stats.kept_bytes
        assert kept == len(keep) * 4096                   # a block: K and V, 2 KiB each
        if stay == 0:
            assert rel.copied_bytes == kept and rel.stats.stayed_pages == 0
        elif stay is None:
            assert rel.copied_bytes == 0
            # a page group one of whose pages stays stays whole: its other pages are held
            assert rel.stats.stayed_pages - rel.stats.held_pages == -(-kept // PAGE)
        else:  # stay= bounds the pages that stay for kept bytes, not those a group holds
            assert rel.stats.stayed_pages - rel.stats.held_pages <= 1
        rel.resume()
        assert rel.stats.copied_in_bytes == rel.copied_bytes
        assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before)), round_
    del caches


def test_a_tag_on_pages_of_a_freed_tags_groups_is_released_whole():
    """A resume makes a tag's released run again as page groups; the tag dies, and two new
    tags get its pages. No group holds pages of both, and each tag's release gives back all
    of its pages (a group goes to the driver whole: one shared with the other tag would give
    none of it back), the other tags' bits untouched."""
    z = sublet.pool("grp-z", device="cpu")
    tz = random_bytes(z.empty(PAGE, dtype=torch.uint8), seed=20)  # holds the region
    a = sublet.pool("grp-a", device="cpu")
    ta = a.empty(32 * PAGE, dtype=torch.uint8).fill_(1)
    rel = sublet.release(a, keep=[ta[:100]])
    rel.resume()
    assert rel.stats.released_pages == 31 and rel.stats.allocations < 31  # in groups
    del ta, rel
    gc.collect()
    a.empty_cache()  # its 32 pages are the arena's free pages now, in their groups
    b, c = sublet.pool("grp-b", device="cpu"), sublet.pool("grp-c", device="cpu")
    tb = random_bytes(b.empty(8 * PAGE, dtype=torch.uint8), seed=21)
    tc = random_bytes(c.empty(8 * PAGE, dtype=torch.uint8), seed=22)
    free0 = free_bytes()
    for pool, other in ((b, tc), (c, tb)):  # keep=[]: the released tag's own bytes go
        kept = [bits(t) for t in (tz, other)]
        released = sublet.release(pool, keep=[])
        assert released.stats.stayed_pages == 0 and released.released_bytes >= 8 * PAGE
        assert free_bytes() == free0 + released.released_bytes
        released.resume()
        assert all(np.array_equal(bits(t), k) for t, k in zip((tz, other), kept)), pool.tag
    del tz, tb, tc
    gc.collect()
    for pool in (z, b, c):
        pool.empty_cache()


def test_a_refused_release_of_nothing_kept_leaves_every_byte_in_place():
    """With nothing kept, the owner unmaps the pages while subletd works (release.c,
    early_unmap); subletd refuses this one (half of it is released already), so every page
    of the other half is mapped again, its bytes untouched, and the memory stays the
    owner's."""
    b, c = sublet.pool("refused-b", device="cpu"), sublet.pool("refused-c", device="cpu")
    tb = random_bytes(b.empty(4 * PAGE, dtype=torch.uint8), seed=31)
    tc = random_bytes(c.empty(4 * PAGE, dtype=torch.uint8), seed=32)
    before = bits(tc)
    rel = sublet.release(b, keep=[])
    free0 = free_bytes()
    with pytest.raises(sublet.BusyError, match="released already"):
        sublet.release([b, c], keep=[])
    assert np.array_equal(bits(tc), before)
    assert free_bytes() == free0
    tc.add_(1)  # mapped for writing too
    rel.resume()
    del tb, tc


def test_tags_released_one_by_one_and_resumed_in_another_order():
    """SGLang's order: kv_cache, weights, cuda_graph paused; resumed graph, weights, kv."""
    pools = {t: sublet.pool(f"sg-{t}", device="cpu") for t in ("kv", "w", "g")}
    kv = layers(pools["kv"], 4, (2, 8, 1024), seed=3)
    w = layers(pools["w"], 3, (64, 1024), seed=4)
    g = layers(pools["g"], 1, (32, 1024), seed=5)
    w_before, g_before = [bits(t) for t in w], [bits(t) for t in g]
    free0 = free_bytes()
    rels = [sublet.release(pools["kv"], keep=[]),
            sublet.release(pools["w"], stay=0),       # weights to the host (CPU backup)
            sublet.release(pools["g"], stay=0)]
    assert free_bytes() == free0 + sum(r.released_bytes for r in rels)
    assert rels[0].released_bytes == 4 * PAGE
    with pytest.raises(sublet.BusyError, match="released already"):
        sublet.release(pools["w"], keep=[])
    for r in reversed(rels):
        r.resume()
    assert all(np.array_equal(bits(t), b) for t, b in zip(w, w_before))
    assert all(np.array_equal(bits(t), b) for t, b in zip(g, g_before))
    assert free_bytes() == free0
    del kv, w, g


def test_pool_allocations_during_a_release_avoid_released_pages():
    kv, other = sublet.pool("hole-kv", device="cpu"), sublet.pool("hole-other", device="cpu")
    a = layers(kv, 2, (32, 1024), seed=6)
    b = layers(other, 1, (32, 1024), seed=7)
    del a[0]
    gc.collect()                                   # a free gap in the middle of the arena
    rel = sublet.release(kv, keep=[])              # a[1]'s pages go back
    fresh = [random_bytes(other.empty(32, 1024, dtype=torch.bfloat16), seed=8 + i)
             for i in range(3)]                    # into the gap or the tail, never a hole
    snap = [bits(t) for t in fresh]
    rel.resume()
    assert all(np.array_equal(bits(t), s) for t, s in zip(fresh, snap))
    del a, b, fresh


def test_what_a_release_refuses():
    cache = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    rel = sublet.release(cache, keep=cache[:100])
    with pytest.raises(sublet.BusyError, match="resume them before lending"):
        with sublet.lend(cache):
            pass
    with pytest.raises(sublet.BusyError, match="released already"):
        sublet.release(cache, keep=[])
    with pytest.raises(ValueError, match="stay is bytes"):
        sublet.release(cache, stay=-1)
    rel.resume()                                   # in page groups: not lent ...
    with pytest.raises(sublet.BusyError, match="resumed already"):
        rel.resume()
    with pytest.raises(sublet.BusyError, match=r"page groups.*resume\(groups=False\)"):
        with sublet.lend(cache):
            pass
    sublet.release(cache, keep=[]).resume(groups=False)  # ... until resumed page by page
    with sublet.lend(cache):                       # a normal loan works again
        with pytest.raises(sublet.BusyError, match="is lent"):
            sublet.release(cache, keep=[])           # ... and its memory is not released
    assert "resumed" in repr(rel)


def test_a_view_releases_its_own_pages_and_keeps_its_neighbours():
    cache = sublet.empty(8 * PAGE, dtype=torch.uint8, device="cpu")
    cache.copy_(torch.randint(0, 256, cache.shape, dtype=torch.uint8))
    before = cache.clone()
    rel = sublet.release(cache[2 * PAGE + 10:], keep=[])   # page 2 is shared: kept
    assert rel.stats.released_pages == 5 and rel.stats.stayed_pages == 1
    rel.resume()
    assert torch.equal(cache[:2 * PAGE + 10], before[:2 * PAGE + 10])


def test_resume_waits_for_the_memory_to_be_free():
    cache = sublet.empty(16 * PAGE, dtype=torch.uint8, device="cpu")
    cache[:PAGE].copy_(torch.arange(PAGE, dtype=torch.int64).to(torch.uint8))
    before = cache[:PAGE].clone()
    rel = sublet.release(cache, keep=cache[:PAGE], stay=0)
    hog = sublet.empty(free_bytes(), dtype=torch.uint8, device="cpu")  # all that is free
    with pytest.raises(sublet.SubletOutOfMemoryError, match="free it first"):
        rel.resume()
    assert rel.active
    del hog
    gc.collect()
    rel.resume()
    assert torch.equal(cache[:PAGE], before)


def test_status_shows_releases():
    from sublet import _memory, _status
    cache = sublet.empty(4 * PAGE, dtype=torch.uint8, device="cpu")
    cache[:10].fill_(7)
    rel = sublet.release(cache, keep=cache[:10])
    _, client = _memory.resolve_device("cpu")
    status = client.status()
    mine = [r for r in status["releases"] if r["id"] == rel.stats.release_id]
    assert mine and mine[0]["released_bytes"] == 3 * PAGE and mine[0]["kept_bytes"] == 10
    assert mine[0]["state"] == "released" and mine[0]["stayed_bytes"] == PAGE
    assert [r["released_bytes"] for r in status["regions"] if r["id"] == mine[0]["region"]] \
        == [3 * PAGE]
    status["socket"] = "test"
    assert f"release  {rel.stats.release_id} of region" in _status.text_status(status)
    rel.resume()
    assert all(r["id"] != rel.stats.release_id for r in client.status()["releases"])


OWNER = """
import sys, time, torch, sublet
cache = sublet.empty(int(sys.argv[1]), dtype=torch.uint8, device="cpu")
rel = sublet.release(cache, keep=cache[:1000])  # its first page stays, holding them
print("released", flush=True)
time.sleep(60)
"""


def test_owner_killed_while_released_gives_everything_back():
    free0 = free_bytes()
    child = owner_process(OWNER, str(16 * PAGE))
    try:
        assert child.stdout.readline().startswith("released")
        assert free_bytes() == free0 - PAGE        # all but the page that stays is back
        assert free_after_kill(child, free0, tries=200) == free0
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("stay", [None, 0])
def test_daemon_killed_while_released_the_library_resumes(daemon, stay):
    n = 32 * PAGE
    cache = sublet.empty(n, dtype=torch.uint8, device="cpu")
    cache.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    keep = [cache[i * PAGE + 100:i * PAGE + 4196] for i in range(0, 32, 3)]
    before = [v.clone() for v in keep]
    rel = sublet.release(cache, keep=keep, stay=stay)
    assert rel.stats.released_pages > 0
    stats, caught = resume_without_daemon(daemon, rel)
    assert stats.daemon_died and any("put the kept bytes back" in str(w.message)
                                     for w in caught)
    assert all(torch.equal(v, b) for v, b in zip(keep, before))
    cache.fill_(1)                                  # the memory is this process's own now
    del cache
    gc.collect()


def test_daemon_killed_mid_release_of_nothing_kept_leaves_the_tensor_intact(daemon):
    """With nothing kept the owner unmaps the set while subletd works (release.c,
    early_unmap). subletd is stopped with the Release in its socket, then killed: the
    library maps the pages again with the handles it kept, every byte in place."""
    cache = random_bytes(sublet.empty(16 * PAGE, dtype=torch.uint8, device="cpu"), 41)
    before = bits(cache)
    daemon.proc.send_signal(signal.SIGSTOP)
    threading.Timer(0.5, daemon.kill).start()       # once the owner waits for Released
    with pytest.raises(sublet.DaemonUnavailableError):
        sublet.release(cache, keep=[])
    assert np.array_equal(bits(cache), before)
    cache.fill_(2)                                  # mapped for writing too
    del cache
    gc.collect()


def test_daemon_killed_mid_release_says_the_tensor_is_intact(daemon):
    """A release that keeps bytes of pages it gives back (moved into pages that stay), subletd
    stopped with the Release in its socket and then killed: the error says nothing was
    released and the tensor is intact, and what to do (it said only that subletd closed the
    connection, EPIPE). Every byte compared: a subletd that never ran the job copied nothing;
    one killed mid-job would only have copied kept bytes into unkept ones."""
    n = 32 * PAGE
    cache = random_bytes(sublet.empty(n, dtype=torch.uint8, device="cpu"), 43)
    keep = [cache[i * PAGE + 100:i * PAGE + 4196] for i in range(0, 32, 3)]
    before, kept = bits(cache), [bits(v) for v in keep]
    daemon.proc.send_signal(signal.SIGSTOP)
    threading.Timer(0.5, daemon.kill).start()       # once the owner waits for Released
    with pytest.raises(sublet.DaemonDiedError) as e:
        sublet.release(cache, keep=keep)
    message = str(e.value)
    assert "nothing was released, the tensor is intact" in message, message
    assert "make a new tensor and copy into it" in message, message
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, kept))
    assert np.array_equal(bits(cache), before)
    cache.fill_(3)                                  # mapped for writing, this process's own
    del cache
    gc.collect()


BLOCK = PAGE // 4


def test_page_groups_come_back_whole_and_are_lent_only_page_by_page():
    """A resume makes each run of released pages again as groups (a sixteenth of the run
    each); later releases with a new keep each time give back whole groups and hold the rest
    of a group that must stay. Every kept bit back, the memory counted exactly, then: a grouped
    region is not lent until a resume page by page undoes the groups."""
    n = 64
    t = random_bytes(sublet.empty(n * PAGE, dtype=torch.uint8, device="cpu"), 11)
    free0 = free_bytes()
    with sublet.release(t, keep=[]) as rel:
        assert rel.released_bytes == n * PAGE and free_bytes() == free0 + n * PAGE
    assert rel.stats.allocations == 4                    # 64 pages as 4 groups of 16
    rng = np.random.default_rng(7)
    held = 0
    for round_ in range(6):
        blocks = sorted(rng.choice(4 * n, size=int(rng.integers(1, 60)), replace=False).tolist())
        t[blocks[0] * BLOCK:(blocks[0] + 1) * BLOCK].copy_(
            random_bytes(torch.empty(BLOCK, dtype=torch.uint8), 100 + round_))  # owner's work
        keep = [t[b * BLOCK:(b + 1) * BLOCK] for b in blocks]
        before = [bits(v) for v in keep]
        rel = sublet.release(t, keep=keep)
        assert rel.copied_bytes == 0, round_
        assert rel.released_bytes + rel.stayed_bytes == n * PAGE
        assert rel.stats.stayed_pages - rel.stats.held_pages == -(-len(blocks) * BLOCK // PAGE)
        held += rel.stats.held_pages
        assert free_bytes() == free0 + rel.released_bytes
        taken = sublet.empty(rel.released_bytes, dtype=torch.uint8, device="cpu")
        taken.fill_(0xEE)                                # someone else used it meanwhile
        del taken
        gc.collect()
        rel.resume()
        assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before)), round_
        assert free_bytes() == free0
    assert held > 0                                      # some group stayed whole
    with pytest.raises(sublet.BusyError, match="groups=False"):
        with sublet.lend(t, keep=[]):
            pass
    before = bits(t)
    rel = sublet.release(t)                              # keep all: nothing released
    assert rel.released_bytes == 0
    rel.resume()
    sublet.release(t, keep=[t[:PAGE]], stay=0).resume(groups=False)
    assert np.array_equal(bits(t[:PAGE]), before[:PAGE])
    with sublet.lend(t, keep=[t[:PAGE]]) as loan:        # lendable again
        assert fill_loan(loan, 5) >= (n - 1) * PAGE  # the borrower wrote the rest
    assert np.array_equal(bits(t[:PAGE]), before[:PAGE])
    del t, keep, loan, rel
    gc.collect()
    assert free_bytes() == free0 + n * PAGE              # every group went with the region


def test_daemon_killed_while_groups_are_released(daemon):
    """Groups released, subletd SIGKILLed: the library makes the pages itself (a page each)
    and puts the kept bytes back; the region's groups are unmapped cleanly at its end."""
    n = 48
    t = random_bytes(sublet.empty(n * PAGE, dtype=torch.uint8, device="cpu"), 12)
    sublet.release(t, keep=[]).resume()                  # groups now
    keep = [t[i * PAGE + 64:i * PAGE + 64 + BLOCK] for i in range(0, n, 5)]
    before = [bits(v) for v in keep]
    rel = sublet.release(t, keep=keep, stay=None)
    assert rel.released_bytes > 0
    stats, _ = resume_without_daemon(daemon, rel)
    assert stats.daemon_died
    assert all(np.array_equal(bits(v), b) for v, b in zip(keep, before))
    t.fill_(3)                                           # every page is mapped and writable
    del t
    gc.collect()
