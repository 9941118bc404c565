"""Limits a shared cluster sets, for real: the open-files limit (`ulimit -n`) of the child process, a full
cache disk (a tmpfs mounted by the test: root only, skipped with the reason elsewhere, a failure under
CI=true), and another user's run directory (a child that becomes `nobody`: root only likewise).
"""
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .run_helpers import assert_same, env_with, option_set, read, skip_or_fail, suggested_commands
from .tiny_models import REPO, run_cli


def _open_files_limit(soft: int, hard: int | None = None):
    def apply():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard or resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return apply


def _run_limited(args, soft: int, hard: int | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), *args], capture_output=True, text=True,
                          env=env_with(RUN_SHARDS_REPORT="0", **(env or {})), cwd=REPO,
                          preexec_fn=_open_files_limit(soft, hard), timeout=600)


def test_many_shards_under_a_low_open_files_limit(fasta, common, reference, tmp_path):
    """10 shards through 2 worker slots under `ulimit -n 32`. Each ended worker's spawn pipes were kept open,
    two descriptors a shard, so the parent died with "Too many open files" (a traceback) after a few shards
    here; and the merge, which holds every shard open, called each shard it could not open "corrupt" and
    sent the user to `rerun`. Every worker is killed here as it finishes its shard (a worker that finishes one
    computes the next in the same process, and one that fails leaves its slot to a new process: ten processes);
    the run names the ten shards, and the rerun completes (the merge raises the soft limit to the hard one);
    under a hard limit too low for the merge, it says so and names the command that merges once it is raised."""
    out = tmp_path / "out"
    res = _run_limited([fasta, "--out", str(out), *common, "--shards", "10"], soft=32,
                       env={"RUN_SHARDS_FAULT_DIE_AT": "shard-written"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "Too many open files" not in res.stderr and res.stderr.count(" failed: ") == 10, res.stderr[-3000:]
    res = _run_limited(["rerun", str(out)], soft=32)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert_same(read(out / "result.h5"), reference)

    (out / "result.h5").unlink()
    res = _run_limited(["merge", str(out)], soft=16, hard=16)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "corrupt" not in res.stderr and "rerun" not in res.stderr, res.stderr
    assert "10 files at once, and this process may hold at most 16" in res.stderr, res.stderr
    (command,) = [c for c in suggested_commands(res.stderr) if c[0] == "merge"]
    partial = _run_limited(["merge", str(out), "--allow-partial"], soft=16, hard=16)   # the command as it was given
    assert partial.returncode == 2 and [c for c in suggested_commands(partial.stderr) if c[0] == "merge"] == \
        [["merge", str(out), "--allow-partial"]], partial.stderr
    res = run_cli(*command, env={"RUN_SHARDS_REPORT": "0"})
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)


def test_an_index_cache_on_a_full_disk_keeps_no_spill_folder(fasta, tmpfs):
    """The index cache's disk is full: the index is built elsewhere (a warning says so) and the cache keeps
    nothing. The build's spill folder was left there, locked, after closing its files failed a second time
    (the flush of a buffered write on the full disk) and skipped its removal."""
    disk = tmpfs.mount("1m")
    cache = disk / "cache"
    filler = tmpfs.fill(disk)
    res = run_cli("index", fasta, env={"RUN_SHARDS_CACHE": str(cache)})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "could not write the index cache" in res.stderr
    assert [p.name for p in (cache / "index").iterdir()] == []
    filler.unlink()


def _folder_for_nobody(prefix: str, mode: int, *also: Path) -> Path:
    """A new folder of `mode` that user nobody can reach (and the files `also`, e.g. the interpreter), or a skip
    naming what this machine's layout keeps from other users (a home of mode 700 above it)."""
    import tempfile
    top = Path(tempfile.mkdtemp(prefix=prefix))
    top.chmod(mode)
    if any(not p.stat().st_mode & 0o001 for p in [*top.parents, *(q for f in also for q in f.resolve().parents)]):
        shutil.rmtree(top)
        pytest.skip(f"{top} or a folder above {', '.join(map(str, also)) or 'it'} cannot be reached by other users")
    return top


def _as_nobody(*args: str) -> tuple[int, str]:
    """The CLI run in a forked child that has become user `nobody` (exit code, stderr). Forked rather than
    started: the interpreter may live where nobody cannot reach it (a home of mode 700); every module the
    command needs is imported before the fork, by the same command run as root."""
    import pwd

    from click.testing import CliRunner

    from pipeline.cli import main
    nobody = pwd.getpwnam("nobody")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: nobody, stderr into the pipe, the command, its exit code
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            result = CliRunner().invoke(main, list(args))
            os.write(write_fd, result.output.encode())
            os._exit(result.exit_code)
        finally:
            os._exit(99)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        text = fh.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


def test_another_users_run_directory_names_its_owner(reference_run):
    """A run directory made by root under `umask 077` (its files rw-------, its folders opened to others):
    `status` and `get` by another user said "Permission denied. Run the command where the run directory is
    mounted read-write" and "not a readable run_shards result", as if a mount or the file were at fault.
    They name the file, its owner and mode, and what to do."""
    if os.geteuid() != 0:
        skip_or_fail("becoming another user needs root")
    import pwd
    import tempfile
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        skip_or_fail("this system has no user `nobody`")
    top = Path(tempfile.mkdtemp(prefix="rs-nobody-"))   # (pytest's tmp_path lies in a folder of mode 700)
    try:
        _run_dir_of_root_read_by_nobody(reference_run, top / "out")
    finally:
        shutil.rmtree(top)


def _run_dir_of_root_read_by_nobody(reference_run, out):
    top = out.parent
    top.chmod(0o755)
    if any(not p.stat().st_mode & 0o001 for p in top.parents):
        pytest.skip(f"a folder above {top} cannot be searched by other users")   # (this machine's layout)
    from click.testing import CliRunner

    from pipeline.cli import main
    shutil.copytree(reference_run, out)
    for path in [out, *out.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o600)
    first_id = read(out / "result.h5")["ids"][0].decode()
    for args in (["status", str(out)], ["get", str(out), first_id]):
        assert CliRunner().invoke(main, args).exit_code == 0    # as root: imports what the command needs
        code, text = _as_nobody(*args)
        assert code == 2 and "Traceback" not in text, text
        assert "mounted read-write" not in text and "not a readable" not in text, text
        assert "belongs to root (mode rw-------) and this command runs as nobody" in text, text
        assert "run the command as root" in text, text


def test_an_out_whose_name_is_as_long_as_names_go(fasta, common, tmp_path):
    """An --out of 255 characters (NAME_MAX): every run ended in a traceback (File name too long: 'OUT-2')
    before computing anything, as the run built the OUT-2 its advice on a changed checkpoint would name. The
    run completes, and the sibling that advice names is one the file system takes."""
    from pipeline.rundir.layout import free_out
    out = tmp_path / ("o" * 255)
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_REPORT": "0"})
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    sibling = Path(free_out(out))
    assert sibling.parent == out.parent and sibling.name.endswith("-2") and len(sibling.name) == 255
    sibling.mkdir()   # (the file system takes it)
    assert free_out(out).endswith("-3")


def test_a_worker_that_dies_before_its_log_is_not_sent_to_its_log(fasta, models):
    """A process limit (`ulimit -u`) leaves a starting worker no thread: libgomp prints one line and exits the
    process before the worker writes its log. The parent said "exit code 1 (it raised an error; see its log)"
    of a log that did not exist, and status repeated it. Now the worker's log is started by the parent with
    how it ended, and the message points at the standard error where the worker's last words went; `rerun`
    under the limit again says the same (the logs then hold only the first attempt's lines), and `rerun` without
    the limit finishes. (The limit binds only users other than root: the run is `nobody`'s.)"""
    import pwd
    if os.geteuid() != 0:
        skip_or_fail("becoming another user needs root")
    nobody = pwd.getpwnam("nobody")
    top = _folder_for_nobody("rs-nproc-", 0o777, Path(sys.executable))
    try:
        shutil.copy(fasta, top / "in.fasta")
        shutil.copytree(models["demo"], top / "demo")
        for path in [top, *top.rglob("*")]:
            path.chmod(0o777 if path.is_dir() else 0o644)
        out = top / "out"
        args = [str(top / "in.fasta"), "--out", str(out), "--model", str(top / "demo"), "--gpus", "0",
                "--workers", "2", "--no-progress"]

        def as_nobody(processes: int | None):
            def apply():
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                if processes:
                    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
            return apply

        env = env_with(RUN_SHARDS_REPORT="0", HOME=str(top), RUN_SHARDS_CACHE=str(top / "cache"))
        cli = [sys.executable, str(REPO / "bin" / "run_shards")]
        res = subprocess.run(cli + args, capture_output=True, text=True, env=env, cwd=top,
                             preexec_fn=as_nobody(12), timeout=600)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert "see its log" not in res.stderr, res.stderr[-3000:]
        assert "while starting, before it wrote its log" in res.stderr, res.stderr[-3000:]
        for log in (out / "logs").glob("worker_*.log"):
            assert "ended: exit code 1 while starting" in log.read_text()
        status = subprocess.run(cli + ["status", str(out)], capture_output=True, text=True, env=env, cwd=top,
                                preexec_fn=as_nobody(None), timeout=300)
        assert "see its log" not in status.stdout and "while starting" in status.stdout, status.stdout
        (command,) = [c for c in suggested_commands(res.stderr) if c[0] == "rerun"]
        # rerun under the same limit: the logs exist now (the parent started them), holding only the first
        # attempt's lines; it was sent to them as if they held this attempt's error
        res = subprocess.run(cli + command, capture_output=True, text=True, env=env, cwd=top,
                             preexec_fn=as_nobody(12), timeout=600)
        assert res.returncode == 1 and "see its log" not in res.stderr, res.stderr[-3000:]
        assert "while starting, before it wrote its log" in res.stderr, res.stderr[-3000:]
        res = subprocess.run(cli + command, capture_output=True, text=True, env=env, cwd=top,
                             preexec_fn=as_nobody(None), timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
    finally:
        shutil.rmtree(top)


def test_get_and_export_to_a_full_disk_name_the_file(reference_run, tmpfs):
    """`get -o` and `export -o` onto a full disk said "cannot write a file": the file is named, nothing partial
    is left, and after freeing space the same command writes it."""
    disk = tmpfs.mount("1m")
    filler = tmpfs.fill(disk)
    first_id = read(reference_run / "result.h5")["ids"][0].decode()
    commands = [["get", str(reference_run), first_id, "-o", str(disk / "rows.tsv")],
                ["export", str(reference_run), "--format", "parquet", "-o", str(disk / "all.parquet")]]
    for args in commands:
        res = run_cli(*args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"cannot write {args[-1]}: no space left on the device" in res.stderr, res.stderr
    assert [p.name for p in disk.iterdir()] == ["filler"]
    filler.unlink()
    for args in commands:
        assert run_cli(*args).returncode == 0
        assert Path(args[-1]).stat().st_size > 0


def test_a_run_directory_of_ones_own_closed_to_oneself_is_not_called_another_users(reference_run, capsys):
    """Your own file that refuses you (a manifest made mode 000; an NFS export mapping root to another user):
    the refusal said it "belongs to nobody and this command runs as nobody. Ask nobody to open it to you, or
    run the command as nobody". It says the file is yours and how to open it to yourself. And an EPERM (here
    root changing a /proc file; an immutable file, another's file in a sticky folder), which the same words
    are for, was a traceback."""
    if os.geteuid() != 0:
        skip_or_fail("becoming another user needs root")
    import pwd

    from click.testing import CliRunner

    from pipeline.cli import _run_step, main
    nobody = pwd.getpwnam("nobody")
    top = _folder_for_nobody("rs-own-", 0o755)
    try:
        out = top / "out"
        shutil.copytree(reference_run, out)
        for path in [out, *out.rglob("*")]:
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        (out / "manifest.json").chmod(0)
        CliRunner().invoke(main, ["status", str(out)])   # (as root: imports what the command needs)
        code, text = _as_nobody("status", str(out))
        assert code == 2 and "Traceback" not in text, text
        assert f"the file {out / 'manifest.json'} is nobody's own (mode ---------)" in text, text
        assert "Ask nobody" not in text and "as nobody" not in text, text
        assert f"chmod u+rwX {out / 'manifest.json'}" in text, text
    finally:
        shutil.rmtree(top)

    with pytest.raises(SystemExit) as e:   # a real EPERM: root may not change the mode of a /proc file
        _run_step(os.chmod, "/proc/self/status", 0o644)
    assert e.value.code == 2
    assert "error: cannot use /proc/self/status: permission denied: the file /proc/self/status is root's own" \
        in capsys.readouterr().err


def test_a_rerun_whose_workers_die_before_logging_is_not_sent_to_the_earlier_logs(fasta, common, tmp_path):
    """Workers that exit while starting (as libgomp makes them under `ulimit -u`; here a sitecustomize that exits
    every spawned process, so no root is needed) leave no log; the parent starts each with how it ended. A
    `rerun` under the same limit found those logs there and said "it raised an error; see its log", of a log
    holding only the first attempt's lines. It says again where the worker's last words went."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if '--multiprocessing-fork' in sys.argv:   # a spawned worker, as it starts\n"
        "    os.write(2, b'libgomp: Thread creation failed: Resource temporarily unavailable\\n')\n"
        "    os._exit(1)\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           "RUN_SHARDS_REPORT": "0"}
    out = tmp_path / "out"
    for args in ([fasta, "--out", str(out), *common], ["rerun", str(out), "--no-progress"]):
        res = run_cli(*args, env=env)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert "see its log" not in res.stderr and "while starting, before it wrote its log" in res.stderr, \
            res.stderr[-3000:]
    assert (out / "logs" / "worker_0.log").read_text().count("ended: exit code 1 while starting") == 2


def test_a_full_system_file_table_is_not_sent_to_ulimit(capsys):
    """ENFILE (the system's table of open files full) was advised like EMFILE, "Raise the limit (`ulimit -n`)",
    which does nothing for it."""
    import errno

    from pipeline.cli import _run_step

    def refused(code):
        raise OSError(code, os.strerror(code), "/data/shard_0.h5")
    for code, said, unsaid in ((errno.ENFILE, "fs.file-max", "ulimit -n"), (errno.EMFILE, "`ulimit -n`", "file-max")):
        with pytest.raises(SystemExit) as e:
            _run_step(refused, code)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "cannot open /data/shard_0.h5" in err and said in err and unsaid not in err, err


def test_cpu_workers_whose_model_copies_do_not_fit_are_refused_before_any_loads(fasta, common, reference, tmp_path):
    """Each CPU worker loads its own copy of the model as it starts: where the copies could not fit in the free
    memory (here the 1.2 MB RUN_SHARDS_FAULT_FREE_RAM stands for, against the demo model's two 777 KB copies),
    every worker was started and the kernel's OOM killer ended some mid-load. The run is refused while planning,
    before any worker is told to load the model, with the command that runs it on as many workers as fit; that
    command (on this machine's real memory) gives the reference rows."""
    common = option_set(common, "--workers", "2")   # (both shards computing at once)
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_FREE_RAM": "1200000"})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "2 CPU worker(s) would each hold a copy of the model (776.9 KB in float32): 1.6 MB in all, and 1.2 MB" \
           in res.stderr, res.stderr
    assert not out.exists() and "loading" not in res.stderr
    (command,) = suggested_commands(res.stderr)
    assert command[command.index("--workers") + 1] == "1", command
    res = run_cli(*command, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)
    bf16 = run_cli(fasta, "--out", str(out) + "2", *common, env={"RUN_SHARDS_FAULT_FREE_RAM": "500000"})
    assert bf16.returncode == 2 and "one copy alone does not fit in float32" in bf16.stderr, bf16.stderr
    (command,) = suggested_commands(bf16.stderr)
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--workers") + 1] == "1"
    res = run_cli(*command, "--no-progress")
    assert res.returncode == 0 and read(Path(str(out) + "2") / "result.h5")["ids"].tolist() == reference["ids"].tolist()


def test_a_rerun_whose_model_copies_do_not_fit_names_the_run_that_continues_on_fewer_workers(fasta, common, reference,
                                                                                              tmp_path):
    """`rerun` starts the run's workers as they were planned (here 2): where their copies of the model cannot fit in
    the memory free now, it stops before any worker loads it and names the `run` command that continues the run on
    as many workers as fit (a 16-bit dtype is not offered: the run's dtype is fixed); that command finishes it."""
    common = option_set(common, "--workers", "2")   # (both shards computing at once)
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert res.returncode == 1, res.stderr
    logs = {p.name: p.read_text() for p in (out / "logs").glob("worker_*.log")}
    res = run_cli("rerun", str(out), env={"RUN_SHARDS_FAULT_FREE_RAM": "1200000"})
    assert res.returncode == 2 and "2 CPU worker(s) would each hold a copy of the model" in res.stderr, res.stderr
    assert {p.name: p.read_text() for p in (out / "logs").glob("worker_*.log")} == logs   # (no worker started)
    (command,) = suggested_commands(res.stderr)
    assert command[:2] == ["run", fasta] and command[command.index("--out") + 1] == str(out), command
    assert command[command.index("--workers") + 1] == "1" and "--dtype" not in command, command
    res = run_cli("rerun", str(out), "--shards", "1", env={"RUN_SHARDS_FAULT_FREE_RAM": "500000"})
    assert res.returncode == 2 and "1 CPU worker(s) would each hold a copy" in res.stderr, res.stderr
    assert "one copy alone does not fit: free memory" in res.stderr and "bfloat16" not in res.stderr, res.stderr
    res = run_cli(*command, "--no-progress")
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)
