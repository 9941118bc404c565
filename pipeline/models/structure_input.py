"""Input that carries structure, for checkpoints whose vocabulary reads it, told by the vocabulary (never by a
model's name or path):

- a vocabulary of residue + 3Di pairs (SaProt's 441 tokens 'Mp', 'M#', '#p', ...): a structure-aware
  sequence pairs each residue (upper case, '#' where unknown) with its Foldseek 3Di letter (lower case, '#'
  where there is no structure), 'MdEvVp...' or 'M#E#V#...', and is tokenized as written (SaProt's card:
  `"".join(seq + struc)` pairs through its EsmTokenizer), one token and one per-residue row per pair. Amino
  acids alone are written as SaProt's card writes a sequence without structure: each residue with '#'.
- a vocabulary with 3Di states and '<fold2AA>' (ProstT5's): 3Di strings are lower case, space-separated
  after the prefix '<fold2AA>', amino acids upper case after '<AA2fold>' (ProstT5's card decides by case:
  `"<AA2fold>" + " " + s if s.isupper() else "<fold2AA>" + " " + s`).

`--input-format auto` looks at the sample the tokenization check reads (planning/tokenization_check.py), with
its case: every sampled sequence written as structure (a lower-case letter, or '#' for SaProt) gives the
structure form, none gives amino acids, and both in one input are refused naming the option that says which it
is. `--input-format saprot-sa`, `3di` and `aa` say so outright. In the structure forms a residue the form does
not read (a lone letter where residues are pairs, an upper-case letter in a 3Di string, a letter of no 3Di
state) is odd: its row is computed as the tokenizer reads it and gets status 2, as an unknown character's does.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .conventions import PROSTT5_AA, SAPROT_NO_STRUCTURE, Convention

SAPROT_RESIDUES = "ACDEFGHIKLMNPQRSTVWY#"   # SaProt's foldseek_seq_vocab ('#': the residue is unknown)
THREE_DI = "pynwrqhgdlvtmfsaeikc"           # Foldseek's 20 3Di states, in SaProt's foldseek_struc_vocab order
PROSTT5_3DI_LETTERS = "".join(sorted(THREE_DI))

# SaProt's card: residue + 3Di letter per token, as written ('#' for no structure).
SAPROT_SA = Convention("SaProt structure-aware", keeps_case=True, paired_with=THREE_DI + "#",
                       alphabet=SAPROT_RESIDUES)
# ProstT5's card, 3Di to embed: "<fold2AA>" + " " + " ".join(list(s)) with s in lower case.
PROSTT5_3DI = Convention("ProstT5 <fold2AA>", separator=" ", keeps_case=True, alphabet=PROSTT5_3DI_LETTERS,
                         prefix="<fold2AA> ", prefix_excluded=True)

AMINO_ACIDS_OPTION = "aa"


@dataclass(frozen=True)
class StructureVocabulary:
    what: str                # in messages
    option: str              # the --input-format value of its structure form
    structure: Convention    # its structure form
    amino_acids: Convention  # amino acids as its card writes them
    form: str                # how its structure input looks, in messages
    marks: str               # characters besides lower-case letters that make a sequence structure input

    def structural(self, text: str) -> bool:
        """The sequence is written in the structure form (a lower-case letter, or a mark such as SaProt's '#')."""
        return any(c.islower() or c in self.marks for c in text)


SAPROT = StructureVocabulary("a vocabulary of residue+3Di pairs ('Mp', 'M#', '#p': SaProt's)", "saprot-sa",
                             SAPROT_SA, SAPROT_NO_STRUCTURE,
                             "residue + 3Di letter pairs, e.g. 'MdEvVp' or 'M#E#V#'", "#")
PROSTT5 = StructureVocabulary("a vocabulary of 3Di states with '<fold2AA>' (ProstT5's)", "3di", PROSTT5_3DI,
                              PROSTT5_AA, "3Di states in lower case, e.g. 'dvvlvv'", "")
OPTIONS = (AMINO_ACIDS_OPTION, SAPROT.option, PROSTT5.option)   # the --input-format values of this module


def vocabulary(tokenizer) -> StructureVocabulary | None:
    """The structure-reading vocabulary `tokenizer` has, or None."""
    vocab = tokenizer.get_vocab()
    if all(a + b in vocab for a in SAPROT_RESIDUES for b in THREE_DI + "#"):
        return SAPROT
    if "<fold2AA>" in vocab and "<AA2fold>" in vocab and all(c in vocab for c in PROSTT5_3DI_LETTERS):
        return PROSTT5
    return None


def choose(tokenizer, input_format: str, texts: list[str], ids: list[str], model: str) -> tuple[Convention, str] | None:
    """(the convention, why) where the input form is this module's to decide: `input_format` is one of OPTIONS,
    or `auto` for a structure-reading vocabulary; None otherwise. `texts` are the sampled sequences with their
    case, `ids` their ids, `model` names the checkpoint in messages. UserError for an option the vocabulary does
    not read, or a sample holding both forms under `auto`."""
    found = vocabulary(tokenizer)
    if input_format in OPTIONS:
        if found is None:
            raise UserError(f"--input-format {input_format}: {model} has no vocabulary that reads structure (neither "
                            f"{SAPROT.what} nor {PROSTT5.what}), so its input is amino acids (or DNA) as its card "
                            "writes them: leave out --input-format (or give plain or spaced).")
        if input_format == AMINO_ACIDS_OPTION:
            return found.amino_acids, f"--input-format {input_format} (amino acids, as its card writes them)"
        if input_format != found.option:
            other = SAPROT if found is PROSTT5 else PROSTT5
            raise UserError(f"--input-format {input_format} is for a checkpoint with {other.what}; {model} has "
                            f"{found.what}: give --input-format {found.option} for its structure input "
                            f"({found.form}) or --input-format {AMINO_ACIDS_OPTION} for amino acids.")
        return found.structure, f"--input-format {input_format}"
    if input_format != "auto" or found is None:
        return None
    structural = [found.structural(t) for t in texts]
    if texts and all(structural):
        return found.structure, (f"{model} has {found.what}, and every sampled sequence is written as structure "
                                 f"({found.form}; --input-format {found.option})")
    if any(structural):
        shown = lambda flag: ", ".join([f"'{i}'" for i, s in zip(ids, structural) if s == flag][:3])  # noqa: E731
        raise UserError(
            f"--model {model} has {found.what}, and the input holds both forms: {sum(structural)} of "
            f"{len(texts)} sampled sequences are written as structure ({found.form}; e.g. {shown(True)}), the "
            f"others as amino acids (e.g. {shown(False)}). A run reads one form: pass --input-format {found.option} "
            f"(structure) or --input-format {AMINO_ACIDS_OPTION} (amino acids), with a FASTA of that form.")
    return found.amino_acids, f"{model} has {found.what}; the sampled sequences are amino acids"


def alternatives(tokenizer) -> list[tuple[str, Convention]]:
    """(--input-format value, convention) of the forms a structure-reading vocabulary reads (none for others)."""
    found = vocabulary(tokenizer)
    return [] if found is None else [(AMINO_ACIDS_OPTION, found.amino_acids), (found.option, found.structure)]


def refusal_hint(convention: Convention) -> str | None:
    """What to do when input given as this structure form is odd in bulk, beyond another --input-format."""
    if convention == PROSTT5_3DI:
        return ("if the input is 3Di written in upper case (as Foldseek writes it), lower-case its sequence lines "
                "first (ProstT5 reads 3Di states in lower case), e.g. "
                "`awk '/^>/ {print; next} {print tolower($0)}' in.fa > in.3di.fa`")
    return None


def check_task(convention: Convention, task: str) -> None:
    """Structure input is embedded; the masked-LM scores read amino acids (SaProt's mutation scoring writes a
    masked residue '#' beside its 3Di letter, per position), which this run does not do for it."""
    if convention in (SAPROT_SA, PROSTT5_3DI) and task != "embed":
        raise UserError(f"--task {task} on structure input ({convention.words()}) is not supported: its "
                        f"scores read amino acids. Use --task embed, or score the amino acids alone "
                        f"(--input-format {AMINO_ACIDS_OPTION}, a FASTA of residues without 3Di letters).")
