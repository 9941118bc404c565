"""A real, throw-away SLURM cluster on this machine, for tests of the SLURM launcher.

`LocalSlurm` writes a slurm.conf into a temp dir and runs `slurmctld -D` and one `slurmd -D -N nX` per
node as child processes: two nodes on one host, each with one CPU and one fake GPU (gres on /dev/null).
Jobs run as root on this host, in their submit directory, so run directories under tmp work as they
would on shared storage. The `slurm_cluster` fixture below hands one cluster to every test of a session.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

log = logging.getLogger(__name__)

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel")
# States after which a job (or array task) never runs again unless someone requeues it.
FINISHED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})
# A slurmd's job-step sockets live in its spool dir and a Unix socket path holds at most 107 bytes.
MAX_SPOOL_PATH = 60


class SlurmError(RuntimeError):
    """The local cluster did not start, or a SLURM command failed; the message carries its output."""


def poll_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Return condition()'s first truthy value, checking every `interval` s; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(interval)


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now, held together while picking so that they differ."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def unavailable_reason() -> str | None:
    """Why a local cluster cannot run here, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if missing:
        return (f"SLURM is not installed (no {', '.join(missing)}); `make test` installs it with "
                "tests/setup/install_slurm.sh when run as root on a machine with apt-get")
    if os.geteuid() != 0:
        return "the local SLURM cluster runs its daemons and jobs as root; these tests are not root"
    return None


