"""Per-residue rows are residues for every tokenizer (issue 37, point 6): where a token stands for several residues
(ProtGPT2's and Llama 3's BPE oligomers, Nucleotide Transformer's 6-mers) each of them gets the token's state, a
token that stands for none (ProtGPT2's line breaks) gives no row, so a record has as many rows as residues, as
the storage estimate counts; the result says so (the `per_residue` group's `unit` and `token_spread`, the root
attributes `per_residue_unit` and `per_residue_tokens`), and an older result or run directory whose rows were
tokens is not mixed with residue rows."""
from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest
import torch

from tests.families import card_usage

from .family_runs import (DNA, PROTEIN, assert_embeddings_as_accurate, family_checkpoint,  # noqa: F401
                          in_process, per_residue_rows, result, write_fasta)
from .tiny_models import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKAL"
PROTEINS = [LONG, PROTEIN["P2"], PROTEIN["P3"], PROTEIN["P6"], "MA"]   # over 60 residues: ProtGPT2's line breaks


@pytest.mark.parametrize("name", ["protgpt2", "llama3", "nucleotide_transformer_v1"])
def test_per_residue_rows_are_residues_each_its_tokens_state(name, family_checkpoint):
    """Rows == residues exactly, each row transformers' hidden state of the token that covers the residue (the
    card's usage: tests/families/card_usage.py, float32 as accurate as float64 grounds it); the mean is the
    tokens' as before."""
    path = family_checkpoint(name)
    sequences = list(DNA.values()) if name.startswith("nucleotide") else PROTEINS
    out, _ = in_process(path, "embed", sequences)
    lengths = out.lengths["per_residue"]
    assert lengths.tolist() == [len(s) for s in sequences]
    assert len(out.values["per_residue/values"]) == sum(len(s) for s in sequences)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = [out.values["per_residue/values"][offsets[i]:offsets[i + 1]] for i in range(len(sequences))]
    exact = card_usage.embed(path, sequences, torch.float64)
    assert_embeddings_as_accurate(out.columns["embeddings/mean"], rows, exact,
                                  card_usage.embed(path, sequences, torch.float32))
    # a token of several residues puts the same state on each: neighbouring rows repeat
    assert any((np.diff(r, axis=0) == 0).all(axis=1).any() for r in rows), "no token of several residues"


@pytest.fixture(scope="module")
def protgpt2_run(family_checkpoint, tmp_path_factory):
    """ProtGPT2 `embed --per-residue` through the CLI, one worker: (its OUT, its records)."""
    tmp = tmp_path_factory.mktemp("protgpt2_run")
    records = {"long": LONG * 2, "short": PROTEIN["P3"]}
    fasta = write_fasta(tmp / "in.fa", records)
    out = tmp / "out"
    res = run_cli("run", str(fasta), "--out", str(out), "--model", str(family_checkpoint("protgpt2")), "--gpus", "0",
                  "--workers", "1", "--no-progress", "--per-residue", "--per-residue-dtype", "float32")
    assert res.returncode == 0, res.stderr
    return out, records


def test_the_result_says_its_per_residue_rows_are_residues_as_the_estimate_counts(protgpt2_run):
    """One row per residue in result.h5 (ProtGPT2's line breaks give none), as many as the storage estimate
    counts (the records' residues), and the unit and how tokens map in its attributes."""
    from pipeline.output.schema import TOKEN_STATE_ON_ITS_RESIDUES
    out, records = protgpt2_run
    data = result(out)
    assert [len(r) for r in per_residue_rows(data)] == [len(s) for s in records.values()]
    assert data["per_residue/values"].shape[0] == int(data["lengths"].sum())   # what planning/storage.py counts
    with h5py.File(out / "result.h5") as f:
        assert dict(f["per_residue"].attrs) == {"unit": "residue", "token_spread": TOKEN_STATE_ON_ITS_RESIDUES}
        assert (f.attrs["per_residue_unit"], f.attrs["per_residue_tokens"]) == ("residue", TOKEN_STATE_ON_ITS_RESIDUES)


def test_older_token_rows_are_neither_reused_nor_continued(protgpt2_run, family_checkpoint, tmp_path):
    """A result (or a run directory) from before per-residue rows were residues holds token rows for ProtGPT2:
    --reuse refuses it and a command continuing the run directory refuses, each saying why and what to do."""
    from pipeline.config import RunConfig
    from pipeline.errors import RunDirError, UserError
    from pipeline.planning.plan import plan
    old = tmp_path / "old"
    shutil.copytree(protgpt2_run[0], old)
    with h5py.File(old / "result.h5", "r+") as f:   # as run_shards wrote it when rows were tokens
        for key in ("per_residue_unit", "per_residue_tokens"):
            del f.attrs[key]
        for key in ("unit", "token_spread"):
            del f["per_residue"].attrs[key]
    options = dict(fasta=[str(protgpt2_run[0].parent / "in.fa")], model=str(family_checkpoint("protgpt2")),
                   workers=1, per_residue=True, per_residue_dtype="float32")
    with pytest.raises(UserError, match=r"with a per-residue row per token \(an earlier run_shards\).*Nothing was "
                                        r"computed"):
        plan(RunConfig(out=str(tmp_path / "again"), reuse=[str(old)], **options))

    manifest = json.loads((old / "manifest.json").read_text())
    for key in ("per_residue_unit", "per_residue_tokens"):
        del manifest["attrs"][key]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunDirError, match=r"planned by an earlier run_shards.*per-residue row per token.*Use "
                                          r"another --out: `run_shards run"):
        plan(RunConfig(out=str(old), **options))


