"""What runs that cannot be right say, before any compute (exit 2, the family, what was seen, the fix), and the
registry's answers: residues that become unknown tokens in bulk, a convention that cannot be told, a checkpoint
that needs --trust-remote-code, engine and task refusals, a tokenizer transformers cannot build, model-load
failures (damaged files only when a file fails to read), the demo cache built by one process at a time, and
docs/models.md holding the registry's table.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch

from pipeline.engine import selection
from pipeline.errors import UserError
from pipeline.models import checkpoint, registry

from .family_runs import DNA, PROTEIN, family_checkpoint, run  # noqa: F401
from .tiny_models import REPO


def _refused_before_compute(res, out: Path) -> str:
    """A run refused at planning: exit 2, one error line and no traceback, no worker started, no run left."""
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "started shard" not in res.stderr
    assert not out.exists()
    return res.stderr


def test_residues_as_unknown_tokens_are_refused_before_compute(family_checkpoint, tmp_path):
    """ProtBert given residues as written (the issue's exit 0 of embeddings of nothing): refused, naming the
    family, the unknown token, the impossible token count and the option that fixes it."""
    res, out = run(tmp_path, family_checkpoint("prot_bert"), PROTEIN, "--input-format", "plain")
    err = _refused_before_compute(res, out)
    assert "(ProtBert / ProtBert-BFD): its tokenizer does not read this input written as residues as written" in err
    assert "are the unknown token '[UNK]'" in err and "became fewer tokens than their residues can make" in err
    assert "'P2': 64 residues as 1 token(s)" in err
    assert "--input-format spaced (residues space-separated) tokenizes the sample with no more than a few" in err
    assert "--input-format plain for a ProtBert / ProtBert-BFD checkpoint, whose card writes residues so" in err


def test_an_input_the_model_does_not_read_is_refused(family_checkpoint, tmp_path):
    """Proteins given to Nucleotide Transformer: unknown tokens in bulk, the characters named."""
    res, out = run(tmp_path, family_checkpoint("nucleotide_transformer_v1"), PROTEIN)
    err = _refused_before_compute(res, out)
    assert "(Nucleotide Transformer v1): its tokenizer does not read this input" in err
    assert "unknown on their own: 'D', 'E'" in err and "check that the input is what this model reads" in err


def test_odd_rows_among_many_keep_status_2_and_most_rows_unreadable_refuse(tmp_path, caplog):
    """The line between 'a few odd characters' (logged, status 2) and 'in bulk' (refused): more than half of
    the sampled sequences with a quarter or more of their tokens unknown."""
    from index import load_or_build
    from pipeline.models import demo
    from pipeline.planning.tokenization_check import decide_and_check

    from .family_runs import write_fasta
    path = demo.write(tmp_path / "demo")
    source = checkpoint.local_source(str(path))
    tokenizer = checkpoint.read_tokenizer(source, checkpoint.read_config(source))

    def check(odd: int, name: str):
        records = {f"s{i}": ("MKJJV" if i < odd else "MKTAYV") for i in range(10)}
        index, _ = load_or_build([str(write_fasta(tmp_path / f"{name}.fa", records))])
        return decide_and_check(index, source, tokenizer, "auto")

    with caplog.at_level(logging.WARNING, logger="run_shards"):
        assert check(5, "half").name == "plain"
    assert "5 of 10 sampled sequences contain characters this model's tokenizer does not know ('J')" in caplog.text
    with pytest.raises(UserError, match=r"6 of 10 sampled sequences\. No model ran"):
        check(6, "most")


def _dna_bert(path: Path) -> Path:
    """A BERT over single nucleotides with a word-level vocab.txt (no family of the registry: 'other')."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"ACGTN"]) + "\n")
    BertTokenizer(str(path / "vocab.txt"), do_lower_case=False).save_pretrained(path)
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, max_position_embeddings=128)).save_pretrained(path)
    return path


