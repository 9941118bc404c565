"""run_shards: sharded multi-GPU (or multi-CPU-worker) inference for sequence models over FASTA."""
__version__ = "0.1.0"
