"""The run directory OUT/: where each file lives, its locks, the run's copy of the index and the parent's
log. Never torch at import."""
