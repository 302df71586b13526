"""_TorchMemorySaverImpl: the state behind sublet's torch_memory_saver facade (entrypoint.py):
regions as sublet pools, pause/resume as sublet releases, the host copies of CPU-backup tags.

How it maps (docs/compat-torch-memory-saver.md says it for users):

- region(tag, enable_cpu_backup) routes the process's CUDA allocations on the current device
  to one sublet pool per (tag, backup flag) (_env.pool_name: "kv", "kv+backup"), as the
  original keys its MemPools by (tag, flags, device). Sublet's pools hold whole pages per
  segment, so a pool's pages hold tensors of one backup flag only, and "keep the backed-up
  tensors" is "keep all of the backup pool": no tensor tracking needed. cuda_graph(tag)
  captures into the tag's graph pool ("kv+graph"), apart from its regions' tensors as the
  original's graph pools are.
- pause(tag) is a sublet.release() of each of the tag's pools that hold memory: the plain pool
  keeping nothing; the backup pool keeping nothing either after its bytes are copied to this
  process's host buffers (_host.py: get_cpu_backup reads them while paused, as the original),
  or, with SUBLET_TMS_BACKUP=daemon, keeping everything with stay=0 (subletd holds the copy,
  pinned ahead). pause(tag, keep=...) is one sublet.release() of the tag's pools with that
  keep. resume(tag) resumes those releases. A tag that holds nothing pauses and resumes as a
  no-op, as in the original.
- Pools do not nest in sublet (one routes the device at a time), so nested regions leave the
  outer pool and enter it again after the inner one: the inner tag wins, the outer comes back.
- Sublet routes the whole process (every thread), where torch_memory_saver's region is the
  calling thread's: use regions from one thread at a time.

Errors where torch_memory_saver calls exit(1) (pausing a paused tag, resuming an active one,
an unknown pointer in get_cpu_backup) are exceptions here, naming the fix.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import torch

from . import _env
from ._host import HostCopies

logger = logging.getLogger(__name__)

_PoolKey = tuple[str, bool, torch.device, bool]  # (tag, enable_cpu_backup, device, graph)


class _Entry(NamedTuple):
    """A region entered on a device: its pool (None: a disable() block inside it) and the
    config the original's library would report for it."""
    pool: Any
    tag: str
    enable_cpu_backup: bool
    backend: str


def _release_api():
    """sublet.release (docs/design/release.md), named clearly when this sublet lacks it."""
    import sublet
    release = getattr(sublet, "release", None)
    if release is None:
        try:
            from sublet._release import release
        except ImportError as exc:
            raise RuntimeError("this sublet has no sublet.release(), which pause() needs: "
                               "install a sublet with the release API (issue 22)") from exc
    return release