class LocalSlurm:
    """slurmctld plus one slurmd per node, all on localhost, configured and logged under `root`.

    Use as a context manager, or call start() and stop(). Run SLURM commands with `env`, or through
    run() / sbatch() / job_states() / wait_for_job().
    """

    def __init__(self, root: Path, *, max_array_size: int = 1001, nodes: tuple[str, ...] = ("n1", "n2"),
                 cpus_per_node: int = 1, kill_wait: int = 2, max_job_count: int | None = None):
        self.root = Path(root)
        assert len(str(self.root / "spool" / max(nodes, key=len))) <= MAX_SPOOL_PATH, \
            f"{self.root} is too long for slurmd's job-step socket paths"
        self.max_array_size = max_array_size
        self.max_job_count = max_job_count      # None: SLURM's default (10,000)
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.kill_wait = kill_wait
        self.conf_path = self.root / "slurm.conf"
        self.log_dir = self.root / "log"
        self.startup_seconds: float | None = None
        self._daemons: dict[str, subprocess.Popen] = {}

    @property
    def epilog_path(self) -> Path:
        return self.root / "epilog.sh"

    @property
    def epilog_seconds_path(self) -> Path:
        return self.root / "epilog_seconds"

    @contextlib.contextmanager
    def slow_epilog(self, seconds: float):
        """Every job that ends meanwhile stays COMPLETING for `seconds` (its node's epilog sleeps). On the way
        out it waits for those epilogs, so that a test failing inside leaves the next one free nodes."""
        self.epilog_seconds_path.write_text(f"{seconds}\n")
        try:
            yield
        finally:
            self.epilog_seconds_path.unlink(missing_ok=True)
            poll_until(lambda: "COMPLETING" not in self.run("squeue", "--noheader", "--format=%T"), seconds + 15,
                       "the slow epilogs done")

    @property
    def env(self) -> dict[str, str]:
        """This process's environment as it is now, pointed at this cluster: for subprocesses that run
        SLURM commands. Variables of an enclosing SLURM job are left out so they cannot leak in."""
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("SLURM_", "SBATCH_", "SQUEUE_", "SINFO_", "SCANCEL_"))}
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    # Configuration

    def write_config(self) -> None:
        """slurm.conf and gres.conf for a cluster on fresh ports, with every path inside `root`."""
        for folder in ("state", "log", *(f"spool/{node}" for node in self.nodes)):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        node_lines = [
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus_per_node} RealMemory=1000 Gres=gpu:1 State=UNKNOWN"
            for node, port in zip(self.nodes, node_ports)]
        root = self.root
        lines = [
            f"ClusterName=local{ctld_port}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            # No munge daemon: every message is trusted, which is fine for a cluster that lives on
            # localhost for one test session.
            "AuthType=auth/none",
            "CredType=cred/none",
            # A requeued job waits cred_expire + 1 s before it may start again: 121 s by default,
            # 6 s at the smallest value slurm accepts.
            "AuthInfo=cred_expire=5",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerParameters=bf_interval=1",
            "GresTypes=gpu",
            # Node sizes are made up: take them from this file rather than from the host's hardware.
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "MailProg=/bin/true",
            f"MaxArraySize={self.max_array_size}",
            *([f"MaxJobCount={self.max_job_count}"] if self.max_job_count else []),
            "MessageTimeout=5",
            "SlurmdTimeout=20",
            "ReturnToService=2",
            f"KillWait={self.kill_wait}",
            # Finished jobs stay visible to squeue -t all for this long, which wait_for_job relies on.
            "MinJobAge=600",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.%n.log",
            f"Epilog={self.epilog_path}",
            *node_lines,
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")
        # A job is COMPLETING while the epilog runs (a task being requeued too, before it is PENDING again):
        # slow_epilog() holds it there for a test.
        self.epilog_path.write_text(f"#!/bin/sh\n[ -f {self.epilog_seconds_path} ] && "
                                    f"sleep \"$(cat {self.epilog_seconds_path})\"\nexit 0\n")
        self.epilog_path.chmod(0o755)
        (self.root / "gres.conf").write_text(f"NodeName={','.join(self.nodes)} Name=gpu File=/dev/null\n")

    # Lifecycle

    def start(self, timeout: float = 30) -> None:
        """Start the daemons and return once sinfo shows every node idle."""
        started = time.monotonic()
        self.write_config()
        try:
            self._spawn("slurmctld", ["slurmctld", "-D"])
            for node in self.nodes:
                self._spawn(node, ["slurmd", "-D", "-N", node])
            poll_until(self._all_nodes_idle, timeout, f"nodes {', '.join(self.nodes)} idle")
        except Exception as error:
            report = self.logs_tail()
            self.stop()
            raise SlurmError(f"local SLURM cluster did not start: {error}\n{report}") from error
        self.startup_seconds = time.monotonic() - started
        log.info("local SLURM cluster up in %.2f s (%s)", self.startup_seconds, self.conf_path)

    def stop(self, timeout: float = 10) -> None:
        """Cancel all jobs, shut the daemons down, and kill whatever of this cluster still runs."""
        shutting_down = False
        controller = self._daemons.get("slurmctld")
        if controller is not None and controller.poll() is None:
            try:
                self.cancel_all(timeout=timeout)
                self.run("scontrol", "shutdown", timeout=timeout)
                shutting_down = True
            except (SlurmError, TimeoutError, subprocess.TimeoutExpired) as error:
                log.warning("stopping the local SLURM cluster: %s; killing its daemons", error)
        deadline = time.monotonic() + (timeout if shutting_down else 0)
        for name, process in self._daemons.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) still runs; killing it", name, process.pid)
                process.kill()
                process.wait()
        self._daemons.clear()
        self._kill_leftovers()

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # Commands

    def run(self, *args: str, cwd: Path | None = None, timeout: float = 30) -> str:
        """Run a SLURM client command against this cluster; its stdout, or SlurmError with its stderr."""
        done = subprocess.run(args, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SlurmError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, args: list[str], cwd: Path | None = None) -> str:
        """Submit a batch job; its id (an array's id names all its tasks)."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd).strip().split(";")[0]

    def job_states(self, job_id: str) -> dict[str, str]:
        """{job id: state} of a job or of each task of an array ('12_0': 'COMPLETED'), finished ones too."""
        out = self.run("squeue", "--noheader", "--array", "--states=all", f"--jobs={job_id}",
                       "--format=%i %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_for_job(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """Wait until the job (every task of an array) has finished; its job_states()."""
        def finished():
            states = self.job_states(job_id)
            return states if states and set(states.values()) <= FINISHED_STATES else None
        try:
            return poll_until(finished, timeout, f"job {job_id} finished", interval=0.2)
        except TimeoutError as error:
            raise TimeoutError(f"{error}; states now {self.job_states(job_id)}") from None

    def node_states(self) -> dict[str, str]:
        """{node name: state}, e.g. {'n1': 'idle', 'n2': 'mixed'}."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def cancel_all(self, timeout: float = 10) -> None:
        """Cancel every job and wait until none is left running or pending, so the nodes are free."""
        self.run("scancel", "--user=root")
        poll_until(lambda: not self.run("squeue", "--noheader", "--format=%i").strip(), timeout,
                   "all jobs cancelled")

    def logs_tail(self, lines: int = 15) -> str:
        """The last lines of every daemon log, for error messages."""
        parts = []
        for path in sorted(self.log_dir.glob("*")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # Internals

    def _spawn(self, name: str, command: list[str]) -> None:
        # Daemons write to their log files once the config is read; what they say before that (a
        # config error) goes to stderr, kept beside the logs.
        with open(self.log_dir / f"{name}.stderr", "wb") as stderr:
            self._daemons[name] = subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL,
                                                   stdout=stderr, stderr=stderr)

    def _all_nodes_idle(self) -> bool:
        for name, process in self._daemons.items():
            if process.poll() is not None:
                raise SlurmError(f"{name} exited with {process.returncode}")
        try:
            states = self.node_states()
        except SlurmError:  # slurmctld is not listening yet
            return False
        return all(states.get(node) == "idle" for node in self.nodes)

    def _kill_leftovers(self) -> None:
        """SIGKILL job steps and their processes that outlived the daemons: each has this cluster's
        SLURM_CONF in its environment (slurmstepd inherits it from slurmd, jobs get it from slurm)."""
        marker = f"SLURM_CONF={self.conf_path}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                os.kill(int(proc.name), signal.SIGKILL)
                log.warning("killed leftover pid %s of the local SLURM cluster", proc.name)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue


# Fixtures. Import both into a conftest to use them suite-wide; the cluster is kept on the pytest
# config, so every module that imports them shares one cluster per session.

# Explicit rather than slurm's default (1001) so tests can rely on it; a test of splitting an array
# starts its own LocalSlurm with a small one (about a second).
SESSION_MAX_ARRAY_SIZE = 100
_SESSION_CLUSTER = pytest.StashKey[LocalSlurm]()


def require_slurm() -> None:
    """Skip the test where SLURM cannot run here; under CI=true fail instead, since CI installs it."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_session(request, tmp_path_factory) -> LocalSlurm:
    """One local cluster for the whole session (started on first use, stopped at the end)."""
    require_slurm()
    cluster = request.config.stash.get(_SESSION_CLUSTER, None)
    if cluster is None:
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), max_array_size=SESSION_MAX_ARRAY_SIZE)
        cluster.start()
        request.config.stash[_SESSION_CLUSTER] = cluster
        request.config.add_cleanup(cluster.stop)
    return cluster


@pytest.fixture
def slurm_cluster(slurm_session):
    """The session's local cluster, with every job cancelled after the test so the next one starts on
    idle nodes."""
    yield slurm_session
    slurm_session.cancel_all()
