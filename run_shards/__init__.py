"""run_shards from Python: the package users import, and everything in it is public and stable (`__all__`;
docs/python.md). It only names what lives in the project's rooms (pipeline/, index/), so that code using
it never depends on where a function is kept.

    import run_shards

    with run_shards.open_result("emb") as res:        # a run directory or a result.h5
        vector = res.get("P12345")["embeddings/mean"]

    run_shards.run("proteins.fasta", out="emb", model="esm2_dir", pool=["mean", "cls"])
    print(run_shards.status("emb"))

Each command of the `run_shards` command line is a function of the same name taking the command's
arguments: run, status, rerun, merge, report, index, get, export, work.
"""
from index import FastaError
from pipeline import __version__
from pipeline.api import NotMerged, merge, rerun
from pipeline.commands import export, get, index, report, run, run_config
from pipeline.config import RunConfig
from pipeline.errors import RunFailed, RunInterrupted, UserError
from pipeline.launchers.job import Submitted
from pipeline.launchers.work import work
from pipeline.output.result_reader import MissingIds, ResultFile, open_result
from pipeline.reporting.status import status

__all__ = [
    # reading a result
    "open_result", "ResultFile", "MissingIds",
    # the commands, with the command line's arguments
    "run", "status", "rerun", "merge", "report", "index", "get", "export", "work",
    # what `run` takes and returns
    "run_config", "RunConfig", "NotMerged", "Submitted",
    # errors: a user's mistake (its message is the command line's), bad input files, failed shards
    "UserError", "FastaError", "RunFailed", "RunInterrupted",
    "__version__",
]
