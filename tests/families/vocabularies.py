"""The published vocabularies of the protein and DNA families, token by token in id order.

Each list is the published file's content (vocab.txt lines, SentencePiece pieces, added tokens); the source of
each is in FAMILIES.md. They are small enough to carry whole, so the tiny checkpoints tokenize exactly as the
published ones do.
"""
from __future__ import annotations

import itertools

# ESM-1b / ESM-1v / ESM-2 vocab.txt (facebook/esm2_t6_8M_UR50D and siblings; fair-esm's Alphabet "ESM-1b").
ESM_SPECIALS = ["<cls>", "<pad>", "<eos>", "<unk>"]
ESM_RESIDUES = list("LAGVSERTIDPKQNFYMHWCXBUZO")
ESM_VOCAB = ESM_SPECIALS + ESM_RESIDUES + [".", "-", "<null_1>", "<mask>"]

# ProtBert / ProtBert-BFD vocab.txt (Rostlab/prot_bert, Rostlab/prot_bert_bfd: identical files).
PROTBERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("LAGVESIKRDTPNQFYMHCWXUBZO")

# ProtT5 spiece.model pieces (Rostlab/prot_t5_xl_uniref50, ..._half_uniref50-enc): <pad> </s> <unk>, then the
# 25 residues as word-initial pieces "▁A" in UniRef frequency order; ids 28..127 are T5's 100 sentinels.
T5_RESIDUES = "ALGVSREDTIPKFQNYMHWCXBOUZ"
PROTT5_PIECES = ["<pad>", "</s>", "<unk>"] + ["▁" + r for r in T5_RESIDUES]
PROTT5_EXTRA_IDS = 100

# ProstT5 added_tokens.json (Rostlab/ProstT5): Foldseek's 3Di states as lowercase letters at 128..147, in the
# order of the first 20 ProtT5 residues, then the two direction tokens.
PROSTT5_3DI = [r.lower() for r in T5_RESIDUES[:20]]
PROSTT5_ADDED = {token: 128 + i for i, token in enumerate(PROSTT5_3DI)} | {"<fold2AA>": 148, "<AA2fold>": 149}

# Ankh tokenizer.json (ElnaggarLab/ankh-base, -large): a Unigram model over the same letters at the same ids as
# ProtT5 but WITHOUT the "▁" word marker; the rest of its 144 entries are sentinels (count inferred from
# vocab_size 144; see FAMILIES.md).
ANKH_PIECES = ["<pad>", "</s>", "<unk>"] + list(T5_RESIDUES)
ANKH_VOCAB_SIZE = 144

# SaProt vocab.txt (westlake-repl/SaProt_650M_AF2): 5 specials, then every (residue, 3Di state) pair, residue
# outer, in SaProt's foldseek_seq_vocab x foldseek_struc_vocab order; "#" is the "unknown" placeholder on
# either side.
SAPROT_SEQ = "ACDEFGHIKLMNPQRSTVWY#"
SAPROT_STRUC = "pynwrqhgdlvtmfsaeikc#"
SAPROT_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"] + [a + b for a, b in itertools.product(SAPROT_SEQ,
                                                                                                       SAPROT_STRUC)]

# Nucleotide Transformer v1 vocab.txt (InstaDeepAI/nucleotide-transformer-500m-human-ref): 4 specials (no
# <eos>/<bos> in the HF files: it tokenizes without an end token), the 4,096 6-mers over A,T,C,G in
# itertools.product order, then the single nucleotides used when a 6-mer cannot be formed.
NT_NUCLEOTIDES = "ATCG"
NT_VOCAB = (["<unk>", "<pad>", "<mask>", "<cls>"]
            + ["".join(k) for k in itertools.product(NT_NUCLEOTIDES, repeat=6)] + list(NT_NUCLEOTIDES) + ["N"])



def check_sizes() -> None:
    """The published sizes these lists must have (config.json vocab_size of each family)."""
    assert len(ESM_VOCAB) == 33 and len(PROTBERT_VOCAB) == 30 and len(SAPROT_VOCAB) == 446
    assert len(PROTT5_PIECES) + PROTT5_EXTRA_IDS == 128 and max(PROSTT5_ADDED.values()) == 149
    assert len(NT_VOCAB) == 4105
