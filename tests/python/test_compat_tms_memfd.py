"""sublet.compat.torch_memory_saver end to end on the memfd backend (no GPU): regions, nesting,
pause/resume of one tag and of all (and of tags holding nothing: no-ops), keep= and stay=,
where a paused CPU-backup tag's bytes are kept (this process's host copy, which
get_cpu_backup reads while paused; or subletd's with SUBLET_TMS_BACKUP=daemon),
retain_cpu_backup, memory_margin_bytes, TMS_INIT_ENABLE, against a real subletd (conftest's
memfd_daemon: 64 KiB pages, 64 MiB).

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
from sublet.compat.torch_memory_saver import _env, _impl

from conftest import PAGE, TOTAL, memfd_free_bytes as free_bytes
from pool_helpers import bits, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

MiB = 1024 * 1024


def _has_release() -> bool:
    try:
        _impl._release_api()
        return True
    except RuntimeError:
        return False


# pause() is sublet.release(): until this sublet has it (issue 22), those tests skip.
needs_release = pytest.mark.skipif(not _has_release(), reason="this sublet has no "
                                   "sublet.release() yet (docs/design/release.md)")


def new_saver() -> tms_module.TorchMemorySaver:
    """A fresh TorchMemorySaver on the memfd daemon's device."""
    saver = tms_module.TorchMemorySaver()
    saver._impl_ctor_kwargs["device"] = "cpu"
    return saver


def finish(saver: tms_module.TorchMemorySaver) -> None:
    """Resumes whatever a test left paused, so that the next test finds the memory free."""
    if saver._impl is not None:
        for tag in list(saver._impl._paused):
            saver._impl._resume_tag(tag)
    gc.collect()


@pytest.fixture
def tms():
    saver = new_saver()
    yield saver
    finish(saver)


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
@pytest.mark.parametrize("place", ["process", "daemon"])
def test_pause_gives_the_memory_back_and_resume_restores_the_backed_up_bits(place, monkeypatch):
    """The backup pool's bytes are kept by this process (copied to host buffers, the pool
    released keeping nothing) or, with SUBLET_TMS_BACKUP=daemon, by subletd (a release that
    keeps it all, stay=0)."""
    monkeypatch.setenv("SUBLET_TMS_BACKUP", place)
    tms = new_saver()
    tag = f"pr-{place}"
    with tms.region(tag):
        plain = alloc(tms, 8 * MiB, seed=1)
    with tms.region(tag, enable_cpu_backup=True):
        backed = alloc(tms, 8 * MiB + 3, seed=2)      # a partial last page
    before, ptrs = bits(backed), (plain.data_ptr(), backed.data_ptr())
    free0 = free_bytes()
    tms.pause(tag)
    rels = releases(tms, tag)
    assert len(rels) == 2                               # one per pool of the tag
    released = sum(r.released_bytes for r in rels)
    assert released >= 16 * MiB and free_bytes() - free0 >= 16 * MiB
    copied = 8 * MiB + PAGE if place == "daemon" else 0   # the backup pool's, by subletd
    assert sum(r.copied_bytes for r in rels) == copied
    # The memory is the daemon's to give: another region of all of it can be made meanwhile.
    other = sublet.empty(16 * MiB, dtype=torch.uint8, device="cpu").fill_(0xA5)
    del other
    gc.collect()
    tms.resume(tag)
    assert tag not in tms._impl._paused
    assert (plain.data_ptr(), backed.data_ptr()) == ptrs
    assert np.array_equal(bits(backed), before)
    del plain, backed
    finish(tms)


@needs_release
def test_a_cpu_backup_region_pins_host_memory_ahead_of_its_first_pause(monkeypatch):
    """With SUBLET_TMS_BACKUP=daemon, leaving a region with enable_cpu_backup asks the daemon
    to pin the backup tags' bytes for the next release, in the background
    (sublet.pin_ahead(release=True)): the host memory the first pause would otherwise make on
    its path (what the daemon does with it: test_pin_ahead_memfd.py, test_pin.c). The pause
    then keeps its bits. Without it (this process keeps the copy) nothing is asked."""
    monkeypatch.setenv("SUBLET_TMS_BACKUP", "daemon")
    tms = new_saver()
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
    finish(tms)
    monkeypatch.setenv("SUBLET_TMS_BACKUP", "process")
    here = new_saver()
    with here.region("ahead-here", enable_cpu_backup=True):
        kept_here = alloc(here, MiB, seed=7)
    assert len(asked) == 1
    del kept_here


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


