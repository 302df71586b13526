"""sublet.compat.torch_memory_saver end to end on the memfd backend (no GPU): regions, nesting,
pause/resume of one tag and of all, keep= and stay=, the host copies of retain_cpu_backup and
TMS_INIT_ENABLE, against a real subletd (conftest's memfd_daemon: 64 KiB pages, 64 MiB).

CPU allocations are not routed (PyTorch has no allocator hook for them), so a region routes
nothing here: the tests allocate "in the region" from the pool the innermost region names
(`tms._impl.current_pool().empty(...)`). On a GPU, tensors made inside the region go there by
themselves (test_gpu_compat_tms.py). Every test uses tags of its own: pools live as long as
the process.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sublet
from sublet.compat import torch_memory_saver as tms_module

from conftest import PAGE, memfd_free_bytes as free_bytes
from pool_helpers import bits, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

MiB = 1024 * 1024


def _has_release() -> bool:
    try:
        tms_module._release_api()
        return True
    except RuntimeError:
        return False


# pause() is sublet.release(): until this sublet has it (issue 22), those tests skip.
needs_release = pytest.mark.skipif(not _has_release(), reason="this sublet has no "
                                   "sublet.release() yet (docs/design/release.md)")


@pytest.fixture
def tms():
    """A fresh TorchMemorySaver on the memfd daemon's device; whatever a test left paused is
    resumed, so that the next test finds the daemon's memory free."""
    saver = tms_module.TorchMemorySaver()
    saver._impl_ctor_kwargs["device"] = "cpu"
    yield saver
    if saver._impl is not None:
        for tag in list(saver._impl._paused):
            saver._impl._resume_tag(tag)
    gc.collect()


def alloc(tms, nbytes: int, seed: int) -> torch.Tensor:
    """A tensor of random bytes "made inside" the innermost region (its pool's empty())."""
    pool = tms._impl.current_pool()
    assert pool is not None, "alloc() is for use inside a region"
    return random_bytes(pool.empty(nbytes, dtype=torch.uint8), seed)


def releases(tms, tag: str) -> list:
    return tms._impl._paused[tag]


# --------------------------------------------------------------------------- regions

def test_nested_regions_inner_tag_wins_and_the_outer_comes_back(tms):
    impl = None
    with tms.region("nest-outer"):
        impl = tms._impl
        assert impl.current_pool().tag == "nest-outer"
        with tms.region("nest-inner", enable_cpu_backup=True):
            assert impl.current_pool().tag == "nest-inner+backup"
            with tms.disable():
                assert impl.current_pool() is None
            assert impl.current_pool().tag == "nest-inner+backup"
        assert impl.current_pool().tag == "nest-outer"
        with tms.region("nest-outer"):           # the same tag again: fine
            assert impl.current_pool().tag == "nest-outer"
    assert impl.current_pool() is None
    assert impl.tags() == ["nest-outer", "nest-inner"]


def test_disable_outside_a_region_is_refused(tms):
    with pytest.raises(RuntimeError, match="inside a region"):
        with tms.disable():
            pass


def test_one_pool_per_tag_and_backup_flag(tms):
    with tms.region("flags", enable_cpu_backup=False):
        plain = tms._impl.current_pool()
    with tms.region("flags", enable_cpu_backup=True):
        backup = tms._impl.current_pool()
    assert plain is sublet.pool("flags", device="cpu")
    assert backup is sublet.pool("flags+backup", device="cpu")


# --------------------------------------------------------------------------- pause, resume

@needs_release
def test_pause_gives_the_memory_back_and_resume_restores_the_backed_up_bits(tms):
    with tms.region("pr"):
        plain = alloc(tms, 8 * MiB, seed=1)
    with tms.region("pr", enable_cpu_backup=True):
        backed = alloc(tms, 8 * MiB + 3, seed=2)      # a partial last page
    before, ptrs = bits(backed), (plain.data_ptr(), backed.data_ptr())
    free0 = free_bytes()
    tms.pause("pr")
    rels = releases(tms, "pr")
    assert len(rels) == 2                               # one per pool of the tag
    released = sum(r.released_bytes for r in rels)
    assert released >= 16 * MiB and free_bytes() - free0 >= 16 * MiB
    assert sum(r.copied_bytes for r in rels) == 8 * MiB + PAGE   # the backup pool's
    # The memory is the daemon's to give: another region of all of it can be made meanwhile.
    other = sublet.empty(16 * MiB, dtype=torch.uint8, device="cpu").fill_(0xA5)
    del other
    gc.collect()
    tms.resume("pr")
    assert "pr" not in tms._impl._paused
    assert (plain.data_ptr(), backed.data_ptr()) == ptrs
    assert np.array_equal(bits(backed), before)
    del plain, backed


