"""The bundled demo model: a tiny Qwen3.5-style hybrid (Gated DeltaNet + attention) over a protein alphabet.

Its weights are random but fixed: every value comes from a counter-based hash of the parameter's name and
position (splitmix64), so every machine materialises bit-identical weights offline, with no download. It
exists to exercise the pipeline end to end; for real work pass `--model` a real checkpoint.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from ..processes import process_alive

log = logging.getLogger(__name__)

NAME = "demo"
VERSION = 1
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = "ACDEFGHIKLMNPQRSTVWYXBZUO"   # 20 standard residues, X, and the ambiguity/rare codes
VOCAB = SPECIAL_TOKENS + list(ALPHABET)
CONFIG = dict(
    vocab_size=32, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=65536, rms_norm_eps=1e-6,
    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# sha256 over (name, float32 bytes) of every parameter in name order; pinned so a change is noticed.
WEIGHTS_DIGEST = "d856a55120ccb5e4746132b17621784dca6656c0df8bc7d4838dd9c8ce613b17"


def _uniform(name: str, n: int) -> np.ndarray:
    """n values uniform in [-1, 1), a pure function of (name, position): splitmix64 of a counter."""
    seed = int.from_bytes(hashlib.sha256(f"run_shards-demo-v{VERSION}/{name}".encode()).digest()[:8], "little")
    z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (2.0 / 2**53) - 1.0


def _value(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The fixed value of one parameter, by the role its name gives it."""
    n = int(np.prod(shape))
    u = _uniform(name, n)
    root3 = 3.0 ** 0.5  # uniform on [-1, 1) has std 1/sqrt(3)
    if name.endswith("A_log"):
        v = np.log(1.0 + 15.0 * (u + 1.0) / 2.0)                 # decay rates A in [1, 16)
    elif name.endswith("dt_bias"):
        v = 1.0 + 0.1 * u
    elif name.endswith("linear_attn.norm.weight"):             # gated RMSNorm: weight used as is
        v = 1.0 + 0.1 * u
    elif name.endswith("norm.weight"):                         # zero-centred RMSNorm: x * (1 + w)
        v = 0.1 * u
    elif name.endswith("embed_tokens.weight"):
        v = root3 * u
    elif name.endswith("conv1d.weight"):
        v = root3 * u / shape[-1] ** 0.5
    elif name.endswith(".weight") and len(shape) == 2:          # linear layers: unit-variance outputs
        v = root3 * u / shape[1] ** 0.5
    else:
        raise AssertionError(f"demo model: no value rule for parameter {name}")
    return v.astype(np.float32).reshape(shape)


def build_model():
    """The demo model as a transformers Qwen3_5ForCausalLM with its fixed weights (float32, CPU)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**CONFIG)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(_value(name, tuple(param.shape))))
    return model.eval()


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").float().contiguous().numpy().tobytes())
    return h.hexdigest()


def build_tokenizer():
    """A character-level protein tokenizer: '<bos> residues <eos>', unknown characters -> '<unk>'."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=CONFIG["max_position_embeddings"])


MARKER = "run_shards_demo.json"


def write(path: str | os.PathLike) -> Path:
    """Write the demo checkpoint (config.json, model.safetensors, tokenizer files) to `path`; its marker file,
    written last, holds the sha256 of every other file."""
    from .hf_config import quiet_transformers
    quiet_transformers()   # no "Writing model shards" bar on the user's terminal
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model()
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer().save_pretrained(path)
    files = {f.name: _sha256(f) for f in sorted(path.iterdir()) if f.is_file() and f.name != MARKER}
    (path / MARKER).write_text(json.dumps(
        {"name": NAME, "version": VERSION, "weights_sha256": weights_digest(model), "files": files,
         "note": "random fixed weights for demonstrations and tests; pass --model for real work"}, indent=1))
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damage(path: Path) -> str | None:
    """None when the demo checkpoint at `path` is whole (every file's sha256 as written); else what is wrong."""
    try:
        files = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path / MARKER} is missing or unreadable"
    for name, digest in files.items():
        try:
            if _sha256(path / name) != digest:
                return f"{path / name} does not match its checksum"
        except OSError as e:
            return f"{path / name}: {e.strerror or e}"
    return None


def ensure(cache_root: Path) -> Path:
    """The demo checkpoint under `cache_root`, verified, materialised on first use and rebuilt when damaged.

    Builders take turns (a lock on the folder that holds it), and each checks again once it holds the lock, so a copy
    another process just built is used, never moved aside; a new copy is built under a temporary name and
    renamed into place, so a process loading the old copy keeps reading whole files, and a failed build
    leaves nothing behind.
    """
    target = Path(cache_root) / "models" / f"{NAME}-v{VERSION}"
    if target.exists() and damage(target) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(target.parent, os.O_RDONLY)   # the models folder itself: no lock file left behind
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = damage(target) if target.exists() else "not built yet"
        if problem is None:
            return target
        if target.exists():
            log.warning("the demo model in %s is damaged (%s); building it again", target, problem)
        _build_into(target)
    finally:
        os.close(lock)   # releases the lock
    return target


def _build_into(target: Path) -> None:
    """Build under a temporary name, move a damaged copy aside (readers keep their open files), rename."""
    from ..errors import UserError, disk_full_reason
    _remove_abandoned_builds(target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    log.info("materialising the demo model in %s", target)
    try:
        write(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = disk_full_reason(e) if isinstance(e, Exception) else None
        if reason:
            raise UserError(f"cannot materialise the demo model in {target.parent}: {reason} (it needs about "
                            "1 MB). Free space there, or set RUN_SHARDS_CACHE to a directory on a disk with room, "
                            "and run the same command again.") from None
        raise
    if target.exists():
        old = target.with_name(f"{target.name}.damaged{os.getpid()}")
        os.replace(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, target)


def _remove_abandoned_builds(target: Path) -> None:
    """Builds left by processes that died while writing (named `.tmp<pid>` / `.damaged<pid>`)."""
    for path in target.parent.glob(f"{target.name}.*"):
        pid = path.name.rsplit(".", 1)[-1].removeprefix("tmp").removeprefix("damaged")
        if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)

