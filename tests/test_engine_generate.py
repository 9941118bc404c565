"""Generation on the native engine: greedy equals transformers' greedy `generate` token for token, and
sampling depends only on (seed, sequence key), not on batching, order or step budget."""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.native import NativeEngine, SamplingParams
from tests.families.fixtures import family_checkpoint  # noqa: F401
from tests.tiny_checkpoints import random_sequences, write_tiny

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_gen")
    return {kind: write_tiny(kind, root / kind) for kind in ("qwen3_5", "llama")}


def hf_greedy(path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
            out.append(ids)
    return out


@pytest.mark.parametrize("kind", ("qwen3_5", "llama"))
@pytest.mark.parametrize("budget,max_seqs", [(4096, 256), (7, 3)])
def test_greedy_equals_transformers_generate(checkpoints, kind, budget, max_seqs):
    """Big budget: every prompt in one step. Tiny budget: chunked prefill, decodes mixed with prefill
    chunks, sequences admitted as others finish (continuous batching)."""
    prompts = random_sequences([12, 1, 40, 3, 25, 8, 60], seed=11, eos=None)
    engine = NativeEngine.load(str(checkpoints[kind]), CPU, torch.float32, "", max_tokens_per_step=budget,
                               max_seqs=max_seqs, max_new_tokens=24)
    got = engine.generate(prompts, range(len(prompts)), SamplingParams(max_new_tokens=24))
    want = hf_greedy(checkpoints[kind], prompts, 24)
    assert [g.token_ids for g in got] == want
    assert len({tuple(w) for w in want}) > 3, "degenerate reference: every prompt continues the same way"
    for g in got:
        assert g.finish_reason == ("stop" if g.token_ids[-1] == 2 else "length")
        assert 2 not in g.token_ids[:-1] and (g.finish_reason == "stop" or len(g.token_ids) == 24)


def test_sampling_is_reproducible_per_sequence_whatever_the_batching(checkpoints):
    prompts = random_sequences([12, 1, 40, 3, 25, 8], seed=12, eos=None)
    keys = [100, 7, 3, 55, 9, 21]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=5)
    path = str(checkpoints["qwen3_5"])
    big = NativeEngine.load(path, CPU, torch.float32, "", max_new_tokens=16)
    small = NativeEngine.load(path, CPU, torch.float32, "", max_tokens_per_step=5, max_seqs=2, max_new_tokens=16)
    a = big.generate(prompts, keys, params)
    b = small.generate(prompts[::-1], keys[::-1], params)[::-1]
    c = [big.generate([p], [k], params)[0] for p, k in zip(prompts[:2], keys[:2])]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a[:2]] == [x.token_ids for x in c]
    other_seed = big.generate(prompts, keys, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=6))
    assert [x.token_ids for x in a] != [x.token_ids for x in other_seed]
    greedy = big.generate(prompts, keys, SamplingParams(max_new_tokens=16))
    assert [x.token_ids for x in a] != [x.token_ids for x in greedy]


def test_alive_is_asked_before_each_step_and_false_gives_the_call_up(checkpoints):
    """`alive(tokens)` is asked before every step with the tokens computed so far (a worker's heartbeat and its stop:
    a generate call's steps have no bound); False raises Stopped before the step, and the engine's next call
    computes what it would have without the stopped one."""
    from pipeline.engine.interface import Stopped
    prompts, keys = random_sequences([12, 5, 30], seed=13, eos=None), [40, 41, 42]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    engine = NativeEngine.load(str(checkpoints["qwen3_5"]), CPU, torch.float32, "", max_tokens_per_step=16, max_seqs=2,
                               max_new_tokens=10)
    asked, steps, tokens = [], engine.stats.steps, engine.stats.tokens
    want = engine.generate(prompts, keys, params, alive=lambda computed: asked.append(computed) or True)
    assert len(asked) == engine.stats.steps - steps >= 10
    assert asked[0] == 0 and all(a < b for a, b in zip(asked, asked[1:])) and asked[-1] < engine.stats.tokens - tokens

    asked, steps = [], engine.stats.steps
    with pytest.raises(Stopped):
        engine.generate(prompts, keys, params, alive=lambda computed: asked.append(computed) or len(asked) <= 3)
    assert len(asked) == 4 and engine.stats.steps - steps == 3   # the fourth step did not run
    again = engine.generate(prompts, keys, params)
    assert [(g.token_ids, g.finish_reason) for g in again] == [(g.token_ids, g.finish_reason) for g in want]


