"""What a run directory says about its run, for people: `run_shards status` and report.html, from the
run directory and worker logs alone (every launcher gets the same answers). Never torch at import."""
