"""Commands run at the same time on one run directory, as users of a shared machine or cluster do: one
command's clean-up must never take another's file, and what each says must hold while the other works."""
import os
import shutil
import time

from pipeline.rundir.layout import atomic_path

from .tiny_models import run_cli


def test_a_command_taking_the_run_lock_leaves_an_export_writing_in_out_alone(fasta, common, reference_run,
                                                                             tmp_path):
    """`export` (and `get --output`, `report`) take no run lock and write in OUT through a temporary file: a
    `run`, `rerun` or `merge` started meanwhile took every `.NAME.tmp*` in OUT for its own killed command's
    leftovers and removed it (at 770fa95), so the export then failed, or renamed a file holding only what
    it wrote after the removal into place as OUT/result.parquet. Leftovers of dead commands still go."""
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    stale_merge = out / ".result.h5.tmp"                  # a merge killed under the lock: stale at once
    stale_merge.write_bytes(b"half a result")
    dead_export = out / ".result.per-id.h5.tmp999999"     # an export killed two hours ago
    dead_export.write_bytes(b"half an export")
    two_hours_ago = time.time() - 7200
    os.utime(dead_export, (two_hours_ago, two_hours_ago))
    with atomic_path(out / "result.parquet") as tmp:      # this process exports now, as `export` writes
        with open(tmp, "wb") as fh:
            fh.write(b"first half, ")
            fh.flush()
            res = run_cli(fasta, "--out", str(out), *common)   # the same run again: the result stands
            assert res.returncode == 0, res.stderr
            assert "nothing was computed or merged again" in res.stderr
            assert tmp.exists(), "the live export's temporary file was removed"
            res = run_cli("merge", str(out))
            assert res.returncode == 0, res.stderr
            assert tmp.exists(), "the live export's temporary file was removed by merge"
        with open(tmp, "ab") as fh:
            fh.write(b"second half")
    assert (out / "result.parquet").read_bytes() == b"first half, second half"
    assert not stale_merge.exists() and not dead_export.exists()
