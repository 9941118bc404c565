"""Per-row status codes stored in every output's `status` column (0 = ok)."""
OK = 0
SKIPPED_TOO_LONG = 1       # longer than the model's limit under --on-long skip: no values computed
UNKNOWN_RESIDUES = 2       # contains characters outside the model's alphabet, fed as its unknown token (not scored)
EMPTY = 3                  # record with no residues, kept by --skip-empty: no values computed
OUT_OF_MEMORY = 4          # did not fit in device memory even alone: no values computed

DESCRIPTIONS = {
    OK: "ok",
    SKIPPED_TOO_LONG: "skipped: longer than the model's limit (--on-long skip)",
    UNKNOWN_RESIDUES: "computed; contains characters outside the model's alphabet (fed as the unknown token: "
                      "context for the others, not scored)",
    EMPTY: "empty record kept by --skip-empty; no values",
    OUT_OF_MEMORY: "out of memory even as a batch of one; no values",
}

HAS_VALUES = {OK, UNKNOWN_RESIDUES}
