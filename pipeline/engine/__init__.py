"""The native inference engine: sequences, page allocation, state slots, scheduling, model runner.

sequence.py (one request) -> scheduler.py (what runs this step, under the token and sequence budgets,
with block_manager.py handing out KV pages and state_slots.py delta-rule state slots) ->
model_runner.py (a step as tensors, through the model) -> engine.py (the Engine the pipeline calls:
`forward` for embed/score, `generate` with continuous batching). config.py validates the budgets.
"""
