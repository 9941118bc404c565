"""Each family's model card usage in transformers, as the card writes it (its tokenizer and model classes, its
preprocessing, its pooling over residues only), as the reference run_shards' fidelity tests compare with.

`embed(ckpt_dir, sequences, dtype)` gives per sequence (per_residue [L, D], mean [D]) from the final hidden state
(after the final norm): a row per residue, the state of the token that covers it (a token of several residues,
a k-mer or a BPE oligomer, on each of them; a line break on none), and the mean over the non-special tokens,
which for a tokenizer with a token per residue is the mean of those rows; `score(ckpt_dir, sequences, dtype)`
gives per sequence (sum of log p(token | preceding tokens) over non-special tokens that have a preceding token,
their count), as docs/DESIGN.md defines logprob_sum; `perplexity` the card's exp(model(ids, labels=ids).loss).
The card is chosen from the checkpoint's files (`recognise`), never from its name or path. One sequence per
forward call (a card's batch of one), so padding plays no part.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .recognise import recognise

Embedding = tuple[torch.Tensor, torch.Tensor]


@contextlib.contextmanager
def _precision(dtype: torch.dtype) -> Iterator[None]:
    """float64 runs inside tests/float64_reference.float64_everywhere: transformers computes norms, rotary
    angles and log-softmax in float32 even for a float64 model, which would cap the reference's accuracy."""
    if dtype == torch.float64:
        from tests.float64_reference import float64_everywhere
        with float64_everywhere(), torch.no_grad():
            yield
    else:
        with torch.no_grad():
            yield


def _rare_to_x(seq: str) -> str:
    return re.sub(r"[UZOB]", "X", seq)


def _residues(out: torch.Tensor, start: int, length: int, end: int = 1) -> Embedding:
    """Rows start..start+length of a [1, T, D] output whose T must be start + length + end (prefix, one token
    per residue, end token): a tokenizer that merged or dropped residues (a run of unknown characters is one
    <unk> for vocab.txt tokenizers) would otherwise misalign every later row without a word."""
    if out.shape[1] != start + length + end:
        raise ValueError(f"{out.shape[1]} tokens for {length} residues (expected {start} + {length} + {end}): "
                         f"the tokenizer did not give one token per residue")
    per_residue = out[0, start:start + length]
    return per_residue, per_residue.mean(0)