def test_a_convention_told_by_the_tokenizer_and_one_that_cannot_be(tmp_path):
    """An unrecognised checkpoint: space-separated where its tokenizer reads only that (run.log says why);
    where neither way reads, the run refuses to guess and names --input-format."""
    from index import load_or_build
    from pipeline.planning.tokenization_check import decide_and_check

    from .family_runs import write_fasta
    path = _dna_bert(tmp_path / "dna_bert")
    source = checkpoint.local_source(str(path))
    assert source.family is registry.OTHER
    tokenizer = checkpoint.read_tokenizer(source, checkpoint.read_config(source))
    dna, _ = load_or_build([str(write_fasta(tmp_path / "dna.fa", DNA))])
    assert decide_and_check(dna, source, tokenizer, "auto").name == "spaced"
    protein, _ = load_or_build([str(write_fasta(tmp_path / "protein.fa", PROTEIN))])
    with pytest.raises(UserError, match="cannot tell how its tokenizer wants residues written: as written, .*"
                                        "Pass --input-format plain or --input-format spaced"):
        decide_and_check(protein, source, tokenizer, "auto")


def test_remote_code_is_refused_without_the_flag(family_checkpoint, tmp_path):
    res, out = run(tmp_path, family_checkpoint("dnabert2_remote"), DNA)
    err = _refused_before_compute(res, out)
    assert "this checkpoint runs its own Python code" in err and "run again with --trust-remote-code" in err
    assert "config.json auto_map: AutoModel -> bert_layers.BertModel" in err
    for name in ("hyenadna_remote", "progen2_remote"):
        source = checkpoint.local_source(str(family_checkpoint(name)))
        assert source.family is registry.REMOTE_CODE
        with pytest.raises(UserError, match="--trust-remote-code"):
            checkpoint.refuse_remote_code(source, trusted=False)


def _hub_serving(published: Path, snapshot: Path, asked: list | None = None):
    """A stand-in for huggingface_hub.snapshot_download (this machine has no network): what the hub gives, the
    files of the repository `published` that match the patterns asked for, copied into `snapshot`."""
    def snapshot_download(repo_id, allow_patterns):
        if asked is not None:
            asked.append(allow_patterns)
        snapshot.mkdir(exist_ok=True)
        for f in published.iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, snapshot / f.name)
        return str(snapshot)
    return snapshot_download


