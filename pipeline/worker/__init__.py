"""One shard in one process, wherever it runs: a spawned local worker, a SLURM array task or a Ray task."""