class _TorchMemorySaverImpl:
    """The pools by (tag, backup, device, graph), the region stack of each device, the live
    releases of each paused tag, and the host copies.

    hook_mode: stored ("preload", "torch" or Dynamo's "gms"); sublet routes the same way in
    each. device: the device regions allocate on (None: the current CUDA device, or "cpu"
    where there is no CUDA: the memfd backend, on which nothing is routed and tensors come
    from current_pool().empty(): tests)."""

    def __init__(self, hook_mode: str = "preload", device=None):
        self._hook_mode = hook_mode
        self._device = None if device is None else torch.device(device)
        self._lock = threading.RLock()
        self._pools: dict[_PoolKey, Any] = {}
        self._stacks: dict[torch.device, list[_Entry]] = {}  # innermost last
        self._routed: dict[torch.device, Any] = {}
        self._suspended: set[torch.device] = set()  # tms_set_interesting_region(False)
        self._paused: dict[str, list] = {}            # tag -> its live sublet Releases
        self._backends: dict[_PoolKey, str] = {}     # the cpu_backup_backend last asked for
        self._host = HostCopies()
        self._binary = None
        self.retain_cpu_backup = _env.env_bool("TMS_RETAIN_CPU_BACKUP")
        self.disk_backup_dir = os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")
        self.memory_margin_bytes = 0
        self.default_backend = _env.env_backend()
        self.backup_place = _env.backup_place()

    @property
    def _binary_wrapper(self):
        """The original's `_impl._binary_wrapper`: its `.cdll` is a Python stand-in
        (binary_wrapper.py says what it has)."""
        if self._binary is None:
            from .binary_wrapper import BinaryWrapper
            self._binary = BinaryWrapper(self)
        return self._binary

    @property
    def _mem_pools(self) -> "_PoolsView":
        """The original's `_impl._mem_pools`, its MemPools by (tag, enable_cpu_backup,
        enable_disk_backup, cpu_backup_backend or "", device index), which code reaches into:
        a view of sublet's pools. A pool popped from it and dropped takes its host copies
        with it, retained or not, as the original's frees an allocation's backup with it."""
        return _PoolsView(self)

    @contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool,
                            cpu_backup_backend: Optional[str], enable_disk_backup: bool = False):
        """The original's: the library reports this config inside the block (frees made
        under it included). Nothing is routed anew, and a paused tag is no refusal."""
        device = self._current_device()
        entry = _Entry(self.current_pool(device), tag, bool(enable_cpu_backup),
                       cpu_backup_backend or self.default_backend)
        with self._pushed(device, entry):
            yield

    def discard_backups(self, key: _PoolKey) -> None:
        """The pool's host copies go, and PyTorch's cache of page-locked host memory gives
        them back to the system (the original frees them with the allocation)."""
        with self._lock:
            self._host.drop([key])
        if key[2].type == "cuda":
            torch.cuda.synchronize(key[2])
            empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
            if empty_host_cache is not None:
                empty_host_cache()

    # ------------------------------------------------------------ pools and devices
    def _current_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def pool(self, tag: str, enable_cpu_backup: bool, device: torch.device | None = None,
             graph: bool = False):
        """The sublet pool of (tag, backup) on device (default: the current one); graph: the
        one cuda_graph() captures into. A graph's pool is not its tag's regions' pool, as in
        the original (where graphs have PyTorch's graph pools): PyTorch hands the blocks a
        capture freed to later allocations of the same pool, which the graph's replays would
        then overwrite."""
        import sublet
        device = self._current_device() if device is None else torch.device(device)
        key = (tag, bool(enable_cpu_backup), device, bool(graph))
        with self._lock:
            found = self._pools.get(key)
            if found is None:
                name = _env.pool_name(tag, enable_cpu_backup, graph)
                found = self._pools[key] = sublet.pool(name, device=device)
                self._apply_margin(device)
            return found

    def current_pool(self, device: torch.device | None = None):
        """The pool the innermost region routes to on device (None: none, or disable())."""
        entry = self._innermost(device)
        return entry.pool if entry is not None else None

    def _innermost(self, device: torch.device | None = None) -> Optional[_Entry]:
        stack = self._stacks.get(self._current_device() if device is None else device, [])
        return stack[-1] if stack else None

    def tags(self) -> list[str]:
        """Every tag a region has used, in first-use order."""
        with self._lock:
            return list(dict.fromkeys(key[0] for key in self._pools))

    # ------------------------------------------------------------ the library's config view
    def config(self) -> _Entry:
        """The innermost region's config on the current device, or the process default (the
        original's thread-local config outside regions)."""
        return self._innermost() or _Entry(None, _env.TAG_DEFAULT,
                                           _env.env_bool("TMS_INIT_ENABLE_CPU_BACKUP"),
                                           self.default_backend)

    def interesting(self) -> bool:
        """tms_get_interesting_region: is a region routing the current device now?"""
        device = self._current_device()
        return self.current_pool(device) is not None and device not in self._suspended

    def set_interesting(self, value: bool) -> None:
        """tms_set_interesting_region: False suspends the routing of the current device (its
        allocations are PyTorch's own) until True; True outside a region is refused."""
        device = self._current_device()
        with self._lock:
            if value and self.current_pool(device) is None:
                raise RuntimeError("tms_set_interesting_region(True) outside a region: sublet "
                                   "routes allocations inside region() only; enter one")
            if value:
                self._suspended.discard(device)
            else:
                self._suspended.add(device)
            self._route(device)

    # ------------------------------------------------------------ regions
    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool,
               cpu_backup_backend: Optional[str]):
        if enable_disk_backup:
            raise NotImplementedError(
                "sublet's torch_memory_saver has no disk backup: use "
                "region(enable_cpu_backup=True), whose bytes are kept on the host while "
                "paused (or on the GPU: pause(tag, keep=...))")
        _check_tag(tag)
        if tag in self._paused:
            raise RuntimeError(f"tag {tag!r} is paused: resume({tag!r}) before allocating in "
                               f"region({tag!r})")
        device = self._current_device()
        entry = _Entry(self.pool(tag, enable_cpu_backup), tag, bool(enable_cpu_backup),
                       cpu_backup_backend or self.default_backend)
        self._backends[(tag, bool(enable_cpu_backup), device, False)] = entry.backend
        with self._pushed(device, entry):
            yield
        if enable_cpu_backup:
            self._pin_backups(device)

    def _pin_backups(self, device: torch.device) -> None:
        """With SUBLET_TMS_BACKUP=daemon the CPU-backup tags' bytes go to subletd's host memory
        at their pause: the daemon pins it now, in the background, instead of on the first
        pause's path (where it takes seconds per 10 GiB: docs/benchmarks.md). A hint: a
        daemon too old for it, or one that refuses, costs the pause nothing it did not cost
        before."""
        import sublet
        if self.retain_cpu_backup or self.backup_place != "daemon":
            return  # pause() then keeps nothing: the host copy is this process's own
        with self._lock:
            pools = [p for key, p in self._pools.items() if key[1] and key[2] == device]
        total = sum(p.nbytes for p in pools)
        try:
            if total:
                sublet.pin_ahead(total, device=device, release=True)
        except sublet.SubletError as e:
            logger.debug("no pin ahead of the CPU backups (%s): the first pause pins", e)

    @contextmanager
    def _pushed(self, device: torch.device, entry: _Entry) -> Iterator[None]:
        """entry routes the device until the block ends; then the region around it routes
        again."""
        with self._lock:
            stack = self._stacks.setdefault(device, [])
            stack.append(entry)
            try:
                self._route(device)
            except BaseException:
                stack.pop()
                self._route(device)
                raise
        try:
            yield
        finally:
            with self._lock:
                if not stack or stack[-1] is not entry:
                    raise RuntimeError("torch_memory_saver regions ended out of order: sublet "
                                       "routes the whole process, so use regions from one "
                                       "thread at a time")
                stack.pop()
                self._route(device)

    def _route(self, device: torch.device) -> None:
        """Makes the innermost entry's pool the one sublet pool entered on the device (none
        while suspended): pools do not nest in sublet, so the one routing now is left first.
        Nothing routes on a device that is not CUDA (memfd tests allocate with
        Pool.empty())."""
        target = None if device in self._suspended else self.current_pool(device)
        current = self._routed.get(device)
        if current is target:
            return
        if device.type != "cuda":
            self._routed[device] = target
            return
        if current is not None:
            current.__exit__(None, None, None)
            self._routed[device] = None
        if target is not None:
            target.__enter__()
            self._routed[device] = target

    def start_init_region(self) -> None:
        """TMS_INIT_ENABLE=1: a "default" region (TMS_INIT_ENABLE_CPU_BACKUP: with backup)
        that lasts for the process, from this first use of torch_memory_saver on. Unlike the
        original's LD_PRELOAD hook, allocations made before this call are not in it."""
        if not _env.env_bool("TMS_INIT_ENABLE"):
            return
        if _env.env_bool("TMS_INIT_ENABLE_DISK_BACKUP"):
            raise NotImplementedError("$TMS_INIT_ENABLE_DISK_BACKUP: sublet's "
                                      "torch_memory_saver has no disk backup; use "
                                      "TMS_INIT_ENABLE_CPU_BACKUP=1 instead")
        _env.warn_once("init", "TMS_INIT_ENABLE=1: sublet starts the 'default' region at the "
                               "first use of torch_memory_saver; CUDA memory allocated before "
                               "it is not pauseable (the original hooks cudaMalloc from "
                               "process start)")
        device = self._current_device()
        backup = _env.env_bool("TMS_INIT_ENABLE_CPU_BACKUP")
        entry = _Entry(self.pool(_env.TAG_DEFAULT, backup, device), _env.TAG_DEFAULT, backup,
                       self.default_backend)
        self._backends[(_env.TAG_DEFAULT, backup, device, False)] = entry.backend
        with self._lock:
            self._stacks.setdefault(device, []).insert(0, entry)
            self._route(device)

    @contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True):
        if not dispose_mem_pool_after_use:
            raise ValueError("only dispose_mem_pool_after_use=True is supported (as in the "
                             "original)")
        device = self._current_device()
        outer = self._innermost(device)
        if outer is None or outer.pool is None:
            raise RuntimeError("disable() is for use inside a region() (or with "
                               "TMS_INIT_ENABLE=1): outside one, allocations are ordinary "
                               "PyTorch memory already")
        with self._pushed(device, outer._replace(pool=None)):
            if device.type != "cuda":
                yield
                return
            mempool = torch.cuda.MemPool()  # as the original: PyTorch's memory, freed after
            with torch.cuda.use_mem_pool(mempool):
                yield
            del mempool

    @contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag: str,
                   enable_cpu_backup: bool, cpu_backup_backend: Optional[str]):
        """torch.cuda.graph(...) with pool= the MemPool of the tag's graph pool: the graph's
        private memory is sublet memory, which pause(tag) releases. PyTorch routes the capture
        to that MemPool, and libsublet serves its segments from the tag (Pool.capturing); the
        region around the capture, if any, routes the rest as before."""
        device = self._current_device()
        if device.type != "cuda":
            raise RuntimeError("cuda_graph() captures a CUDA graph and needs a CUDA device")
        _check_tag(tag)
        if pool is not None:
            _env.warn_once("graph-pool", "torch_memory_saver.cuda_graph(pool=...): sublet "
                                         "captures into the tag's graph pool instead (graphs "
                                         "of one tag share its memory)")
        target = self.pool(tag, enable_cpu_backup, device, graph=True)
        self._backends[(tag, bool(enable_cpu_backup), device, True)] = (
            cpu_backup_backend or self.default_backend)
        with target.capturing() as pool_id:
            with torch.cuda.graph(cuda_graph, pool=pool_id, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield

    # ------------------------------------------------------------ pause and resume
    def pause(self, tag: Optional[str], keep=None, stay: Optional[int] = None,
              need: Optional[int] = None) -> None:
        tag = tag or None
        with self._lock:
            done: list[str] = []
            try:
                for t in self._tags_to_pause(tag, keep, need):
                    self._paused[t] = self._release_tag(t, keep, stay, need)
                    done.append(t)
            except BaseException:
                for t in reversed(done):  # all or nothing: the ones paused come back
                    self._resume_tag(t)
                raise

    def _tags_to_pause(self, tag: Optional[str], keep, need: Optional[int] = None) -> list[str]:
        """The tags pause(tag) releases: those holding memory; a tag holding nothing is a
        no-op, as in the original (SGLang pauses "cuda_graph" with or without graphs). By
        need, every tag's: those whose release keeps fewest bytes (no backup) first."""
        if tag is None:
            if keep is not None:
                raise ValueError("pause(keep=...) needs the tag whose tensors keep names: "
                                 "pause(tag, keep=...)")
            tags = [t for t in self.tags() if t not in self._paused and self._live_pools(t)]
            if need is not None:
                tags.sort(key=lambda t: sum(p.nbytes for key, p in self._live_pools(t)
                                            if key[1]))
            return tags
        if tag in self._paused:
            raise RuntimeError(f"tag {tag!r} is paused already: resume({tag!r}) first "
                               f"(torch_memory_saver would exit(1) here)")
        return [tag] if self._live_pools(tag) or keep is not None else []

    def _live_pools(self, tag: str) -> list[tuple[_PoolKey, Any]]:
        with self._lock:
            pools = [(key, p) for key, p in self._pools.items() if key[0] == tag]
        return [(key, p) for key, p in pools if len(p.segments())]

    def _release_tag(self, tag: str, keep, stay: Optional[int],
                     need: Optional[int] = None) -> list:
        """sublet.release of the tag's pools; returns the live Releases."""
        pools = self._live_pools(tag)
        release = _release_api()
        if need is not None:
            by_need = self._release_by_need(release, tag, pools, keep, stay, need)
            if by_need is not None:
                return [by_need]
        if keep is not None:
            _one_device(tag, pools, "keep")
            return [release([p for _, p in pools], keep=keep, stay=stay)]
        releases: list = []
        try:
            for key, p in pools:
                releases.append(self._release_pool(release, key, p, stay))
        except BaseException:
            for rel in reversed(releases):
                rel.resume()
            raise
        return releases

    def _release_by_need(self, release, tag: str, pools: list, keep, stay: Optional[int],
                         need: int):
        """One sublet.release of the tag's pools by need (_need.py): the taker needs `need`
        bytes of device memory; subletd releases only the pages that takes beyond the free
        bytes, the cheapest to give (few kept bytes in few runs). What is kept: keep= if given; else every
        byte of the backup pools (they stay on the device where the pages that stay hold
        them, the rest in subletd's host memory: get_cpu_backup() is None while paused),
        unless this process keeps their host copy (retain_cpu_backup): then nothing of them.
        Returns None when the tag cannot give that much (NeedTooLargeError, nothing moved):
        the caller releases it as without need, and the next tag goes on by the same need."""
        import sublet
        from sublet._keep import Spans
        if not pools:
            return None
        if len({p.device for _, p in pools}) != 1:
            _env.warn_once("need-devices", f"pause({tag!r}, need=...): the tag holds memory on "
                                           f"several devices; a need speaks of one: paused "
                                           f"without it")
            return None
        copies: list[_PoolKey] = []
        if keep is None:
            spans = []
            for key, p in pools:
                if not key[1]:
                    continue
                if self.retain_cpu_backup or self._host.has(key):
                    copies.append(key)
                    continue
                base = p.arena.addr
                spans += [(base + off, n) for off, n in p.segments().tolist()]
            keep = Spans(spans) if spans else []
        for key in copies:
            p = self._pools[key]
            backend = self._backends.get(key, self.default_backend)
            self._host.snapshot(key, p, pinned=backend == "pinned")
        try:
            rel = release([p for _, p in pools], keep=keep, stay=stay, need=need)
        except sublet.NeedTooLargeError as exc:
            logger.info("torch_memory_saver pause(%r, need=%d): %s; released as without need",
                        tag, need, exc)
            return None
        return _Restoring(rel, self, copies) if copies else rel

    def _release_pool(self, release, key: _PoolKey, pool, stay: Optional[int]):
        """The plain pool keeps nothing. The backup pool's bytes go to this process's host
        copy (resume() restores from it), unless SUBLET_TMS_BACKUP=daemon or stay= was given:
        then the release keeps them all, to subletd's host memory (stay=0) by default."""
        if not key[1]:
            return release(pool, keep=[])
        if self._copies_here(key, stay):
            backend = self._backends.get(key, self.default_backend)
            self._host.snapshot(key, pool, pinned=backend == "pinned")
            return _Restoring(release(pool, keep=[]), self, [key])
        return release(pool, keep=None, stay=0 if stay is None else stay)

    def _copies_here(self, key: _PoolKey, stay: Optional[int]) -> bool:
        """Does this process keep the backup pool's bytes (not subletd)? With
        retain_cpu_backup, or a copy kept so far, always (its buffers are refreshed)."""
        if self.retain_cpu_backup or self._host.has(key):
            return True
        return stay is None and self.backup_place == "process"

    def resume(self, tag: Optional[str]) -> None:
        tag = tag or None
        with self._lock:
            for t in self._tags_to_resume(tag):
                self._resume_tag(t)

    def _tags_to_resume(self, tag: Optional[str]) -> list[str]:
        """The paused tags resume(tag) resumes; a tag holding nothing is a no-op, as in the
        original, and one holding active memory an error (the original exits)."""
        if tag is None:
            if not self._paused and any(self._live_pools(t) for t in self.tags()):
                raise RuntimeError("nothing is paused: pause() before resume() "
                                   "(torch_memory_saver would exit(1) here)")
            return list(self._paused)
        if tag in self._paused:
            return [tag]
        if self._live_pools(tag):
            raise RuntimeError(f"tag {tag!r} is not paused: pause({tag!r}) before resuming "
                               f"it (torch_memory_saver would exit(1) here)")
        return []

    def _resume_tag(self, tag: str) -> None:
        """Resumes the tag's releases in order; one that fails (out of memory: free some and
        call again) leaves it and the rest paused, so resume(tag) again continues."""
        releases = self._paused[tag]
        while releases:
            releases[0].resume()
            releases.pop(0)
        del self._paused[tag]
        if not self.retain_cpu_backup:
            self._host.drop([k for k in self._host.keys() if k[0] == tag])

    # ------------------------------------------------------------ host copies
    def restore(self, key: _PoolKey) -> None:
        """The host copy back into the resumed pool; none when the pool was discarded
        meanwhile (_mem_pools.pop: its tensors are gone)."""
        if self._host.has(key):
            self._host.restore(key, self._pools[key])

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"get_cpu_backup takes a tensor, not a {type(x).__name__}")
        if not x.is_contiguous():
            raise ValueError(f"get_cpu_backup needs a contiguous tensor (shape "
                             f"{tuple(x.shape)}, strides {x.stride()}): pass the tensor made "
                             f"in the region, or .contiguous() views of it before pausing")
        key, pool = self._pool_holding(x)
        if not key[1]:
            return None  # no backup: nothing on the host (as the original)
        host = self._host.find(key, x.data_ptr() - pool.arena.addr, x.nbytes)
        if host is None:
            return None  # active and not retained; or SUBLET_TMS_BACKUP=daemon: subletd's
        host = host.view(x.dtype).view(x.shape)
        return host if zero_copy else host.clone()

    def _pool_holding(self, x: torch.Tensor) -> tuple[_PoolKey, Any]:
        """The (key, pool) whose segments hold x's bytes; ValueError if no region made x."""
        start, end = x.data_ptr(), x.data_ptr() + x.nbytes
        with self._lock:
            pools = [(key, p) for key, p in self._pools.items() if key[2] == x.device]
        for key, p in pools:
            base = p.arena.addr if p.arena.holds(start) else None
            if base is None:
                continue
            for off, length in p.segments().tolist():
                if base + off <= start and end <= base + off + length:
                    return key, p
        raise ValueError(f"the tensor at {start:#x} on {x.device} was not made inside a "
                         f"torch_memory_saver region() (the original exits here): pass a "
                         f"tensor allocated in a region")

    # ------------------------------------------------------------ settings
    def set_memory_margin_bytes(self, value: int) -> None:
        """Allocations in regions that need new device memory fail (out of memory) while
        fewer than value bytes would stay free on the device (the original's check of each
        malloc); 0 turns the check off."""
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
            raise ValueError(f"memory_margin_bytes is a byte count (an int >= 0), not "
                             f"{value!r}")
        with self._lock:
            self.memory_margin_bytes = value
            for device in {self._current_device(), *(key[2] for key in self._pools)}:
                self._apply_margin(device)

    def _apply_margin(self, device: torch.device) -> None:
        from sublet._memory import resolve_device
        if self.memory_margin_bytes or device in {key[2] for key in self._pools}:
            _, client = resolve_device(device)
            client.pool_set_margin(self.memory_margin_bytes)

    def set_disk_backup_dir(self, path: Optional[str]) -> None:
        """Creates the directory and records it (disk backup itself is refused)."""
        if not path:
            raise ValueError("set_disk_backup_dir needs a directory path")
        os.makedirs(path, exist_ok=True)
        self.disk_backup_dir = path


