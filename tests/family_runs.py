"""What the family tests share: their inputs, the tiny family checkpoints (built once per session), a run of
the real CLI, the worker's own path in-process (for variants of a family the CLI already ran), and the
float64-grounded comparison with each model card's usage (tests/families/card_usage.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.families import checkpoints
from tests.float64_reference import assert_as_accurate

from .run_helpers import read
from .tiny_models import run_cli

# Proteins of 9..64 residues: P5 holds U (written X where the card does; SaProt has no U), P6 holds J (no
# family knows it: the unknown token, status 2).
PROTEIN = {"P1": "MKTAYIAKQRQISFVKSHFSRQ", "P2": "MSTNPKPQRKTKRNTNRRPQDVKFPGGGQIVGGVYLLPRRGPRLGVRATRKTSERSQPRGRRQP",
           "P3": "GSHMLEDPVDAFQ", "P4": "MVLSEGEWQLVLHVWAKVEADVAGHGQDILIRLFKSHPETLEKF", "P5": "MAUGCKDWRLLAE",
           "P6": "MKVLJAAGIW"}
DNA = {"D1": "ACGTACGTTTGACCAGTAGGCATTAGCAT", "D2": "GGGCCCAAATTTGGNACGTAC", "D3": "ACGTTGCAAC" * 5,
       "D4": "TTAGGGTTAGGGTTAGGGTTAGGG"}
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """name -> the tiny checkpoint of that family (tests/families/checkpoints.py), built once per session."""
    root = tmp_path_factory.mktemp("families")
    return lambda name: checkpoints.build_cached(name, root)


def write_fasta(path: Path, records: dict[str, str]) -> Path:
    path.write_text("".join(f">{k}\n{v}\n" for k, v in records.items()))
    return path


def run(tmp_path: Path, model: Path, records: dict[str, str], *options: str, env: dict | None = None,
        name: str = "out") -> tuple[subprocess.CompletedProcess, Path]:
    """`run_shards run` with 2 CPU workers on `records`; (the process, OUT)."""
    fasta = write_fasta(tmp_path / f"{name}.fa", records)
    out = tmp_path / name
    res = run_cli("run", str(fasta), "--out", str(out), "--model", str(model), "--gpus", "0", "--workers", "2",
                  "--no-progress", *options, env=env)
    return res, out


def result(out: Path) -> dict:
    return read(out / "result.h5")


def per_residue_rows(data: dict) -> list[np.ndarray]:
    offsets, values = data["per_residue/offsets"], data["per_residue/values"]
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def assert_embeddings_as_accurate(means: np.ndarray, residues: list[np.ndarray], exact: list, theirs: list) -> None:
    """Per row: the mean and the per-residue rows as accurate as the card's float32 run, both against its
    float64 run (tests/float64_reference.py)."""
    assert len(means) == len(residues) == len(exact) == len(theirs)
    for i, ((r64, m64), (r32, m32)) in enumerate(zip(exact, theirs)):
        assert residues[i].shape == tuple(r64.shape), (i, residues[i].shape, r64.shape)
        assert_as_accurate(means[i], m32, m64, f"row {i} mean")
        assert_as_accurate(residues[i], r32, r64, f"row {i} per residue")


def assert_scores_as_accurate(sums: np.ndarray, counts: np.ndarray, exact: list, theirs: list) -> None:
    assert counts.tolist() == [n for _, n in exact] == [n for _, n in theirs]
    for i, ((s64, _), (s32, _)) in enumerate(zip(exact, theirs)):
        assert_as_accurate(np.array([sums[i]]), np.array([s32]), np.array([s64]), f"row {i} logprob_sum")


def _told(source, engine, sequences: list[str]):
    """The convention the parent's check decides for a family without one (told by its tokenizer)."""
    import tempfile

    from index import load_or_build
    from pipeline.planning.tokenization_check import decide_and_check
    with tempfile.TemporaryDirectory() as tmp:
        fasta = write_fasta(Path(tmp) / "in.fa", {f"s{i}": s for i, s in enumerate(sequences)})
        index, _ = load_or_build([str(fasta)])
        return decide_and_check(index, source, engine.tokenizer, "auto")


def in_process(path: Path, task: str, sequences: list[str], trust_remote_code: bool = False, engine: str = "auto",
               run_root: Path | None = None):
    """The worker's own path without the CLI around it (describe, engine choice and load, the family's input
    convention, the task): (TaskOutput, engine name), for a variant of a family whose CLI run a test checks.
    `run_root`: a folder holding the variants task's variants.npz (records: the sequences' places in `sequences`)."""
    from pipeline.config import RunConfig
    from pipeline.engine import selection
    from pipeline.models import checkpoint
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer

    source = checkpoint.local_source(str(path))
    name = selection.choose(engine, source, task)
    config = RunConfig(fasta=["x.fa"], out="x", model=str(path), task=task, per_residue=task == "embed",
                       per_residue_dtype="float32", trust_remote_code=trust_remote_code,
                       variants="variants.csv" if task == "variants" else None)
    hf_config = checkpoint.read_config(source, trust_remote_code)
    info = checkpoint.describe(source, name, checkpoint.read_tokenizer(source, hf_config, trust_remote_code),
                               trust_remote_code)
    engine = selection.load(name, str(path), CPU, torch.float32, logprobs=task in ("score", "variants"), info=info,
                          config=config)
    tokenizer = SequenceTokenizer(engine.tokenizer, source.family.convention or _told(source, engine, sequences))
    task = make_task(config, engine.info, run_root)
    task.prepare(tokenizer)   # as the worker does before its first batch
    out = task.run(engine, tokenizer.encode(sequences), np.arange(len(sequences)))
    return out, name
