"""`--model` as checkpoints really come: a sharded set missing a shard, a checkpoint that changes after the run
was planned (a SLURM or Ray task starts later), a Hugging Face cache folder, a `~` path, a folder without
tokenizer files. Each works, or is refused before any compute naming the file and what to do."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
from safetensors.torch import load_file, save_file

from pipeline.errors import UserError
from pipeline.models import checkpoint

from .tiny_models import REPO, run_cli


@pytest.fixture(scope="module")
def small_fasta(tmp_path_factory):
    path = tmp_path_factory.mktemp("fasta") / "small.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "12", "--seed", "3",
                    "--max-len", "120", str(path)], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="module")
def sharded_esm(models, tmp_path_factory):
    """The tiny ESM checkpoint as transformers saves it in shards (model.safetensors.index.json)."""
    from transformers import EsmForMaskedLM
    path = tmp_path_factory.mktemp("sharded") / "esm"
    EsmForMaskedLM.from_pretrained(models["esm"]).save_pretrained(path, max_shard_size="20KB")
    for f in Path(models["esm"]).iterdir():
        if f.suffix not in (".safetensors", ".json") or f.name.startswith("tokenizer"):
            shutil.copy(f, path)
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    return path


def cli_args(model) -> list[str]:
    return ["--model", str(model), "--gpus", "0", "--workers", "1", "--no-progress"]


def test_a_sharded_set_missing_a_shard_is_refused_while_planning(small_fasta, sharded_esm, tmp_path):
    """A shard its index lists but absent (a download or copy cut short) passed planning; the worker then
    failed, and the `rerun` it suggested was refused once the shard was back (the fingerprint of the planned
    run lacked it). Now the run refuses before any run directory exists, naming the file; `rerun` of a run
    whose shard went missing later refuses naming it too, and works once it is restored."""
    model = tmp_path / "esm"
    shutil.copytree(sharded_esm, model)
    shard = sorted(model.glob("model-*.safetensors"))[1]
    kept = tmp_path / shard.name
    shard.rename(kept)
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), *cli_args(model))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"missing weight file(s): {shard} (listed in model.safetensors.index.json)" in res.stderr
    assert not out.exists()

    kept.rename(shard)
    res = run_cli(small_fasta, "--out", str(out), *cli_args(model), env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert res.returncode == 1
    shard.rename(kept)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 2 and f"missing weight file(s): {shard}" in res.stderr, res.stderr
    assert "changed since the run started" not in res.stderr
    kept.rename(shard)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr


def test_a_worker_refuses_a_checkpoint_changed_since_planning(small_fasta, models, tmp_path):
    """A SLURM or Ray task runs `run_shards work` whenever it starts: a checkpoint changed in place after
    planning was loaded as it was then, and its rows were merged under the planned model's fingerprint. The
    worker now refuses it, naming the rerun once the checkpoint is restored, and computes nothing."""
    model = tmp_path / "llama"
    shutil.copytree(models["llama"], model)
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), *cli_args(model), "--launcher", "slurm", "--dry-run",
                  "--shards", "2")
    assert res.returncode == 0, res.stderr
    weights = model / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    save_file({name: t * 2 for name, t in tensors.items()}, weights, metadata={"format": "pt"})   # changed in place
    res = run_cli("work", str(out), "--shard", "0")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert (f"the model checkpoint of this run, {model}, changed since the run started (config.json or the "
            "weight files differ)") in res.stderr, res.stderr
    assert f"Restore it as it was and run `run_shards rerun {out}`" in res.stderr
    assert not (out / "shards" / "shard_0.h5").exists()

    weights.write_bytes(original)
    for shard in ("0", "1"):
        assert run_cli("work", str(out), "--shard", shard).returncode == 0
    assert run_cli("merge", str(out)).returncode == 0
    with h5py.File(out / "result.h5") as f:
        assert len(f["ids"]) == 12


def test_a_checkpoint_saved_over_with_the_same_size_is_seen_changed(small_fasta, tmp_path, monkeypatch):
    """At 9185f6a a checkpoint's fingerprint took each weight file's size and first MiB: top layers fine-tuned
    and saved over the checkpoint (the same size, nothing changed in the first MiB) went unseen, so `rerun` merged
    rows of both models and `--reuse` copied the old model's rows. The weights are now digested whole, the digest
    kept between commands under a key of the file's size, inode and times (a write changes its ctime, which
    restoring the modification time does not undo); a run planned the earlier way is checked the earlier way."""
    from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer

    from pipeline.models import file_digest

    from .tiny_models import ESM_VOCAB
    monkeypatch.setenv("RUN_SHARDS_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "esm"
    (tmp_path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    EsmTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(model)
    config = EsmConfig(vocab_size=len(ESM_VOCAB), hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                       intermediate_size=256, max_position_embeddings=1026, position_embedding_type="rotary",
                       pad_token_id=1, mask_token_id=32, token_dropout=True, emb_layer_norm_before=False)
    EsmForMaskedLM(config).eval().save_pretrained(model)
    weights = model / "model.safetensors"
    planned = checkpoint.resolve(str(model), tmp_path / "cache").identity()
    earlier = checkpoint.fingerprint(model, like="0123456789abcdef")   # (as a run of before 2026-12-07 kept it)
    reads = []
    real_read = file_digest._read
    monkeypatch.setattr(file_digest, "_read", lambda *a: reads.append(a) or real_read(*a))
    checkpoint.check_unchanged(planned)
    checkpoint.check_unchanged({**planned, "fingerprint": earlier})
    assert reads == []   # (each weight file read once, when the run was planned)

    before, stat = weights.read_bytes(), weights.stat()
    tensors = load_file(weights)
    save_file({n: t + 0.01 if ".layer.5." in n else t for n, t in tensors.items()}, weights, metadata={"format": "pt"})
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = weights.read_bytes()
    assert len(after) == len(before) > 2 << 20 and after[:1 << 20] == before[:1 << 20] and after != before
    assert checkpoint.fingerprint(model, like=earlier) == earlier   # what the earlier way could not see
    with pytest.raises(UserError, match="changed since the run started \\(config.json or the weight files differ\\)"):
        checkpoint.check_unchanged(planned)
    assert len(reads) == 1

    old = tmp_path / "old"
    done = run_cli(small_fasta, "--out", str(old), *cli_args(model))   # (rows of the fine-tuned model)
    assert done.returncode == 0, done.stderr
    save_file(tensors, weights, metadata={"format": "pt"})   # the checkpoint saved over again, as it was planned
    res = run_cli(small_fasta, "--out", str(tmp_path / "new"), *cli_args(model), "--reuse", str(old))
    assert res.returncode == 2 and "with another model" in res.stderr and "weight files differ" in res.stderr, \
        res.stderr


def hub_cache(source, root, commit: str = "a" * 40):
    """`source` laid out as huggingface_hub caches a download: models--ORG--NAME/blobs/ holds the files, and
    snapshots/COMMIT/ links to them; refs/main names the commit."""
    import hashlib
    import os
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for f in sorted(Path(source).iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", repo / "snapshots" / commit / f.name)
    return repo


def test_a_hugging_face_cache_folder_is_its_main_snapshot(models, tmp_path):
    """The models--ORG--NAME folder of the cache was refused as 'no config.json; pass a Hugging Face
    checkpoint directory'. It is the snapshot refs/main names, the one its hub id loads offline, identical
    to passing that snapshot (symlinks into blobs/ included)."""
    repo = hub_cache(models["esm"], tmp_path / "hub")
    snapshot = repo / "snapshots" / ("a" * 40)
    whole = checkpoint.resolve(str(repo), tmp_path / "cache")
    given = checkpoint.resolve(str(snapshot), tmp_path / "cache")
    assert whole.path == given.path == str(snapshot)
    assert whole.identity() | {"name": ""} == given.identity() | {"name": ""}
    assert whole.fingerprint == checkpoint.resolve(models["esm"], tmp_path / "cache").fingerprint

    hub_cache(models["llama"], tmp_path / "hub", commit="b" * 40)   # a second snapshot, refs/main now names it
    assert checkpoint.resolve(str(repo), tmp_path / "cache").path == str(repo / "snapshots" / ("b" * 40))
    (repo / "refs" / "main").unlink()   # two snapshots and no ref: which one is not ours to guess
    with pytest.raises(UserError, match=f"{repo} is a model's folder of the Hugging Face cache.*snapshots: "
                                        f"{'a' * 40}, {'b' * 40}.*Pass one snapshot"):
        checkpoint.resolve(str(repo), tmp_path / "cache")


def test_a_hugging_face_cache_whose_weight_blob_is_gone_names_the_missing_file(models, tmp_path):
    """A cache cleaned by hand (or a download cut short) leaves the snapshot's link to a blob that is gone:
    it was refused as a "damaged weight file ([Errno 2] No such file or directory)", and "replace it with an
    intact copy". It is missing: the link and its target are named, and the way out is a whole download."""
    repo = hub_cache(models["esm"], tmp_path / "hub")
    link = repo / "snapshots" / ("a" * 40) / "model.safetensors"
    blob = (link.parent / link.readlink()).resolve()
    blob.unlink()
    with pytest.raises(UserError) as e:
        checkpoint.resolve(str(repo), tmp_path / "cache")
    assert str(e.value) == (f"--model {repo}: missing weight file(s): {link} (a link to "
                            f"{link.parent / link.readlink()}, which is gone). Download or copy the checkpoint "
                            "again, whole (every file its index lists), and run the same command again.")
    assert checkpoint.load_failure(OSError("no such file"), str(link.parent)).startswith(
        f"missing weight file(s): {link} (a link to")


