"""How a sequence's residues become the text a model's tokenizer reads (an input convention): as written,
space-separated for word-level vocabularies, rare residues written as X, a prefix, line breaks. Each family
in registry.py names its model card's convention; `--input-format` names one where none can be told.
Conventions whose input carries structure (SaProt's residue + 3Di pairs, ProstT5's 3Di strings) keep the
input's case and say which characters they read: structure_input.py holds them and decides when they apply."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

RARE_RESIDUES = re.compile(r"[UZOB]")
_PAIR = re.compile(r"[A-Z#][a-z#]|.", re.DOTALL)   # a residue letter and the structure letter after it, or one alone


@dataclass(frozen=True)
class Convention:
    name: str
    separator: str = ""          # between residues (" " for word-level tokenizers)
    unit_suffix: str = ""        # after every residue (SaProt's structure placeholder "#")
    upper: bool = False          # upper-cased first (ProstT5: lower case would mean 3Di states)
    rare_to_x: bool = False      # U, Z, O, B written as X (the cards of ProtT5, ProstT5, ProtBert)
    prefix: str = ""             # text before the residues (ProstT5's "<AA2fold> ")
    suffix: str = ""
    line_width: int = 0          # residues per line, 0 = one line (ProtGPT2's 60-residue FASTA lines)
    prefix_excluded: bool = False   # the prefix's tokens are left out of pooling and per-residue rows
    # Masked-LM scores (tasks/residue_tokens.py): a residue is masked by writing `masked_residue` in its place
    # ("" = the tokenizer's mask token), and where a residue's token pairs it with one of the letters
    # `pairs_with` (SaProt's 3Di states), an amino acid's probability is the sum over its pairings.
    masked_residue: str = ""
    pairs_with: str = ""
    # Input that carries structure (structure_input.py). `keeps_case`: the residues are read from the FASTA with
    # their case (case is meaning: 3Di letters are lower case), not upper-cased as the index gives them.
    # `paired_with`: each residue is two characters, a residue letter of `alphabet` and its structure letter of
    # these (SaProt's 'Mp', 'M#', '#p'): one token and one per-residue row. `alphabet`: the residue letters the
    # convention reads; a residue outside it is odd (its row gets status 2, as an unknown character's does).
    keeps_case: bool = False
    paired_with: str = ""
    alphabet: str = ""

    def text(self, residues: str) -> str:
        """The tokenizer's input for one sequence."""
        if self.upper:
            residues = residues.upper()
        if self.rare_to_x:
            residues = RARE_RESIDUES.sub("X", residues)
        if self.line_width:
            lines = [residues[i:i + self.line_width] for i in range(0, len(residues), self.line_width)]
            body = "\n".join(self._units(line) for line in lines)
        else:
            body = self._units(residues)
        return self.prefix + body + self.suffix

    def units(self, residues: str) -> list[str]:
        """Each residue's own text (upper-cased, rare residues as X, the per-residue suffix)."""
        if self.upper:
            residues = residues.upper()
        if self.rare_to_x:
            residues = RARE_RESIDUES.sub("X", residues)
        return [r + self.unit_suffix for r in self.residues(residues)]

    def residues(self, text: str) -> list[str]:
        """The residues of a sequence's text: its characters, or with `paired_with` a residue letter with the
        structure letter after it ('Mp'); a character that pairs with none stands alone (an odd residue)."""
        if not self.paired_with:
            return list(text)
        return _PAIR.findall(text)

    def count(self, text: str) -> int:
        """How many residues (per-residue rows) a sequence's text holds."""
        return len(self.residues(text)) if self.paired_with else len(text)

    def odd(self, text: str) -> int:
        """How many residues of `text` the convention does not read (outside `alphabet`, or a lone letter where
        residues are pairs); 0 where it names no alphabet."""
        if not self.alphabet:
            return 0
        if not self.paired_with:
            return len(text) - sum(text.count(c) for c in set(text) if c in self.alphabet)
        return sum(1 for r in self.residues(text)
                   if len(r) != 2 or r[0] not in self.alphabet or r[1] not in self.paired_with)

    def example(self, residues: str) -> str:
        """`residues` (upper-case amino acids) as this convention's input writes them: each with the no-structure
        letter '#' where residues are pairs, lower case for a lower-case alphabet (3Di)."""
        if self.paired_with:
            return "".join(r + "#" for r in residues)
        if self.alphabet and self.alphabet.islower():
            return residues.lower()
        return residues

    def _units(self, residues: str) -> str:
        if not self.separator and not self.unit_suffix:
            return residues
        return self.separator.join(r + self.unit_suffix for r in self.residues(residues))

    @property
    def one_unit_per_residue(self) -> bool:
        """Each residue is written as its own word or unit (spaced, or with a per-residue suffix)."""
        return bool(self.separator or self.unit_suffix)

    def words(self) -> str:
        """What the convention does, in words (run.log, docs/models.md)."""
        parts = ["residues space-separated" if self.separator == " " else
                 f"each residue followed by '{self.unit_suffix}'" if self.unit_suffix else
                 "each residue a residue letter and its 3Di letter as written ('Mp', 'M#', '#p')" if self.paired_with
                 else "residues as written"]
        if self.keeps_case:
            parts.append("case kept" + (" (3Di states in lower case)" if self.alphabet.islower() else ""))
        if self.upper:
            parts.append("upper-cased")
        if self.rare_to_x:
            parts.append("U/Z/O/B written as X")
        if self.line_width:
            parts.append(f"in lines of {self.line_width}")
        if self.prefix:
            parts.append(f"after the prefix {self.prefix!r}")
        if self.suffix:
            parts.append(f"before the suffix {self.suffix!r}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Convention":
        return cls(**data)   # fields an older run did not record take their defaults


PLAIN = Convention("plain")
SPACED = Convention("spaced", separator=" ")
# The cards of ProtT5 and ProtBert: " ".join(list(re.sub(r"[UZOB]", "X", sequence))).
SPACED_RARE_AS_X = Convention("spaced, U/Z/O/B as X", separator=" ", rare_to_x=True)
# ProstT5's card, amino acids to embed: "<AA2fold>" + " " + " ".join(list(sequence.upper())), rare as X.
PROSTT5_AA = Convention("ProstT5 <AA2fold>", separator=" ", upper=True, rare_to_x=True, prefix="<AA2fold> ",
                        prefix_excluded=True)
# SaProt's card: residue + 3Di letter per token; without a structure every 3Di letter is "#". Its mutation
# scoring (westlake-repl/SaProt, model/saprot/saprot_foldseek_mutation_model.py) masks a residue by writing "#"
# for the amino acid beside its 3Di letter, and sums an amino acid's probability over its 21 3Di pairings.
SAPROT_NO_STRUCTURE = Convention("SaProt residue#", unit_suffix="#", masked_residue="#",
                                 pairs_with="pynwrqhgdlvtmfsaeikc#")
# ProtGPT2's card (perplexity): FASTA lines of 60 residues between <|endoftext|> separators.
PROTGPT2_FASTA = Convention("ProtGPT2 FASTA lines", prefix="<|endoftext|>\n", suffix="\n<|endoftext|>",
                            line_width=60)

# --input-format values other than auto (config.INPUT_FORMATS), which takes the family's convention or the
# one its tokenizer shows (planning/tokenization_check.py); aa, saprot-sa and 3di are structure_input.py's.
BY_OPTION = {"plain": PLAIN, "spaced": SPACED}