def test_a_tag_with_no_memory_pauses_and_resumes_as_no_ops(tms):
    """As the original: pause(t) and resume(t) of a tag holding nothing do nothing, however
    often (SGLang pauses "cuda_graph" whether or not it captured graphs); a region of it can
    be entered after its pause."""
    for _ in range(2):
        tms.pause("never-used")
    for _ in range(2):
        tms.resume("never-used")
    tms.resume("never-paused")
    with tms.region("empty-region"):
        pass
    tms.pause("empty-region")
    tms.pause("empty-region")
    assert "empty-region" not in tms._impl._paused
    with tms.region("empty-region"):
        pass
    tms.resume("empty-region")
    tms.pause()                                         # every tag, none holding memory
    tms.resume()
    assert not tms._impl._paused


def test_keep_needs_a_tag(tms):
    with pytest.raises(ValueError, match="needs the tag"):
        tms.pause(keep=[])


# --------------------------------------------------------------------------- host copies

@needs_release
def test_get_cpu_backup_while_paused_reads_this_processs_host_copy(tms):
    """As the original (cpu_backup.py): the backed-up tensors' bytes are readable while
    paused, typed and shaped as the tensor; None after the resume (not retained), None for a
    tensor made without backup; a tensor no region made is refused."""
    with tms.region("gcb", enable_cpu_backup=True):
        backed = alloc(tms, MiB, seed=5)
        typed = alloc(tms, 6000 * 4, seed=9).view(torch.float32).view(10, 20, 30)
    with tms.region("gcb"):
        plain = alloc(tms, MiB, seed=6)
    expected, typed_expected = bits(backed), typed.clone()
    foreign = torch.zeros(16, dtype=torch.uint8)
    assert tms.get_cpu_backup(backed) is None          # active, not retained
    tms.pause("gcb")
    host = tms.get_cpu_backup(backed)
    assert host is not None and np.array_equal(host.numpy(), expected)
    got = tms.get_cpu_backup(typed)
    assert (got.dtype, got.shape) == (torch.float32, (10, 20, 30))
    assert torch.equal(got.view(torch.uint8), typed_expected.view(torch.uint8))
    view = tms.get_cpu_backup(backed, zero_copy=True)
    assert view.data_ptr() == tms.get_cpu_backup(backed, zero_copy=True).data_ptr()
    assert tms.get_cpu_backup(plain) is None           # no backup at all
    with pytest.raises(ValueError, match="not made inside"):
        tms.get_cpu_backup(foreign)
    tms.resume("gcb")
    assert np.array_equal(bits(backed), expected)
    assert tms.get_cpu_backup(backed) is None          # dropped at the resume
    del backed, typed, plain, view


@needs_release
def test_with_the_daemon_keeping_the_bytes_get_cpu_backup_is_none_while_paused(monkeypatch):
    monkeypatch.setenv("SUBLET_TMS_BACKUP", "daemon")
    tms = new_saver()
    with tms.region("gcb-daemon", enable_cpu_backup=True):
        backed = alloc(tms, MiB, seed=5)
    expected = bits(backed)
    tms.pause("gcb-daemon")
    assert tms.get_cpu_backup(backed) is None          # subletd holds pause()'s copy
    tms.resume("gcb-daemon")
    assert np.array_equal(bits(backed), expected)
    del backed
    finish(tms)


@needs_release
def test_retain_set_while_paused_keeps_the_copy_at_its_address(tms):
    """cpu_backup.py's sequence: pause, read the copy (zero_copy), turn retain on, resume:
    the same host buffer still holds the bytes; with retain off, the next resume drops it."""
    with tms.region("gcb-retain", enable_cpu_backup=True):
        t = alloc(tms, 4096, seed=11)
    expected = bits(t)
    tms.pause("gcb-retain")
    first = tms.get_cpu_backup(t, zero_copy=True).data_ptr()
    tms.retain_cpu_backup = True
    tms.resume("gcb-retain")
    after = tms.get_cpu_backup(t, zero_copy=True)
    assert after.data_ptr() == first and np.array_equal(after.numpy(), expected)
    tms.retain_cpu_backup = False
    tms.pause("gcb-retain")
    tms.resume("gcb-retain")
    assert tms.get_cpu_backup(t) is None
    assert np.array_equal(bits(t), expected)
    del t, after


