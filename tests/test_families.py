"""Every model family (docs/models.md) equals transformers used as its model card shows, through the real CLI
with 2 workers: embeddings per row (mean and per residue) for the encoders, log-likelihood sums for the causal
LMs, greedy generation where the native engine runs it. Checkpoints carry the published config values and
tokenizer files, only sizes shrunk (tests/families/); the reference is each card's usage
(tests/families/card_usage.py), in float32 and float64, and ours must be as accurate as the card's float32
against float64 (tests/float64_reference.py: at most 4x its error plus 8 ulps of the scale).

One CLI run per way through the pipeline (engine, tokenizer kind, input convention); the other families and
variants, which differ from one of those only in config values or tokenizer vocabulary (ESM-1b/1v and ESM-2 650M
beside 8M, Ankh large, the half-precision ProtT5 encoder, ProtBert-BFD, Llama 2 beside 3.x, Qwen2 beside
Mistral, Qwen3, the rope types), run the worker's own path in-process (family_runs.in_process), which keeps the
added time down (each CLI run starts two workers: about 10 s on 2 cores). Each protein CLI run also checks the
status-2 reporting: P6 holds a residue no family knows.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipeline.models.checkpoint import local_source
from tests.families import card_usage, masked_lm_recipes

from .family_runs import (DNA, PROTEIN, assert_embeddings_as_accurate, assert_scores_as_accurate,
                          family_checkpoint, in_process, per_residue_rows, result, run)  # noqa: F401
from .tiny_models import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One CLI run per way through the pipeline (engine, tokenizer kind, input convention); the rest in-process.
EMBED_CLI = ["esm2_t6_8m", "saprot", "nucleotide_transformer_v1", "prot_t5_xl_u50", "prostt5", "ankh_base", "prot_bert"]
EMBED_VARIANTS = ["esm2_t33_650m", "esm1b", "esm1v", "prot_t5_xl_half_enc", "ankh_large", "prot_bert_bfd"]
SCORE_CLI = ["llama3", "qwen3_5", "mistral", "protgpt2"]
SCORE_VARIANTS = {"llama2": "native", "qwen3": "native", "qwen2": "hf", "llama_rope_linear": "native",
                  "llama_rope_yarn": "native", "llama_rope_dynamic": "hf", "llama_rope_longrope": "hf"}
ENGINE = {"esm2_t6_8m": "native", "saprot": "native", "nucleotide_transformer_v1": "native", "prot_t5_xl_u50": "native",
          "prostt5": "native", "ankh_base": "native", "llama3": "native", "qwen3_5": "native"}


def _records(name: str) -> dict[str, str]:
    return DNA if name.startswith("nucleotide") else PROTEIN


def _unknown_rows(name: str) -> list[str]:
    """Rows whose residues the family's tokenizer does not know (status 2)."""
    if name.startswith("nucleotide"):
        return []
    return ["P5", "P6"] if name == "saprot" else ["P6"]


@pytest.mark.parametrize("name", EMBED_CLI)
def test_embeddings_equal_the_model_card(name, family_checkpoint, tmp_path):
    path = family_checkpoint(name)
    records = _records(name)
    report = name == "esm2_t6_8m"   # report.html's row statuses, once
    res, out = run(tmp_path, path, records, "--per-residue", "--per-residue-dtype", "float32", "--pool", "mean,cls",
                   env={"RUN_SHARDS_REPORT": "1"} if report else None)
    assert res.returncode == 0, res.stderr
    # `cls` is the first token's state: a summary where the card puts a token before the residues (<cls>, [CLS],
    # ProstT5's prefix), the first residue's state where it puts none (ProtT5, Ankh), which planning says
    residue_first = card_usage.tokens_before_residues(path) == 0
    assert ("embeddings/cls is the first residue's state" in res.stderr) is residue_first, res.stderr
    data = result(out)
    sequences = list(records.values())
    exact = card_usage.embed(path, sequences, torch.float64)
    theirs = card_usage.embed(path, sequences, torch.float32)
    assert_embeddings_as_accurate(data["embeddings/mean"], per_residue_rows(data), exact, theirs)
    assert data["status"].tolist() == [2 if k in _unknown_rows(name) else 0 for k in records]
    run_log = (out / "logs" / "run.log").read_text()
    family = local_source(str(path)).family
    assert f"input format: {family.convention.words()}; {family.name}" in run_log
    _assert_status_2_reported(name, out, res.stderr, report)
    assert json.loads((out / "manifest.json").read_text())["engine"] == ENGINE.get(name, "hf")


