"""GPU tests of sublet.compat.torch_memory_saver: torch_memory_saver's own examples run
unchanged against it (tests/python/tms_upstream/test/examples/, copied from its repository,
MIT: see the README there; its whole suite: test_compat_tms_upstream.py), each in a child
process that imports `torch_memory_saver` from the shim that
`python -m sublet.compat install --target DIR` writes; then scenarios of the examples that
read the original's C library (cpu_backup.py, training_engine.py) and SGLang's sequence, with
every kept byte compared as bits. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_compat_tms.py -m gpu -s
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import sublet
from sublet import _pool as sublet_pool
from sublet.compat import torch_memory_saver as tms_module
from sublet.compat.__main__ import install

from conftest import CHILD_ENV
from test_gpu import cuda_daemon, random_fill, settled_free_memory  # noqa: F401 (fixture)
from test_gpu_pool import bits, kv_layers, same_bits
from gpu_memory import free_now, scribble

GiB, MiB = 1024 ** 3, 1024 ** 2
EXAMPLES = Path(__file__).resolve().parent / "tms_upstream" / "test" / "examples"
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    """A directory where `import torch_memory_saver` gives sublet's drop-in."""
    target = tmp_path_factory.mktemp("tms-shim")
    install("torch_memory_saver", target)
    return target


def run_child(code: str, shim: Path, env: dict[str, str] | None = None) -> str:
    """Runs code in a child with the shim and the examples on its path; returns its output,
    failing the test with it when the child fails."""
    child_env = {**os.environ, **CHILD_ENV, **(env or {})}
    child_env.pop("SUBLET_BACKEND", None)
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(shim), str(EXAMPLES), child_env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"child failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout


# --------------------------------------------------------------------------- their examples

@pytest.mark.parametrize("example", ["simple", "rl_example", "cuda_graph"])
@pytest.mark.parametrize("hook_mode", ["torch", "preload"])
def test_torch_memory_saver_example_runs_unchanged(example, hook_mode, shim):
    """simple: 1 GB freed by pause() and back at the same address; rl_example: two tags
    paused and resumed, a plain CUDA graph replays on them; cuda_graph: in "preload" mode the
    graph is captured with torch_memory_saver.cuda_graph(g, tag="graph"), and pause("graph")
    must free its 4 GB of intermediates (sublet: the graph's memory is the tag's pool).
    The examples measure the whole device's free memory, so an earlier test's process still
    giving memory back would count as theirs (run after test_gpu.py, all three failed in
    torch mode, the first to run): wait until it has settled."""
    settled_free_memory()
    out = run_child(f"""
        import torch_memory_saver, {example}
        from sublet.compat import torch_memory_saver as ours
        assert torch_memory_saver is ours
        {example}.run(hook_mode={hook_mode!r})
        print("EXAMPLE OK")
    """, shim)
    assert "EXAMPLE OK" in out


# --------------------------------------------------------------------------- scenarios

@pytest.fixture
def tms():
    saver = tms_module.TorchMemorySaver()
    yield saver
    if saver._impl is not None:
        for tag in list(saver._impl._paused):
            saver._impl._resume_tag(tag)
    gc.collect()
    for pool in list(sublet_pool._pools.values()):
        pool.empty_cache()
    torch.cuda.empty_cache()


def test_cpu_backup_scenario(tms):
    """cpu_backup.py's first part: one tensor with backup, one without; pause() frees both,
    the freed memory is used by plain PyTorch, and resume() brings the backed-up bits back at
    the same address."""
    with tms.region(enable_cpu_backup=True):
        backed = random_fill(torch.empty(20_000_000, dtype=torch.uint8, device="cuda"), 1)
        typed = torch.randn((10, 20, 30), dtype=torch.float32, device="cuda")
    with tms.region(enable_cpu_backup=False):
        plain = torch.full((20_000_000,), 20, dtype=torch.uint8, device="cuda")
    before, typed_before, ptr = bits(backed), bits(typed), backed.data_ptr()
    free0 = free_now()
    tms.pause()
    freed = free_now() - free0
    assert freed >= 40_000_000 - 4 * MiB
    scribble(freed)
    tms.resume()
    assert backed.data_ptr() == ptr
    assert same_bits(backed, before) and same_bits(typed, typed_before)
    assert tms.get_cpu_backup(typed) is None
    del backed, typed, plain


def test_retain_cpu_backup_scenario(tms):
    """cpu_backup.py's retained-copy part: the host copy stays at one address across cycles
    and holds the bits of the last pause."""
    expected = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    with tms.region(tag="retained", enable_cpu_backup=True):
        t = expected.to("cuda")
    tms.retain_cpu_backup = True
    tms.pause("retained")
    first = tms.get_cpu_backup(t, zero_copy=True)
    ptr = first.data_ptr()
    assert torch.equal(first, expected)
    tms.resume("retained")
    after = tms.get_cpu_backup(t, zero_copy=True)
    assert after.data_ptr() == ptr and torch.equal(after, expected)
    assert torch.equal(t.cpu(), expected)
    tms.retain_cpu_backup = False
    tms.pause("retained")
    tms.resume("retained")
    assert tms.get_cpu_backup(t) is None and torch.equal(t.cpu(), expected)
    del t, first, after


