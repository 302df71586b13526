"""sublet's drop-in for torch_memory_saver 0.0.10: the same names and behaviour, on sublet.

    from sublet.compat.torch_memory_saver import torch_memory_saver   # the singleton
    with torch_memory_saver.region("kv_cache"):       # allocations: sublet pool "kv_cache"
        kv = torch.empty(...)
    torch_memory_saver.pause("kv_cache")              # the memory is the driver's now
    torch_memory_saver.resume("kv_cache")             # same addresses; CUDA graphs still valid

How it maps (docs/compat-torch-memory-saver.md says it for users):

- region(tag, enable_cpu_backup) routes the process's CUDA allocations on the current device
  to the sublet pool named `tag`, or `tag + "+backup"` with enable_cpu_backup: one pool per
  (tag, backup flag), as the original keys its MemPools by (tag, flags, device). Sublet's pools
  hold whole pages per segment, so a pool's pages hold tensors of one backup flag only, and
  "keep the backed-up tensors" is "keep all of the backup pool": no tensor tracking needed.
  cuda_graph(tag) captures into pool `tag + "+graph"` (`+graph+backup`), apart from the
  regions' tensors as the original's graph pools are.
- pause(tag) is sublet.release() of each of the tag's pools: the plain pool keeping nothing,
  the backup pool keeping everything with stay=0 (all of it to the host, the GPU memory freed,
  as torch_memory_saver does). pause(tag, keep=...) is one sublet.release() of the tag's pools
  with that keep, whose kept bytes stay on the GPU where they fit (stay=None) unless stay=
  says otherwise. resume(tag) resumes those releases.
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
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Optional

import torch

logger = logging.getLogger(__name__)

_TAG_DEFAULT = "default"
BACKUP_SUFFIX = "+backup"  # the sublet pool of a tag's enable_cpu_backup=True allocations
GRAPH_SUFFIX = "+graph"    # ... of its cuda_graph() captures: apart from its regions' tensors
CpuBackupBackend = Literal["mmap", "pinned"]
HookMode = Literal["preload", "torch"]

_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")


def _env_bool(name: str, default: bool = False) -> bool:
    """A boolean environment variable, spelled as torch_memory_saver accepts them."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"${name}={value!r} is not a boolean: set it to one of "
                     f"{', '.join(_TRUE + _FALSE)}")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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


