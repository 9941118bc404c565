"""Shared test setup.

Without a GPU, Triton kernels run through the interpreter: TRITON_INTERPRET=1 must be set before any
module defining kernels is imported (triton decides compiled vs interpreted when a kernel is decorated),
so it is set here, first. With a GPU it is left alone so kernel tests run compiled. Code under test that
must not run interpreted kernels (the engine's CPU path, the CLI's workers) does not depend on it.
"""
import collections
import os
import signal

import torch

# The commands the tests start meet Ctrl-C as a terminal gives it: with SIGINT's default. A test runner started
# as a script's background job (`pytest ... &` in a non-interactive shell, `nohup`) has SIGINT ignored, which every
# process it starts inherits, and run_shards keeps a signal it was started with ignored (as a shell means it):
# the tests that interrupt a run with SIGINT then saw it finish instead. (A test of that case ignores it itself.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter as it is, less its repeated patching of triton.language on every helper call (a fifth of
    # the kernel tests' time): tests/interpreter_patching.py.
    from .interpreter_patching import skip_repeated_patching

    skip_repeated_patching()
    # and computing bfloat16 as a GPU does (rounding to nearest even, arithmetic on the values, not on their bits),
    # so the kernels' bfloat16 cases run on the CPU too: tests/interpreter_bfloat16.py.
    from .interpreter_bfloat16 import compute_bfloat16_as_a_gpu

    compute_bfloat16_as_a_gpu()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Threads that wait for work sleep instead of spinning, in every process the tests start (workers with two torch
# threads: a run with --workers 1 on this 2-core machine). The suite keeps both cores busy, and libgomp's
# default spinning then took a 300-record demo run from 5.6 to 18.1 CPU seconds (5.2 to 16.8 s wall:
# bench/bench_wait_policy.py); an idle machine, as users run it, is what the default is for. Waiting changes no
# value computed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Runs write OUT/report.html at their end. With its charts plain SVG it costs a run about 0.02 s (docs/BENCHMARKS.md,
# "Run report"): nothing measurable here (tests/test_result_reader.py's 11 CLI runs took as long with it as without).
# The suite's runs skip it all the same: a page that cannot be written is only a warning, so writing it would check
# nothing in them; tests/test_report.py (in Chromium) and the few tests that set RUN_SHARDS_REPORT=1 check the page.
os.environ.setdefault("RUN_SHARDS_REPORT", "0")

# Matmuls in MKL's strict CNR mode, as workers run them (pipeline/worker/cpu_setup.py), so that in-process
# engine tests compute what workers compute: MKL takes the mode only before it first computes, so it is set
# here, before any test does (tests/test_batch_invariance.py checks that it holds).
from pipeline.worker.cpu_setup import set_strict_matmuls  # noqa: E402

set_strict_matmuls()

import pathlib  # noqa: E402

import pytest  # noqa: E402

from .run_helpers import TRITON_MISSING, triton_missing  # noqa: E402
from .slurm_cluster import slurm_cluster, slurm_session  # noqa: E402,F401  (fixtures: a local SLURM cluster)
from .slurm_helpers import small_fasta, small_local_four  # noqa: E402,F401  (one small input for every SLURM test)

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"

# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup; most tests wait on worker processes,
# schedulers and timeouts, so one process keeps 2 cores about 60% busy). How the tests are dealt to them:
# - The tests that share one external service per session (a single SLURM cluster, a single Ray head) go to one
#   worker together, first: one long unit of mostly waiting, started while the other worker computes. (Until
#   2026-12-06 the groups were marked after xdist's hook had read them and none held: both workers started a
#   SLURM cluster and a Ray head of their own.)
# - A module's tests that use a module-scoped fixture of that module (a finished run, checkpoints) go to one worker
#   together, so the fixture is built once, not once on each worker; these groups next, the largest first.
# - Every other test is dealt singly, last, so that the workers finish together.
SERVICE_FIXTURES = ("slurm_session", "ray_head")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False   # xdist's own order (groups by size) would put services anywhere
    if getattr(config.option, "dist", None) == "loadgroup" and _loadgroup_loses_groups():
        import xdist
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not keep --dist loadgroup's "
            "groups (pytest-xdist issue 1386): each worker would start its own SLURM cluster and Ray head. `make "
            "test` installs the pytest setup.cfg names; or run `pip install 'pytest<9.2'`")


def _loadgroup_loses_groups() -> bool:
    """pytest 9.2 keeps node ids as structures, and pytest-xdist up to 3.8 marks a grouped test by rewriting its
    id (`...@services`), which is all the scheduler goes by: the groups were silently dealt test by test."""
    import xdist

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())
    return version(pytest.__version__) >= (9, 2) and version(xdist.__version__) <= (3, 8)


