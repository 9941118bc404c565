"""The run's own index, as later commands reopen it: checked against the FASTA files as they are now, with
both ways out when they changed (restore them and `rerun`, or start a new run on them as they are)."""
from __future__ import annotations

from pathlib import Path

from index import IndexCorrupt, SequenceIndex

from ..advice import command
from ..config import RunConfig
from ..errors import RunDirError, UserError
from ..rundir.layout import RunDir, free_out


def start_over_advice(run: RunDir, manifest: dict) -> str:
    """Advice when a run's inputs changed: both ways out, each with a command that works (a new run on a FASTA
    that is gone cannot be named: its new place is the user's to give)."""
    config = RunConfig.from_manifest(manifest)
    gone = [f for f in config.fasta if not Path(f).exists()]
    if gone:
        return (f"Put {', '.join(gone)} back where {'it was' if len(gone) == 1 else 'they were'} (moved or renamed, "
                f"the run no longer finds {'it' if len(gone) == 1 else 'them'}) and run `{command('rerun', run.root)}` "
                "again, or start a new run on the file where it is now, with another --out.")
    return (f"Restore the original file and run `{command('rerun', run.root)}` again, or start a new run on the "
            f"file as it is now: `{config.as_command(free_out(run.root))}`.")


def load_run_index(run: RunDir, manifest: dict, refresh_copies: bool = False, verify: bool = True) -> SequenceIndex:
    """The run's index (memory-mapped), after checking that the FASTA files still match it (refusing with
    what changed). `refresh_copies` (only where no worker of the run can be reading them): decompress again
    the .gz inputs that changed, so a restored .gz lets the run continue. `verify`: read the whole file for
    its checksum first (`status` and array tasks, which read a few pages of it, do not)."""
    try:
        index = SequenceIndex.load(run.index_path, verify=verify)
    except IndexCorrupt as e:
        config = RunConfig.from_manifest(manifest)
        raise RunDirError(f"the run's index is damaged ({e}); start a new run: "
                          f"`{config.as_command(free_out(run.root))}`") from None
    except OSError as e:
        raise RunDirError(f"cannot read the run's index {run.index_path} ({e.strerror or e}); check the file "
                          "system, then run the same command again") from None
    if refresh_copies:
        from index.compressed import refresh
        refresh([f.path for f in index.inputs])
    changed = index.records_changed()
    if not changed:   # a .gz whose decompressed copy the run reads
        from index.compressed import source_changes
        changed = "; ".join(source_changes([f.path for f in index.inputs])) or None
    if changed:
        index.close()
        raise UserError(f"the input FASTA no longer matches this run ({changed}). {start_over_advice(run, manifest)}")
    return index
