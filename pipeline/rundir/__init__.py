"""The run directory OUT/: its layout and locks, shard states, logs, and what status and report read
from it. Never torch at import."""