class TorchMemorySaver:
    """torch_memory_saver's facade: every call creates the implementation on first use
    (_ensure_initialized), so hook_mode can be set before it, as in the original."""

    def __init__(self):
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._impl: Optional[_TorchMemorySaverImpl] = None

    @contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """Allocations inside go to sublet pool `tag` (`tag + "+backup"` with
        enable_cpu_backup: pause() then saves all of their bytes to the host). Nests: the
        inner region's tag and flags win until it ends. enable_disk_backup is not supported
        (NotImplementedError); cpu_backup_backend is accepted and ignored (the daemon holds
        the host copy)."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        with impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup,
                         enable_disk_backup=enable_disk_backup,
                         cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """As torch.cuda.graph(...), but the graph's memory is pauseable under `tag`: it is
        captured into the tag's graph pool, sublet pool `tag + "+graph"` (whose MemPool
        replaces `pool`: the graphs of one tag share it, as graphs given one pool share
        theirs)."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        with impl.cuda_graph(cuda_graph=cuda_graph, pool=pool, stream=stream,
                             capture_error_mode=capture_error_mode, tag=tag,
                             enable_cpu_backup=enable_cpu_backup,
                             cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def disable(self):
        """Inside a region (or TMS_INIT_ENABLE=1): allocations in the block are ordinary
        PyTorch memory, in a MemPool of their own freed at the end."""
        impl = self._ensure_initialized()
        with impl.disable():
            yield

    def pause(self, tag: Optional[str] = None, *, keep=None, stay: Optional[int] = None):
        """Gives the memory of `tag` (None: of every tag not paused) back to the driver.
        Without keep: the enable_cpu_backup tensors' bytes go to the host, the others' are
        lost. sublet adds keep= (views of the tag's tensors, sublet.blocks(...)): those bytes
        come back, staying on the GPU where they fit unless stay= (bytes) says otherwise."""
        impl = self._ensure_initialized()
        if keep is None and stay is None:
            impl.pause(tag=tag)  # the original's call: a plugged-in _impl keeps working
        else:
            impl.pause(tag=tag, keep=keep, stay=stay)

    def resume(self, tag: Optional[str] = None):
        """Maps fresh memory at the same addresses and restores what pause() kept."""
        impl = self._ensure_initialized()
        impl.resume(tag=tag)

    @property
    def enabled(self):  # for compatibility, as the original
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set (as in torch_memory_saver)")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode):
        """Accepted and ignored: sublet needs no LD_PRELOAD and no hook of its own."""
        if hook_mode not in ("preload", "torch"):
            raise ValueError(f"hook_mode is 'preload' or 'torch', not {hook_mode!r}")
        if not hasattr(self, "_impl_ctor_kwargs"):
            raise AttributeError("hook_mode must be set before the first use of "
                                 "torch_memory_saver (as in the original)")
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        impl = self._ensure_initialized()
        impl.set_memory_margin_bytes(value)

    @property
    def retain_cpu_backup(self) -> bool:
        impl = self._ensure_initialized()
        return impl.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        impl = self._ensure_initialized()
        impl.retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        """The host copy of x (a contiguous tensor made in a region with enable_cpu_backup)
        while retain_cpu_backup holds one, else None (see the docs: the copy that pause()
        makes is the daemon's, not readable here)."""
        impl = self._ensure_initialized()
        return impl.get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        """Creates the directory and records it; disk backup itself is not supported: a
        region with enable_disk_backup=True raises NotImplementedError."""
        impl = self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        impl.disk_backup_dir = path

    def _validate_cpu_backup_backend(self, enable_cpu_backup: bool,
                                     cpu_backup_backend: Optional[CpuBackupBackend]) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if cpu_backup_backend not in ("mmap", "pinned"):
            raise ValueError(f"cpu_backup_backend is 'mmap' or 'pinned', not "
                             f"{cpu_backup_backend!r}")

    def _ensure_initialized(self) -> _TorchMemorySaverImpl:
        """The implementation, made on first use (the original's name; it returns None
        there)."""
        if self._impl is None:
            self._impl = _TorchMemorySaverImpl(**self._impl_ctor_kwargs)
            del self._impl_ctor_kwargs
            self._impl.start_init_region()
        return self._impl


_PoolKey = tuple[str, bool, torch.device, bool]  # (tag, enable_cpu_backup, device, graph)


