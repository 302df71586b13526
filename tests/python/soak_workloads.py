"""Borrowers for the GPU soak (test_gpu_soak.py), run inside a loan in the owner's process or
in the soak's borrower process: realistic PyTorch work, chosen at random per loan.

Each workload allocates through whatever routing is active (the loan) and frees everything
before it returns, except `leak`, which hands back a tensor for the caller to keep alive past
the loan (a LeakError), and `exception`, which raises PlannedError at the end.
"""

from __future__ import annotations

import random
import threading

import torch

KINDS = ["train_eager", "train_compiled", "small_allocations", "streams", "thread",
         "exception", "out_of_memory", "leak"]
D_MODEL, LAYERS, TOKENS = 1024, 4, 4096


class PlannedError(RuntimeError):
    """The exception a borrower raises inside the loan on purpose."""


def _weights(device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    shapes = [(4 * D_MODEL, D_MODEL), (D_MODEL, 4 * D_MODEL)] * LAYERS
    return [(torch.randn(s, device=device, generator=g) * 0.02).requires_grad_() for s in shapes]


def _mlp(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    for up, down in zip(weights[::2], weights[1::2]):
        x = x + torch.nn.functional.gelu(x @ up.t()) @ down.t()
    return x.float().pow(2).mean()


_compiled = None


def _train(device: torch.device, compiled: bool, steps: int = 2) -> float:
    """Training steps of a 4-layer MLP block stack: autograd, AdamW, bf16 autocast."""
    global _compiled
    fn = _mlp
    if compiled:
        if _compiled is None:
            _compiled = torch.compile(_mlp)  # compiled once per process, reused every loan
        fn = _compiled
    weights = _weights(device)
    opt = torch.optim.AdamW(weights, lr=1e-4)
    loss = torch.zeros((), device=device)
    for _ in range(steps):
        x = torch.randn(TOKENS, D_MODEL, device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(x, *weights)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    value = float(loss)
    del weights, opt
    return value


def _small_allocations(device: torch.device, rng: random.Random) -> None:
    """Thousands of allocations of 1 KiB to 1 MiB, each written, freed in random order."""
    live: list[torch.Tensor] = []
    for _ in range(3000):
        if live and (len(live) > 400 or rng.random() < 0.45):
            live.pop(rng.randrange(len(live)))
        else:
            live.append(torch.empty(rng.randint(1 << 10, 1 << 20), dtype=torch.uint8,
                                    device=device).fill_(rng.randrange(256)))
    rng.shuffle(live)
    torch.cuda.synchronize(device)
    live.clear()


def _streams(device: torch.device) -> None:
    """Work on side streams; tensors used there are freed with record_stream, as PyTorch
    code does."""
    side = [torch.cuda.Stream(device) for _ in range(3)]
    main = torch.cuda.current_stream(device)
    for i, s in enumerate(side):
        x = torch.randn(2048, 2048, device=device)
        s.wait_stream(main)
        with torch.cuda.stream(s):
            y = (x @ x).relu_()
            x.record_stream(s)
            y.record_stream(s)
        del x, y
        if i == 1:
            main.wait_stream(s)
    torch.cuda.synchronize(device)


def _thread(device: torch.device) -> None:
    """A second thread allocating and computing beside the main one."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            torch.cuda.set_device(device)
            for _ in range(20):
                a = torch.randn(1024, 1024, device=device)
                (a @ a).sum().item()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    _train(device, compiled=False, steps=1)
    t.join()
    if errors:
        raise errors[0]


def _out_of_memory(device: torch.device) -> None:
    """Asks for more than any loan can give, is refused, and goes on with less."""
    try:
        torch.empty(1 << 42, dtype=torch.uint8, device=device)
        raise AssertionError("4 TiB were granted")
    except torch.OutOfMemoryError:
        pass
    torch.empty(64 << 20, dtype=torch.uint8, device=device).fill_(3)


def run(kind: str, rng: random.Random, device: torch.device, spill_bytes: int
        ) -> torch.Tensor | None:
    """One borrower: a spill tensor of spill_bytes (to reach kept pages) and the workload.
    Returns the tensor `leak` leaks; raises PlannedError for `exception`."""
    spill = torch.empty(spill_bytes, dtype=torch.uint8, device=device).fill_(0xEE)
    if kind in ("train_eager", "train_compiled"):
        _train(device, compiled=kind == "train_compiled")
    elif kind == "small_allocations":
        _small_allocations(device, rng)
    elif kind == "streams":
        _streams(device)
    elif kind == "thread":
        _thread(device)
    elif kind == "out_of_memory":
        _out_of_memory(device)
    torch.cuda.synchronize(device)
    del spill
    if kind == "exception":
        raise PlannedError("a borrower's exception inside the loan (planned)")
    if kind == "leak":
        return torch.empty(8 << 20, dtype=torch.uint8, device=device).fill_(1)
    return None
