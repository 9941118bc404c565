"""The tokens a masked-LM score reads: how a residue is masked, and which tokens stand for each of the 20
standard amino acids as the model's input convention writes a residue. This is the one place that decides it,
from the tokenizer and the convention (never from a model's name): a letter and the tokenizer's mask token for
ESM-2/ESM-1b/ESM-1v and ProtBert; for SaProt, whose tokens pair a residue with a 3Di letter (`A#`), the residue
written as `#` beside its 3Di letter, and an amino acid's probability summed over its 21 pairings (SaProt's
own mutation scoring; models/conventions.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import UserError
from ..output.variant_list import AMINO_ACIDS
from .tokenization import SequenceTokenizer


@dataclass(frozen=True)
class ResidueTokens:
    mask: int                  # the token id a masked residue is written as
    amino_acids: np.ndarray    # int64 [20, P]: the token ids standing for each of AMINO_ACIDS, in that order
    # With P > 1 (paired tokens): each residue token's id -> the ids standing for its residue (absent: itself).
    pairings: dict[int, tuple[int, ...]] = field(default_factory=dict)

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
        if not convention.pairs_with:
            return cls(int(mask), np.asarray(ids_of([run_tokenizer.unit(a) for a in AMINO_ACIDS]), np.int64)[:, None])
        rows = np.asarray([ids_of([a + p for p in convention.pairs_with]) for a in AMINO_ACIDS], np.int64)
        pairings = {int(t): tuple(int(i) for i in row)
                    for t, row in zip(ids_of([run_tokenizer.unit(a) for a in AMINO_ACIDS]), rows)}
        return cls(int(mask), rows, pairings)

    def index(self) -> dict[str, int]:
        """Amino acid -> its column in a per-residue table (AMINO_ACIDS order)."""
        return {a: i for i, a in enumerate(AMINO_ACIDS)}

    def own(self, lp: torch.Tensor, tokens: np.ndarray) -> torch.Tensor:
        """`[n]`: log p of each row's residue, whose token is `tokens[i]`, from log-probabilities `lp [n, V]`."""
        if not self.pairings:
            return lp[torch.arange(len(tokens), device=lp.device), torch.from_numpy(tokens).to(lp.device)]
        width = self.amino_acids.shape[1]
        rows = [self.pairings.get(int(t), (int(t),)) for t in tokens]
        index = np.full((len(tokens), width), lp.shape[1], np.int64)   # lp.shape[1]: the -inf column below
        for i, row in enumerate(rows):
            index[i, :len(row)] = row
        return self._summed(lp, torch.from_numpy(index).to(lp.device))

    def table(self, lp: torch.Tensor) -> torch.Tensor:
        """`[n, 20]`: log p of each amino acid (AMINO_ACIDS order) on each row of `lp [n, V]`."""
        if not self.pairings:
            return lp[:, torch.from_numpy(self.amino_acids[:, 0]).to(lp.device)]
        index = torch.from_numpy(self.amino_acids).to(lp.device)   # [20, P]
        return torch.logsumexp(lp[:, index], dim=-1)

    @staticmethod
    def _summed(lp: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """logsumexp over each row's `index` entries; index lp.shape[1] reads -inf (a padded pairing)."""
        padded = torch.cat([lp, lp.new_full((lp.shape[0], 1), float("-inf"))], dim=1)
        return torch.logsumexp(padded.gather(1, index), dim=1)