def _one_device(tag: str, pools: list, what: str) -> None:
    devices = {p.device for _, p in pools}
    if len(devices) != 1:
        where = "no memory" if not devices else f"memory on {len(devices)} devices"
        raise ValueError(f"pause({tag!r}, {what}=...): the tag holds {where}; {what} speaks of "
                         f"one device's tensors: pause without {what}=")


def _check_tag(tag: object) -> None:
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"a region's tag is a non-empty str, not {tag!r}")


class _Restoring:
    """A Release whose pools' bytes come back from this process's host copies after resume()."""

    def __init__(self, release, impl: _TorchMemorySaverImpl, keys: list[_PoolKey]):
        self.release, self._impl, self._keys = release, impl, keys

    def resume(self) -> None:
        self.release.resume()
        for key in self._keys:
            self._impl.restore(key)

    def __getattr__(self, name: str):
        return getattr(self.release, name)


class _PoolsView(Mapping):
    """_impl._mem_pools (see there): the original's keys over sublet's pools (not the graph
    pools: the original's graphs capture into PyTorch's pools, not these)."""

    def __init__(self, impl: _TorchMemorySaverImpl):
        self._impl = impl

    def _keys(self) -> dict[tuple, _PoolKey]:
        impl = self._impl
        with impl._lock:
            keys = [k for k in impl._pools if not k[3]]
            backends = dict(impl._backends)
        view = {}
        for tag, backup, device, graph in keys:
            backend = backends.get((tag, backup, device, graph), impl.default_backend)
            index = device.index if device.type == "cuda" else device
            view[(tag, backup, False, backend if backup else "", index)] = (tag, backup,
                                                                            device, graph)
        return view

    def __getitem__(self, key: tuple):
        return self._impl._pools[self._keys()[key]]

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def pop(self, key: tuple, *default):
        """The pool, to be dropped: its host copies go when the returned object does."""
        found = self._keys().get(key)
        if found is None:
            if default:
                return default[0]
            raise KeyError(key)
        return _Discarded(self._impl, found)


class _Discarded:
    """A pool popped from _mem_pools: the pool's attributes; dropped, its host copies go."""

    def __init__(self, impl: _TorchMemorySaverImpl, key: _PoolKey):
        self._impl, self._key = impl, key

    def __getattr__(self, name: str):
        return getattr(self._impl._pools[self._key], name)

    def __del__(self):
        try:
            self._impl.discard_backups(self._key)
        except Exception:  # noqa: BLE001 (a finalizer, at exit too: nothing to tell)
            logger.debug("host copies of %s not discarded", self._key, exc_info=True)