def test_top_p_keeps_the_nucleus_only():
    from pipeline.engine.sampler import sample, uniforms
    import numpy as np
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    u = uniforms(1, np.arange(2000, dtype=np.uint64), np.zeros(2000, np.uint64))
    tokens = sample(logits, 1.0, 0.7, u)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).tolist()
    assert counts[2] == counts[3] == 0                # outside the 0.8-mass nucleus {0, 1}
    assert abs(counts[0] / 2000 - 0.625) < 0.05       # renormalised: 0.5 / 0.8
    assert sample(logits[:3], 0.0, 0.7, u[:3]) == [0, 0, 0]


def test_never_samples_ids_past_the_tokenizer(tmp_path):
    """The demo model's embedding has 32 rows and its tokenizer 29 tokens (padded vocabularies are common
    in real checkpoints too): at a temperature that makes the distribution nearly uniform, 128 draws
    would pick one of the 3 padding rows with probability 1 - (29/32)^128 > 0.99999 if they were allowed."""
    from pipeline.models import demo as demo_model
    path = demo_model.write(tmp_path / "demo")
    engine = NativeEngine.load(str(path), CPU, torch.float32, "", max_new_tokens=16)
    assert engine.spec.vocab_size > len(engine.tokenizer)
    prompts = random_sequences([5, 9, 3, 7, 12, 4, 6, 8], seed=13, eos=None)
    got = engine.generate(prompts, range(8), SamplingParams(max_new_tokens=16, temperature=1e4, seed=1))
    drawn = [t for g in got for t in g.token_ids]
    assert len(drawn) >= 64 and max(drawn) < len(engine.tokenizer)


def test_text_of_ids_without_a_token(tmp_path):
    """Greedy search (exactly transformers') may pick a padded vocabulary row: its text is the unknown token."""
    from pipeline.models import demo as demo_model
    from pipeline.config import RunConfig
    from pipeline.tasks.generate import GenerateTask
    path = demo_model.write(tmp_path / "demo")
    engine = NativeEngine.load(str(path), CPU, torch.float32, "", max_new_tokens=4)
    tok = engine.tokenizer
    task = GenerateTask(RunConfig(fasta=["x.fa"], out="o", task="generate"), engine.info)
    assert task._decode(tok, tok.convert_tokens_to_ids(["M", "K"]) + [len(tok) + 1, 2]) == "MK" + tok.unk_token
    # The unknown token itself, generated (the demo model did, 10 times for a prompt ending in one): decode
    # dropped it as a special token, and the text of 10 new tokens was empty.
    assert task._decode(tok, [tok.unk_token_id] + tok.convert_tokens_to_ids(["M"]) + [tok.unk_token_id, 2]) == \
        tok.unk_token + "M" + tok.unk_token


def _full_sort_sample(logits, temperature, top_p, u):
    """The sampler before issue 20 (a stable sort of the whole vocabulary per row), kept as the reference."""
    import numpy as np
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = before < top_p
    sorted_probs = sorted_probs.masked_fill(~kept, 0.0)
    cdf = sorted_probs.double().cumsum(dim=-1)
    target = torch.from_numpy(np.asarray(u)) * cdf[:, -1]
    pick = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
    kept_sets = [set(order[i][kept[i]].tolist()) for i in range(len(order))]
    return order.gather(1, pick).squeeze(1).tolist(), kept_sets


