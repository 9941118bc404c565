"""The model families: the one place that says, per family, how a checkpoint is recognised (config
model_type/architectures and the tokenizer's vocabulary, never its name or path), which engine runs it, which
tasks it supports, how residues become its input text, which transformers class the hf engine builds and which
tokens pooling leaves out. Engine choice, loading, limits, the CLI help and docs/models.md all read FAMILIES.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import UserError
from . import conventions as cv
from .checkpoint_facts import DYNAMIC_ROPE_TYPES, CheckpointFacts
from .conventions import Convention

CAUSAL_TASKS = ("embed", "score", "variants", "generate")
RAW_TEXT = "the sequence as text through the checkpoint's own tokenizer (the card's usage)"
ENCODER_TASKS = ("embed",)
MASKED_LM_TASKS = ("embed", "score", "variants")   # an encoder with its masked-LM head scores by masking


@dataclass(frozen=True)
class Family:
    key: str
    name: str
    recognised_by: str                   # in words (docs/models.md, run.log)
    matches: Callable[[CheckpointFacts], bool]
    native: str = ""                     # the native model that runs it ("esm", "llama", ...); "" = hf only
    convention: Convention | None = None   # None: told by the tokenizer (planning/tokenization_check.py)
    convention_source: str = ""          # where the convention comes from (its model card)
    hf_class: str = "AutoModel"          # what the hf engine builds for embed (AutoModelForCausalLM for score)
    hf_kwargs: dict = field(default_factory=dict)
    tokenizer_json: bool = False         # read tokenizer.json as written (AutoTokenizer would rebuild it)
    not_native: str = ""                 # why the native engine does not run it (hf-only families)
    position_table: Callable | None = None   # config -> tokens its learned position table holds (None: no table),
    #                                      where the family fixes where it is; unset: found by building the
    #                                      model on the meta device (hf_config.position_table_tokens), ~1 s
    causal: bool | None = False          # a causal LM (its text model, for Qwen3.5's multimodal checkpoints);
    #                                      None: told by its architecture names (hf_config.is_causal_lm)
    card: str = ""

    def supports_native(self, facts: CheckpointFacts) -> tuple[bool, str]:
        """(runs natively, why not): the family's native model, unless a config value keeps it off."""
        if not self.native:
            return False, self.not_native
        blocker = _native_blocker(self, facts)
        return blocker is None, blocker or ""


def _vocab_letters(facts: CheckpointFacts, *letters: str) -> bool:
    return facts.has_tokens(*letters)


def _is_kmer_vocab(facts: CheckpointFacts) -> bool:
    """A DNA k-mer vocabulary (Nucleotide Transformer's 6-mers)."""
    return sum(1 for t in facts.vocab if len(t) >= 3 and set(t) <= set("ACGTN")) >= 64


def _gpt2_protein(f: CheckpointFacts) -> bool:
    return f.model_type == "gpt2" and f.vocab.get("<|endoftext|>") == 0


def _no_position_table(config) -> None:
    """Positions by rotation (Llama, Qwen) or relative buckets (T5): no learned table to fill."""
    return None


def _esm_position_table(config) -> int | None:
    """ESM's learned table (ESM-1b, ESM-1v, Nucleotide Transformer; transformers' EsmEmbeddings builds it when
    position_embedding_type is absolute, its default), indexed from padding_idx + 1; ESM-2 rotates instead."""
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return None
    pad = getattr(config, "pad_token_id", None)
    return config.max_position_embeddings - (pad + 1 if pad is not None else 0)


_NO_POOLER = {"add_pooling_layer": False}   # embeddings are hidden states; the pooler head is never used

