"""A process under sublet's preload library (LD_PRELOAD), as slime's trainer runs: each
scenario below is one child of test_compat_tms_preload.py, which sets the environment
(LD_PRELOAD, SUBLET_SOCKET of a memfd daemon, TMS_INIT_ENABLE...) and reads the JSON line it
prints last. On the memfd backend device memory is host memory, so the child writes and reads
it with memmove; cudaMalloc and cudaFree are the library's symbols (no CUDA runtime here).
"""

import ctypes
import json
import sys
import threading

PROCESS = ctypes.CDLL(None)
malloc = PROCESS.cudaMalloc
malloc.argtypes, malloc.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.c_int
free = PROCESS.cudaFree
free.argtypes, free.restype = [ctypes.c_void_p], ctypes.c_int
for name in ("tms_pause", "tms_resume"):
    getattr(PROCESS, name).argtypes = [ctypes.c_char_p]
PROCESS.tms_set_interesting_region.argtypes = [ctypes.c_bool]
PROCESS.tms_get_interesting_region.restype = ctypes.c_bool
PROCESS.tms_set_current_tag.argtypes = [ctypes.c_char_p]
PROCESS.tms_set_enable_cpu_backup.argtypes = [ctypes.c_bool]
PROCESS.tms_sublet_last_error.restype = ctypes.c_char_p
PROCESS.tms_get_cpu_backup_pointer.restype = ctypes.c_void_p
PROCESS.tms_get_cpu_backup_pointer.argtypes = [ctypes.c_void_p, ctypes.c_uint64]


def alloc(size: int) -> int:
    ptr = ctypes.c_void_p()
    rc = malloc(ctypes.byref(ptr), size)
    assert rc == 0, (rc, PROCESS.tms_sublet_last_error())
    return ptr.value


def fill(ptr: int, size: int, seed: int) -> bytes:
    data = bytes((i * 7 + seed) % 251 for i in range(size))
    ctypes.memmove(ptr, data, size)
    return data


def read(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


def free_bytes() -> int:
    import sublet
    return sublet.info("cpu").free_bytes


def before_any_call(size: int) -> dict:
    """TMS_INIT_ENABLE=1 (+ CPU_BACKUP): memory made before torch_memory_saver is imported is
    paused by its first call, pause(), and comes back bit for bit. That first pause is by need
    (issue 42: slime's pause() under $SUBLET_RELEASE_NEED, read at the call): a need of one
    page beyond the free memory releases one page of the tag; a plain pause then all of it,
    and a need beyond all of it all of it too, as without need."""
    import os
    ptr = alloc(size)
    data = fill(ptr, size, 3)
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    freed_by_need, same_by_need = [], []

    def pause_by_need(extra: int) -> None:
        free_before = free_bytes()
        os.environ["SUBLET_RELEASE_NEED"] = str(free_before + extra)
        saver.pause()
        del os.environ["SUBLET_RELEASE_NEED"]
        freed_by_need.append(free_bytes() - free_before)
        saver.resume()
        same_by_need.append(read(ptr, size) == data)

    pause_by_need(64 * 1024)              # the memfd daemon's page
    free_before = free_bytes()
    saver.pause()
    freed = free_bytes() - free_before
    backup = PROCESS.tms_get_cpu_backup_pointer(ptr, size)
    backed = read(backup, size) == data if backup else None
    saver.resume()
    same = read(ptr, size) == data
    pause_by_need(1 << 40)                # more than there is
    return {"freed": freed, "backup_while_paused": backed, "same": same,
            "impl": type(saver._impl).__name__,
            "deep_ep_get": saver._impl._binary_wrapper.cdll.tms_get_interesting_region(),
            "freed_by_need": freed_by_need, "same_by_need": same_by_need}


def tags_and_threads(size: int) -> dict:
    """Regions are per thread: a region on one thread routes nothing of another; pause(tag)
    releases that tag only."""
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    with saver.region("kv", enable_cpu_backup=True):
        kv = alloc(size)
        kv_data = fill(kv, size, 5)
        outside = {}
        worker = threading.Thread(target=lambda: outside.update(
            rc=malloc(ctypes.byref(ctypes.c_void_p()), size),
            interesting=bool(PROCESS.tms_get_interesting_region())))
        worker.start()
        worker.join()
    with saver.region("weights", enable_cpu_backup=True):
        w = alloc(size)
        w_data = fill(w, size, 9)
    free_before = free_bytes()
    saver.pause("kv")
    freed_kv = free_bytes() - free_before
    w_readable = read(w, size) == w_data   # "weights" stays mapped, untouched
    saver.resume("kv")
    return {"other_thread": outside, "freed_kv": freed_kv, "weights_untouched": w_readable,
            "kv_same": read(kv, size) == kv_data, "weights_same": read(w, size) == w_data}


def free_while_paused(size: int) -> dict:
    """upstream's cuda_vmm_granularity order: pause(None), cudaFree of one allocation while
    paused, resume(None): the other's bytes come back."""
    PROCESS.tms_set_interesting_region(True)
    PROCESS.tms_set_enable_cpu_backup(True)
    gone, kept = alloc(size), alloc(size)
    data = fill(kept, size, 11)
    assert PROCESS.tms_pause(None) == 0
    rc_free = free(gone)
    assert PROCESS.tms_resume(None) == 0
    return {"free_rc": rc_free, "kept_same": read(kept, size) == data,
            "free_again_rc": free(kept)}


def errors(size: int) -> dict:
    """The original's exit(1) cases are errors that say what to do; a tag holding nothing
    pauses and resumes as a no-op."""
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    out = {}
    saver.pause("nothing-here")
    saver.resume("nothing-here")
    with saver.region("kv"):
        alloc(size)
    for name, call in (("resume_active", lambda: saver.resume("kv")),
                       ("pause_twice", lambda: (saver.pause("kv"), saver.pause("kv"))),
                       ("keep", lambda: saver.pause("kv", keep=[]))):
        try:
            call()
            out[name] = None
        except (RuntimeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    saver.resume("kv")
    return out


def expandable(size: int) -> dict:
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bypasses cudaMalloc: refused at the
    first call, as the original."""
    import torch_memory_saver
    try:
        torch_memory_saver.torch_memory_saver.pause()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def no_daemon(size: int) -> dict:
    ptr = ctypes.c_void_p()
    return {"rc": malloc(ctypes.byref(ptr), size),
            "error": PROCESS.tms_sublet_last_error().decode()}


if __name__ == "__main__":
    scenario, size = sys.argv[1], int(sys.argv[2])
    print(json.dumps(globals()[scenario](size)))