def test_a_tokenizer_with_a_token_per_residue_says_so(family_checkpoint):
    """ESM-2: rows are its residue tokens, and the attribute says one token per residue."""
    from pipeline.config import RunConfig
    from pipeline.models import checkpoint
    from pipeline.output.schema import ONE_TOKEN_PER_RESIDUE, TOKEN_STATE_ON_ITS_RESIDUES
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer
    for name, spread in (("esm2_t6_8m", ONE_TOKEN_PER_RESIDUE),
                         ("nucleotide_transformer_v1", TOKEN_STATE_ON_ITS_RESIDUES)):
        source = checkpoint.local_source(str(family_checkpoint(name)))
        hf_config = checkpoint.read_config(source)
        tokenizer = checkpoint.read_tokenizer(source, hf_config)
        info = checkpoint.describe(source, "native", tokenizer, False, hf_config)
        task = make_task(RunConfig(fasta=["x.fa"], out="x", task="embed", per_residue=True), info)
        task.prepare(SequenceTokenizer(tokenizer, source.family.convention))
        assert task.attrs() == {"per_residue_unit": "residue", "per_residue_tokens": spread}, name


def test_a_python_tokenizer_whose_tokens_cannot_be_placed_is_refused_before_any_work(family_checkpoint):
    """Nucleotide Transformer's tokenizer has no offsets; its tokens are placed by their own text. One whose
    tokens' text is not the text it read cannot be placed: --per-residue is refused, saying what to do."""
    from pipeline.errors import UserError
    from pipeline.models import checkpoint
    from pipeline.tasks.residue_spans import refuse_unplaced_tokens
    from pipeline.tasks.tokenization import SequenceTokenizer
    source = checkpoint.local_source(str(family_checkpoint("nucleotide_transformer_v1")))
    hf = checkpoint.read_tokenizer(source, checkpoint.read_config(source))
    refuse_unplaced_tokens(SequenceTokenizer(hf, source.family.convention))   # as it is: placed
    hf.convert_tokens_to_string = lambda tokens: "".join(t[::-1] for t in tokens)
    with pytest.raises(UserError, match="Leave out --per-residue, or give the checkpoint its tokenizer.json"):
        refuse_unplaced_tokens(SequenceTokenizer(hf, source.family.convention))


def test_float16_per_residue_values_past_its_range_are_warned_of(family_checkpoint, tmp_path, caplog):
    """float16 holds +-65,504: a state past it (here layer 0 of an ESM-2 whose token embeddings were scaled
    up, as an intermediate layer of a large LLM can hold) is stored as inf, and the worker's log says so,
    naming the column and the count; float32 storage keeps the values, with no warning."""
    import logging

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.config import RunConfig
    from pipeline.engine.native import NativeEngine
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer
    ckpt = shutil.copytree(family_checkpoint("esm2_t6_8m"), tmp_path / "esm")
    (weights,) = ckpt.glob("*.safetensors")
    tensors = load_file(weights)
    (name,) = [k for k in tensors if k.endswith("word_embeddings.weight")]
    tensors[name] = tensors[name] * (1e5 / tensors[name].abs().max())
    save_file(tensors, weights, metadata={"format": "pt"})
    engine = NativeEngine.load(str(ckpt), torch.device("cpu"), torch.float32, "x")
    tokenizer = SequenceTokenizer(engine.tokenizer)
    toks = tokenizer.encode(["MKTAYIAKQRQ", "GSHM"])
    got, warned = {}, {}
    for dtype in ("float16", "float32"):
        task = make_task(RunConfig(fasta=["x.fa"], out="x", per_residue=True, per_residue_dtype=dtype, layers=[0]),
                         engine.info)
        task.prepare(tokenizer)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="run_shards"):
            got[dtype] = task.run(engine, toks, np.arange(2)).values["per_residue/values_layer0"]
        warned[dtype] = [r.getMessage() for r in caplog.records if "float16's range" in r.getMessage()]
    past = int((np.abs(got["float32"]) > 65504).any(axis=-1).sum())   # residues with a value past the range
    assert past > 0 and np.isfinite(got["float32"]).all() and warned["float32"] == []
    assert int(np.isinf(got["float16"]).any(axis=-1).sum()) == past
    (message,) = warned["float16"]
    assert message.startswith(f"per_residue/values_layer0: {past} residue(s) of this batch")