# --------------------------------------------------------------------------- the C library's stand-in

def test_the_c_library_stand_in_reports_the_region_config_and_refuses_the_rest(monkeypatch):
    """_impl._binary_wrapper.cdll, the Python stand-in of the original's C library: the
    region config as nested_region.py reads it, slime's interesting-region switch around
    deep_ep's Buffer (routing suspended, then back), and clear refusals for the rest."""
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    tms = new_saver()
    tms._ensure_initialized()
    cdll = tms._impl._binary_wrapper.cdll
    assert (cdll.tms_get_interesting_region(), cdll.tms_get_current_tag()) == (False, b"default")
    assert cdll.tms_get_cpu_backup_backend() == b"mmap"
    with tms.region("lib-outer", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert cdll.tms_get_interesting_region() and cdll.tms_get_enable_cpu_backup()
        assert cdll.tms_get_current_tag() == b"lib-outer"
        assert cdll.tms_get_cpu_backup_backend() == b"pinned"
        cdll.tms_set_interesting_region.argtypes = [object]   # as code does; ignored
        cdll.tms_set_interesting_region(False)                # slime, around deep_ep
        assert not cdll.tms_get_interesting_region()
        assert tms._impl._routed[tms._impl._current_device()] is None
        cdll.tms_set_interesting_region(True)
        assert tms._impl._routed[tms._impl._current_device()] is tms._impl.current_pool()
        with tms.disable():
            assert not cdll.tms_get_interesting_region()
            assert cdll.tms_get_current_tag() == b"lib-outer"
    assert cdll.tms_get_retain_cpu_backup() is False
    cdll.tms_set_retain_cpu_backup(True)
    assert tms.retain_cpu_backup is True
    with pytest.raises(RuntimeError, match="outside a region"):
        cdll.tms_set_interesting_region(True)
    with pytest.raises(NotImplementedError, match="region"):
        cdll.tms_set_current_tag(b"x")
    with pytest.raises(AttributeError, match="get_cpu_backup"):
        cdll.tms_get_cpu_backup_pointer



# --------------------------------------------------------------------------- margin

@pytest.fixture
def margin_reset():
    yield
    sublet.pool("margin-reset", device="cpu")  # the client every pool of the device shares
    from sublet._memory import resolve_device
    resolve_device("cpu")[1].pool_set_margin(0)


def _arena_gaps() -> int:
    """Bytes of the device's arena no segment holds (an allocation there grows nothing)."""
    from sublet._memory import resolve_device
    client = resolve_device("cpu")[1]
    region = client.pool_region()
    if region is None:
        return 0
    used = int(client.pool_segments(0)[:, 1].sum()) if len(client.pool_segments(0)) else 0
    return region.size - used


def test_memory_margin_bytes_fails_region_allocations_that_would_leave_less_free(
        tms, margin_reset):
    """As the original's malloc (csrc/core.cpp:47-60): an allocation in a region fails with
    out-of-memory when margin + its new device memory > the device's free memory; within
    it, or with the margin back at 0, it succeeds."""
    size = _arena_gaps() + 4 * MiB                      # the arena must grow by >= 4 MiB
    tms.memory_margin_bytes = free_bytes() - 2 * MiB
    with tms.region("margin"):
        with pytest.raises(sublet.SubletOutOfMemoryError, match="margin"):
            alloc(tms, size, seed=12)
    tms.memory_margin_bytes = free_bytes() - size - 2 * MiB
    with tms.region("margin"):
        within = alloc(tms, size, seed=13)
    tms.memory_margin_bytes = TOTAL                     # more than the device has
    with tms.region("margin"):
        with pytest.raises(sublet.SubletOutOfMemoryError, match="margin"):
            alloc(tms, _arena_gaps() + MiB, seed=14)
    tms.memory_margin_bytes = 0
    with tms.region("margin"):
        more = alloc(tms, 2 * MiB, seed=15)
    del within, more


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


@needs_release
@pytest.mark.parametrize("paused", [False, True])
def test_a_pool_popped_from_mem_pools_and_dropped_takes_its_retained_copy(tms, paused):
    """cpu_backup.py's last step, as code reaches into the original: _impl._mem_pools keyed
    (tag, backup, disk, backend, device), a pool popped and dropped under
    _with_region_config takes its host copy with it, retained, paused or not."""
    with tms.region("popped", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        t = alloc(tms, PAGE + 100, seed=21)
    expected = bits(t)
    impl = tms._impl
    key = ("popped", True, False, "pinned", impl._current_device())
    assert key in impl._mem_pools and ("popped", False, False, "", key[4]) not in impl._mem_pools
    tms.retain_cpu_backup = True
    tms.pause("popped")
    backup = tms.get_cpu_backup(t, zero_copy=True)
    assert np.array_equal(backup.numpy(), expected)
    if not paused:
        tms.resume("popped")
        assert tms.get_cpu_backup(t, zero_copy=True).data_ptr() == backup.data_ptr()
    pool = impl._mem_pools.pop(key)
    assert pool.nbytes > 0                               # the pool's own attributes
    del backup
    with impl._with_region_config(tag="popped", enable_cpu_backup=True,
                                  cpu_backup_backend="pinned"):
        assert impl.config().tag == "popped"
        del pool
        gc.collect()
    assert impl._host.keys() == []
    if paused:
        tms.resume("popped")                             # nothing to restore: dropped
    else:
        assert tms.get_cpu_backup(t) is None and np.array_equal(bits(t), expected)
    tms.retain_cpu_backup = False
    del t


def test_the_c_library_stand_in_resolves_cuda_runtime_symbols_of_the_process():
    """cdll.cudaHostGetFlags (cpu_backup.py asks it of a backup's pointer): the libcudart
    PyTorch loaded; without one loaded, the AttributeError names the preload library."""
    cdll = _impl._TorchMemorySaverImpl(device="cpu")._binary_wrapper.cdll
    loaded = any("libcudart.so" in line for line in open("/proc/self/maps"))
    if loaded:
        assert callable(cdll.cudaHostGetFlags) and cdll.cudaGetLastError.__name__
    else:
        with pytest.raises(AttributeError, match="preload library"):
            cdll.cudaHostGetFlags


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
    _env._warned.discard("init")
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


# ------------------------------------------------------------------ need= (issue 42)

def _need_tag(tms, tag: str, plain_bytes: int, backed_bytes: int, seed: int):
    """A tag of a plain tensor and a CPU-backup one; (plain, backed)."""
    with tms.region(tag):
        plain = alloc(tms, plain_bytes, seed=seed)
    with tms.region(tag, enable_cpu_backup=True):
        backed = alloc(tms, backed_bytes, seed=seed + 1)
    return plain, backed


@needs_release
def test_pause_by_need_releases_only_the_pages_the_need_takes(tms):
    """pause(tag, need=N): one release of the tag's pools by need. The free bytes count first;
    of the rest, the pages with no kept byte (the plain pool's) go first; the backup bytes are
    kept by the release and never cross the host link; status shows the need. Without need the
    same tag gives back every page (the backup bytes to the host)."""
    from sublet import _memory
    plain, backed = _need_tag(tms, "nd-one", MiB, MiB, seed=40)
    before = bits(backed)
    gc.collect()
    free0 = free_bytes()
    tms.pause("nd-one", need=free0 + 5 * PAGE)
    (rel,) = releases(tms, "nd-one")
    assert rel.need_bytes == free0 + 5 * PAGE
    assert rel.stats.released_pages == 5 and free_bytes() == free0 + 5 * PAGE
    assert rel.moved_bytes == rel.copied_bytes == 0     # plain pages: nothing kept in them
    mine = [r for r in _memory.resolve_device("cpu")[1].status()["releases"]
            if r["id"] == rel.stats.release_id]
    assert (mine[0]["need_bytes"], mine[0]["free_bytes"]) == (free0 + 5 * PAGE, free0)
    tms.resume("nd-one")
    assert np.array_equal(bits(backed), before)
    tms.pause("nd-one")                                 # the original's call: everything
    everything = sum(r.released_bytes for r in releases(tms, "nd-one"))
    assert everything >= 2 * MiB > 5 * PAGE
    tms.resume("nd-one")
    assert np.array_equal(bits(backed), before)
    del plain, backed


@needs_release
def test_pause_keep_and_need_move_the_kept_bytes_into_pages_that_stay(tms):
    """pause(tag, keep=..., need=N): one release by need with that keep. A quarter of each of 8
    pages kept, 4 pages needed: those 4 pages' kept bytes (a page) move on the device into the
    holes of the 4 that stay, nothing to the host; every kept bit comes back. Without need 6
    go (as few pages stay as hold the kept bytes)."""
    with tms.region("nd-keep"):
        t = alloc(tms, 8 * PAGE, seed=42).view(8, PAGE)
    kept = t[:, :PAGE // 4]
    before = bits(kept)
    gc.collect()
    free0 = free_bytes()
    tms.pause("nd-keep", keep=kept, need=free0 + 4 * PAGE)
    (rel,) = releases(tms, "nd-keep")
    assert (rel.stats.released_pages, rel.stats.stayed_pages) == (4, 4)
    assert (rel.moved_bytes, rel.copied_bytes) == (PAGE, 0)
    tms.resume("nd-keep")
    assert np.array_equal(bits(kept), before)
    tms.pause("nd-keep", keep=kept)                     # without need
    assert releases(tms, "nd-keep")[0].stats.released_pages == 6
    tms.resume("nd-keep")
    del t, kept


@needs_release
def test_sglangs_pauses_under_one_need_from_the_environment(tms, monkeypatch):
    """$SUBLET_RELEASE_NEED (a human size) is read at each pause, as SGLang calls them
    (kv_cache, weights, cuda_graph): the KV cache cannot give the need alone, so it goes whole
    (as without need); the weights then give only the rest (their other pages stay on the
    device, bytes and all); the graph tag, the need met, gives nothing."""
    with tms.region("nd-kv"):
        kv = alloc(tms, 6 * PAGE, seed=44)
    with tms.region("nd-w", enable_cpu_backup=True):
        weights = alloc(tms, 8 * PAGE, seed=45)
    with tms.region("nd-g"):
        graph = alloc(tms, 2 * PAGE, seed=46)
    before = bits(weights)
    gc.collect()
    free0 = free_bytes()
    kv_pages = sublet.pool("nd-kv", device="cpu").nbytes // PAGE
    need = free0 + (kv_pages + 3) * PAGE
    monkeypatch.setenv("SUBLET_RELEASE_NEED", f"{need // 1024}KiB")
    for tag in ("nd-kv", "nd-w", "nd-g"):
        tms.pause(tag)
    (kv_rel,) = releases(tms, "nd-kv")
    (w_rel,) = releases(tms, "nd-w")
    (g_rel,) = releases(tms, "nd-g")
    assert kv_rel.need_bytes is None and kv_rel.stats.released_pages == kv_pages
    assert w_rel.need_bytes == need and w_rel.stats.released_pages == 3
    assert w_rel.copied_bytes == 3 * PAGE               # the weights fill their pages: only
    assert w_rel.stayed_bytes == 5 * PAGE               # the 3 taken went to the host
    assert g_rel.need_bytes == need and g_rel.stats.released_pages == 0
    assert free_bytes() == need
    for tag in ("nd-g", "nd-w", "nd-kv"):
        tms.resume(tag)
    assert np.array_equal(bits(weights), before)
    del kv, weights, graph


@needs_release
def test_a_malformed_need_is_refused_naming_the_fix_before_anything_is_paused(tms, monkeypatch):
    with tms.region("nd-bad"):
        t = alloc(tms, MiB, seed=48)
    monkeypatch.setenv("SUBLET_RELEASE_NEED", "24 gigs")
    with pytest.raises(ValueError, match=r"\$SUBLET_RELEASE_NEED='24 gigs'.*24GiB.*unset it"):
        tms.pause("nd-bad")
    monkeypatch.delenv("SUBLET_RELEASE_NEED")
    for bad in (-1, 1.5, True, "lots"):
        with pytest.raises(ValueError, match="need="):
            tms.pause("nd-bad", need=bad)
    assert not tms._impl._paused
    del t