@needs_release
def test_a_cpu_backup_region_pins_host_memory_ahead_of_its_first_pause(tms, monkeypatch):
    """Leaving a region with enable_cpu_backup asks the daemon to pin the backup tags' bytes
    for the next release, in the background (sublet.pin_ahead(release=True)): the host
    memory the first pause would otherwise make on its path (what the daemon does with it:
    test_pin_ahead_memfd.py, test_pin.c). The pause then keeps its bits."""
    asked = []
    pin = sublet.pin_ahead
    monkeypatch.setattr(sublet, "pin_ahead", lambda n, device=None, release=False:
                        (asked.append((n, release)), pin(n, device=device, release=release)))
    with tms.region("ahead", enable_cpu_backup=True):
        backed = alloc(tms, 4 * MiB, seed=5)
    assert asked and asked[-1][1] is True
    assert asked[-1][0] >= sublet.pool("ahead+backup", device="cpu").nbytes >= 4 * MiB
    before = bits(backed)
    tms.pause("ahead")
    assert sum(r.copied_bytes for r in releases(tms, "ahead")) == 4 * MiB
    tms.resume("ahead")
    assert np.array_equal(bits(backed), before)
    with tms.region("ahead"):                           # no backup: no pin asked
        plain = alloc(tms, MiB, seed=6)
    assert len(asked) == 1
    del backed, plain


@needs_release
def test_pause_keep_keeps_those_bytes_on_the_device_unless_stay_says_otherwise(tms):
    with tms.region("keep"):
        t = alloc(tms, 4 * MiB, seed=3).view(64, -1)
    kept = t[::4]
    before = bits(kept)
    tms.pause("keep", keep=kept)
    (rel,) = releases(tms, "keep")
    assert rel.copied_bytes == 0 and rel.stats.kept_bytes == kept.numel()
    assert rel.released_bytes >= 3 * MiB - PAGE   # three quarters compacted away
    tms.resume("keep")
    assert np.array_equal(bits(kept), before)
    tms.pause("keep", keep=kept, stay=0)                # all of it to the host instead
    (rel,) = releases(tms, "keep")
    assert rel.copied_bytes == kept.numel() and rel.stayed_bytes == 0
    tms.resume("keep")
    assert np.array_equal(bits(kept), before)
    del t, kept


@needs_release
def test_pause_all_pauses_every_tag_not_paused_and_resume_all_resumes_them(tms):
    made = {}
    for i, tag in enumerate(["all-a", "all-b", "all-c"]):
        with tms.region(tag, enable_cpu_backup=True):
            made[tag] = alloc(tms, MiB, seed=10 + i)
    before = {tag: bits(t) for tag, t in made.items()}
    tms.pause("all-b")
    tms.pause()                                         # a and c; b is paused already
    assert set(tms._impl._paused) == {"all-a", "all-b", "all-c"}
    tms.pause()                                         # nothing left to pause: nothing done
    tms.resume()
    assert not tms._impl._paused
    assert all(np.array_equal(bits(made[t]), before[t]) for t in made)
    del made


@needs_release
def test_double_pause_and_resume_raise_instead_of_exiting(tms):
    with tms.region("twice", enable_cpu_backup=True):
        t = alloc(tms, MiB, seed=4)
    with pytest.raises(RuntimeError, match="is not paused"):
        tms.resume("twice")
    tms.pause("twice")
    with pytest.raises(RuntimeError, match="paused already"):
        tms.pause("twice")
    with pytest.raises(RuntimeError, match="is paused"):
        with tms.region("twice"):
            pass
    tms.resume("twice")
    with pytest.raises(RuntimeError, match="nothing is paused"):
        tms.resume()
    del t


def test_a_tag_with_no_memory_pauses_and_resumes(tms):
    """SGLang pauses "cuda_graph" whether or not it captured graphs."""
    tms.pause("never-used")
    tms.resume("never-used")
    with tms.region("empty-region"):
        pass
    tms.pause("empty-region")
    assert releases(tms, "empty-region") == []
    tms.resume("empty-region")


def test_keep_needs_a_tag(tms):
    with pytest.raises(ValueError, match="needs the tag"):
        tms.pause(keep=[])


# --------------------------------------------------------------------------- host copies

