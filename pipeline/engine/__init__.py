"""Engines: what turns token ids into hidden states, log-probabilities or new tokens.

interface.py is what tasks see of any engine; selection.py chooses and loads one (hf.py: transformers on padded
batches; native.py: ours), windowed.py runs long sequences as windows on either, mkl_cnr.py keeps CPU matmuls
reproducible. The native engine: sequence.py (one request) -> scheduler.py (what runs this step, under the token
and sequence budgets, with block_manager.py handing out KV pages and state_slots.py delta-rule state slots) ->
model_runner.py (a step as tensors, through the model) -> native.py (`forward` for embed/score, `generate` with
continuous batching). config.py validates the budgets.
"""
