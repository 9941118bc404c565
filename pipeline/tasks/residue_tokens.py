"""The tokens a masked-LM score reads: the model's mask token, and the token of each of the 20 standard amino
acids as the model's input convention writes one residue. This is the one place that decides it, from the
tokenizer and the convention (never from a model's name): a letter for ESM-2/ESM-1b/ESM-1v and ProtBert,
the letter and SaProt's `#` structure placeholder (`A#`) for SaProt."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from ..output.variant_list import AMINO_ACIDS
from .tokenization import SequenceTokenizer


@dataclass(frozen=True)
class ResidueTokens:
    mask: int                  # the mask token's id
    amino_acids: np.ndarray    # int64 [20]: the token id of each of AMINO_ACIDS, in that order

    @classmethod
    def of(cls, run_tokenizer: SequenceTokenizer) -> "ResidueTokens":
        """From the run's tokenizer: each residue's token is that of the text the run writes for it
        (SequenceTokenizer.unit). UserError when the tokenizer lacks the mask or any amino acid's token."""
        tokenizer, unit = run_tokenizer.tokenizer, run_tokenizer.unit
        mask = getattr(tokenizer, "mask_token_id", None)
        if mask is None:
            raise UserError("masked-LM scoring needs the model's mask token, and this tokenizer has none "
                            "(tokenizer_config.json sets no mask_token)")
        ids = [tokenizer.convert_tokens_to_ids(unit(a)) for a in AMINO_ACIDS]
        unk = tokenizer.unk_token_id
        missing = [unit(a) for a, i in zip(AMINO_ACIDS, ids) if i is None or (i == unk and unit(a) != tokenizer.unk_token)]
        if missing:
            raise UserError(f"masked-LM scoring reads the token of each of the 20 standard amino acids; this "
                            f"tokenizer has none for {', '.join(repr(m) for m in missing)}")
        return cls(int(mask), np.asarray(ids, np.int64))

    def index(self) -> dict[str, int]:
        """Amino acid -> its column in a per-residue table (AMINO_ACIDS order)."""
        return {a: i for i, a in enumerate(AMINO_ACIDS)}