def test_remote_code_files_come_with_a_download_and_their_absence_is_named(family_checkpoint, tmp_path,
                                                                         monkeypatch):
    """A hub id's download left out the checkpoint's own .py files (the patterns had no *.py), so with
    --trust-remote-code transformers failed on it ('does not appear to have a file named bert_layers.py.
    Checkout https://huggingface.co//DIR'), told as 'is its model_type one this transformers version knows?'.
    The download fetches them, and a folder without them is refused naming the files."""

    import huggingface_hub
    published = family_checkpoint("dnabert2_remote")
    code = sorted(f.name for f in published.glob("*.py"))
    assert code

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_serving(published, tmp_path / "snapshot"))
    source = checkpoint.resolve("org/dnabert2", tmp_path / "cache")
    assert sorted(f.name for f in Path(source.path).glob("*.py")) == code
    checkpoint.read_config(source, trust_remote_code=True)

    bare = tmp_path / "bare"
    shutil.copytree(published, bare, ignore=shutil.ignore_patterns("*.py"))
    source = checkpoint.resolve(str(bare), tmp_path / "cache")
    with pytest.raises(UserError, match=f"--model {bare}: the code its auto_map names is not in {bare}: "
                                        f"{re.escape(', '.join(code))}. Put the checkpoint's Python files"):
        checkpoint.read_config(source, trust_remote_code=True)

    # A config class of transformers' own, the model's code in auto_map: the config reads, and without this
    # check the run was planned, then each worker's load failed on the missing file, told as "damaged files"
    # with a `rerun` that failed the same way.
    own_config = tmp_path / "own_config"
    shutil.copytree(family_checkpoint("esm2_t6_8m"), own_config)
    config = json.loads((own_config / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "my_model.MyModel"}
    (own_config / "config.json").write_text(json.dumps(config))
    source = checkpoint.resolve(str(own_config), tmp_path / "cache")
    checkpoint.read_config(source)   # (without --trust-remote-code its code is never run: nothing is missing)
    with pytest.raises(UserError, match=f"--model {own_config}: the code its auto_map names is not in {own_config}: "
                                        "my_model.py. Put the checkpoint's Python files"):
        checkpoint.read_config(source, trust_remote_code=True)


def test_engine_and_task_refusals_name_the_reason(family_checkpoint, caplog):
    def source(name):
        return checkpoint.local_source(str(family_checkpoint(name)))
    with pytest.raises(UserError, match=r"--engine native does not run this checkpoint \(ProtBert / ProtBert-BFD\): "
                                        "BERT runs on the hf engine. Use --engine hf"):
        selection.choose("native", source("prot_bert"), "embed")
    with pytest.raises(UserError, match="config.json rope_scaling.type is 'dynamic': its rotary frequencies depend"):
        selection.choose("native", source("llama_rope_dynamic"), "score")
    with pytest.raises(UserError, match=r"--task generate runs on the native engine, which does not run this "
                                        r"checkpoint \(Mistral\): its sliding-window attention.*\. On the hf "
                                        r"engine it supports --task embed and score and variants\.$"):
        selection.choose("auto", source("mistral"), "generate")
    with pytest.raises(UserError, match=r"--task generate runs on the native engine, and --engine hf was given: drop "
                                        r"it \(or give --engine auto or native\) for this Llama"):
        selection.choose("hf", source("llama3"), "generate")
    with pytest.raises(UserError, match=r"--task score needs a language model with its head: a causal LM, or a "
                                        r"masked LM .*; this ProtT5 checkpoint \(T5ForConditionalGeneration\) is "
                                        r"neither: it supports --task embed"):
        selection.choose("auto", source("prot_t5_xl_u50"), "score")
    with caplog.at_level(logging.INFO, logger="run_shards"):
        assert selection.choose("auto", source("llama_rope_longrope"), "score") == "hf"
    assert "rope_scaling.type is 'longrope'" in caplog.text
    assert selection.choose("auto", source("llama3"), "generate") == "native"


def test_a_sentencepiece_only_tokenizer_says_what_to_install(family_checkpoint, tmp_path):
    """ProtT5's half-precision encoder is published with spiece.model alone, which transformers 5 reads with
    the sentencepiece package: without it, a refusal naming the package; with it, the family's card."""
    path = family_checkpoint("prot_t5_xl_half_enc_spm_only")
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        res, out = run(tmp_path, path, PROTEIN)
        err = _refused_before_compute(res, out)
        assert "its tokenizer is a SentencePiece model only (spiece.model, no tokenizer.json)" in err
        assert "`pip install sentencepiece`" in err
        return
    from tests.families import card_usage

    from .family_runs import assert_embeddings_as_accurate, in_process
    out, _ = in_process(path, "embed", list(PROTEIN.values()))
    means = out.columns["embeddings/mean"]
    exact, theirs = (card_usage.embed(path, list(PROTEIN.values()), d) for d in (torch.float64, torch.float32))
    rows, start = [], 0
    for n in out.lengths["per_residue"]:
        rows.append(out.values["per_residue/values"][start:start + n])
        start += n
    assert_embeddings_as_accurate(means, rows, exact, theirs)


def test_config_and_tokenizer_transformers_cannot_read(tmp_path, family_checkpoint):
    bad = tmp_path / "bad"
    shutil.copytree(family_checkpoint("esm2_t6_8m"), bad)
    (bad / "config.json").write_text((bad / "config.json").read_text().replace('"esm"', '"no_such_model"'))
    with pytest.raises(UserError, match="transformers cannot read its config.json .*is its model_type one"):
        checkpoint.read_config(checkpoint.local_source(str(bad)))
    # a field of another type (huggingface_hub's StrictDataclassFieldValidationError), and JSON that is not an
    # object: at 17c2823 both ended in a traceback (a red team's finding)
    typed = tmp_path / "typed"
    shutil.copytree(family_checkpoint("esm2_t6_8m"), typed)
    settings = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**settings, "num_hidden_layers": "two"}))
    with pytest.raises(UserError, match="transformers cannot read its config.json .*StrictDataclassFieldValidation"):
        checkpoint.read_config(checkpoint.local_source(str(typed)))
    for text, said in (("[1, 2]", "it holds a JSON list, not an object of settings"),
                       (json.dumps({**settings, "architectures": "EsmForMaskedLM"}),
                        "its architectures is 'EsmForMaskedLM', not a list of class names")):
        (typed / "config.json").write_text(text)
        with pytest.raises(UserError, match=f"cannot read {typed}/config.json \\({said}\\); replace it with an "
                                            "intact copy"):
            checkpoint.resolve(str(typed), tmp_path / "cache")
    broken = tmp_path / "broken"
    shutil.copytree(family_checkpoint("llama3"), broken)
    (broken / "tokenizer.json").write_text("{not json")
    source = checkpoint.local_source(str(broken))
    with pytest.raises(UserError, match="cannot build its tokenizer from tokenizer.json, tokenizer_config.json"):
        checkpoint.read_tokenizer(source, checkpoint.read_config(source))