def _esm(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/docs/transformers/model_doc/esm, where the ESM-2 cards point (AutoTokenizer +
    # EsmModel, raw residues) and
    # https://github.com/facebookresearch/esm#quickstart: per-protein = mean of token_representations[i, 1:L+1],
    # "token 0 is always a beginning-of-sequence token" and the <eos> after the last residue is left out.
    from transformers import AutoTokenizer, EsmModel
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = EsmModel.from_pretrained(ckpt, dtype=dtype, add_pooling_layer=False).eval()
    return [_residues(model(**tokenizer(s, return_tensors="pt")).last_hidden_state, 1, len(s)) for s in seqs]


def _prott5(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/Rostlab/prot_t5_xl_half_uniref50-enc: T5Tokenizer(do_lower_case=False),
    # T5EncoderModel, " ".join(list(re.sub(r"[UZOB]", "X", sequence))), emb_0 = last_hidden_state[0, :7] for a
    # 7-residue protein (the trailing </s> left out), per-protein = emb_0.mean(dim=0). The U50 card itself calls
    # T5Model without decoder inputs, which transformers refuses (FAMILIES.md); its encoder is used the same way.
    from transformers import T5EncoderModel, T5Tokenizer
    tokenizer = T5Tokenizer.from_pretrained(ckpt, do_lower_case=False)
    model = T5EncoderModel.from_pretrained(ckpt, dtype=dtype).eval()
    texts = [" ".join(list(_rare_to_x(s))) for s in seqs]
    return [_residues(model(**tokenizer(t, return_tensors="pt")).last_hidden_state, 0, len(s))
            for s, t in zip(seqs, texts)]


def _prostt5(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/Rostlab/ProstT5: amino acids upper-case, spaced, rare residues to X, then
    # "<AA2fold>" + " " + s; emb_0 = last_hidden_state[0, 1:8] for 7 residues (prefix and </s> left out).
    from transformers import T5EncoderModel, T5Tokenizer
    tokenizer = T5Tokenizer.from_pretrained(ckpt, do_lower_case=False)
    model = T5EncoderModel.from_pretrained(ckpt, dtype=dtype).eval()
    texts = ["<AA2fold>" + " " + " ".join(list(_rare_to_x(s.upper()))) for s in seqs]
    return [_residues(model(**tokenizer(t, return_tensors="pt")).last_hidden_state, 1, len(s))
            for s, t in zip(seqs, texts)]


def _ankh(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://github.com/agemagician/Ankh#usage: ankh.load_base_model() = T5EncoderModel + AutoTokenizer;
    # protein_sequences = [list(seq) ...]; batch_encode_plus(..., add_special_tokens=True,
    # is_split_into_words=True). Under transformers 5 AutoTokenizer puts "▁" before every word and Ankh's
    # vocabulary has none, so that literal call yields <unk> before each residue (FAMILIES.md); the card's
    # meaning, its checkpoint's own tokenizer.json pipeline (what transformers 4 ran), is used here.
    from tokenizers import Tokenizer
    from transformers import T5EncoderModel
    pipeline = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = T5EncoderModel.from_pretrained(ckpt, dtype=dtype).eval()
    out = []
    for s in seqs:
        ids = torch.tensor([pipeline.encode(list(s), is_pretokenized=True).ids])
        out.append(_residues(model(input_ids=ids).last_hidden_state, 0, len(s)))
    return out


def _protbert(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/Rostlab/prot_bert: BertTokenizer.from_pretrained(..., do_lower_case=False),
    # BertModel, residues space-separated ("A E T C Z A O") with re.sub(r"[UZOB]", "X", ...); [CLS] and [SEP]
    # left out of the per-residue rows.
    from transformers import BertModel, BertTokenizer
    tokenizer = BertTokenizer.from_pretrained(ckpt, do_lower_case=False)
    model = BertModel.from_pretrained(ckpt, dtype=dtype, add_pooling_layer=False).eval()
    texts = [_rare_to_x(" ".join(list(s))) for s in seqs]
    return [_residues(model(**tokenizer(t, return_tensors="pt")).last_hidden_state, 1, len(s))
            for s, t in zip(seqs, texts)]


def _saprot(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/westlake-repl/SaProt_650M_AF2: EsmTokenizer + EsmForMaskedLM on "M#EvVpQpL#..."
    # (residue + 3Di letter per token); with no structure every 3Di letter is the placeholder "#".
    from transformers import EsmForMaskedLM, EsmTokenizer
    tokenizer = EsmTokenizer.from_pretrained(ckpt)
    model = EsmForMaskedLM.from_pretrained(ckpt, dtype=dtype).eval()
    texts = ["".join(r + "#" for r in s) for s in seqs]
    return [_residues(model.esm(**tokenizer(t, return_tensors="pt")).last_hidden_state, 1, len(s))
            for s, t in zip(seqs, texts)]


def _nucleotide_transformer(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
    # https://huggingface.co/InstaDeepAI/nucleotide-transformer-500m-human-ref: AutoTokenizer +
    # AutoModelForMaskedLM on the raw DNA string (6-mers, then single nucleotides where a 6-mer cannot be
    # formed), no <eos>. A row per nucleotide: its token's state (a 6-mer's on each of its six); the card's own
    # mean also counts <cls> (its attention mask); here <cls> is left out as DESIGN.md's mean is (FAMILIES.md).
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForMaskedLM.from_pretrained(ckpt, dtype=dtype).eval()
    out = []
    for s in seqs:
        ids = tokenizer(s, return_tensors="pt")
        tokens = tokenizer.convert_ids_to_tokens(ids.input_ids[0])
        if tokens[0] != tokenizer.cls_token or "".join(tokens[1:]) != s:
            raise ValueError(f"{s!r} is not <cls> and its nucleotides' tokens: {tokens}")
        hidden = model.esm(**ids).last_hidden_state[0, 1:]
        rows = hidden.repeat_interleave(torch.tensor([len(t) for t in tokens[1:]]), dim=0)
        out.append((rows, hidden.mean(0)))
    return out


def _residue_chars(text: str, seq: str, card: str) -> list[int]:
    """Where each residue of `seq` sits in the card's text of it: after ProtGPT2's "<|endoftext|>\n", one
    line break per 60 residues before it; in the plain text, at its own position."""
    if card != "protgpt2":
        return list(range(len(seq)))
    start = len("<|endoftext|>\n")
    at = [start + r + r // 60 for r in range(len(seq))]
    assert "".join(text[i] for i in at) == seq
    return at


def _causal_lm(card: str) -> Callable[[Path, Sequence[str], torch.dtype], list[Embedding]]:
    """A causal LM's hidden states as its card feeds it (ProtGPT2's FASTA-like text, the others' tokenizer on
    the residues), AutoModel's last_hidden_state (after the final norm): each residue takes the state of the
    token whose characters (the fast tokenizer's offsets) hold it."""
    def embed(ckpt: Path, seqs: Sequence[str], dtype: torch.dtype) -> list[Embedding]:
        from transformers import AutoModel, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModel.from_pretrained(ckpt, dtype=dtype).eval()
        special = set(tokenizer.all_special_ids)
        out = []
        for s in seqs:
            text = protgpt2_text(s) if card == "protgpt2" else s
            enc = tokenizer(text, return_offsets_mapping=True, return_tensors="pt")
            hidden = model(input_ids=enc.input_ids).last_hidden_state[0]
            offsets = enc.offset_mapping[0].tolist()
            content = torch.tensor([t not in special for t in enc.input_ids[0].tolist()])
            covering = []
            for char in _residue_chars(text, s, card):
                (token,) = [k for k, (a, b) in enumerate(offsets) if a <= char < b and content[k]]
                covering.append(token)
            out.append((hidden[covering], hidden[content].mean(0)))
        return out
    return embed


_EMBED: dict[str, Callable[[Path, Sequence[str], torch.dtype], list[Embedding]]] = {
    "esm": _esm, "prott5": _prott5, "prostt5": _prostt5, "ankh": _ankh, "protbert": _protbert,
    "saprot": _saprot, "nucleotide_transformer": _nucleotide_transformer, "protgpt2": _causal_lm("protgpt2"),
    "causal_lm": _causal_lm("causal_lm")}


# Tokens before a sequence's residues in each encoder card's usage above (the `start` of its rows): a special
# token (<cls>, [CLS]) or a prefix the card leaves out of the rows (ProstT5's <AA2fold>).
_BEFORE_RESIDUES = {"esm": 1, "prott5": 0, "prostt5": 1, "ankh": 0, "protbert": 1, "saprot": 1,
                    "nucleotide_transformer": 1}


def tokens_before_residues(ckpt_dir: str | Path) -> int:
    return _BEFORE_RESIDUES[recognise(Path(ckpt_dir))]


def embed(ckpt_dir: str | Path, sequences: Sequence[str], dtype: torch.dtype = torch.float32) -> list[Embedding]:
    """Per sequence (per_residue [L, D], mean [D]) as the checkpoint's family card computes them."""
    ckpt = Path(ckpt_dir)
    card = recognise(ckpt)
    if card not in _EMBED:
        raise ValueError(f"{ckpt}: recognised as {card!r}, which has no embedding usage in its card")
    with _precision(dtype):
        return [(r.to(dtype), m.to(dtype)) for r, m in _EMBED[card](ckpt, sequences, dtype)]


def protgpt2_text(seq: str) -> str:
    """ProtGPT2's card form (https://huggingface.co/nferruz/ProtGPT2, perplexity example): FASTA-like lines
    of 60 residues, between <|endoftext|> separators."""
    return "<|endoftext|>\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)) + "\n<|endoftext|>"


def score(ckpt_dir: str | Path, sequences: Sequence[str],
          dtype: torch.dtype = torch.float32) -> list[tuple[float, int]]:
    """Per sequence (logprob_sum, num_scored) with AutoTokenizer + AutoModelForCausalLM as the Llama, Mistral,
    Qwen and ProtGPT2 cards load them; the tokenizer adds BOS where the family does (Llama, Mistral), none
    for Qwen (its first token is then not scored) or ProtGPT2 (whose card text starts with <|endoftext|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt = Path(ckpt_dir)
    card = recognise(ckpt)
    if card not in ("causal_lm", "protgpt2"):
        raise ValueError(f"{ckpt}: recognised as {card!r}, not a causal language model")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    special = set(tokenizer.all_special_ids)
    results = []
    with _precision(dtype):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        for s in sequences:
            ids = tokenizer(protgpt2_text(s) if card == "protgpt2" else s, return_tensors="pt").input_ids
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].to(dtype), dim=-1)
            token_logp = logp.gather(1, ids[0, 1:, None])[:, 0]
            # (bool even when empty: a one-token sequence, Qwen's single residue, has no token to score)
            scored = torch.tensor([t not in special for t in ids[0, 1:].tolist()], dtype=torch.bool)
            results.append((float(token_logp[scored].sum()), int(scored.sum())))
    return results


def card_losses(ckpt_dir: str | Path, sequences: Sequence[str], dtype: torch.dtype = torch.float32
                ) -> list[tuple[float, int]]:
    """Per sequence (loss, tokens averaged) as ProtGPT2's calculatePerplexity (https://huggingface.co/nferruz/ProtGPT2)
    computes the loss: `input_ids = torch.tensor(tokenizer.encode(sequence)).unsqueeze(0)`, `outputs =
    model(input_ids, labels=input_ids)`, `outputs[0]`, on its card's text; the other causal LMs the same on their
    tokenizer's encoding of the residues (Llama 3's adds <|begin_of_text|>, no end token). The loss averages every
    token after the first, the end token included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ckpt = Path(ckpt_dir)
    card = recognise(ckpt)
    if card not in ("causal_lm", "protgpt2"):
        raise ValueError(f"{ckpt}: recognised as {card!r}, not a causal language model")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    results = []
    with _precision(dtype):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
        for s in sequences:
            input_ids = torch.tensor(tokenizer.encode(protgpt2_text(s) if card == "protgpt2" else s)).unsqueeze(0)
            outputs = model(input_ids, labels=input_ids)
            results.append((float(outputs[0]), input_ids.shape[1] - 1))
    return results


def perplexity(ckpt_dir: str | Path, sequences: Sequence[str], dtype: torch.dtype = torch.float32) -> list[float]:
    """Per sequence the card's perplexity, `math.exp(outputs[0])` (card_losses)."""
    import math
    return [math.exp(loss) for loss, _ in card_losses(ckpt_dir, sequences, dtype)]


def log_likelihood(ckpt_dir: str | Path, sequences: Sequence[str], dtype: torch.dtype = torch.float32) -> list[float]:
    """Per sequence the card's log-likelihood: its loss (card_losses) times the tokens it averages, so a variant's
    log-likelihood ratio is the difference of two of these."""
    return [-loss * n for loss, n in card_losses(ckpt_dir, sequences, dtype)]