def test_top_p_from_candidates_equals_the_full_sort():
    """Top-p among torch.topk candidates (not a sort of the vocabulary) draws exactly the tokens the full
    stable sort drew, over seeded rows: peaked and flat distributions, nuclei larger than the first
    candidate count (redone, then more candidates), ties (equal logits, ranked by id); and each row's kept
    set equals the old one, and the nucleus computed in float64 where float32 prefix sums can decide it
    (top_p <= 0.95, no ties)."""
    import numpy as np
    from pipeline.engine.sampler import Sampler, _nucleus, _stable_top, uniforms
    g = torch.Generator().manual_seed(21)
    V = 5000
    logits = torch.randn(48, V, generator=g) * torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(12)[:, None]
    logits[40:, :600] = 2.0                               # 600 tied top tokens: the nucleus cuts a tie group
    logits[44:, 600:] = -50.0
    u = uniforms(3, np.arange(48, dtype=np.uint64), np.zeros(48, np.uint64))
    for temperature, top_p in ((1.0, 0.9), (0.7, 0.5), (2.0, 0.95), (1.0, 0.999)):
        sampler = Sampler(temperature, top_p, candidates=64)
        want, kept = _full_sort_sample(logits, temperature, top_p, u)
        assert sampler(logits, u) == want
        assert sampler(logits, u) == want   # again, with the candidate count the first call adapted to
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        vals, order = _stable_top(probs, 256)
        _, fits = _nucleus(vals, order, top_p, torch.from_numpy(u))
        assert fits.any() and not fits.all()
        for i in fits.nonzero().flatten().tolist():
            assert set(order[i][(vals[i].cumsum(0) - vals[i]) < top_p].tolist()) == kept[i]
        p64 = torch.softmax(logits.double() / temperature, dim=-1)
        for i in range(40 if top_p <= 0.95 else 0):
            vals64, order64 = p64[i].sort(descending=True, stable=True)
            assert kept[i] == set(order64[(vals64.cumsum(0) - vals64) < top_p].tolist()), (temperature, top_p, i)
    assert max(len(k) for k in kept) > 64 and min(len(k) for k in kept) < 64


@pytest.mark.slow
def test_a_run_that_may_generate_past_the_models_positions_says_so(tmp_path):
    """Prompts of 17 tokens (BOS and EOS included) on a model of 24 positions: up to 8 new tokens keep within
    them (17 + 8 - 1 = 24), more reach past them, which generation runs on silently as transformers' does:
    the run warns, naming the --max-new-tokens that keeps the longest within them, and still runs."""
    import json

    import h5py

    from tests.tiny_models import run_cli, save_llama

    model = save_llama(tmp_path / "llama24")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQRQISFV\n>b\nGSHM\n")

    def run(new_tokens):
        out = tmp_path / f"out{new_tokens}"
        res = run_cli(str(fasta), "--out", str(out), "--model", str(model), "--task", "generate", "--max-new-tokens",
                      str(new_tokens), "--gpus", "0", "--workers", "1", "--no-progress")
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stderr, out

    err, _ = run(8)
    assert "past the model's" not in err, err
    err, out = run(12)   # a's 17 + 11 reach past the 24 positions, b's 6 + 11 do not
    assert ("1 sequence(s) may be continued past the model's 24 positions (max_position_embeddings): their tokens "
            "and --max-new-tokens 12 reach up to 28") in err, err
    assert "--max-new-tokens 8 keeps the longest within them" in err
    with h5py.File(out / "result.h5") as f:
        assert f["status"][:].tolist() == [0, 0]
        # num_tokens: the tokenized sequence, its EOS included though the prompt leaves it out (README)
        assert f["num_tokens"][:].tolist() == [17, 6]


@pytest.mark.parametrize("name", ["protgpt2", "qwen3"])
def test_generated_text_with_a_nul_is_stored(family_checkpoint, tmp_path, name):
    """A byte-level BPE decodes its byte-0 token as a NUL character, which an HDF5 string cannot hold: a model
    that generated it (random weights did) stopped its shard at the next checkpoint ("VLEN strings do not support
    embedded NULLs") and lost the rows since the last. The text has U+FFFD there; the token ids keep the byte-0
    token, and the rest of the text is transformers' decode."""
    import h5py
    import numpy as np

    from pipeline.config import RunConfig
    from pipeline.models import checkpoint
    from pipeline.models.checkpoint import EngineInfo
    from pipeline.tasks.generate import GenerateTask
    source = checkpoint.local_source(str(family_checkpoint(name)))
    tok = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    ids = tok("MK\0V", add_special_tokens=False)["input_ids"]
    assert "\0" in tok.decode(ids)   # transformers' own decode gives the NUL back
    info = EngineInfo(name="native", hidden_size=8, num_layers=1, is_causal=True, max_tokens=None)
    text = GenerateTask(RunConfig(fasta=["x.fa"], out="o", task="generate"), info)._decode(tok, ids)
    assert text == tok.decode(ids).replace("\0", "\ufffd") and "\0" not in text
    with h5py.File(tmp_path / "t.h5", "w") as f:   # as the shard writer stores a text column
        f.create_dataset("text", data=np.array([text], dtype=object), dtype=h5py.string_dtype("utf-8"))
        with pytest.raises(ValueError, match="NUL"):
            f.create_dataset("raw", data=np.array([tok.decode(ids)], dtype=object), dtype=h5py.string_dtype("utf-8"))
    with h5py.File(tmp_path / "t.h5") as f:
        assert f["text"][0].decode() == text


