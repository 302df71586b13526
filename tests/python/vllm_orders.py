"""What each tested vLLM (sublet.compat.vllm_versions.TESTED) asks of its sleep allocator:
the offload tags of allocator.sleep per level, whether level 2 also passes the parameters'
storage (0.34's discardable), and whether the Worker saves the buffers itself at level 2.

test_compat_vllm_versions.py checks this table against the calls the real Worker of the
installed vLLM makes; test_gpu_compat_vllm.py replays it on a GPU, where vLLM is not
installed. Read from the wheels (paths under site-packages/vllm/):
- 0.24.0: v1/worker/gpu_worker.py:165-197, Worker.sleep calls the allocator itself;
- 0.25.0 to 0.31.0: device_allocator/sleep_mode_backend.py:120-132, CuMemBackend.suspend(level);
  0.31.0's Worker also saves the preserved parameters (gpu_worker.py:278);
- 0.32.0, 0.33.0: sleep_mode_backend.py:127-137, with "runtime" and "cudagraph";
- 0.34.0: sleep_mode_backend.py:126-132 and v1/worker/gpu_worker.py:297-337,
  suspend(discardable): the buffers are the backend's to keep.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Order:
    offload: dict[int, tuple[str, ...]]   # level -> allocator.sleep's offload tags
    discardable: bool                     # level 2 passes the unpreserved parameters
    worker_saves_buffers: bool            # level 2: the Worker copies the buffers to the host
    preserves: bool                       # --sleep-preserve-parameter-names exists
    deferrable: tuple[str, ...] | None    # tags a wake may defer (None: every tag)


_OLD = Order({1: ("weights",), 2: ()}, False, True, False, None)
_PRESERVE = Order({1: ("weights",), 2: ()}, False, True, True, None)
_RUNTIME = Order({1: ("weights", "runtime", "cudagraph"), 2: ("runtime", "cudagraph")},
                 False, True, True, ("weights", "kv_cache"))
_DISCARDABLE = Order({1: ("weights", "runtime", "cudagraph"),
                      2: ("weights", "runtime", "cudagraph")}, True, False, True,
                     ("weights", "kv_cache"))

ORDERS: dict[str, Order] = {
    "0.24.0": _OLD, "0.25.0": _OLD, "0.25.1": _OLD, "0.26.0": _OLD, "0.27.0": _OLD,
    "0.27.1": _OLD, "0.28.0": _OLD, "0.29.0": _OLD, "0.30.0": _OLD,
    "0.31.0": _PRESERVE,
    "0.32.0": _RUNTIME, "0.33.0": _RUNTIME,
    "0.34.0": _DISCARDABLE,
}
