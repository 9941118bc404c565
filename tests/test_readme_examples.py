"""README.md cannot drift from the program (issue 30): every example in it runs as written, every
`run_shards` command line it shows parses with the CLI as it is, and `make demo` installs the torch build
the README says it does.

Fenced blocks are `sh` (run in order, with `bash -e`, in a scratch directory where `examples/` is the
checkout's and `run_shards` is this checkout's bin/run_shards), `python` (run there, after the shell blocks
before it) or `text` (synopses, layouts, excerpts: not run, but their `run_shards` lines are parsed). The
Quickstart's `make demo` runs the run_shards command of the Makefile's demo recipe (installing is what
CI's own `make test` does); `make test` is this suite.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from .run_helpers import env_with, skip_or_fail
from .tiny_models import REPO

README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
QUICKSTART = ["make demo", "make test"]


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README)]


def test_every_block_says_what_it_is_and_the_quickstart_is_two_commands():
    kinds = [kind for kind, _ in blocks()]
    assert set(kinds) <= {"sh", "python", "text"}, kinds
    quickstart = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    (kind, code), = [(m.group(1), m.group(2)) for m in FENCE.finditer(quickstart)]
    assert kind == "sh" and code.strip().splitlines() == QUICKSTART


def _sandbox(tmp_path: Path) -> tuple[Path, dict]:
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "run_shards"
    script = REPO / "bin" / "run_shards"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))} \"$@\"\n")
    wrapper.chmod(0o755)
    return work, env_with(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=REPO)   # python examples import this checkout too


def _demo_command() -> str:
    """The run_shards line of `make demo`'s recipe (the install steps before it are CI's)."""
    plan = subprocess.run(["make", "-n", "demo", "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout
    (line,) = [line for line in plan.splitlines() if "/run_shards " in line]
    return "run_shards " + line.split("/run_shards ", 1)[1]


def test_every_example_runs_as_written(tmp_path):
    work, env = _sandbox(tmp_path)
    skipped = []
    for kind, code in blocks():
        if kind == "sh":
            if code.strip().splitlines() == QUICKSTART:
                code = _demo_command()
            done = subprocess.run(["bash", "-e", "-c", code], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=900)
        elif kind == "python":
            missing = [m for m in re.findall(r"^import (\w+)", code, re.M) if importlib.util.find_spec(m) is None]
            if missing:
                skipped.append(f"{', '.join(missing)} not installed (`pip install -e .[test]` installs it)")
                continue
            done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=300)
        else:
            continue
        assert done.returncode == 0, f"README example failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (work / "demo_out" / "result.h5").exists()
    if skipped:
        skip_or_fail("; ".join(skipped))


def _command_lines() -> list[str]:
    """Every `run_shards ...` command line the README shows: in inline code, and on the lines of its code
    blocks (up to an aligned description or comment). Synopses with [optional] parts, and a bare
    `run_shards COMMAND` naming a command, are not command lines."""
    from pipeline.cli import main
    found = re.findall(r"(?<!`)`(run_shards [^`]+)`", README)
    for kind, code in blocks():
        for line in code.replace("\\\n", " ").splitlines():
            if line.strip().startswith("run_shards "):
                found.append(re.split(r"\s{2,}", line.strip())[0])
    return [line for line in found if "[" not in line and "|" not in line
            and not (len(line.split()) == 2 and line.split()[1] in main.commands)]


def _parse(line: str) -> None:
    """Parse `line` as the CLI would, without running it; placeholders (OUT, FASTA, N, HOST:PORT, ...)
    stand for values."""
    from pipeline.cli import main
    words = ["1" if re.fullmatch(r"[A-Z][A-Z0-9_:.,-]*(\.\.\.)?", w) else w
             for w in shlex.split(line, comments=True)[1:]]
    if not words or words[0] in ("--help", "-h", "--version"):
        return
    if words[0] not in main.commands:
        words = ["run", *words]
    try:
        main.commands[words[0]].make_context(words[0], words[1:])
    except click.exceptions.Exit:   # --help
        pass


def test_every_command_line_in_the_readme_parses():
    lines = _command_lines()
    assert len(lines) > 30, lines
    wrong = []
    for line in lines:
        try:
            _parse(line)
        except click.ClickException as e:
            wrong.append(f"{line}: {e.format_message()}")
    assert wrong == []


@pytest.mark.parametrize("nvidia", [True, False])
def test_make_installs_the_torch_build_of_the_machine(tmp_path, nvidia):
    """A machine where nvidia-smi answers gets the CUDA build (PyPI's default); one with neither nvidia-smi
    nor /proc/driver/nvidia the CPU-only build; DEVICE= and TORCH= override the choice."""
    fake = tmp_path / "fake"
    fake.mkdir()
    if nvidia:
        (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (fake / "nvidia-smi").chmod(0o755)
    elif Path("/proc/driver/nvidia").exists() or any(
            (Path(d) / "nvidia-smi").exists() for d in os.environ["PATH"].split(os.pathsep)):
        pytest.skip("this machine has an NVIDIA driver: the CPU case cannot be shown here")

    def torch_line(*extra: str) -> str:
        plan = subprocess.run(["make", "-n", "install", "VENV=/nonexistent/venv", *extra], cwd=REPO,
                              capture_output=True, text=True, check=True,
                              env=env_with(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")).stdout
        return next(line for line in plan.splitlines() if "pip install -q torch" in line)

    if nvidia:
        assert "-q torch==2.13.0 " in torch_line() and "+cpu" not in torch_line()
    else:
        assert "-q torch==2.13.0+cpu " in torch_line()
    assert "torch==2.13.0+cpu" in torch_line("DEVICE=cpu") and "+cpu" not in torch_line("DEVICE=cuda")
    assert "-q torch==9.9 " in torch_line("TORCH=torch==9.9")


def test_every_option_of_every_command_says_what_it_does():
    """`run_shards COMMAND --help` documents every option (the README says so): `--per-residue-dtype` had its
    choices and default only."""
    from pipeline.cli import main
    silent = [f"{name} {p.opts[0]}" for name, command in main.commands.items() for p in command.params
              if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()]
    assert silent == []


def test_a_failed_torch_install_says_what_to_run_where_pytorchs_index_cannot_be_reached(tmp_path):
    """On a machine that reaches PyPI but not download.pytorch.org (Python 3.10, 3.12 and 3.13 here, whose
    CPU wheel is not among pip's local ones), `make demo` ended in pip's bare `ResolutionImpossible`; it now
    names the Python, the index it tried and the make command that installs PyPI's build instead. (A torch
    requirement that no index can meet stands for the unreachable one: `--no-index` keeps pip offline.)"""
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "demo", "DEVICE=cpu", f"VENV={venv}", f"PYTHON={sys.executable}",
                           "TORCH=--no-index torch==0.0.0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not (venv / ".installed").exists()
    (message,) = [line for line in done.stderr.splitlines() if line.startswith("error: pip could not install")]
    version = "Python " + ".".join(map(str, sys.version_info[:3]))
    assert f"({version})" in message and "https://download.pytorch.org/whl/cpu" in message, message
    suggested = message.split(" does: ", 1)[1]
    assert suggested == f"make demo TORCH=torch==2.13.0 PYTHON={sys.executable} VENV={venv}", message
    plan = subprocess.run([*shlex.split(suggested.replace("make demo", "make -n demo DEVICE=cpu", 1))], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout
    torch_line = next(line for line in plan.splitlines() if "pip install -q torch" in line)
    assert "-q torch==2.13.0 2>" in torch_line and "+cpu" not in torch_line   # PyPI's build, no +cpu


def test_a_failed_cuda_torch_install_suggests_nothing_it_cannot_know(tmp_path):
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "install", "DEVICE=cuda", f"VENV={venv}", f"PYTHON={sys.executable}",
                           "TORCH=--no-index torch==0.0.0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    (message,) = [line for line in done.stderr.splitlines() if line.startswith("error: pip could not install")]
    assert done.returncode != 0 and message.endswith("from its indexes (pip's message is above)."), message


def test_every_example_in_the_commands_help_parses():
    """`run_shards COMMAND --help` shows examples too; like the README's command lines, each parses with the
    CLI as it is (the words after `#` are a comment)."""
    from pipeline.cli import main
    examples = [line.strip() for command in main.commands.values() for line in (command.help or "").splitlines()
                if line.strip().startswith("run_shards ")]
    assert len(examples) >= 2, examples
    wrong = []
    for line in examples:
        try:
            _parse(line)
        except click.ClickException as e:
            wrong.append(f"{line}: {e.format_message()}")
    assert wrong == []


def test_no_option_in_the_commands_help_is_cut_at_its_dashes():
    """In 80 columns, click breaks words at hyphens: an example such as "--partition=gpu" was shown as `"--` at
    one line's end and `partition=gpu` on the next, which does not copy as an option."""
    from pipeline.cli import main
    cut = []
    for name, command in main.commands.items():
        text = command.get_help(click.Context(command, info_name=name, terminal_width=80, max_content_width=80))
        cut += [f"{name}: {line.strip()}" for line in text.splitlines() if line.rstrip().endswith("-")
                and re.search(r"(^|[\s\"'(`])--?$", line.rstrip().split(" ")[-1])]
    assert cut == []
