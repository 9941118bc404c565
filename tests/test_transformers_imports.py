"""transformers' import structure kept between processes (pipeline/models/transformers_imports.py): the kept
structure is the one transformers computes, a process that finds it kept does not scan transformers' sources,
a changed source file is scanned again, and a cache that cannot be written changes nothing but the time."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from pipeline.models.transformers_imports import kept_scan

from .run_helpers import REPO, run_cli

IMPORTS_TRANSFORMERS = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from pipeline.models.transformers_imports import keep_import_structure
    assert keep_import_structure(Path(sys.argv[1]))
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import import_utils
    scans = import_utils.create_import_structure_from_path.cache_info().misses
    config = CONFIG_MAPPING["esm"]   # a model's own subpackage, through the structures
    models = Path(transformers.__file__).parent / "models"
    kept = import_utils.define_import_structure(models, prefix="models")
    fresh = import_utils.define_import_structure.__wrapped__(models, prefix="models")
    print(json.dumps({"folders_scanned": scans, "same": kept == fresh, "config": config.__name__,
                      "modules": sum(len(m) for m in fresh.values())}))
""")


def _import_in_a_process(cache: Path) -> dict:
    res = subprocess.run([sys.executable, "-c", IMPORTS_TRANSFORMERS, str(cache)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_process_finds_the_structure_kept_and_scans_no_source(tmp_path):
    cache = tmp_path / "cache"
    first = _import_in_a_process(cache)
    assert first["same"] and first["config"] == "EsmConfig" and first["modules"] > 1000
    assert first["folders_scanned"] > 300    # every model's folder, the first time
    assert len(list(cache.glob("*.json"))) >= 2
    second = _import_in_a_process(cache)
    assert second["same"] and second["config"] == "EsmConfig"
    assert second["folders_scanned"] == 0, second   # transformers read none of its sources for its structure


def _scanner():
    """transformers' own scan of a folder, without its in-process memory (lru_cache), as a process sees it."""
    from transformers.utils import import_utils
    return lambda folder, prefix=None: import_utils.spread_import_structure(
        import_utils.create_import_structure_from_path.__wrapped__(os.fspath(folder)))


def test_a_source_changed_in_place_added_or_removed_is_scanned_again(tmp_path):
    source = tmp_path / "models"
    source.mkdir()
    (source / "configuration_a.py").write_text('__all__ = ["AConfig"]\n')
    (source / "modeling_a.py").write_text('__all__ = ["AModel"]\n')
    scan, scanned = _scanner(), []

    def counted(folder, prefix=None):
        scanned.append(folder)
        return scan(folder, prefix)
    kept = kept_scan(counted, tmp_path / "cache", "test")
    first = kept(source)
    assert first == {frozenset(): {"configuration_a": {"AConfig"}}, frozenset({"torch"}): {"modeling_a": {"AModel"}}}
    assert kept(source) == first and len(scanned) == 1

    # the same size, the modification time set back: the change time still says it was written
    config = source / "configuration_a.py"
    before = config.stat()
    config.write_text('__all__ = ["BConfig"]\n')
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
    from pipeline.models import transformers_imports
    transformers_imports._fingerprints.clear()   # (a new process: the folder's files are read again)
    assert kept(source)[frozenset()] == {"configuration_a": {"BConfig"}} and len(scanned) == 2

    (source / "configuration_b.py").write_text('__all__ = ["CConfig"]\n')
    transformers_imports._fingerprints.clear()
    assert kept(source)[frozenset()]["configuration_b"] == {"CConfig"} and len(scanned) == 3
    (source / "configuration_b.py").unlink()
    transformers_imports._fingerprints.clear()
    assert "configuration_b" not in kept(source)[frozenset()] and len(scanned) == 4


def test_a_cache_that_cannot_be_written_or_read_changes_nothing_but_the_time(tmp_path):
    source = tmp_path / "models"
    source.mkdir()
    (source / "configuration_a.py").write_text('__all__ = ["AConfig"]\n')
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert kept_scan(_scanner(), not_a_folder, "test")(source) == {frozenset(): {"configuration_a": {"AConfig"}}}
    cache = tmp_path / "cache"
    kept = kept_scan(_scanner(), cache, "test")
    kept(source)
    for damaged in ("{", '{"fingerprint": 3}', "[]", ""):
        for f in cache.glob("*.json"):
            f.write_text(damaged)
        from pipeline.models import transformers_imports
        transformers_imports._fingerprints.clear()
        assert kept(source) == {frozenset(): {"configuration_a": {"AConfig"}}}, damaged


def test_a_run_keeps_the_structure_in_its_cache(small_fasta, tmp_path):
    cache = tmp_path / "fresh_cache"
    res = run_cli(small_fasta, "--out", str(tmp_path / "out"), "--workers", "1", env={"RUN_SHARDS_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr
    kept = [json.loads(f.read_text()) for f in (cache / "transformers").glob("*.json")]
    assert max(sum(len(modules) for _, modules in k["structure"]) for k in kept) > 1000, "transformers.models"