def test_a_checkpoint_without_weights_is_refused_while_planning(family_checkpoint, tmp_path, monkeypatch):
    """A directory with config.json and a tokenizer but no weights passed planning, and every worker then
    stopped on it (the failure report's `rerun` could only fail again). A hub repository published with
    pytorch_model.bin alone (ProtT5's) was downloaded without it: the .bin is fetched where no safetensors are."""

    import huggingface_hub
    bare = tmp_path / "bare"
    shutil.copytree(family_checkpoint("esm2_t6_8m"), bare, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(UserError, match=f"--model {bare}: {bare} has no weights: no .safetensors file nor "
                                        "pytorch_model.bin"):
        checkpoint.resolve(str(bare), tmp_path / "cache")
    published = tmp_path / "published"   # the hub repository: its weights as pytorch_model.bin only
    shutil.copytree(bare, published)
    shutil.copy(family_checkpoint("esm2_t6_8m") / "model.safetensors", published / "pytorch_model.bin")
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _hub_serving(published, tmp_path / "snapshot", asked))
    source = checkpoint.resolve("org/bin-only", tmp_path / "cache")
    assert (Path(source.path) / "pytorch_model.bin").exists() and len(asked) == 2
    assert not any("*.bin" in p for p in asked[0])   # (a repository with safetensors: its .bin not fetched too)


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_while_planning(family_checkpoint, tmp_path):
    """ESM-2's 33-token tokenizer beside weights of 25 tokens (tokenizer files of another checkpoint): every
    worker stopped at its first batch with an IndexError traceback; now refused before any worker, naming the
    tokens the model has no row for. A config.json that disagrees with the weights likewise."""
    import json

    from safetensors.torch import load_file, save_file

    from pipeline.models import vocabulary_fit
    small = tmp_path / "small"
    shutil.copytree(family_checkpoint("esm2_t6_8m"), small)
    tensors = load_file(small / "model.safetensors")
    save_file({k: v[:25].clone() if v.shape[:1] == (33,) else v for k, v in tensors.items()},
              small / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(config | {"vocab_size": 25, "mask_token_id": 24}))
    res, out = run(tmp_path, small, PROTEIN)
    err = _refused_before_compute(res, out)
    assert (f"--model {small}: its tokenizer gives token ids the model has no embedding for: 'B' (id 25)" in err
            and "'<mask>' (id 32); config.json says vocab_size 25 (ids 0..24)" in err), err
    # config.json of the 33-token model beside those weights: the load stopped every worker with a traceback
    (small / "config.json").write_text(json.dumps(config))
    source = checkpoint.local_source(str(small))
    hf_config = checkpoint.read_config(source)
    with pytest.raises(UserError, match=r"config.json says vocab_size 33, but the weights' token embedding "
                                        r"\(esm.embeddings.word_embeddings.weight\) has 25 rows"):
        vocabulary_fit.check(str(small), small, hf_config, checkpoint.read_tokenizer(source, hf_config))