class _TorchMemorySaverImpl:
    """The state behind the facade: the pools by (tag, backup, device), the region stack of
    each device, the live releases of each paused tag, and the retained host copies.

    hook_mode: accepted and ignored. device: the device regions allocate on (None: the
    current CUDA device, or "cpu" where there is no CUDA: the memfd backend, on which nothing
    is routed and tensors come from current_pool().empty(): tests)."""

    def __init__(self, hook_mode: HookMode = "preload", device=None):
        self._hook_mode = hook_mode
        self._device = None if device is None else torch.device(device)
        self._lock = threading.RLock()
        self._pools: dict[_PoolKey, Any] = {}
        self._stacks: dict[torch.device, list] = {}   # regions entered, innermost last;
        self._routed: dict[torch.device, Any] = {}    # None marks a disable() block
        self._paused: dict[str, list] = {}            # tag -> its live sublet Releases
        self._retained: dict[_PoolKey, list[tuple[int, torch.Tensor]]] = {}
        self.retain_cpu_backup = _env_bool("TMS_RETAIN_CPU_BACKUP")
        self.disk_backup_dir = os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")
        self.memory_margin_bytes = 0
        backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "")
        if backend not in ("", "mmap", "pinned"):
            raise ValueError(f"$TMS_INIT_CPU_BACKUP_BACKEND={backend!r}: set it to 'mmap' or "
                             f"'pinned' (sublet accepts either and ignores it)")

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
                name = (tag + (GRAPH_SUFFIX if graph else "")
                        + (BACKUP_SUFFIX if enable_cpu_backup else ""))
                found = self._pools[key] = sublet.pool(name, device=device)
            return found

    def current_pool(self, device: torch.device | None = None):
        """The pool the innermost region routes to on device (None: none, or disable())."""
        stack = self._stacks.get(self._current_device() if device is None else device, [])
        return stack[-1] if stack else None

    def tags(self) -> list[str]:
        """Every tag a region has used, in first-use order."""
        with self._lock:
            return list(dict.fromkeys(key[0] for key in self._pools))

    # ------------------------------------------------------------ regions
    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool,
               cpu_backup_backend: Optional[CpuBackupBackend]):
        if enable_disk_backup:
            raise NotImplementedError(
                "sublet's torch_memory_saver has no disk backup: use "
                "region(enable_cpu_backup=True), whose bytes the daemon keeps on the host "
                "(or stay on the GPU: pause(tag, keep=...)) while paused")
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"a region's tag is a non-empty str, not {tag!r}")
        if tag in self._paused:
            raise RuntimeError(f"tag {tag!r} is paused: resume({tag!r}) before allocating in "
                               f"region({tag!r})")
        device = self._current_device()
        with self._pushed(device, self.pool(tag, enable_cpu_backup)):
            yield
        if enable_cpu_backup:
            self._pin_backups(device)

    def _pin_backups(self, device: torch.device) -> None:
        """The CPU-backup tags' bytes go to the host at their pause: the daemon pins host
        memory for them now, in the background, instead of on the first pause's path (where
        making 64 GiB of host pages took 18 to 20 s on an H200). A hint: a daemon too old for
        it, or one that refuses, costs the pause nothing it did not cost before."""
        import sublet
        if self.retain_cpu_backup:
            return  # pause() then keeps nothing: the host copy is this module's own
        with self._lock:
            pools = [p for key, p in self._pools.items() if key[1] and key[2] == device]
        total = sum(p.nbytes for p in pools)
        try:
            if total:
                sublet.pin_ahead(total, device=device, release=True)
        except sublet.SubletError as e:
            logger.debug("no pin ahead of the CPU backups (%s): the first pause pins", e)

    @contextmanager
    def _pushed(self, device: torch.device, pool) -> Iterator[None]:
        """pool (None: no pool, for disable()) routes the device until the block ends; then
        the region around it routes again."""
        with self._lock:
            stack = self._stacks.setdefault(device, [])
            stack.append(pool)
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
                if not stack or stack[-1] is not pool:
                    raise RuntimeError("torch_memory_saver regions ended out of order: sublet "
                                       "routes the whole process, so use regions from one "
                                       "thread at a time")
                stack.pop()
                self._route(device)

    def _route(self, device: torch.device) -> None:
        """Makes the innermost entry of the device's stack the one sublet pool entered: pools
        do not nest in sublet, so the one routing now is left first. Nothing routes on a
        device that is not CUDA (memfd tests allocate with Pool.empty())."""
        stack = self._stacks.get(device, [])
        target = stack[-1] if stack else None
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
        if not _env_bool("TMS_INIT_ENABLE"):
            return
        if _env_bool("TMS_INIT_ENABLE_DISK_BACKUP"):
            raise NotImplementedError("$TMS_INIT_ENABLE_DISK_BACKUP: sublet's "
                                      "torch_memory_saver has no disk backup; use "
                                      "TMS_INIT_ENABLE_CPU_BACKUP=1 instead")
        _warn_once("init", "TMS_INIT_ENABLE=1: sublet starts the 'default' region at the first "
                           "use of torch_memory_saver; CUDA memory allocated before it is not "
                           "pauseable (the original hooks cudaMalloc from process start)")
        device = self._current_device()
        pool = self.pool(_TAG_DEFAULT, _env_bool("TMS_INIT_ENABLE_CPU_BACKUP"), device)
        with self._lock:
            self._stacks.setdefault(device, []).insert(0, pool)
            self._route(device)

    @contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True):
        if not dispose_mem_pool_after_use:
            raise ValueError("only dispose_mem_pool_after_use=True is supported (as in the "
                             "original)")
        device = self._current_device()
        if self.current_pool(device) is None:
            raise RuntimeError("disable() is for use inside a region() (or with "
                               "TMS_INIT_ENABLE=1): outside one, allocations are ordinary "
                               "PyTorch memory already")
        with self._pushed(device, None):
            if device.type != "cuda":
                yield
                return
            mempool = torch.cuda.MemPool()  # as the original: PyTorch's memory, freed after
            with torch.cuda.use_mem_pool(mempool):
                yield
            del mempool

    @contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag: str,
                   enable_cpu_backup: bool, cpu_backup_backend: Optional[CpuBackupBackend]):
        """torch.cuda.graph(...) with pool= the MemPool of the tag's graph pool: the graph's
        private memory is sublet memory, which pause(tag) releases. PyTorch routes the capture
        to that MemPool, and libsublet serves its segments from the tag (Pool.capturing); the
        region around the capture, if any, routes the rest as before."""
        device = self._current_device()
        if device.type != "cuda":
            raise RuntimeError("cuda_graph() captures a CUDA graph and needs a CUDA device")
        if pool is not None:
            _warn_once("graph-pool", "torch_memory_saver.cuda_graph(pool=...): sublet captures "
                                     "into the tag's graph pool instead (graphs of one tag "
                                     "share its memory)")
        target = self.pool(tag, enable_cpu_backup, device, graph=True)
        with target.capturing() as pool_id:
            with torch.cuda.graph(cuda_graph, pool=pool_id, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield

    # ------------------------------------------------------------ pause and resume
    def pause(self, tag: Optional[str], keep=None, stay: Optional[int] = None) -> None:
        tag = tag or None  # "" means every tag, as in the original
        with self._lock:
            if tag is not None and tag in self._paused:
                raise RuntimeError(f"tag {tag!r} is paused already: resume({tag!r}) first "
                                   f"(torch_memory_saver would exit(1) here)")
            if tag is None and keep is not None:
                raise ValueError("pause(keep=...) needs the tag whose tensors keep names: "
                                 "pause(tag, keep=...)")
            tags = [tag] if tag is not None else [t for t in self.tags()
                                                  if t not in self._paused]
            done: list[str] = []
            try:
                for t in tags:
                    self._paused[t] = self._release_tag(t, keep, stay)
                    done.append(t)
            except BaseException:
                for t in reversed(done):  # all or nothing: the ones paused come back
                    self._resume_tag(t)
                raise

    def _live_pools(self, tag: str) -> list[tuple[_PoolKey, Any]]:
        with self._lock:
            pools = [(key, p) for key, p in self._pools.items() if key[0] == tag]
        return [(key, p) for key, p in pools if len(p.segments())]

    def _release_tag(self, tag: str, keep, stay: Optional[int]) -> list:
        """sublet.release of the tag's pools; returns the live Releases."""
        pools = self._live_pools(tag)
        if not pools and keep is None:
            return []  # nothing to give back (SGLang pauses "cuda_graph" with no graphs)
        release = _release_api()
        if keep is not None:
            devices = {p.device for _, p in pools}
            if len(devices) != 1:
                where = "no memory" if not devices else f"memory on {len(devices)} devices"
                raise ValueError(f"pause({tag!r}, keep=...): the tag holds {where}; keep "
                                 f"speaks of one device's tensors: pause without keep=")
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

    def _release_pool(self, release, key: _PoolKey, pool, stay: Optional[int]):
        """The plain pool keeps nothing; the backup pool keeps all, to the host (stay=0) by
        default. With a retained host copy (retain_cpu_backup), that copy is refreshed and the
        backup pool keeps nothing instead: resume() restores from the copy."""
        if not key[1]:
            return release(pool, keep=[])
        if self.retain_cpu_backup or key in self._retained:
            self._snapshot(key, pool)
            return _Restoring(release(pool, keep=[]), self, key)
        return release(pool, keep=None, stay=0 if stay is None else stay)

    def resume(self, tag: Optional[str]) -> None:
        tag = tag or None
        with self._lock:
            if tag is not None and tag not in self._paused:
                raise RuntimeError(f"tag {tag!r} is not paused: pause({tag!r}) before resuming "
                                   f"it (torch_memory_saver would exit(1) here)")
            tags = [tag] if tag is not None else list(self._paused)
            if tag is None and not tags and any(self._live_pools(t) for t in self.tags()):
                raise RuntimeError("nothing is paused: pause() before resume() "
                                   "(torch_memory_saver would exit(1) here)")
            for t in tags:
                self._resume_tag(t)

    def _resume_tag(self, tag: str) -> None:
        """Resumes the tag's releases in order; one that fails (out of memory: free some and
        call again) leaves it and the rest paused, so resume(tag) again continues."""
        releases = self._paused[tag]
        while releases:
            releases[0].resume()
            releases.pop(0)
        del self._paused[tag]
        if not self.retain_cpu_backup:
            for key in [k for k in self._retained if k[0] == tag]:
                del self._retained[key]

    # ------------------------------------------------------------ host copies
    def _snapshot(self, key: _PoolKey, pool) -> None:
        """Copies the backup pool's segments to host buffers, reusing the buffers of an
        earlier copy where the segments are the same (zero_copy pointers stay valid)."""
        from sublet._memory import wrap
        old = {(off, buf.numel()): buf for off, buf in self._retained.get(key, [])}
        base = pool.arena.addr
        copies = []
        for off, length in pool.segments().tolist():
            buf = old.get((off, length))
            if buf is None:
                buf = torch.empty(length, dtype=torch.uint8,
                                  pin_memory=pool.device.type == "cuda")
            buf.copy_(wrap(base + off, length, pool.device, None, (length,), torch.uint8))
            copies.append((off, buf))
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
        self._retained[key] = copies

    def _restore(self, key: _PoolKey, pool) -> None:
        """Copies the retained host buffers back into the resumed backup pool's pages."""
        from sublet._memory import wrap
        base = pool.arena.addr
        for off, buf in self._retained[key]:
            wrap(base + off, buf.numel(), pool.device, None, (buf.numel(),),
                 torch.uint8).copy_(buf)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)

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
        start = x.data_ptr() - pool.arena.addr
        for off, buf in self._retained.get(key, []):
            if off <= start and start + x.nbytes <= off + buf.numel():
                host = buf[start - off:start - off + x.nbytes].view(x.dtype).view(x.shape)
                return host if zero_copy else host.clone()
        return None  # the daemon holds pause()'s copy; see retain_cpu_backup

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

    def set_memory_margin_bytes(self, value: int) -> None:
        """Recorded, not enforced: sublet's allocator has no margin check."""
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"memory_margin_bytes is a non-negative int, not {value!r}")
        _warn_once("margin", "torch_memory_saver.memory_margin_bytes is not enforced by sublet "
                             "(allocations fail only when the device is out of memory)")
        self.memory_margin_bytes = value


