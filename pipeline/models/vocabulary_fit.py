"""Whether a checkpoint's tokenizer and its model go together: every token id the tokenizer gives a residue or
puts around the residues must have a row in the model's embedding (config.json `vocab_size`). Tokenizer files
from another checkpoint (a larger vocabulary beside a model trained on fewer tokens) otherwise stop every worker
at its first batch with an index error, after planning.
"""
from __future__ import annotations

from ..errors import UserError

# The special tokens a run feeds the model: around the residues, for unknown residues, and a masked LM's mask.
# (The padding token is never a model input of the native engine, and published GPT-2-style tokenizers add one
# past the embedding that transformers never embeds unmasked, so it is left out.)
FED_SPECIAL = ("bos", "eos", "cls", "sep", "unk", "mask")


def check(name: str, config, tokenizer) -> None:
    """Refuse (UserError) a tokenizer whose residue tokens (one printable character each) or fed special tokens
    have ids at or past the model's `vocab_size`, naming them and the size."""
    from .hf_config import text_config
    size = getattr(text_config(config), "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        return
    fed = {token: i for token, i in tokenizer.get_vocab().items() if len(token) == 1 and token.isprintable()}
    for kind in FED_SPECIAL:
        token, i = getattr(tokenizer, f"{kind}_token", None), getattr(tokenizer, f"{kind}_token_id", None)
        if token is not None and isinstance(i, int):
            fed[str(token)] = i
    beyond = sorted((i, token) for token, i in fed.items() if i >= size)
    if beyond:
        listed = ", ".join(f"{token!r} (id {i})" for i, token in beyond[:10])
        more = f" and {len(beyond) - 10} more" if len(beyond) > 10 else ""
        raise UserError(f"--model {name}: its tokenizer gives token ids the model has no embedding for: {listed}{more}; "
                        f"config.json says vocab_size {size} (ids 0..{size - 1}). The tokenizer files do not belong "
                        "to these weights: put the checkpoint's own tokenizer files beside its config.json.")
