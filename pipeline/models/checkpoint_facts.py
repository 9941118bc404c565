"""What a checkpoint directory's files say before transformers builds anything: config.json as written, the
tokenizer's vocabulary (vocab.txt, vocab.json, tokenizer.json, SentencePiece's spiece.model, added tokens)
and whether it asks to run its own Python code. The family registry recognises checkpoints from these alone."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model",
                   "sentencepiece.bpe.model", "added_tokens.json", "tokenizer_config.json")
# Rope types whose frequencies depend on the sequence length at run time: not supported natively
# (models/registry.py sends such checkpoints to the hf engine before any worker starts). Here, not in
# layers/rotary.py, so that the parent reads it without importing the kernels (triton).
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class CheckpointFacts:
    path: str
    config: dict                        # config.json as written
    model_type: str                     # its model_type, or the one its architecture name implies (old BERTs)
    architectures: tuple[str, ...]
    vocab: dict[str, int]               # token -> id, from the tokenizer's files
    tokenizer_files: tuple[str, ...]    # which of TOKENIZER_FILES are there
    remote_code: tuple[str, ...]        # "config.json auto_map: AutoModel -> bert_layers.BertModel", ...

    @property
    def text_config(self) -> dict:
        """The language model's part of a multimodal config (Qwen3.5's text_config), else the config."""
        return self.config.get("text_config") or self.config

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else self.model_type

    def rope(self) -> tuple[str, str]:
        """(rope type, the config field that says it), as transformers reads old and new configs alike."""
        text = self.text_config
        for field in ("rope_parameters", "rope_scaling"):
            params = text.get(field)
            if isinstance(params, dict):
                kind = params.get("rope_type") or params.get("type")
                if kind:
                    key = "rope_type" if "rope_type" in params else "type"
                    return str(kind), f"{field}.{key}"
        return "default", ""

    def has_tokens(self, *tokens: str) -> bool:
        return all(t in self.vocab for t in tokens)


def read_facts(path: str | Path) -> CheckpointFacts:
    """The facts of the checkpoint directory at `path` (its config.json must exist)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"it holds a JSON {type(config).__name__}, not an object of settings")
    architectures = config.get("architectures") or ()
    if not isinstance(architectures, (list, tuple)) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"its architectures is {architectures!r}, not a list of class names")
    architectures = tuple(architectures)
    model_type = config.get("model_type") or _model_type_of(architectures) or ""
    if not isinstance(model_type, str):
        raise ValueError(f"its model_type is {model_type!r}, not a name")
    files = tuple(f for f in TOKENIZER_FILES if (path / f).exists())
    tokenizer_config = read_json(path / "tokenizer_config.json")
    auto_map = config.get("auto_map") or {}
    remote = [f"config.json auto_map: {k} -> {v}" for k, v in auto_map.items()] if isinstance(auto_map, dict) else \
        [f"config.json auto_map: {v}" for v in _flat(auto_map)]
    remote += [f"tokenizer_config.json auto_map: {v}" for v in _flat(tokenizer_config.get("auto_map"))]
    return CheckpointFacts(str(path), config, model_type, architectures, vocabulary(path), files,
                           tuple(remote))


def _flat(auto_map) -> list[str]:
    if isinstance(auto_map, dict):
        return [str(v) for v in auto_map.values() if v]
    return [str(v) for v in auto_map or [] if v]


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict; {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# A checkpoint's weights as transformers (which prefers safetensors) and the native engine read them: the single
# file, else the sharded set its index lists, else the files of that format there are.
WEIGHT_FORMATS = (("model.safetensors", "*.safetensors"), ("pytorch_model.bin", "pytorch_model.bin"))


def weight_files(path: Path) -> tuple[list[str], dict | None, str]:
    """(the weight files a load reads, the index's tensor -> file map or None, the index's name or ""), in
    transformers' order (WEIGHT_FORMATS); ([], None, "") where there are none. A folder holding both a
    model.safetensors and an older sharded set: transformers reads the single file, and so must the native
    engine, or the engines compute different models. The files an index lists need not exist (`missing`
    in models/checkpoint.py says so); OSError or ValueError where the index cannot be read."""
    for single, pattern in WEIGHT_FORMATS:
        index = path / f"{single}.index.json"
        if (path / single).exists():
            found = [single], None, ""
        elif index.exists():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index.name} has no weight_map")
            found = sorted(set(weight_map.values())), weight_map, index.name
        else:
            found = sorted(p.name for p in path.glob(pattern)), None, ""
        if found[0]:
            return found
    return [], None, ""