def test_a_home_path_and_a_file_of_the_checkpoint(small_fasta, models, tmp_path, monkeypatch):
    """`--model=~/ck` reaches run_shards with its `~` (the shell expands only a word that starts with it),
    and was taken for a hub id (HFValidationError). A file of a checkpoint is refused naming its folder."""
    shutil.copytree(models["esm"], tmp_path / "ck")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert checkpoint.resolve("~/ck", tmp_path / "cache").path == str(tmp_path / "ck")
    with pytest.raises(UserError, match=f"--model ~/ck/config.json: is a file; pass --model {tmp_path / 'ck'}$"):
        checkpoint.resolve("~/ck/config.json", tmp_path / "cache")
    # a path that does not exist, which no hub id can be either: named as a missing folder (it was the hub's
    # "HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'")
    for given, folder, missing in (("~/ck2", tmp_path, "ck2"), (str(tmp_path / "ck" / "sub" / "deeper"), tmp_path / "ck",
                                                                "sub")):
        with pytest.raises(UserError, match=re.escape(f"--model {given}: no such directory ({folder} holds no "
                                                      f"{missing!r}), and not a Hugging Face hub id (ORG/NAME)")):
            checkpoint.resolve(given, tmp_path / "cache")
    out = tmp_path / "out"   # the run records the checkpoint's absolute path, as for any other local one
    res = run_cli(small_fasta, "--out", str(out), "--model=~/ck", *cli_args("x")[2:], env={"HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "result.h5") as f:
        assert f.attrs["model"] == str(tmp_path / "ck")


def test_a_checkpoint_without_tokenizer_files_says_so(models, tmp_path):
    """A folder with no tokenizer file at all (weights and config.json copied alone) was refused with
    transformers' "Couldn't instantiate the backend tokenizer from one of: " and no way out."""
    bare = tmp_path / "llama"
    shutil.copytree(models["llama"], bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    source = checkpoint.resolve(str(bare), tmp_path / "cache")
    with pytest.raises(UserError, match=f"--model {bare}: cannot build its tokenizer: {bare} holds none of its files "
                                        r"\(tokenizer.json, vocab.txt, .*\). Put the checkpoint's tokenizer files "
                                        "beside its config.json"):
        checkpoint.read_tokenizer(source, checkpoint.read_config(source))
