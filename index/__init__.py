"""FASTA index: one binary row per record (id, length, file, byte offset), cached across runs."""
from .cache import cache_path, load_or_build, records_changed
from .errors import FastaError, InputChanged
from .fasta_scan import scan_fasta, sequence_text
from .input_file import lasting_path
from .sequence_index import IndexCorrupt, InputFile, SequenceIndex, ShardStats, length_descending_order

__all__ = ["FastaError", "IndexCorrupt", "InputChanged", "InputFile", "SequenceIndex", "ShardStats", "cache_path",
           "lasting_path", "length_descending_order", "load_or_build", "records_changed", "scan_fasta", "sequence_text"]
