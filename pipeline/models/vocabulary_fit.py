"""Whether a checkpoint's files go together: every token id the tokenizer gives a residue or puts around the
residues must have a row in the model's embedding (config.json `vocab_size`), and the weights' embedding must
have the rows config.json says. Files of another checkpoint (a larger vocabulary beside a model trained on
fewer tokens) otherwise stop every worker at its first batch or its load with a traceback, after planning.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .checkpoint_facts import safetensors_header

# How checkpoints name their token embedding (ESM/BERT, Llama/Qwen, T5, GPT-2), under any prefix.
EMBEDDING_NAMES = ("word_embeddings.weight", "embed_tokens.weight", "shared.weight", "wte.weight")

# The special tokens a run feeds the model: around the residues, for unknown residues, and a masked LM's mask.
# (The padding token is never a model input of the native engine, and published GPT-2-style tokenizers add one
# past the embedding that transformers never embeds unmasked, so it is left out.)
FED_SPECIAL = ("bos", "eos", "cls", "sep", "unk", "mask")


def check(name: str, path: str | Path, config, tokenizer) -> None:
    """Refuse (UserError) weights whose embedding has other rows than config.json's `vocab_size`, and a
    tokenizer whose residue tokens (one printable character each) or fed special tokens have ids at or past it,
    naming them and the sizes."""
    from .hf_config import text_config
    size = getattr(text_config(config), "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        return
    stored = _embedding_rows(Path(path))
    if stored is not None and stored[1] != size:
        raise UserError(f"--model {name}: config.json says vocab_size {size}, but the weights' token embedding "
                        f"({stored[0]}) has {stored[1]} rows. config.json and the weights are not of one "
                        "checkpoint: put the checkpoint's own files together.")
    fed = {token: i for token, i in tokenizer.get_vocab().items() if len(token) == 1 and token.isprintable()}
    for kind in FED_SPECIAL:
        token, i = getattr(tokenizer, f"{kind}_token", None), getattr(tokenizer, f"{kind}_token_id", None)
        if token is not None and isinstance(i, int):
            fed[str(token)] = i
    beyond = sorted((i, token) for token, i in fed.items() if i >= size)
    if beyond:
        listed = ", ".join(f"{token!r} (id {i})" for i, token in beyond[:10])
        more = f" and {len(beyond) - 10} more" if len(beyond) > 10 else ""
        raise UserError(f"--model {name}: its tokenizer gives token ids the model has no embedding for: "
                        f"{listed}{more}; config.json says vocab_size {size} (ids 0..{size - 1}). The tokenizer files "
                        "and config.json are not of one checkpoint: put the checkpoint's own files together.")


def _embedding_rows(path: Path) -> tuple[str, int] | None:
    """(name, rows) of the token embedding in the checkpoint's safetensors headers (nothing else is read);
    None where there is none to read (PyTorch .bin weights, a name of another kind)."""
    for file in sorted(path.glob("*.safetensors")):
        try:
            _, header = safetensors_header(file)
        except (OSError, ValueError):
            return None   # (a damaged file is named by checkpoint.weight_problems)
        for tensor, spec in header.items():
            if tensor.endswith(EMBEDDING_NAMES) and isinstance(spec, dict) and spec.get("shape"):
                return tensor, int(spec["shape"][0])
    return None