def test_extreme_temperatures_sample_tokens_not_nan(tmp_path):
    """The tempered distribution is softmax(logits / T) in float32: T = 1e-40 overflowed the logits to inf
    (inf - inf = NaN), 1e-300 was 0 and 1e300 inf as float32 (a masked padded row's -inf / inf = NaN), and a
    NaN row drew its last id, one of the demo model's 3 padded rows that are no token, at every step. Now a
    tiny temperature draws what greedy search picks (the limit), a huge one nearly uniformly among the
    tokens; and --temperature inf is refused before any work."""
    from pipeline.config import RunConfig
    from pipeline.errors import UserError
    from pipeline.models import demo as demo_model
    path = demo_model.write(tmp_path / "demo")
    engine = NativeEngine.load(str(path), CPU, torch.float32, "", max_new_tokens=8)
    prompts = random_sequences([5, 9, 3, 7, 12, 4], seed=14, eos=None)
    greedy = [g.token_ids for g in engine.generate(prompts, range(6), SamplingParams(max_new_tokens=8))]
    assert max(t for g in greedy for t in g) < len(engine.tokenizer)
    for tiny in (1e-40, 1e-300):
        got = engine.generate(prompts, range(6), SamplingParams(max_new_tokens=8, temperature=tiny, top_p=0.9, seed=3))
        assert [g.token_ids for g in got] == greedy, tiny
    got = engine.generate(prompts, range(6), SamplingParams(max_new_tokens=8, temperature=1e300, seed=3))
    drawn = [t for g in got for t in g.token_ids]
    assert max(drawn) < len(engine.tokenizer) and len(set(drawn)) > 10
    with pytest.raises(UserError, match="--temperature must be finite"):
        RunConfig(fasta=["x.fa"], out="o", task="generate", temperature=float("inf")).validate()


def test_temperatures_in_use_keep_the_plain_divisions_bits():
    """Within PLAIN_TEMPERATURES the tempered distribution is softmax(logits / T) to the bit, as earlier versions
    computed it: a run continued from one samples the same tokens (taking the row's maximum off first, which the
    extreme temperatures need, rounds otherwise)."""
    from pipeline.engine.sampler import tempered
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(5)) * 12
    logits[:, -3:] = float("-inf")   # masked padded rows
    for temperature in (1e-4, 0.1, 0.3, 0.7, 1.0, 1.3, 2.0, 10.0, 1e4):
        assert torch.equal(tempered(logits, temperature), torch.softmax(logits / temperature, dim=-1)), temperature


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_text_of_ids_without_a_token_from_a_subword_tokenizer(family_checkpoint, name):
    """Greedy search picks a padded vocabulary row where its logit is the largest (the tiny Qwen3 generated id 490
    of 512 rows, its tokenizer has 461 tokens): the byte-level BPE's decode dropped it without a trace, so the
    text read as if nothing had been generated there. It reads as the unknown token, `?` for these tokenizers,
    which have none, as it does for a character-level tokenizer; the rest is transformers' decode."""
    from pipeline.config import RunConfig
    from pipeline.models import checkpoint
    from pipeline.models.checkpoint import EngineInfo
    from pipeline.tasks.generate import GenerateTask
    source = checkpoint.local_source(str(family_checkpoint(name)))
    tok = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
    assert tok.unk_token is None
    info = EngineInfo(name="native", hidden_size=8, num_layers=1, is_causal=True, max_tokens=None)
    task = GenerateTask(RunConfig(fasta=["x.fa"], out="o", task="generate"), info)
    mk, v = (tok(s, add_special_tokens=False)["input_ids"] for s in ("MKTAY", "VLS"))
    past = len(tok) + 3
    assert task._decode(tok, mk + [past] + v) == tok.decode(mk) + "?" + tok.decode(v)
    assert task._decode(tok, [past, past] + v + [past]) == "??" + tok.decode(v) + "?"
    assert task._decode(tok, mk + v) == tok.decode(mk + v)