FAMILIES: tuple[Family, ...] = (
    # Protein and DNA encoders: embed.
    Family("saprot", "SaProt", "model_type esm; a vocabulary of residue+3Di pairs ('A#', 'Ap', ...)",
           lambda f: f.model_type == "esm" and f.has_tokens("A#", "L#"), native="esm",
           position_table=_esm_position_table, convention=cv.SAPROT_NO_STRUCTURE, hf_kwargs=_NO_POOLER,
           convention_source="amino acids alone: each 3Di letter is the '#' placeholder (card: 'M#E#V#...'); "
           "input written as residue + 3Di pairs is read as such (--input-format saprot-sa)",
           card="https://huggingface.co/westlake-repl/SaProt_650M_AF2"),
    Family("nucleotide_transformer", "Nucleotide Transformer v1", "model_type esm; a DNA 6-mer vocabulary",
           lambda f: f.model_type == "esm" and _is_kmer_vocab(f), native="esm", position_table=_esm_position_table,
           convention=cv.PLAIN, hf_kwargs=_NO_POOLER, convention_source="the raw DNA string; the tokenizer cuts "
           "6-mers (single nucleotides where it cannot); per-residue rows per nucleotide, each its token's state",
           card="https://huggingface.co/InstaDeepAI/nucleotide-transformer-500m-human-ref"),
    Family("esm", "ESM-2 / ESM-1b / ESM-1v", "model_type esm (after SaProt and Nucleotide Transformer)",
           lambda f: f.model_type == "esm", native="esm", position_table=_esm_position_table, convention=cv.PLAIN,
           hf_kwargs=_NO_POOLER,
           convention_source="raw residues (card: AutoTokenizer on the sequence)",
           card="https://huggingface.co/facebook/esm2_t33_650M_UR50D"),
    Family("prostt5", "ProstT5", "model_type t5; a vocabulary with '<AA2fold>'",
           lambda f: f.model_type == "t5" and f.has_tokens("<AA2fold>"), convention=cv.PROSTT5_AA,
           native="t5", position_table=_no_position_table, hf_class="T5EncoderModel",
           convention_source="card: '<AA2fold>' + ' ' + residues upper-cased and spaced, U/Z/O/B as X; the "
           "prefix token is not a residue; 3Di states in lower case after '<fold2AA>' (--input-format 3di)",
           card="https://huggingface.co/Rostlab/ProstT5"),
    Family("prott5", "ProtT5", "model_type t5; a SentencePiece vocabulary of word-initial residues ('▁A')",
           lambda f: f.model_type == "t5" and f.has_tokens("▁A", "▁L"), convention=cv.SPACED_RARE_AS_X,
           native="t5", position_table=_no_position_table, hf_class="T5EncoderModel",
           convention_source="card: ' '.join(list(re.sub(r'[UZOB]', 'X', sequence)))",
           card="https://huggingface.co/Rostlab/prot_t5_xl_half_uniref50-enc"),
    Family("ankh", "Ankh", "model_type t5; a single-letter residue vocabulary without '▁'",
           lambda f: f.model_type == "t5" and f.has_tokens("A", "L") and not f.has_tokens("▁A"),
           convention=cv.PLAIN, native="t5", position_table=_no_position_table, hf_class="T5EncoderModel",
           tokenizer_json=True,
           convention_source="card: the residues as single letters through the checkpoint's own tokenizer.json "
           "(one token per residue)", card="https://github.com/agemagician/Ankh"),
    Family("protbert", "ProtBert / ProtBert-BFD", "BERT (model_type or architecture); a word-level vocabulary "
           "of single residues with [CLS]", lambda f: f.model_type == "bert" and f.has_tokens("[CLS]", "L", "A"),
           convention=cv.SPACED_RARE_AS_X, hf_kwargs=_NO_POOLER, not_native="BERT runs on the hf engine",
           convention_source="card: re.sub(r'[UZOB]', 'X', ' '.join(sequence))",
           card="https://huggingface.co/Rostlab/prot_bert"),
    # Causal language models: embed, score, and generate on the native engine.
    Family("protgpt2", "ProtGPT2", "model_type gpt2 with '<|endoftext|>' at id 0", _gpt2_protein, causal=True,
           convention=cv.PROTGPT2_FASTA, not_native="GPT-2 runs on the hf engine",
           convention_source="card (perplexity): FASTA lines of 60 residues between <|endoftext|> separators",
           card="https://huggingface.co/nferruz/ProtGPT2"),
    Family("llama", "Llama 2 / 3.x", "model_type llama", lambda f: f.model_type == "llama", native="llama",
           position_table=_no_position_table, causal=True, convention=cv.PLAIN, convention_source=RAW_TEXT,
           card="https://huggingface.co/meta-llama/Llama-3.2-1B"),
    Family("qwen3", "Qwen3", "model_type qwen3", lambda f: f.model_type == "qwen3", native="qwen3",
           position_table=_no_position_table, causal=True, convention=cv.PLAIN, convention_source=RAW_TEXT,
           card="https://huggingface.co/Qwen/Qwen3-0.6B"),
    Family("qwen3_5", "Qwen3.5 (and the demo model)", "model_type qwen3_5 or qwen3_5_text",
           lambda f: f.model_type in ("qwen3_5", "qwen3_5_text"), native="qwen3_5",
           position_table=_no_position_table, causal=True, convention=cv.PLAIN, convention_source=RAW_TEXT),
    Family("mistral", "Mistral", "model_type mistral", lambda f: f.model_type == "mistral",
           position_table=_no_position_table, causal=True, convention=cv.PLAIN, convention_source=RAW_TEXT,
           not_native="its sliding-window attention is not in the native engine",
           card="https://huggingface.co/mistralai/Mistral-7B-v0.1"),
    Family("qwen2", "Qwen2 / Qwen2.5", "model_type qwen2", lambda f: f.model_type == "qwen2",
           position_table=_no_position_table, causal=True, convention=cv.PLAIN, convention_source=RAW_TEXT,
           not_native="Qwen2's attention biases are not in the native engine",
           card="https://huggingface.co/Qwen/Qwen2.5-0.5B"),
    Family("gpt2", "GPT-2", "model_type gpt2", lambda f: f.model_type == "gpt2", causal=True, convention=cv.PLAIN,
           convention_source=RAW_TEXT, not_native="GPT-2 runs on the hf engine"),
)
# Checkpoints with their own Python code (config.json or tokenizer_config.json auto_map): DNABERT-2,
# HyenaDNA, Caduceus, ProGen2's original code. Only with --trust-remote-code, on the hf engine.
REMOTE_CODE = Family("remote_code", "remote code (DNABERT-2, HyenaDNA, Caduceus, ProGen2, ...)",
                     "an auto_map in config.json or tokenizer_config.json", lambda f: bool(f.remote_code),
                     causal=None, not_native="its model is the checkpoint's own Python code, which only "
                     "transformers runs (--trust-remote-code)")
