"""sublet's sleep mode for vLLM 0.24 to 0.34: vLLM's sleep allocator on sublet pools and
releases. docs/compat-vllm.md says it for users.

    python -m sublet.compat install vllm     # or SUBLET_VLLM=1 in vLLM's environment
    vllm serve MODEL --enable-sleep-mode     # as before: sleep and wake run on sublet

- SubletAllocator is vLLM's MemAllocator (vllm/device_allocator/__init__.py, CuMemAllocator in
  cumem.py) on sublet: use_memory_pool(tag) routes the process's CUDA allocations to
  sublet.pool(tag); sleep(offload_tags, discardable) is one sublet.release() per tag: an
  offload tag keeps its live blocks but the discardable tensors (to the host, stay=0: vLLM's
  sleep frees the GPU memory), the others keep nothing; wake_up(tags) resumes them, and the
  tags vLLM does not let a wake defer on every wake. The extension: keep={"kv_cache":
  sublet.blocks(...)} (or keep_on_next_sleep) keeps those bytes of a tag on the GPU where they
  fit (stay=None: compacted into as few of the tag's pages as hold them). And need= (or
  need_on_next_sleep, or $SUBLET_RELEASE_NEED: compat/_need.py): only what a taker needs
  beyond the free memory is released, the kept and offloaded bytes staying where they fit.
- The switch (vllm_switch.py) points vLLM's allocator lookup at it, so that vLLM's own Worker
  and "cumem" backend drive it, whatever their version's interface; vllm_versions.py refuses
  the vLLMs it was not tested with.
- SubletBackend ("sublet", vLLM 0.33's --sleep-mode-backend) and SubletWorker
  (--worker-cls) select the same by flags, for those who prefer flags to the switch.

This module imports without vLLM: SubletBackend and SubletWorker subclass vLLM's classes and
are built on first access (vllm_classes.py), the rest needs only sublet.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

import sublet
from sublet._keep import Spans

from . import _need

logger = logging.getLogger(__name__)

BACKEND_NAME = "sublet"
# vllm/device_allocator/__init__.py:17 (0.33.0): a selective wake_up may defer only these; any
# wake restores every other tag. Copied so that this module imports without vLLM
# (tests/python/test_compat_vllm_plugin.py checks it equals vLLM's).
DEFERRABLE_TAGS: tuple[str, ...] = ("weights", "kv_cache")
DEFAULT_TAG = "default"  # CuMemAllocator.default_tag
_VLLM_CLASSES = ("SubletBackend", "SubletWorker")


@dataclass(frozen=True)
class SleepStats:
    """What a tag's sleep did (its sublet release), and what its wake brought back."""
    released_bytes: int   # given back to the driver
    stayed_bytes: int     # of pages that stayed on the device, holding kept bytes
    kept_bytes: int
    moved_bytes: int      # kept bytes compacted on the device (and moved back at the wake)
    copied_bytes: int     # kept bytes saved to the host
    copied_in_bytes: int = 0   # restored from the host at the wake
    need_bytes: int | None = None   # the need the tag was released by (None: all of it)

    @classmethod
    def of(cls, release: Any) -> SleepStats:
        return cls(release.released_bytes, release.stayed_bytes, release.stats.kept_bytes,
                   release.moved_bytes, release.copied_bytes,
                   need_bytes=release.need_bytes)


@dataclass
class _Asleep:
    """A tag's memory while it sleeps: its release, and whether all of it was kept."""
    release: Any          # sublet's Release
    offloaded: bool       # every byte kept (an offload tag): sleep's policy for it