def _xdist_group(item) -> str | None:
    if any(fixture in item.fixturenames for fixture in SERVICE_FIXTURES):
        return "services"
    module = item.nodeid.split("::")[0]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        if any(d.scope == "module" and d.baseid == module for d in definitions):
            return module
    return None


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which marks each grouped test's id with its group
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER") is None and not config.getoption("numprocesses", None):
        return
    groups = {item: _xdist_group(item) for item in items}
    sizes = collections.Counter(groups.values())
    for item, group in groups.items():
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (groups[item] is None, groups[item] != "services", -sizes[groups[item]],
                                 groups[item] or ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that reaches the Triton kernels where triton cannot be imported (a CPU-only install: setup.cfg installs
    it on Linux only) is skipped with that reason, not failed; under CI=true it fails (tests/run_helpers.py)."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and triton_missing(call.excinfo.value) and os.environ.get("CI") != "true":
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {TRITON_MISSING}")


if os.environ.get("PYTEST_XDIST_WORKER") is not None:
    # One torch thread in each xdist worker's own process (the runs it starts choose their own): two workers
    # already keep both cores busy, and idle intra-op threads would only spin-wait.
    torch.set_num_threads(1)


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test: tests share a small machine, and idle intra-op threads spin-wait,
    which made tiny-tensor tests 10-50x slower on a loaded 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def _transformers_import_structure(tmp_path_factory):
    """transformers' import structure as run_shards keeps it (pipeline/models/transformers_imports.py), computed
    once per test session by a process that imports transformers as a run's processes do."""
    import subprocess
    import sys
    kept = tmp_path_factory.mktemp("transformers_imports")
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from pipeline.models.transformers_imports import keep_import_structure; "
                    "assert keep_import_structure(Path(sys.argv[1])); "
                    "import transformers.models.auto.configuration_auto, transformers.models.auto.tokenization_auto",
                    str(kept)], cwd=pathlib.Path(__file__).resolve().parents[1], timeout=300)
    return kept   # (where that failed, empty: each test's processes scan as users' first ones do, and
                  # tests/test_transformers_imports.py says why)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch, _transformers_import_structure):
    """Each test gets its own cache so tests never see each other's (or the user's) files, but for transformers'
    import structure: the same in every test (a function of transformers' files), which each CLI process and
    worker would otherwise compute at its start, 1.5-3 CPU s (tests/test_transformers_imports.py checks it)."""
    import shutil
    cache = tmp_path_factory.mktemp("cache")
    shutil.copytree(_transformers_import_structure, cache / "transformers")
    monkeypatch.setenv("RUN_SHARDS_CACHE", str(cache))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny checkpoints of real architectures, saved as a hub download would be."""
    from pipeline.models import demo as demo_model

    from .tiny_models import save_esm, save_llama, save_qwen3
    root = tmp_path_factory.mktemp("models")
    return {
        "demo": str(demo_model.write(root / "demo")),
        "esm": str(save_esm(root / "esm")),
        "llama": str(save_llama(root / "llama")),
        "qwen3": str(save_qwen3(root / "qwen3")),
    }


# The fault tests' shared input: 240 synthetic sequences, 2 shards on the demo model computed by one CPU worker (one
# process: a worker that finishes a shard computes the next; tests of workers running at once ask for 2 with
# run_helpers.option_set), checkpoints every 20 sequences, and the result of one clean run of it, which every
# faulty run must reproduce after `rerun`.
@pytest.fixture(scope="session")
def fasta(tmp_path_factory):
    import subprocess
    import sys

    from .tiny_models import REPO
    path = tmp_path_factory.mktemp("fasta") / "in.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "240", "--seed", "11",
                    "--max-len", "600", str(path)], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="session")
def common(models):
    return ["--model", models["demo"], "--gpus", "0", "--workers", "1", "--shards", "2", "--max-tokens-per-batch",
            "2000", "--checkpoint-every", "20", "--no-progress"]


@pytest.fixture(scope="session")
def reference_run(fasta, common, tmp_path_factory):
    """The run directory of that clean run (tests that need a finished run copy it: never change it)."""
    from .tiny_models import run_cli
    out = tmp_path_factory.mktemp("ref") / "out"
    res = run_cli(fasta, "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="session")
def reference(reference_run):
    from .run_helpers import read
    return read(reference_run / "result.h5")


@pytest.fixture
def tmpfs(tmp_path):
    from .run_helpers import Tmpfs
    disks = Tmpfs(tmp_path)
    yield disks
    disks.unmount_all()
