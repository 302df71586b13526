"""GPU scenarios under sublet's preload library, each run by test_gpu_compat_tms_preload.py in
a child started with LD_PRELOAD (the environment says which TMS_INIT_* are on); each prints a
JSON line of what it found. Between pause and resume a process that knows nothing of sublet
(no LD_PRELOAD) takes the freed memory and writes over it.
"""

import json
import os
import subprocess
import sys
import threading

import torch

MiB = 1024 ** 2

TAKER = """
import sys, torch
n = int(sys.argv[1]) // (2 << 20) * (2 << 20)
x = torch.empty(n, dtype=torch.uint8, device="cuda"); x.fill_(0xEE); torch.cuda.synchronize()
print(n)
"""


TAKER_SLACK = 2048 * MiB  # the taker's own CUDA context (about 0.5 GiB) and the driver's share


def take_freed(nbytes: int) -> int:
    """A plain PyTorch process takes nbytes less TAKER_SLACK, scribbles over it, exits. (With
    512 MiB less, on an H100, its allocation of 76.91 GiB met 76.90 free: its own context.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_PRELOAD", "TMS_"))}
    done = subprocess.run([sys.executable, "-c", TAKER, str(max(nbytes - TAKER_SLACK, 0))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip())


def random_bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes as dtype: bf16 NaNs and infinities included; compared as bits."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.finfo(dtype).bits // 8,), dtype=torch.uint8,
                        device="cuda", generator=g)
    return raw.view(dtype)


def host_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def free_now() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def trainer_from_start() -> dict:
    """slime's trainer: TMS_INIT_ENABLE=1 and CPU_BACKUP=1 from the start; the model and the
    optimizer's state exist before the first torch_memory_saver call, which is pause()."""
    model = [random_bits(s, torch.bfloat16, i) for i, s in enumerate((256 * MiB, MiB, 4097))]
    state = random_bits(512 * MiB, torch.float32, 9)
    before = [host_bits(t) for t in (*model, state)]
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    free0 = free_now()
    saver.pause()
    freed = free_now() - free0
    with saver.disable():   # slime's weight sync: plain memory, used and given back
        plain = torch.ones(64 * MiB, device="cuda").sum().item()
    taken = take_freed(free_now())
    saver.resume()
    after = [host_bits(t) for t in (*model, state)]
    return {"freed": freed, "held": sum(t.nbytes for t in (*model, state)), "taken": taken,
            "plain": plain, "same": after == before, "impl": type(saver._impl).__name__}


def sglang_order() -> dict:
    """SGLang's release and resume of memory occupation: kv_cache (lost), weights (cpu
    backup), a CUDA graph captured with cuda_graph(tag="cuda_graph", enable_cpu_backup=True);
    paused in that order, resumed in reverse; the graph replays to the same bits."""
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    with saver.region("kv_cache"):
        kv = torch.zeros(1024 * MiB, dtype=torch.uint8, device="cuda")
    with saver.region("weights", enable_cpu_backup=True):
        w = random_bits(64 * MiB, torch.bfloat16, 7)
    x = random_bits(16 * MiB, torch.bfloat16, 8)
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y.copy_(x.mul(2).add(w[:x.numel()]))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with saver.cuda_graph(cuda_graph=graph, pool=torch.cuda.graph_pool_handle(), stream=stream,
                          tag="cuda_graph", enable_cpu_backup=True):
        y.copy_(x.mul(2).add(w[:x.numel()]))
    graph.replay()
    expected, w_before = host_bits(y), host_bits(w)
    free0 = free_now()
    for tag in ("kv_cache", "weights", "cuda_graph"):
        saver.pause(tag)
    freed = free_now() - free0
    taken = take_freed(free_now())
    for tag in ("cuda_graph", "weights", "kv_cache"):
        saver.resume(tag)
    y.zero_()
    graph.replay()
    return {"freed": freed, "taken": taken, "weights_same": host_bits(w) == w_before,
            "graph_same": host_bits(y) == expected, "kv_bytes": kv.nbytes}


def thread_beside() -> dict:
    """A region is its thread's: another thread allocating at the same time gets plain
    memory, which pause() leaves alone (readable while paused, its bits intact)."""
    import torch_memory_saver
    saver = torch_memory_saver.torch_memory_saver
    plain: list = []
    started, go_on = threading.Event(), threading.Event()

    def engine_thread():
        plain.append(random_bits(32 * MiB, torch.float16, 3))
        started.set()
        go_on.wait()

    with saver.region("kv", enable_cpu_backup=True):
        kv = random_bits(256 * MiB, torch.bfloat16, 4)
        worker = threading.Thread(target=engine_thread)
        worker.start()
        started.wait()
    plain_before, kv_before = host_bits(plain[0]), host_bits(kv)
    free0 = free_now()
    saver.pause("kv")
    freed = free_now() - free0
    plain_while_paused = host_bits(plain[0]) == plain_before
    saver.resume("kv")
    go_on.set()
    worker.join()
    return {"freed": freed, "kv": kv.nbytes, "plain_while_paused": plain_while_paused,
            "kv_same": host_bits(kv) == kv_before}


if __name__ == "__main__":
    found = globals()[sys.argv[1]]()
    torch.cuda.synchronize()
    print(json.dumps(found))