# Any other architecture transformers knows: the hf engine, the convention told by its tokenizer.
OTHER = Family("other", "any other transformers model", "none of the above; transformers knows its "
               "model_type", lambda f: True, causal=None,
               not_native="not one of the native engine's architectures")


def recognise(facts: CheckpointFacts) -> Family:
    """The family of a checkpoint, from its files alone."""
    if facts.remote_code:
        return REMOTE_CODE
    for family in FAMILIES:
        if family.matches(facts):
            return family
    return OTHER


def tasks(is_causal: bool, engine: str, masked_lm: bool = False) -> tuple[str, ...]:
    """What a checkpoint can do on an engine: causal LMs embed, score and score variants, and generate on the
    native engine; masked LMs with their head embed, score and score variants; other encoders embed."""
    if not is_causal:
        return MASKED_LM_TASKS if masked_lm else ENCODER_TASKS
    return CAUSAL_TASKS if engine == "native" else tuple(t for t in CAUSAL_TASKS if t != "generate")


def _native_blocker(family: Family, facts: CheckpointFacts) -> str | None:
    """A config value the native model does not run, named with its field; None when it runs."""
    text = facts.text_config
    kind, where = facts.rope()
    if kind in DYNAMIC_ROPE_TYPES:
        params = text.get(where.split(".")[0]) or {}
        start = (params.get("original_max_position_embeddings") or text.get("original_max_position_embeddings")
                 or text.get("max_position_embeddings"))
        how = ("the batch's longest sequence" if kind == "longrope" else "the longest sequence run so far")
        return (f"config.json {where} is '{kind}': its rotary frequencies depend on each sequence's length at "
                f"run time, which the native engine does not compute (on hf, transformers computes them from "
                f"{how} once past {start} positions, so rows of longer sequences depend on what ran with them)")
    if family.native == "esm":
        if text.get("is_decoder"):
            return "config.json is_decoder is true: ESM as a decoder is not in the native engine"
        position = text.get("position_embedding_type", "absolute")
        if position not in ("rotary", "absolute"):
            return f"config.json position_embedding_type is '{position}': not in the native engine"
    if family.native in ("llama", "qwen3"):
        layer_types = set(text.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"} or (text.get("sliding_window") and text.get("use_sliding_window", True)):
            return "config.json sliding_window/layer_types ask for sliding-window attention, not in the native engine"
    return None


def load_model(path: str, device, dtype, family: Family | None = None):
    """The native model of the checkpoint at `path` (a NativeModel on `device` in `dtype`)."""
    from transformers import AutoConfig

    from .checkpoint_facts import read_facts
    from .hf_config import text_config
    facts = read_facts(path)
    family = family or recognise(facts)
    runs, why = family.supports_native(facts)
    if not runs:
        raise UserError(f"--engine native does not run this checkpoint ({family.name}): {why}; use --engine hf")
    config = AutoConfig.from_pretrained(path)
    if family.native == "qwen3_5":
        from .qwen3_5 import Qwen3_5Model
        return Qwen3_5Model.from_checkpoint(path, text_config(config), device, dtype)
    if family.native == "esm":
        from .esm import EsmModel
        return EsmModel.from_checkpoint(path, config, device, dtype)
    if family.native == "t5":   # the encoder, of T5EncoderModel or whole T5 checkpoints
        from .t5 import T5Encoder
        return T5Encoder.from_checkpoint(path, config, device, dtype)
    from .llama import LlamaModel
    return LlamaModel.from_checkpoint(path, config, device, dtype, facts.architecture,
                                      qk_norm=family.native == "qwen3")


def families_help() -> str:
    """The families line of `run --help` (--engine)."""
    native = ", ".join(f.name for f in FAMILIES if f.native)
    return f"native: our engine ({native}); hf: transformers (any other architecture, docs/models.md)"
