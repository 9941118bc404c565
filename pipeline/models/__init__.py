"""Model families the native engine runs, built straight from Hugging Face checkpoints (config.json +
safetensors): registry.py says which and loads one; checkpoint.py resolves and describes a checkpoint for the
parent (no torch at import); base.py, esm.py, t5.py, llama.py, qwen3_5.py and layers/ are the models."""
