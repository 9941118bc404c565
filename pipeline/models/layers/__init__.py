"""Building blocks shared by the native model families: norms, rotary embeddings, MLPs, attention over
the paged KV cache, and the checkpoint loader."""