def _assert_status_2_reported(name: str, out, stderr: str, report: bool) -> None:
    """Rows with an unknown residue: at planning (the characters, example ids), at the end (how many, example
    ids), in `status` and in report.html."""
    unknown = _unknown_rows(name)
    if not unknown:
        assert "status 2" not in stderr
        return
    assert "contain characters this model's tokenizer does not know ('J'" in stderr
    end = f"{len(unknown)} row(s) with characters outside the model's alphabet (status 2"
    assert end in stderr and f"'{unknown[-1]}'" in stderr.split(end)[1].splitlines()[0]
    status = run_cli("status", str(out))
    assert status.returncode == 0 and f"rows: {end}" in status.stdout
    if report:
        html = (out / "report.html").read_text()
        assert "<td>2</td>" in html and unknown[-1] in html


@pytest.mark.parametrize("name", EMBED_VARIANTS)
def test_family_variants_embed_as_their_card(name, family_checkpoint):
    path = family_checkpoint(name)
    sequences = list(PROTEIN.values())
    out, _ = in_process(path, "embed", sequences)
    offsets = np.concatenate([[0], np.cumsum(out.lengths["per_residue"])])
    rows = [out.values["per_residue/values"][offsets[i]:offsets[i + 1]] for i in range(len(sequences))]
    assert_embeddings_as_accurate(out.columns["embeddings/mean"], rows,
                                  card_usage.embed(path, sequences, torch.float64),
                                  card_usage.embed(path, sequences, torch.float32))


@pytest.mark.parametrize("name", ["prot_t5_xl_u50", "ankh_large", "prostt5"])
def test_t5_encoders_on_the_hf_engine_are_the_encoder_model(name, family_checkpoint):
    """--engine hf builds T5EncoderModel for the T5 families (the encoder-decoder class, called without decoder
    inputs, failed every worker), equal to the card."""
    path = family_checkpoint(name)
    sequences = list(PROTEIN.values())
    out, engine = in_process(path, "embed", sequences, engine="hf")
    assert engine == "hf"
    offsets = np.concatenate([[0], np.cumsum(out.lengths["per_residue"])])
    rows = [out.values["per_residue/values"][offsets[i]:offsets[i + 1]] for i in range(len(sequences))]
    assert_embeddings_as_accurate(out.columns["embeddings/mean"], rows,
                                  card_usage.embed(path, sequences, torch.float64),
                                  card_usage.embed(path, sequences, torch.float32))


@pytest.mark.parametrize("name", SCORE_CLI)
def test_scores_equal_the_model_card(name, family_checkpoint, tmp_path):
    path = family_checkpoint(name)
    res, out = run(tmp_path, path, PROTEIN, "--task", "score")
    assert res.returncode == 0, res.stderr
    data = result(out)
    sequences = list(PROTEIN.values())
    assert_scores_as_accurate(data["score/logprob_sum"], data["score/num_scored"],
                              card_usage.score(path, sequences, torch.float64),
                              card_usage.score(path, sequences, torch.float32))
    assert json.loads((out / "manifest.json").read_text())["engine"] == ENGINE.get(name, "hf")


@pytest.mark.parametrize("name", ["esm1v", "prot_bert", "saprot"])
def test_masked_lm_families_pll_as_their_own_recipes(name, family_checkpoint):
    """--task score (pll) on ESM-1v, ProtBert and SaProt equals each family's published way of masking a residue
    and reading its probability (tests/families/masked_lm_recipes.py): the mask token for ESM-1v and ProtBert
    (whose spaced text, rare residues as X, the run writes as its card does), and for SaProt its own recipe, the
    residue written as '#' beside its 3Di letter and each amino acid's probability summed over its 21 3Di
    pairings."""
    path = family_checkpoint(name)
    sequences = [PROTEIN[k] for k in ("P1", "P2", "P3", "P4")]   # standard residues only: every family knows them
    out, engine = in_process(path, "score", sequences)
    assert engine == {"esm1v": "native", "prot_bert": "hf", "saprot": "native"}[name]
    assert_scores_as_accurate(out.columns["score/logprob_sum"], out.columns["score/num_scored"],
                              masked_lm_recipes.pll(path, sequences, torch.float64),
                              masked_lm_recipes.pll(path, sequences, torch.float32))


