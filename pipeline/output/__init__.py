"""The HDF5 output: one schema, written and checkpointed by shards, merged and validated into the result.
Never torch at import."""
