"""Host work of one native-engine step on CPU: milliseconds and torch ops dispatched per decode step at 64
and 256 sequences, per embed step, and the top-p sampler at a real vocabulary.

    flock /tmp/bench.lock .venv/bin/python bench/bench_decode_host.py [--repeats 3] [--out FILE]

The model is a tiny random Qwen3.5 (hidden 64, 4 layers: 3 Gated DeltaNet, 1 gated attention; vocabulary
32, no EOS so no sequence stops early), so its arithmetic is microseconds and what a step costs is the
engine's own work: scheduling, building the step's tensors (block tables, slot mapping, offsets),
dispatching torch ops, sampling. That is the work that stays on the host when the kernels run on a GPU.

Per decode step = (generate with M2 new tokens - generate with M1) / (M2 - M1), which cancels the prefill
and the set-up; prompts of 1 and 128 tokens give each sequence 1 and 9 KV pages (page size 16).
Ops are counted by a TorchDispatchMode over the same two runs (every aten op the step dispatches, the
model's included); "syncs" counts the ops among them that block the host on a GPU (a scalar read back:
item / tolist; nonzero; repeat_interleave with tensor repeats and no output size); host-to-device copies
without non_blocking are not visible on CPU and are not counted. Times are the best of --repeats.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.models import demo as demo_model  # noqa: E402
from pipeline.engine.native import NativeEngine, SamplingParams  # noqa: E402

SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = str(func)
        if name in SYNC_OPS or (name.startswith("aten.repeat_interleave.Tensor") and kwargs.get("output_size") is None):
            self.syncs += 1
        return func(*args, **kwargs)


def write_model(path: Path) -> Path:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                               max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                               layer_types=["linear_attention", "full_attention", "linear_attention",
                                            "linear_attention"])
    Qwen3_5ForCausalLM(config).eval().save_pretrained(path)
    demo_model.build_tokenizer().save_pretrained(path)
    return path


def prompts(num_seqs: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(length)
    return [[1] + rng.integers(4, 29, length - 1).tolist() for _ in range(num_seqs)]


def timed(fn, repeats: int) -> tuple[float, int, int]:
    """(best seconds, ops, syncs) of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    counter = OpCounter()
    with counter:
        fn()
    return best, counter.ops, counter.syncs


def decode_step(path: Path, num_seqs: int, prompt_len: int, params: dict, repeats: int, m1=2, m2=10):
    engine = NativeEngine.load(str(path), torch.device("cpu"), torch.float32, "", max_tokens_per_step=65536,
                               max_seqs=num_seqs, max_new_tokens=m2)
    ps, keys = prompts(num_seqs, prompt_len), list(range(num_seqs))

    def run(m):
        got = engine.generate(ps, keys, SamplingParams(max_new_tokens=m, **params))
        assert all(len(g.token_ids) == m for g in got)

    run(m1)   # warm-up
    t1, o1, s1 = timed(lambda: run(m1), repeats)
    t2, o2, s2 = timed(lambda: run(m2), repeats)
    steps = m2 - m1
    return 1e3 * (t2 - t1) / steps, (o2 - o1) / steps, (s2 - s1) / steps


def embed_step(path: Path, num_seqs: int, length: int, repeats: int):
    engine = NativeEngine.load(str(path), torch.device("cpu"), torch.float32, "", max_tokens_per_step=65536,
                               max_seqs=num_seqs)
    batch = prompts(num_seqs, length)
    layers = [engine.spec.num_layers]
    engine.forward(batch, layers, logprobs=False)
    t, ops, syncs = timed(lambda: engine.forward(batch, layers, logprobs=False), repeats)
    return 1e3 * t, ops, syncs


def sampler_ms(num_seqs: int, vocab: int, peaked: bool, repeats: int) -> float:
    """ms per sample() call at top-p 0.9. peaked: a language model's shape, probabilities ~ rank^-1.5 (ranks
    shuffled per row), a nucleus of ~60 tokens; else flat (logits ~ N(0, 3^2)), a nucleus of thousands."""
    from pipeline.engine.sampler import sample, uniforms
    g = torch.Generator().manual_seed(0)
    if peaked:
        ranks = torch.argsort(torch.rand(num_seqs, vocab, generator=g), dim=-1).float() + 1
        logits = -1.5 * ranks.log()
    else:
        logits = torch.randn(num_seqs, vocab, generator=g) * 3
    u = uniforms(0, np.arange(num_seqs, dtype=np.uint64), np.zeros(num_seqs, np.uint64))
    sample(logits, 1.0, 0.9, u)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sample(logits, 1.0, 0.9, u)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| step | sequences | KV pages | host ms / step | ops / step | syncs / step |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "qwen35-tiny")
        for num_seqs in (64, 256):
            for prompt_len in (1, 128):
                for label, params in (("decode, greedy", {}),
                                      ("decode, top-p 0.9", dict(temperature=1.0, top_p=0.9, seed=1))):
                    ms, ops, syncs = decode_step(path, num_seqs, prompt_len, params, args.repeats)
                    pages = num_seqs * -(-(prompt_len + 9) // 16)
                    lines.append(f"| {label} (prompt {prompt_len}) | {num_seqs} | {pages} | {ms:.2f} | {ops:.0f} | "
                                 f"{syncs:.1f} |")
                    print(lines[-1], flush=True)
        for num_seqs in (64, 256):
            ms, ops, syncs = embed_step(path, num_seqs, 64, args.repeats)
            lines.append(f"| embed (64 tokens each, one step) | {num_seqs} | {num_seqs * 4} | {ms:.2f} | {ops} | {syncs} |")
            print(lines[-1], flush=True)
    lines += ["", "| top-p 0.9 sampler, vocabulary 248,320 | sequences | ms / call |", "| --- | ---: | ---: |"]
    for peaked in (True, False):
        for num_seqs in (64, 256):
            ms = sampler_ms(num_seqs, 248320, peaked, args.repeats)
            label = "peaked (nucleus ~60 tokens)" if peaked else "flat (nucleus of thousands)"
            lines.append(f"| sample(), {label} | {num_seqs} | {ms:.1f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