class _Restoring:
    """A Release whose pool's bytes come back from the retained host copy after resume()."""

    def __init__(self, release, impl: _TorchMemorySaverImpl, key: _PoolKey):
        self.release, self._impl, self._key = release, impl, key

    def resume(self) -> None:
        self.release.resume()
        self._impl._restore(self._key, self._impl._pools[self._key])

    def __getattr__(self, name: str):
        return getattr(self.release, name)


@contextmanager
def configure_subprocess():
    """A no-op context manager: sublet needs no LD_PRELOAD in child processes (the original
    prepends its hook library to LD_PRELOAD here)."""
    yield


# ------------------------------------------------------------ submodules, as the original's
# Code reaches some names through submodules (torch_memory_saver.entrypoint.TorchMemorySaver,
# the examples' torch_memory_saver.testing_utils): small module objects serve them, and the
# installed shim (python -m sublet.compat install) registers them under its own name.

def _is_xpu() -> bool:
    return False  # sublet runs on CUDA (and the memfd backend), never on Intel XPU


def _empty_cache() -> None:
    torch.cuda.empty_cache()


def _get_device() -> str:
    return "cuda"


def _get_and_print_gpu_memory(message, gpu_id=0):
    """Print GPU memory usage with optional message (as testing_utils' original). The
    device's used memory as nvidia-smi gives it; without pynvml (which
    torch.cuda.device_memory_used needs), the driver's total - free: the same figure."""
    try:
        mem = torch.cuda.device_memory_used(gpu_id)
    except ModuleNotFoundError:
        free, total = torch.cuda.mem_get_info(gpu_id)
        mem = total - free
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem


@contextmanager
def _change_env(key: str, value: str):
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _submodule(name: str, doc: str, **names) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{name}", doc)
    module.__dict__.update(names)
    sys.modules[module.__name__] = module
    return module


entrypoint = _submodule("entrypoint", "TorchMemorySaver and its implementation.",
                        TorchMemorySaver=TorchMemorySaver,
                        _TorchMemorySaverImpl=_TorchMemorySaverImpl,
                        CpuBackupBackend=CpuBackupBackend, _TAG_DEFAULT=_TAG_DEFAULT)
utils = _submodule("utils", "What the original's tests use of its utils.",
                   is_xpu=_is_xpu, change_env=_change_env)
testing_utils = _submodule("testing_utils", "The original's helpers for its examples.",
                           is_xpu=_is_xpu, empty_cache=_empty_cache, get_device=_get_device,
                           get_and_print_gpu_memory=_get_and_print_gpu_memory)
__submodules__ = ("entrypoint", "utils", "testing_utils")

# Global singleton
torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