def safetensors_header(file: Path) -> tuple[int, dict]:
    """(header length, header) of a .safetensors file, read from its first bytes alone; OSError or ValueError
    where the file is too short for the length it gives or its header is not JSON."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 2 <= n <= size - 8:
            raise ValueError(f"header length {n} in a file of {size} bytes")
        return n, json.loads(fh.read(n))


# safetensors' floating-point dtypes: the values a load turns into parameters of the run's dtype
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def weight_values(path: Path) -> int | None:
    """How many floating-point values the checkpoint's weights hold (its parameters, as the run's dtype will
    hold them), counted from its safetensors headers without reading a tensor; None where its weights are not
    all safetensors files or cannot be read (the load says why)."""
    try:
        files, _, _ = weight_files(path)
        if not files or not all(f.endswith(".safetensors") for f in files):
            return None
        total = 0
        for f in files:
            _, header = safetensors_header(path / f)
            for name, tensor in header.items():
                if name != "__metadata__" and tensor["dtype"] in FLOAT_DTYPES:
                    total += math.prod(int(dim) for dim in tensor["shape"])
        return total
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _model_type_of(architectures: tuple[str, ...]) -> str:
    """The model type transformers files an architecture class under (BertForMaskedLM -> bert), for configs
    written before model_type existed (ProtBert's)."""
    from transformers.models.auto import modeling_auto
    for name in dir(modeling_auto):
        mapping = getattr(modeling_auto, name)
        if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict):
            for model_type, classes in mapping.items():
                names = classes if isinstance(classes, (list, tuple)) else (classes,)
                if any(a in names for a in architectures):
                    return model_type
    return ""


def vocabulary(path: Path) -> dict[str, int]:
    """Token -> id from whichever tokenizer files the checkpoint has (its added tokens included)."""
    vocab: dict[str, int] = {}
    if (path / "tokenizer.json").exists():
        spec = read_json(path / "tokenizer.json")
        model_vocab = (spec.get("model") or {}).get("vocab") or {}
        vocab = ({entry[0]: i for i, entry in enumerate(model_vocab)} if isinstance(model_vocab, list)
                 else dict(model_vocab))
        vocab |= {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    elif (path / "vocab.txt").exists():
        lines = (path / "vocab.txt").read_text(encoding="utf-8").splitlines()
        vocab = {token: i for i, token in enumerate(lines)}
    elif (path / "vocab.json").exists():
        vocab = read_json(path / "vocab.json")
    elif (path / "spiece.model").exists():
        vocab = _sentencepiece_pieces(path / "spiece.model")
    return vocab | read_json(path / "added_tokens.json")


def _sentencepiece_pieces(path: Path) -> dict[str, int]:
    """A SentencePiece model's pieces, read with the protobuf schema transformers ships (no sentencepiece
    package needed); empty where protobuf is not installed."""
    try:
        from transformers.convert_slow_tokenizer import import_protobuf
        proto = import_protobuf().ModelProto()
        proto.ParseFromString(path.read_bytes())
    except Exception as e:   # noqa: BLE001 - protobuf missing or the file unreadable: recognised without it
        import logging
        logging.getLogger(__name__).debug("cannot read %s (%s)", path, e)
        return {}
    return {p.piece: i for i, p in enumerate(proto.pieces)}