def test_a_tokenizer_without_its_files_names_them(family_checkpoint, tmp_path):
    """ESM-2 without vocab.txt failed with transformers' "TypeError: expected str, bytes or os.PathLike object,
    not NoneType"; ProtBert without it built a tokenizer of no tokens, and planning then asked for
    --input-format. Both name the tokenizer and the files it reads."""
    for family, name, files in (("esm2_t6_8m", "EsmTokenizer", "vocab.txt, not"),
                                ("prot_bert", "BertTokenizer", "tokenizer.json or vocab.txt, none of them")):
        bare = tmp_path / family
        shutil.copytree(family_checkpoint(family), bare, ignore=shutil.ignore_patterns("vocab.txt"))
        source = checkpoint.local_source(str(bare))
        with pytest.raises(UserError) as refused:
            checkpoint.read_tokenizer(source, checkpoint.read_config(source))
        assert str(refused.value) == (f"--model {bare}: cannot build its tokenizer: its tokenizer, {name}, reads "
                                      f"{files} in {bare}. Put the checkpoint's tokenizer files beside its "
                                      "config.json (they come with the checkpoint)")


def test_load_failures_call_files_damaged_only_when_a_file_fails(family_checkpoint, tmp_path):
    """Smell 1 of the review: a worker's load failure is 'damaged files' only when a weight file fails its check
    or its read; an unsupported config value is the loader's own UserError; anything else is not the files
    (exit 1, traceback in worker_N.log)."""
    path = tmp_path / "llama"
    shutil.copytree(family_checkpoint("llama3"), path)
    bug = RuntimeError("a bug")
    assert checkpoint.load_failure(bug, str(path)) is None
    assert checkpoint.load_failure(UserError("rope type 'x'"), str(path)) is None
    assert checkpoint.load_failure(PermissionError(13, "Permission denied", "w.safetensors"), str(path)).startswith(
        "a file fails to read (PermissionError")
    weights = path / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size - 100)
    with pytest.raises(Exception) as failed:
        selection.load("native", str(path), torch.device("cpu"), torch.float32, logprobs=False)
    assert checkpoint.load_failure(failed.value, str(path)).startswith(f"damaged weight file(s): {weights}")


def test_demo_cache_never_moves_a_good_copy_aside(tmp_path):
    """Smell 11: a process that found the demo copy damaged waits for the builder's lock, then checks again
    and uses the copy another process just built (its files never renamed away from a reader)."""
    import fcntl

    from pipeline.models import demo
    target = demo.ensure(tmp_path)
    (target / "model.safetensors").write_bytes(b"damaged")
    lock = os.open(target.parent, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)               # another process is building
    waiting = threading.Thread(target=demo.ensure, args=(tmp_path,))
    waiting.start()                                # sees the damage, waits for the lock
    fresh = demo.write(tmp_path / "built-elsewhere")
    for f in fresh.iterdir():                      # the other process's good copy lands in place
        os.replace(f, target / f.name)
    inode = (target / "model.safetensors").stat().st_ino
    os.close(lock)
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert (target / "model.safetensors").stat().st_ino == inode and demo.damage(target) is None
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_docs_models_md_holds_every_family_of_the_registry():
    text = (REPO / "docs" / "models.md").read_text()
    for family in registry.FAMILIES + (registry.REMOTE_CODE, registry.OTHER):
        first = family.name.split(" (")[0].split(" / ")[0]
        assert first.lower() in text.lower(), family.name
        if family.convention is not None:
            words = family.convention.words()
            assert (words.split(", after")[0] if family.key == "protgpt2" else words) in text, family.key
    assert "--input-format auto|plain|spaced|aa|saprot-sa|3di" in text and "--trust-remote-code" in text
    assert "docs/models.md" in (REPO / "README.md").read_text()
