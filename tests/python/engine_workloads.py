"""Real engines for the engine tests: a small Llama (random weights, no hub) from
transformers, its StaticCache and the paged cache of its continuous batching, greedy
generation, and training steps. Shared by test_gpu_engine.py (CUDA, `with sublet.pool`) and
test_engine_memfd.py (CPU, Pool.empty), and by nothing else.

What the cache holds after a loan: only the kept bytes are the owner's again; every other byte
of what was lent is whatever the borrower left there (random bits: NaN and Inf patterns too).
A StaticCache attends over its whole max_cache_len with a mask, and a masked NaN still poisons
the attention (0 x NaN is NaN), so an engine that keeps a prefix zeroes the rest of its cache
after the loan (crop_static below) before it decodes on: the masked positions then hold what a
fresh cache holds, and generation is bit-for-bit what it would have been without the loan.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import time

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install transformers): the engine tests "
                           "run a real model's StaticCache and continuous batching")
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

# The generate()/forward() keyword of the cache: `cache` from transformers 5.2x on
# (past_key_values still works there, with a deprecation warning), past_key_values before.
CACHE_KW = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
            else "past_key_values")

SIZES = {
    # CPU, float32: a few ms a token.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                 max_position_embeddings=1024),
    # GPU, bf16: about 160 M parameters (320 MB of weights, 1.3 GB with grads and AdamW).
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                  max_position_embeddings=16384),
}


def llama(size: str, device, dtype, seed: int = 0, attn: str = "sdpa") -> LlamaForCausalLM:
    """A Llama of random weights (torch.manual_seed(seed)), in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(**SIZES[size], attn_implementation=attn, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def head_dim(model) -> int:
    c = model.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def prompts(model, batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g)
    return ids.to(model.device)


# --------------------------------------------------------------------------- StaticCache

def static_cache(model, batch: int, max_len: int) -> StaticCache:
    """A StaticCache whose layer tensors are allocated now (not lazily at the first forward):
    inside `with sublet.pool(tag)` they are that pool's."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    cache.early_initialization(batch_size=batch, num_heads=model.config.num_key_value_heads,
                               head_dim=head_dim(model), dtype=model.dtype,
                               device=model.device)
    return cache


def static_cache_from_pool(model, pool, batch: int, max_len: int) -> StaticCache:
    """A StaticCache whose keys and values are Pool.empty() tensors (the CPU form of
    `with pool: static_cache(...)`): allocated by StaticCache, then replaced before any use."""
    cache = static_cache(model, batch, max_len)
    for layer in cache.layers:
        layer.keys = pool.empty(*layer.keys.shape, dtype=layer.keys.dtype).zero_()
        layer.values = pool.empty(*layer.values.shape, dtype=layer.values.dtype).zero_()
    return cache


def kv_of(cache: StaticCache) -> list[torch.Tensor]:
    """Every layer's keys and values, [batch, kv_heads, max_len, head_dim] each."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def lengths_of(cache: StaticCache) -> list[torch.Tensor]:
    """Every layer's cumulative_length: the 0-d tensor of positions written so far."""
    return [layer.cumulative_length for layer in cache.layers]


def crop_static(cache: StaticCache, length: int) -> None:
    """Makes the cache hold positions [0, length) only: the length set, the rest zeroed (after
    a loan it holds the borrower's bits, which the masked attention must not see)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)
        layer.keys[:, :, length:].zero_()
        layer.values[:, :, length:].zero_()


def greedy(model, ids: torch.Tensor, cache, new_tokens: int):
    """Greedy generation continuing `ids` with `cache` (generate() feeds only the positions
    past cache.get_seq_length()); returns (sequences, scores as one [steps, batch, vocab]
    tensor)."""
    with torch.no_grad(), deterministic():
        # Eager: on CUDA, generate() with a static cache compiles the forward (CUDA graphs
        # and autotuned kernels), and a compiled step's logits need not equal an eager one's
        # bit for bit; both runs compared here must take the same kernels.
        out = model.generate(ids, max_new_tokens=new_tokens, disable_compile=True,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             **{CACHE_KW: cache})
    return out.sequences, torch.stack(out.scores)


@contextlib.contextmanager
def deterministic():
    """PyTorch's deterministic kernels for the duration. Without them, on the H200 (torch
    2.11), one generation repeated over the same cache gave logits that differed in their
    bits, and now and then in a token (the attention over a 16384-long StaticCache splits
    its sum in a run-dependent order): then a comparison with a reference says nothing of
    the loan."""
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


# --------------------------------------------------------------------------- continuous batching

def continuous_batching(model, gen, cb, inputs: list[list[int]], max_new_tokens: int,
                        lend=None, lend_at_step: int = 0,
                        timeout: float = 30) -> tuple[list[list[int]], dict]:
    """Continuous batching of `inputs` (all queued before the loop starts) to the end; with
    `lend`, the loop is paused once it reaches batch `lend_at_step` and lend(cache) runs while
    it is paused (the cache is then the live requests' only copy). Returns every request's
    generated tokens, in the order of `inputs`, and what lend returned ({} without it).
    `timeout` bounds each wait for a result and the stop."""
    with deterministic():  # the reference and the run with a loan must agree bit for bit
        manager = model.init_continuous_batching(generation_config=gen,
                                                 continuous_batching_config=cb)
        ids = manager.add_requests(inputs, max_new_tokens=max_new_tokens)
        manager.start()
        report = {}
        try:
            if lend is not None:
                while getattr(manager, "current_batch", 0) < lend_at_step:
                    assert manager.is_running(), "the generation loop died"
                    time.sleep(0.001)
                with manager.pause():
                    report = lend(manager.batch_processor.cache)
            results = {}
            while len(results) < len(ids):
                r = manager.get_result(timeout=timeout)
                assert r is not None, f"continuous batching gave no result within {timeout} s"
                if r.is_finished():
                    assert r.error is None, r.error
                    results[r.request_id] = list(r.generated_tokens)
        finally:
            manager.stop(block=True, timeout=timeout)
            manager.destroy()
    return [results[i] for i in ids], report


# --------------------------------------------------------------------------- bits

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of its element size: equality of bits, not of
    values (a NaN equals itself, -0.0 differs from 0.0)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def changed(now: list[torch.Tensor], before: list[torch.Tensor]) -> list[int]:
    """Indices of the tensors whose bits differ from their snapshot."""
    return [i for i, (a, b) in enumerate(zip(now, before)) if not same_bits(a, b)]


def mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """What differs between two results, for an assertion message."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
    diff = bits(a) != bits(b)
    where = diff.nonzero()[:5].tolist()
    extra = ""
    if a.is_floating_point():
        extra = f", max |a-b| {(a.float() - b.float()).abs().max().item():.3g}"
    return f"{int(diff.sum())} of {a.numel()} elements differ, first at {where}{extra}"


# --------------------------------------------------------------------------- training

def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, written out (log-softmax and a gather: deterministic on CUDA,
    each gradient position receiving one term)."""
    logp = logits.float().log_softmax(-1)
    return -logp.gather(-1, labels.unsqueeze(-1)).mean()


def backward(model, ids: torch.Tensor) -> float:
    loss = lm_loss(model(input_ids=ids[:, :-1]).logits, ids[:, 1:])
    loss.backward()
    return loss.item()


def batch_of(model, batch: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=model.device).manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, seq + 1), device=model.device,
                         generator=g)


def adam_states(opt: torch.optim.Optimizer, params=None) -> list[torch.Tensor]:
    """exp_avg and exp_avg_sq of the optimizer's parameters (all, or those given), in order."""
    params = [p for g in opt.param_groups for p in g["params"]] if params is None else params
    return [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]


@contextlib.contextmanager
def timed(results: dict, key: str):
    t = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    results[key] = time.perf_counter() - t


def collect() -> None:
    """Drops what reference cycles still hold (a model copy's modules refer to each other
    through hooks and configs) before a loan ends: what lives at the end is a leak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def assert_continues_as_reference(model, ids, seq1, cache, ref_cache, prefix: int, n1: int,
                                  n2: int) -> None:
    """After a loan kept cache[:prefix]: generation continued from `seq1` with the cropped
    cache gives, tokens and logits bit for bit, what a reference cache that had no loan gives
    from the same prefix."""
    crop_static(cache, prefix)
    seq2, scores2 = greedy(model, seq1, cache, n2)
    ref_cache.reset()
    ref1, _ = greedy(model, ids, ref_cache, n1)
    assert torch.equal(ref1, seq1)
    crop_static(ref_cache, prefix)
    ref2, ref_scores2 = greedy(model, ref1, ref_cache, n2)
    assert torch.equal(seq2, ref2), mismatch(seq2, ref2)
    assert same_bits(scores2, ref_scores2), mismatch(scores2, ref_scores2)