class SubletAllocator:
    """vLLM's MemAllocator protocol (vllm/device_allocator/__init__.py:28) on sublet pools.

    One per process in vLLM (get_instance()), as CuMemAllocator; tests make their own with a
    device. Not thread-safe beyond what vLLM needs: one thread enters pools and sleeps."""

    instance: SubletAllocator | None = None
    _instance_lock = threading.Lock()

    def __init__(self, device: torch.device | str | int | None = None):
        self._device_arg = device
        self._device: torch.device | None = None   # fixed at the first pool
        self._tags: list[str] = []                  # every tag a pool was made for, in order
        self._asleep: dict[str, _Asleep] = {}
        self._stack: list[sublet.Pool] = []         # use_memory_pool's nesting, innermost last
        self._graph_mempool: Any = None
        self.current_tag: str = DEFAULT_TAG
        self.stats: dict[str, SleepStats] = {}      # tag -> its last sleep
        self._next_keep: dict[str, Any] = {}
        self._next_need: int | None = None
        # The tags a selective wake_up may leave asleep; None: every tag (vLLM before
        # DEFERRABLE_TAGS, which wakes only the tags named). Set for the installed vLLM by
        # vllm_switch.route_allocator().
        self.deferrable_tags: tuple[str, ...] | None = DEFERRABLE_TAGS

    @classmethod
    def get_instance(cls) -> SubletAllocator:
        """The process's allocator, made on first use (on the current CUDA device when its
        first pool is made)."""
        with cls._instance_lock:
            if cls.instance is None:
                cls.instance = cls()
            return cls.instance

    # ------------------------------------------------------------------ pools
    def pool(self, tag: str) -> sublet.Pool:
        """The sublet pool of `tag` on this allocator's device."""
        pool = sublet.pool(tag, self._device if self._device is not None else self._device_arg)
        self._device = pool.device
        if tag not in self._tags:
            self._tags.append(tag)
        return pool

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._tags)

    def is_asleep(self, tag: str) -> bool:
        return tag in self._asleep

    def tag_usage(self, tag: str) -> int:
        """Bytes the tag holds (asleep or not: its addresses stay reserved)."""
        return self.pool(tag).nbytes if tag in self._tags else 0

    def get_current_usage(self) -> int:
        """Bytes all tags hold, asleep ones too, as CuMemAllocator counts (cumem.py:454)."""
        return sum(self.tag_usage(tag) for tag in self._tags)

    def empty(self, *size: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor of the current tag's pool, allocated from it directly: what a torch op
        inside use_memory_pool() gets on CUDA, on any backend (memfd tests have no routing)."""
        return self.pool(self.current_tag).empty(*size, dtype=dtype)

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[sublet.Pool]:
        """Inside, the process's CUDA allocations on the device are sublet memory of `tag`
        (None: "default"); yields the Pool. Nests, as vLLM nests "kv_cache" in "runtime"
        (gpu_worker.py:898-910): sublet pools do not nest, so the outer pool is left and
        entered again after the inner one. On the memfd backend nothing is routed."""
        tag = DEFAULT_TAG if tag is None else tag
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"a memory pool's tag is a non-empty str, not {tag!r}")
        if tag in self._asleep:
            raise RuntimeError(f"tag {tag!r} is asleep: its memory was released; call "
                               f"wake_up([{tag!r}]) before allocating in it")
        pool, outer, old_tag = self.pool(tag), self._top(), self.current_tag
        self._switch(outer, pool)
        self._stack.append(pool)
        self.current_tag = tag
        try:
            yield pool
        finally:
            self._stack.pop()
            self.current_tag = old_tag
            self._switch(pool, self._top())

    def _top(self) -> sublet.Pool | None:
        return self._stack[-1] if self._stack else None

    def _switch(self, leave: sublet.Pool | None, enter: sublet.Pool | None) -> None:
        """Routes `enter` instead of `leave` (either None: none). A pool on the stack several
        times in a row is entered once, so one exit leaves it."""
        if leave is enter:
            return
        if leave is not None and _routes(leave):
            leave.__exit__(None, None, None)
        if enter is not None and _routes(enter):
            try:
                enter.__enter__()
            except BaseException:
                if leave is not None and _routes(leave):
                    leave.__enter__()   # as we found it
                raise

    @contextmanager
    def cudagraph_pool(self) -> Iterator[Any]:
        """Yields the id of a graph pool whose segments are sublet memory of tag "cudagraph"
        (CuMemAllocator.cudagraph_pool, cumem.py:437): capture with torch.cuda.graph(g,
        pool=id) inside. Only capture allocations go there (no other routing). vLLM (0.32
        on) calls it with --sleep-mode-offload-cudagraph and the "cumem" backend, which the
        switch keeps: every level offloads "cudagraph"."""
        pool = self.pool("cudagraph")
        if pool.device.type != "cuda":
            raise RuntimeError("cudagraph_pool() captures CUDA graphs: it needs a CUDA device")
        if self._graph_mempool is None:
            from .._lib import library_path
            from .._torch import pluggable_allocator
            # Kept for the process's life, as CuMemAllocator keeps its pools (pytorch#146431).
            self._graph_mempool = torch.cuda.MemPool(
                pluggable_allocator(library_path())._allocator)
        client, index = pool.arena.client, pool.device.index
        routed = self._top()
        client.torch_bind_pool(index, pool.tag_id)   # libsublet's allocator: this tag
        old_tag, self.current_tag = self.current_tag, "cudagraph"
        try:
            yield self._graph_mempool.id
        finally:
            self.current_tag = old_tag
            client.torch_bind_pool(index, routed.tag_id if routed is not None else 0)

    # ------------------------------------------------------------------ sleep and wake
    def keep_on_next_sleep(self, keep: Mapping[str, Any]) -> None:
        """What the next sleep keeps of each tag named (tag -> keep, as sublet.release takes
        it), on the GPU where it fits: for a caller whose sleep vLLM makes (a backend's
        suspend, a Worker's sleep), which passes no keep itself."""
        self._check_keep_tags(keep)
        self._next_keep = dict(keep)

    def need_on_next_sleep(self, need: int | str | None) -> None:
        """The need of the next sleep (as sleep(need=...) takes it; None: none): for a caller
        whose sleep vLLM makes, which passes no need itself. Overrides $SUBLET_RELEASE_NEED
        for that sleep."""
        self._next_need = None if need is None else _need.check_need(need)

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None,
              discardable: Collection[int] = (),
              keep: Mapping[str, Any] | None = None,
              need: int | str | None = None) -> None:
        """Releases every awake tag's memory to the driver (cumem.py): an offload tag's live
        bytes go to the host (stay=0), the others' are dropped. discardable (vLLM 0.34: the
        storage addresses of the parameters a level-2 sleep rewrites after waking): those
        tensors' bytes are neither saved nor restored. A tag in `keep` (sublet's extension, or
        keep_on_next_sleep's) keeps keep[tag] (views, sublet.blocks(...)) on the GPU where it
        fits, the rest of it dropped. A tag asleep already keeps its policy.

        need (sublet's extension; else need_on_next_sleep's, else $SUBLET_RELEASE_NEED's,
        read now): the bytes of device memory a taker needs. Each tag is then released by
        need, the dropped tags first, then the kept, then the offloaded: only the pages the
        rest of the need takes beyond the free memory, the cheapest to give (few kept bytes),
        whose kept bytes (an offload tag's live blocks too) stay on the device where the
        pages that stay hold them, the rest to the host. A tag that cannot give that much is
        released as without need, and the next goes on."""
        offload = _as_tags(offload_tags, (DEFAULT_TAG,))
        keep = {**self._next_keep, **(keep or {})}
        self._next_keep = {}
        next_need, self._next_need = self._next_need, None
        need = _need.need_for_call(need if need is not None else next_need)
        self._check_keep_tags(keep)
        drop = frozenset(int(a) for a in discardable)
        conflict, freed = False, 0
        awake = []
        for tag in self._tags:
            if tag in self._asleep:
                conflict |= (tag in offload) != self._asleep[tag].offloaded or tag in keep
                continue
            awake.append(tag)
        if need is not None:   # the cheapest first: what keeps nothing, then keep=, then offload
            awake.sort(key=lambda tag: 2 if tag in offload and tag not in keep else
                       1 if tag in keep else 0)
        for tag in awake:
            if tag in keep:
                freed += self._release(tag, keep[tag], stay=None, offloaded=False, need=need)
            elif tag in offload:
                live = Spans(self.pool(tag).live_blocks(drop))
                freed += self._release(tag, live, stay=0, offloaded=True, need=need)
            else:
                freed += self._release(tag, [], stay=0, offloaded=False, need=need)
        if conflict:
            logger.warning("sublet: sleep cannot change the policy of tags already asleep; "
                           "theirs was kept (wake them first)")
        logger.info("sublet: sleep released %.2f GiB%s", freed / 1024**3,
                    f" (need {need} bytes)" if need is not None else "")
        self._empty_torch_cache()

    def _check_keep_tags(self, keep: Mapping[str, Any]) -> None:
        for tag in keep:
            if tag not in self._tags:
                raise ValueError(f"keep names tag {tag!r}, which holds no memory of this "
                                 f"allocator (its tags: {', '.join(self._tags) or 'none'})")

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Releases the awake `tags`' memory keeping nothing (cumem.py:300); wake_up gives
        them fresh memory of undefined contents."""
        for tag in _as_tags(tags, ()):
            if tag not in self._tags:
                continue
            if tag in self._asleep:
                if self._asleep[tag].offloaded:
                    logger.warning("sublet: discard leaves tag %r as it sleeps (offloaded)",
                                   tag)
                continue
            self._release(tag, [], stay=0, offloaded=False)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Resumes the sleeping tags in `tags` (None: all) and, from vLLM 0.32 on, every
        sleeping tag not in deferrable_tags (cumem.py): the kept bytes come back at the same
        addresses, bit for bit; the rest is undefined. Out of device memory: SubletOutOfMemoryError,
        the tags not yet resumed still asleep (free memory and call it again)."""
        self._empty_torch_cache()
        for tag in list(self._asleep):
            if tags is None or tag in tags or not self._deferrable(tag):
                release = self._asleep[tag].release
                if not self._region_alive(tag):
                    del self._asleep[tag]   # every tensor of the pools died asleep: gone
                    continue
                try:
                    resumed = release.resume()
                except sublet.SubletOutOfMemoryError as exc:
                    raise sublet.SubletOutOfMemoryError(
                        f"waking tag {tag!r}: {exc}; it is still asleep (with "
                        f"{', '.join(self._asleep)}): free device memory and call wake_up "
                        f"again", getattr(exc, "code", None)) from exc
                self.stats[tag] = replace(self.stats[tag],
                                          copied_in_bytes=resumed.copied_in_bytes)
                del self._asleep[tag]

    def _deferrable(self, tag: str) -> bool:
        return self.deferrable_tags is None or tag in self.deferrable_tags

    def release_pools(self) -> None:
        """CuMemAllocator's, which vLLM's Worker.shutdown calls: sublet's pools live as long
        as their tensors (and go with the process), so there is nothing to drop early."""

    def _region_alive(self, tag: str) -> bool:
        """Whether the pools' memory (the arena's region) still exists: freeing every tensor
        of every pool, even while they sleep, gives it back, the releases with it."""
        return self.pool(tag).arena.client.pool_region() is not None

    def _release(self, tag: str, keep: Any, stay: int | None, offloaded: bool,
                 need: int | None = None) -> int:
        """One sublet.release of the tag's pool; returns the bytes given to the driver. By
        need: every kept byte may stay (stay=None), and a tag that cannot give the need's
        rest (NeedTooLargeError, nothing moved) is released as without need."""
        pool = self.pool(tag)
        if pool.nbytes == 0:
            return 0   # nothing allocated (or all given back): nothing sleeps
        release = None
        if need is not None:
            try:
                release = sublet.release(pool, keep=keep, stay=None, need=need)
            except sublet.NeedTooLargeError as exc:
                logger.info("sublet: sleep of tag %r by need: %s; released as without need",
                            tag, exc)
        if release is None:
            release = sublet.release(pool, keep=keep, stay=stay)
        self._asleep[tag] = _Asleep(release, offloaded)
        self.stats[tag] = SleepStats.of(release)
        return self.stats[tag].released_bytes

    def _empty_torch_cache(self) -> None:
        """As vLLM around sleep and wake: dead tensors go, PyTorch's own cache goes back."""
        gc.collect()
        if self._device is not None and self._device.type == "cuda":
            with torch.cuda.device(self._device):
                torch.cuda.empty_cache()


def _routes(pool: sublet.Pool) -> bool:
    """Whether entering the pool routes allocations (CUDA); memfd pools allocate directly."""
    return pool.device.type == "cuda"


def _as_tags(tags: Iterable[str] | str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    if tags is None:
        return default
    return (tags,) if isinstance(tags, str) else tuple(tags)


# ---------------------------------------------------------------------- the KV cache's keep

def kv_blocks_keep(kv_caches: Iterable[torch.Tensor], block_ids: Any,
                   num_blocks: int) -> list[torch.Tensor]:
    """keep= for the "kv_cache" tag: blocks `block_ids` (the scheduler's ids, 0 to
    num_blocks - 1) of every layer's KV cache view. vLLM 0.33.0 views each layer as
    [B, H, N, C] (v1/kv_cache_interface.py:418-426) with B = num_blocks * r: a manager block
    split into r kernel blocks, block b being kernel blocks b*r to b*r + r - 1. Returns views
    (one per run of consecutive kernel blocks, per layer), any layout of the dims after B."""
    ids = np.unique(np.asarray(block_ids, dtype=np.int64).reshape(-1))
    if len(ids) and (ids[0] < 0 or ids[-1] >= num_blocks):
        raise ValueError(f"KV block ids must lie in [0, {num_blocks}): got {int(ids[0])} to "
                         f"{int(ids[-1])}")
    views: list[torch.Tensor] = []
    for t in kv_caches:
        ratio, rest = divmod(t.shape[0], num_blocks)
        if rest or not ratio:
            raise ValueError(f"a KV cache view of shape {tuple(t.shape)} does not hold "
                             f"{num_blocks} blocks along dim 0 (nor kernel blocks splitting "
                             f"them): pass keep= views of it instead")
        kernel = (ids[:, None] * ratio + np.arange(ratio)).reshape(-1)
        views += [t.narrow(0, start, n) for start, n in _runs(kernel)]
    return views


def keep_kv_blocks(worker: Any, block_ids: Any) -> None:
    """Keeps these KV cache blocks (the prefix cache's live ones) of a vLLM worker through its
    next sleep, on the GPU where they fit. Through vLLM, on every worker, before the sleep:
    llm.collective_rpc(sublet.compat.vllm.keep_kv_blocks, args=(ids,)) (or the method name
    "sublet_keep_kv_blocks" with SubletWorker). A sleep of level >= 1 still clears vLLM's
    prefix cache: the kept blocks serve a caller that reads them itself. Refused where the KV
    cache is not sublet memory: vLLM 0.34's extensible KV cache (on by default on CUDA) lives
    in vLLM's own address space, which vLLM releases at every sleep."""
    runner = worker.model_runner
    if getattr(runner, "extensible_kv_cache", None) is not None:
        raise RuntimeError(
            "sublet: this vLLM's KV cache is its extensible KV cache, vLLM's own memory, "
            "which vLLM releases (keeping nothing) at every sleep: to keep KV blocks through "
            "a sleep, start vLLM with --no-enable-extensible-kv-cache")
    caches = [t for t in runner.kv_caches if t is not None]
    keep = kv_blocks_keep(caches, block_ids, runner.kv_cache_config.num_blocks)
    SubletAllocator.get_instance().keep_on_next_sleep({"kv_cache": keep})


def sleep_need(worker: Any, need: int | str | None) -> None:
    """The need of a vLLM worker's next sleep (SubletAllocator.need_on_next_sleep), through
    vLLM, on every worker, before the sleep: llm.collective_rpc(sublet.compat.vllm.sleep_need,
    args=(24 << 30,)) (or the method name "sublet_sleep_need" with SubletWorker). For a
    caller that cannot pass sleep(need=...); $SUBLET_RELEASE_NEED sets one for every sleep."""
    del worker   # the allocator is the process's
    SubletAllocator.get_instance().need_on_next_sleep(need)


def _runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids (ascending, unique)."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(ids)]])
    return [(int(ids[a]), int(b - a)) for a, b in zip(starts, ends)]


# ---------------------------------------------------------------------- vLLM's side

def register() -> None:
    """The `vllm.general_plugins` entry point (pyproject.toml), which vLLM runs in every
    process it starts, maybe more than once: registers the "sublet" sleep-mode backend and,
    where the switch is on, puts sublet's allocator under vLLM's sleep (vllm_switch.py)."""
    from . import vllm_switch
    vllm_switch.plug_in()


def __getattr__(name: str) -> Any:
    """SubletBackend and SubletWorker, built from vLLM's classes on first access."""
    if name not in _VLLM_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from . import vllm_classes
    except ImportError as exc:
        raise ImportError(f"sublet.compat.vllm.{name} subclasses vLLM's class and needs vLLM "
                          f"(pip install vllm==0.34.0, or another of "
                          f"sublet.compat.vllm_versions.TESTED): {exc}") from exc
    value = getattr(vllm_classes, name)
    globals()[name] = value
    return value
