"""The tokens a masked-LM score reads: how a residue is masked, and which tokens stand for each of the 20
standard amino acids as the model's input convention writes a residue. This is the one place that decides it,
from the tokenizer and the convention (never from a model's name): a letter and the tokenizer's mask token for
ESM-2/ESM-1b/ESM-1v and ProtBert; for SaProt, whose tokens pair a residue with a 3Di letter (`A#`), the residue
written as `#` beside its 3Di letter, and an amino acid's probability summed over its 21 pairings (SaProt's
own mutation scoring; models/conventions.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from ..models.transfers import to_device
from ..output.variant_list import AMINO_ACIDS
from .tokenization import SequenceTokenizer


@dataclass(frozen=True)
class ResidueTokens:
    mask: int                  # the token id a masked residue is written as
    amino_acids: np.ndarray    # int64 [20, P]: the token ids standing for each of AMINO_ACIDS, in that order
    units: np.ndarray          # int64 [20]: the token the run writes for each of AMINO_ACIDS (P = 1: the same)

    @classmethod
    def of(cls, run_tokenizer: SequenceTokenizer) -> "ResidueTokens":
        """From the run's tokenizer: each residue's tokens are those of the text the run writes for it
        (SequenceTokenizer.unit), or of its pairings. UserError when the tokenizer lacks the mask or any amino
        acid's token."""
        tokenizer, convention = run_tokenizer.tokenizer, run_tokenizer.convention
        unk = tokenizer.unk_token_id

        def ids_of(texts: list[str]) -> list[int]:
            ids = [tokenizer.convert_tokens_to_ids(t) for t in texts]
            missing = [t for t, i in zip(texts, ids) if i is None or (i == unk and t != tokenizer.unk_token)]
            if missing:
                raise UserError(f"masked-LM scoring reads the token of each of the 20 standard amino acids; this "
                                f"tokenizer has none for {', '.join(repr(m) for m in missing)}")
            return ids

        if convention.masked_residue:
            mask = ids_of([run_tokenizer.unit(convention.masked_residue)])[0]
        else:
            mask = getattr(tokenizer, "mask_token_id", None)
            if mask is None:
                raise UserError("masked-LM scoring needs the model's mask token, and this tokenizer has none "
                                "(tokenizer_config.json sets no mask_token)")
        units = np.asarray(ids_of([run_tokenizer.unit(a) for a in AMINO_ACIDS]), np.int64)
        if not convention.pairs_with:
            return cls(int(mask), units[:, None], units)
        rows = np.asarray([ids_of([a + p for p in convention.pairs_with]) for a in AMINO_ACIDS], np.int64)
        return cls(int(mask), rows, units)

    def index(self) -> dict[str, int]:
        """Amino acid -> its column in a per-residue table (AMINO_ACIDS order)."""
        return {a: i for i, a in enumerate(AMINO_ACIDS)}

    def own(self, lp: torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
        """`[n]`: log p of each row's residue, whose token is `tokens[i]`, from log-probabilities `lp [n, V]`:
        with paired tokens, a standard residue's is its column of `table` (any other token reads itself)."""
        rows = torch.arange(len(tokens), device=lp.device)
        own = lp[rows, _sent(tokens, lp)]
        if self.amino_acids.shape[1] == 1:
            return own
        column = np.full(len(tokens), -1, np.int64)
        for i, unit in enumerate(self.units):
            column[tokens == unit] = i
        standard = _sent(column >= 0, lp)
        summed = self.table(lp)[rows, _sent(column.clip(min=0), lp)]
        return torch.where(standard, summed, own)

    def table(self, lp: torch.Tensor) -> torch.Tensor:
        """`[n, 20]`: log p of each amino acid (AMINO_ACIDS order) on each row of `lp [n, V]`."""
        if self.amino_acids.shape[1] == 1:
            return lp[:, _sent(self.amino_acids[:, 0], lp)]
        index = _sent(self.amino_acids, lp)   # [20, P]
        return torch.logsumexp(lp[:, index], dim=-1)


def _sent(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host index array on `like`'s device, sent without waiting for it (models/transfers.py)."""
    return to_device([array], like.device)[0]