@pytest.mark.parametrize("name", sorted(SCORE_VARIANTS))
def test_family_variants_and_every_rope_type_score_as_their_card(name, family_checkpoint, caplog):
    """Static rope types (linear, yarn; llama3 in the CLI run above) on the native engine from the
    checkpoint's own config; dynamic and longrope on hf, saying why."""
    path = family_checkpoint(name)
    sequences = list(PROTEIN.values())
    with caplog.at_level("INFO", logger="run_shards"):
        out, engine = in_process(path, "score", sequences)
    assert engine == SCORE_VARIANTS[name]
    if name in ("llama_rope_dynamic", "llama_rope_longrope"):
        assert ("engine: hf, not native, for this Llama 2 / 3.x checkpoint: config.json rope_scaling.type is"
                in caplog.text)
        assert "once past 4096 positions, so rows of longer sequences depend on what ran with them" in caplog.text
    assert_scores_as_accurate(out.columns["score/logprob_sum"], out.columns["score/num_scored"],
                              card_usage.score(path, sequences, torch.float64),
                              card_usage.score(path, sequences, torch.float32))


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama2"])
def test_scores_of_one_and_two_residues_as_the_card(name, family_checkpoint):
    """The shortest sequences, native (Qwen3, Llama 2) and hf (Qwen2): without a BOS (Qwen) a single residue is
    one token with nothing before it, so nothing is scored (0 and 0), and two residues score one token; with
    a BOS (Llama 2) every residue token is scored. The card's own computation must agree, down to the counts."""
    path = family_checkpoint(name)
    sequences = ["M", "MK", "W", "GS"]
    out, _ = in_process(path, "score", sequences)
    exact, theirs = card_usage.score(path, sequences, torch.float64), card_usage.score(path, sequences, torch.float32)
    sums, counts = out.columns["score/logprob_sum"], out.columns["score/num_scored"]
    assert counts.tolist() == [n for _, n in exact]
    none = [i for i, (_, n) in enumerate(exact) if n == 0]   # (a relative error has no scale at 0)
    assert none == ([0, 2] if name != "llama2" else []) and all(sums[i] == 0 == exact[i][0] for i in none)
    some = [i for i in range(len(sequences)) if i not in none]
    assert_scores_as_accurate(sums[some], counts[some], [exact[i] for i in some], [theirs[i] for i in some])


def test_llama3_generates_as_transformers_greedy_search(family_checkpoint, tmp_path):
    """Llama 3.x (rope type llama3, tied embeddings, grouped-query attention) on the native engine, where every
    worker failed to load it before: greedy continuations equal transformers' generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = family_checkpoint("llama3")
    res, out = run(tmp_path, path, PROTEIN, "--task", "generate", "--max-new-tokens", "6")
    assert res.returncode == 0, res.stderr
    data = result(out)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    offsets = data["generate/offsets"]
    for i, seq in enumerate(PROTEIN.values()):
        prompt = tokenizer(seq, return_tensors="pt").input_ids
        with torch.no_grad():
            want = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert data["generate/token_ids"][offsets[i]:offsets[i + 1]].tolist() == want, i


def test_remote_code_runs_with_the_flag_and_says_so(family_checkpoint, tmp_path):
    """DNABERT-2-shaped (its own bert_layers.py): with --trust-remote-code the hf engine runs it, run.log says
    the checkpoint's code ran, and rows equal its card's usage (AutoModel with trust_remote_code, residues only)."""
    from transformers import AutoModel, AutoTokenizer
    path = family_checkpoint("dnabert2_remote")
    res, out = run(tmp_path, path, DNA, "--trust-remote-code", "--per-residue", "--per-residue-dtype", "float32")
    assert res.returncode == 0, res.stderr
    run_log = (out / "logs" / "run.log").read_text()
    assert "--trust-remote-code: the hf engine runs this checkpoint's own Python code (config.json auto_map" in run_log
    assert "running the checkpoint's own Python code" in (out / "logs" / "worker_0.log").read_text()
    data = result(out)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    rows = {}
    for dtype in (torch.float64, torch.float32):
        model = AutoModel.from_pretrained(path, trust_remote_code=True, dtype=dtype).eval()
        with torch.no_grad():
            hidden = [model(**tokenizer(s, return_tensors="pt")).last_hidden_state[0, 1:-1] for s in DNA.values()]
        rows[dtype] = [(h, h.mean(0)) for h in hidden]
    assert_embeddings_as_accurate(data["embeddings/mean"], per_residue_rows(data), rows[torch.float64],
                                  rows[torch.float32])


def test_remote_code_causal_lm_scores_with_the_flag(family_checkpoint):
    """HyenaDNA-shaped (a causal LM of its own code): score on the hf engine equals AutoModelForCausalLM with
    trust_remote_code on the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = family_checkpoint("hyenadna_remote")
    sequences = list(DNA.values())
    out, engine = in_process(path, "score", sequences, trust_remote_code=True)
    assert engine == "hf"
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    special = set(tokenizer.all_special_ids)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype).eval()
        refs[dtype] = []
        for s in sequences:
            ids = tokenizer(s, return_tensors="pt").input_ids
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].to(dtype), -1)
            lp = logp.gather(1, ids[0, 1:, None])[:, 0]
            keep = torch.tensor([t not in special for t in ids[0, 1:].tolist()])
            refs[dtype].append((float(lp[keep].sum()), int(keep.sum())))
    assert_scores_as_accurate(out.columns["score/logprob_sum"], out.columns["score/num_scored"], refs[torch.float64],
                              refs[torch.float32])
