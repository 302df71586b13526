"""The borrower's half of the cross-process example: borrows "kv" and trains in its memory.

    python3 examples/borrower.py [steps]   (after examples/owner.py, as the same user)

Inside the `with` block every CUDA allocation of this process is served from the loan: the
model, its gradients, the optimiser's state, the activations. Loan.empty() allocates from the
loan directly (it is how the memfd backend, with no GPU, gets any memory from it). Everything
allocated inside must be gone before the block ends, or LeakError says what was left.

On a GPU the scratch tensor is 64 MiB. On the memfd backend (no GPU) it is larger than the
device's free memory: all of it and three quarters of the memory in use (the owner's cache, in
this example), so that the loan must take pages that hold the owner's kept bytes: they move
into unkept bytes of other pages, or go to the host, and come back when the loan ends.
"""
import sys

import torch

import sublet


def train(loan: sublet.Loan, steps: int, device: torch.device, scratch_bytes: int) -> float:
    scratch = loan.empty(scratch_bytes, dtype=torch.uint8).fill_(7)  # straight from the loan
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(512, 1024, device=device)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert int(scratch.min()) == int(scratch.max()) == 7
    return float(loss.detach())


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if gpu:
        scratch_bytes = 64 * 2**20
    else:  # more than the device has free (the memfd device's memory, as the daemon counts it)
        info = sublet.info("cpu")
        scratch_bytes = info.free_bytes + (info.total_bytes - info.free_bytes) * 3 // 4
    with sublet.borrow(name="kv", timeout=60) as loan:
        loss = train(loan, steps, device, scratch_bytes)
    stats = loan.stats
    print(f"trained {steps} steps in the loan (loss {loss:.3f}); used "
          f"{stats.peak_bytes / 2**20:.0f} MiB of it at most; {stats.map_seconds:.3f} s mapping; "
          f"the owner's kept bytes: {stats.moved_bytes / 2**20:.1f} MiB moved on the device, "
          f"{stats.copied_out_bytes / 2**20:.1f} MiB copied to the host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