@needs_release
def test_get_cpu_backup_while_paused_without_retain_is_none(tms):
    with tms.region("gcb", enable_cpu_backup=True):
        backed = alloc(tms, MiB, seed=5)
    with tms.region("gcb"):
        plain = alloc(tms, MiB, seed=6)
    foreign = torch.zeros(16, dtype=torch.uint8)
    tms.pause("gcb")
    assert tms.get_cpu_backup(backed) is None          # the daemon holds pause()'s copy
    assert tms.get_cpu_backup(plain) is None           # no backup at all
    with pytest.raises(ValueError, match="not made inside"):
        tms.get_cpu_backup(foreign)
    tms.resume("gcb")
    del backed, plain


@needs_release
def test_retain_cpu_backup_keeps_a_host_copy_at_one_address_as_the_original(tms):
    """cpu_backup.py's retained-copy sequence: the copy is refreshed at each pause into the
    same buffer, kept after a resume while retain_cpu_backup is on, dropped at the first
    resume with it off."""
    assert tms.retain_cpu_backup is False
    with tms.region("retain", enable_cpu_backup=True):
        t = alloc(tms, 3 * PAGE + 100, seed=7)
    expected = bits(t)
    tms.retain_cpu_backup = True
    tms.pause("retain")
    first = tms.get_cpu_backup(t, zero_copy=True)
    ptr = first.data_ptr()
    assert np.array_equal(first.numpy(), expected)
    copy = tms.get_cpu_backup(t)
    assert copy.data_ptr() != ptr and np.array_equal(copy.numpy(), expected)
    tms.resume("retain")
    assert np.array_equal(bits(t), expected)
    assert tms.get_cpu_backup(t, zero_copy=True).data_ptr() == ptr
    tms.retain_cpu_backup = False
    random_bytes(t, seed=8)
    expected = bits(t)
    tms.pause("retain")                                # refreshes the retained buffer
    again = tms.get_cpu_backup(t, zero_copy=True)
    assert again.data_ptr() == ptr and np.array_equal(again.numpy(), expected)
    tms.resume("retain")
    assert np.array_equal(bits(t), expected)
    assert tms.get_cpu_backup(t) is None
    del t, first, again


def test_retain_from_the_environment(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    saver = tms_module.TorchMemorySaver()
    saver._impl_ctor_kwargs["device"] = "cpu"
    assert saver.retain_cpu_backup is True


# --------------------------------------------------------------------------- TMS_INIT_ENABLE

def test_init_enable_starts_a_default_region_at_first_use(monkeypatch):
    monkeypatch.setenv("TMS_INIT_ENABLE", "1")
    monkeypatch.setenv("TMS_INIT_ENABLE_CPU_BACKUP", "true")
    saver = tms_module.TorchMemorySaver()
    saver._impl_ctor_kwargs["device"] = "cpu"
    tms_module._warned.discard("init")
    with pytest.warns(RuntimeWarning, match="first use"):
        saver._ensure_initialized()
    assert saver._impl.current_pool().tag == "default+backup"
    with saver.region("init-inner"):
        assert saver._impl.current_pool().tag == "init-inner"
    with saver.disable():
        assert saver._impl.current_pool() is None
    assert saver._impl.current_pool().tag == "default+backup"


# --------------------------------------------------------------------------- graphs, failures

@needs_release
def test_a_tags_graph_pool_is_its_own_and_pauses_with_the_tag(tms):
    """cuda_graph(tag) captures into pool tag+"+graph" (a GPU captures; here the pool is
    filled directly), apart from the regions' pool; pause(tag) releases both."""
    with tms.region("g"):
        t = alloc(tms, MiB, seed=20)
    graph_pool = tms._impl.pool("g", False, graph=True)
    assert graph_pool is sublet.pool("g+graph", device="cpu")
    assert graph_pool is not tms._impl.pool("g", False)
    scratch = random_bytes(graph_pool.empty(2 * MiB, dtype=torch.uint8), 21)
    tms.pause("g")
    assert sum(r.released_bytes for r in releases(tms, "g")) >= 3 * MiB
    tms.resume("g")
    with pytest.raises(RuntimeError, match="CUDA"):
        with tms.cuda_graph(object(), tag="g"):
            pass
    del t, scratch


@needs_release
def test_pause_all_is_all_or_nothing(tms):
    """A tag that cannot be released (here: released already by sublet.release itself, so
    BusyError) undoes the pause of the tags released before it in the same call."""
    with tms.region("aon-a", enable_cpu_backup=True):
        a = alloc(tms, MiB, seed=22)
    with tms.region("aon-b"):
        b = alloc(tms, MiB, seed=23)
    a_before = bits(a)
    taken = sublet.release(sublet.pool("aon-b", device="cpu"), keep=[])
    try:
        with pytest.raises(sublet.BusyError):
            tms.pause()
        assert not tms._impl._paused
        assert np.array_equal(bits(a), a_before)
    finally:
        taken.resume()
    del a, b