def test_a_checkpoint_whose_generation_config_samples_is_told_so(family_checkpoint, tmp_path):
    """Qwen3's and Llama 3's generation_config.json set do_sample (temperature, top_p, top_k), which transformers'
    `generate` applies by default: a plain `model.generate(input_ids)` samples where this run decodes greedily
    (and a repetition penalty changes even greedy tokens). The run said nothing of it; it warns, naming the
    settings and the options that sample as they do, and stays silent for a checkpoint without such settings."""
    import json
    import shutil

    from pipeline.config import RunConfig
    from pipeline.tasks.generate import generation_config_note
    from tests.tiny_models import run_cli
    model = tmp_path / "qwen3"
    shutil.copytree(family_checkpoint("qwen3"), model)
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQR\n")

    def run(name, *options):
        res = run_cli(str(fasta), "--out", str(tmp_path / name), "--model", str(model), "--task", "generate",
                      "--max-new-tokens", "2", "--gpus", "0", "--workers", "1", "--no-progress", *options)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stderr

    assert "generation_config.json" not in run("plain")
    # the worker's throughput counts the tokens it ran: the prompt's, then the new ones
    import h5py
    from transformers import AutoTokenizer
    log = (tmp_path / "plain" / "logs" / "worker_0.log").read_text()
    prompt = len(AutoTokenizer.from_pretrained(model)("MKTAYIAKQR")["input_ids"])
    with h5py.File(tmp_path / "plain" / "result.h5") as f:
        new = len(f["generate/token_ids"])
    assert new > 0 and f"(1 sequences, {prompt + new} tokens, " in log, log
    # generate/text's convention for unknown tokens is recorded (a Qwen tokenizer has no unknown token: `?`), and
    # a run planned before it was (whose text left them out) is told apart, not continued into one result
    from pipeline.tasks.earlier_rows import earlier_rows
    attrs = json.loads((tmp_path / "plain" / "manifest.json").read_text())["attrs"]
    assert attrs["generate_unknown_text"] == "?"
    assert earlier_rows("generate", attrs, attrs) is None
    earlier = {k: v for k, v in attrs.items() if k != "generate_unknown_text"}
    assert "left out of generate/text, while this version writes each as '?'" in earlier_rows("generate", earlier,
                                                                                            attrs)
    (model / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 456, "eos_token_id": [458, 456], "do_sample": True, "temperature": 0.6, "top_k": 20,
         "top_p": 0.95}))
    err = run("sampling")
    assert ("the checkpoint's generation_config.json sets do_sample true, temperature 0.6, top_p 0.95, top_k 20: "
            "transformers' generate samples by default; this run decodes greedily (--temperature 0), as "
            "transformers' generate with do_sample=False does; --temperature 0.6 --top-p 0.95 samples as those "
            "settings do, but without top_k (run_shards has no top-k)") in err, err
    sampled = RunConfig(fasta=["x.fa"], out="o", task="generate", temperature=0.6, top_p=0.95)
    assert "top_k 20 (run_shards has no top-k" in generation_config_note(str(model), sampled)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 458, "repetition_penalty": 1.2}))
    greedy = RunConfig(fasta=["x.fa"], out="o", task="generate")
    assert generation_config_note(str(model), greedy) == (
        "the checkpoint's generation_config.json sets repetition_penalty 1.2, which transformers' generate applies "
        "by default and this run does not")
    assert generation_config_note(str(model), sampled).startswith("the checkpoint's generation_config.json sets "
                                                                  "repetition_penalty 1.2,")


def test_a_generated_unknown_token_reads_as_itself_unless_it_is_a_named_special_token(family_checkpoint):
    """Llama 2's <unk> (a residue the tokenizer does not know) reads as itself, not as nothing (decode skipping
    special tokens dropped it); ProtGPT2's unknown token is its <|endoftext|>, BOS and EOS at once, and is left
    out of the text as the other special tokens are."""
    from pipeline.config import RunConfig
    from pipeline.models import checkpoint
    from pipeline.models.checkpoint import EngineInfo
    from pipeline.tasks.generate import GenerateTask
    info = EngineInfo(name="native", hidden_size=8, num_layers=1, is_causal=True, max_tokens=None)
    for name, between in (("llama2", "<unk>"), ("protgpt2", "")):
        source = checkpoint.local_source(str(family_checkpoint(name)))
        tok = checkpoint.read_tokenizer(source, checkpoint.read_config(source, False), False)
        task = GenerateTask(RunConfig(fasta=["x.fa"], out="o", task="generate"), info)
        mk = tok("MKTAY", add_special_tokens=False)["input_ids"]
        assert task._decode(tok, mk + [tok.unk_token_id] + mk) == "MKTAY" + between + "MKTAY", name
