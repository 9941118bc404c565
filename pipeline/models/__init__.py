"""Checkpoints and the native engine's models. registry.py is the table of model families (recognition from
checkpoint_facts.py, engine, tasks, input conventions from conventions.py, loading); checkpoint.py resolves and
describes a checkpoint for the parent (no torch at import); hf_config.py reads its config and tokenizer;
base.py, esm.py, llama.py, qwen3_5.py, t5.py and layers/ are the native models."""
