"""Generation and training on one GPU, lending memory both ways (an RL loop's shape).

    python3 examples/rl_colocate.py [free GiB]   (a CUDA GPU and `pip install transformers`)

An actor generates with a KV cache; a learner (a copy of it, one step ahead, as in
asynchronous RL) trains with AdamW. Neither frees its memory between phases:

1. generate: the actor's StaticCache, made inside `with sublet.pool("kv")` by transformers'
   own code, fills with the prompts and the rollouts.
2. train: the KV cache is lent to the learner's training steps, keeping the prompts'
   positions (sublet.blocks: every layer's keys and values, positions [0, kept)).
3. generate and score: the optimizer state is lent (all of it kept) to the actor, which
   samples new rollouts from the kept prompts (the cache past them is zeroed, the last prompt
   token re-fed) and scores them.

Each phase prints the bytes that crossed the host link (kept bytes copied out and back: twice
loan.copied_bytes), the kept bytes moved on the GPU instead, and its seconds. Another job holds
the rest of the GPU (a stand-in tensor) but `free GiB` (default 4): with the whole GPU free a
loan would find all it needs in free memory and move nothing. The weights are random (no
download): the tokens mean nothing, the memory is the point.

The optimizer state is one tensor of pool "optim", made ahead: all pools of a process share one
region, and what a loan does not lend is pinned, so the learner's state stays untouched while
"kv" is lent, and the actor's weights while "optim" is.
"""
import copy
import sys
import time

import torch

import sublet

MiB, GiB = 1024 ** 2, 1024 ** 3


def main() -> None:
    if not torch.cuda.is_available():
        print("rl_colocate: no CUDA GPU here. The engine's allocations go into a sublet pool "
              "through PyTorch's CUDA allocator hook, which CPU tensors do not have; "
              "examples/quickstart.py runs without a GPU.")
        return
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    except ImportError:
        print("rl_colocate: needs transformers (pip install transformers)")
        return
    free_left = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=8192, pad_token_id=0)
    actor = LlamaForCausalLM(config).cuda().bfloat16().eval()
    learner = copy.deepcopy(actor).train()
    opt = torch.optim.AdamW(learner.parameters(), lr=1e-5)
    state = adamw_state_in_sublet_memory(opt)  # exp_avg, exp_avg_sq: views of one tensor

    batch, prompt_len, new_tokens = 16, 512, 64
    prompts = torch.randint(3, config.vocab_size, (batch, prompt_len), device="cuda")
    with sublet.pool("kv"):  # the engine's code, unchanged, allocates inside
        cache = StaticCache(config=config, max_cache_len=8192)
        cache.early_initialization(batch, config.num_key_value_heads,
                                   config.hidden_size // config.num_attention_heads,
                                   torch.bfloat16, "cuda")
    kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    train_step(learner, opt, prompts)  # the learner's previous step (warms cuBLAS up too)
    print(f"KV cache {sublet.pool('kv').nbytes / GiB:.2f} GiB in pool 'kv', optimizer state "
          f"{state.nbytes / GiB:.2f} GiB; {free_left} GiB of the GPU left free")
    torch.cuda.empty_cache()
    other_job = torch.empty(torch.cuda.mem_get_info()[0] - int(free_left * GiB),
                            dtype=torch.uint8, device="cuda")

    t = time.perf_counter()
    rollouts = generate(actor, prompts, cache, new_tokens)
    report("1 generate", None, t)

    kept = prompt_len - 1  # the last prompt token is fed again when generation goes on
    t = time.perf_counter()
    with sublet.lend("kv", keep=sublet.blocks(kv, torch.arange(kept), dim=2)) as loan:
        for micro_batch in rollouts.split(4):  # every CUDA allocation goes to the loan here
            train_step(learner, opt, micro_batch)
    report("2 train, KV cache lent", loan, t)

    t = time.perf_counter()
    for layer in cache.layers:  # only the kept positions are the engine's again
        layer.cumulative_length.fill_(kept)
        layer.keys[:, :, kept:].zero_()
        layer.values[:, :, kept:].zero_()
    with sublet.lend(state) as loan:  # keep=None: all of it comes back
        rollouts = generate(actor, prompts, cache, new_tokens, sample=True)
        logprob = score(actor, rollouts)
        rollouts = rollouts.cpu()  # nothing made in the loan outlives it
    report("3 generate and score, optimizer state lent", loan, t)
    train_step(learner, opt, rollouts.cuda()[:4])  # the state is as the learner left it
    print(f"rollouts {tuple(rollouts.shape)}, mean log-probability {logprob:.2f}")
    del other_job


def generate(model, prompts, cache, new_tokens, sample=False):
    with torch.no_grad():
        # Eager (no torch.compile): compiling the static cache's step inside a loan would make
        # CUDA graphs there, whose pools sublet does not route.
        return model.generate(prompts, cache=cache, max_new_tokens=new_tokens, do_sample=sample,
                              disable_compile=True)


def score(model, ids) -> float:
    """The mean log-probability of the rollouts' tokens, four rollouts at a time."""
    total = 0.0
    with torch.no_grad():
        for part in ids.split(4):
            logp = model(input_ids=part[:, :-1]).logits.float().log_softmax(-1)
            total += logp.gather(-1, part[:, 1:, None]).sum().item()
    return total / (ids.shape[0] * (ids.shape[1] - 1))


def train_step(model, opt, ids) -> None:
    logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def adamw_state_in_sublet_memory(opt) -> torch.Tensor:
    """AdamW's state made ahead, as views of one tensor of pool "optim" (AdamW would make it
    lazily at its first step), each view 512-byte aligned."""
    params = [p for group in opt.param_groups for p in group["params"]]
    sizes = [-(-p.numel() // 256) * 256 for p in params]
    flat = sublet.pool("optim").empty(2, sum(sizes), dtype=params[0].dtype).zero_()
    offset = 0
    for p, n in zip(params, sizes):
        exp_avg, exp_avg_sq = (flat[i, offset:offset + p.numel()].view_as(p) for i in (0, 1))
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        offset += n
    return flat


def report(phase: str, loan, started: float) -> None:
    torch.cuda.synchronize()
    line = f"{phase:44s} {time.perf_counter() - started:6.2f} s"
    if loan is not None:
        line += (f"   host link {2 * loan.copied_bytes / MiB:7.1f} MiB   moved on the GPU "
                 f"{loan.moved_bytes / MiB:7.1f} MiB   borrower's peak "
                 f"{loan.stats.peak_bytes / MiB:5.0f} MiB")
    print(line)


if __name__ == "__main__":
    main()
