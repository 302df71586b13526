"""The borrower's half of the cross-process example: borrows "kv" and trains in its memory.

    python3 examples/borrower.py [steps]   (after examples/owner.py, as the same user)

Inside the `with` block every CUDA allocation of this process is served from the loan: the
model, its gradients, the optimiser's state, the activations. Loan.empty() allocates from the
loan directly (it is how the memfd backend, with no GPU, gets any memory from it). Everything
allocated inside must be gone before the block ends, or LeakError says what was left.
"""
import sys

import torch

import sublet


def train(loan: sublet.Loan, steps: int, device: torch.device) -> float:
    scratch = loan.empty(64 * 2**20, dtype=torch.uint8).fill_(7)  # 64 MiB straight from the loan
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
    return float(loss)


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with sublet.borrow(name="kv", timeout=60) as loan:
        loss = train(loan, steps, device)
    stats = loan.stats
    print(f"trained {steps} steps in the loan (loss {loss:.3f}); used "
          f"{stats.peak_bytes / 2**20:.0f} MiB of it at most; {stats.map_seconds:.3f} s mapping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
