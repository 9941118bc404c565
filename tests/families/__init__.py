"""Tiny checkpoints of the sequence-model families people use, written as their published checkpoints are
(configs with the published values, only sizes shrunk; the published tokenizer files), and each model card's
own usage in transformers as the reference the pipeline's fidelity tests compare against. See FAMILIES.md.
"""