def test_get_cpu_backup_while_paused_and_the_memory_margin(tms):
    """cpu_backup.py's read of the host copy after a plain pause (this process's copy), and
    memory_margin_bytes failing a routed allocation that would leave less free than it."""
    with tms.region("gcb-gpu", enable_cpu_backup=True):
        t = random_fill(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"), 9)
    before = t.cpu()
    tms.pause("gcb-gpu")
    host = tms.get_cpu_backup(t)
    assert host is not None and torch.equal(host, before)
    tms.resume("gcb-gpu")
    assert tms.get_cpu_backup(t) is None and torch.equal(t.cpu(), before)
    free, _ = torch.cuda.mem_get_info()
    tms.memory_margin_bytes = free                 # nothing more may be taken
    try:
        with tms.region("margin-gpu"):
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        tms.memory_margin_bytes = 0
        with tms.region("margin-gpu"):
            x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    finally:
        tms.memory_margin_bytes = 0
    del t, host, x


def test_keep_blocks_stay_on_the_gpu(tms):
    """sublet's keep=: the live blocks of a paged cache come back, none crossed the host
    link; the rest of the tag's memory was the driver's meanwhile."""
    with tms.region("kv-keep"):
        caches = kv_layers(8, 1024, seed=3)             # 8 layers of 1024 blocks
    ids = torch.from_numpy(np.sort(np.random.default_rng(4).choice(1024, 100, replace=False)))
    kept = [bits(c[:, ids]) for c in caches]
    free0 = free_now()
    tms.pause("kv-keep", keep=sublet.blocks(caches, ids, dim=1))
    (rel,) = tms._impl._paused["kv-keep"]
    assert rel.copied_bytes == 0
    freed = free_now() - free0
    # Everything but the pages holding the 100 MiB kept came free, less what subletd's first
    # kernel launch of its life (the moves) reserved on the device: seen as 0.42 GiB on the
    # H200, once per daemon.
    total = sum(c.nbytes for c in caches)              # 100 of 1024 blocks kept, ~10%
    assert rel.released_bytes >= 0.8 * total
    assert freed >= rel.released_bytes - 512 * MiB
    scribble(freed)
    tms.resume("kv-keep")
    assert all(same_bits(c[:, ids], k) for c, k in zip(caches, kept))
    del caches


def test_nested_regions_route_to_the_inner_tag_and_back(tms):
    with tms.region("n-outer"):
        a = random_fill(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"), 5)
        with tms.region("n-inner"):
            b = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        c = random_fill(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"), 6)
    outer, inner = sublet.pool("n-outer"), sublet.pool("n-inner")
    assert outer.nbytes >= 128 * MiB and inner.nbytes >= 64 * MiB
    assert inner.arena.holds(b.data_ptr())
    a_before, c_before = bits(a), bits(c)
    tms.pause("n-inner")                                  # the outer tag is untouched
    assert same_bits(a, a_before) and same_bits(c, c_before)
    tms.resume("n-inner")
    del a, b, c


def test_sglang_sequence_with_a_pauseable_cuda_graph(tms):
    """SGLang's release_memory_occupation / resume_memory_occupation: kv_cache (lost),
    weights (backup), a graph captured with cuda_graph(cuda_graph=, pool=, stream=,
    tag="cuda_graph", enable_cpu_backup=True); paused kv, weights, graph; resumed graph,
    weights, kv; the graph replays to the same bits."""
    with tms.region("kv_cache"):
        kv = torch.zeros(512 * MiB, dtype=torch.uint8, device="cuda")
    with tms.region("weights", enable_cpu_backup=True):
        w = random_fill(torch.empty(64 * MiB, dtype=torch.float32, device="cuda"), 7)
    x = random_fill(torch.empty(16 * MiB, dtype=torch.float32, device="cuda"), 8)
    y = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y.copy_(x.mul(2).add(w[:x.numel()]))              # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=graph, pool=torch.cuda.graph_pool_handle(), stream=stream,
                        tag="cuda_graph", enable_cpu_backup=True):
        y.copy_(x.mul(2).add(w[:x.numel()]))              # x.mul(2): graph memory
    assert sublet.pool("cuda_graph+graph+backup").nbytes > 0     # the graph's own pool
    graph.replay()
    torch.cuda.synchronize()
    expected, w_before = bits(y), bits(w)
    free0 = free_now()
    for tag in ("kv_cache", "weights", "cuda_graph"):
        tms.pause(tag)
    freed = free_now() - free0
    assert freed >= 512 * MiB + 256 * MiB
    scribble(freed)
    for tag in ("cuda_graph", "weights", "kv_cache"):
        tms.resume(tag)
    assert same_bits(w, w_before)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(y, expected)
    del graph, kv, w


def test_init_enable_and_disable_as_training_engine_does(shim):
    """training_engine.py's sequence, where TMS_INIT_ENABLE routes the process for life
    (hence a child): every allocation after the first use is pauseable with backup; pause();
    inside disable() plain PyTorch memory is used and freed; resume(); weights intact."""
    out = run_child("""
        import torch
        from torch_memory_saver import torch_memory_saver as tms
        tms._ensure_initialized()
        w = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda")
        before = w.clone().cpu()
        tms.pause()
        with tms.disable():
            x = torch.ones(1 << 28, device="cuda").sum()
            assert int(x.item()) == 1 << 28
            del x
        tms.resume()
        assert torch.equal(w.cpu(), before)
        print("INIT OK")
    """, shim, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    assert "INIT OK" in out
