"""Which model types the native engine runs, and loading one: `load_model` picks the family from the
checkpoint config's model_type. Anything else runs on --engine hf."""
from __future__ import annotations

import torch

from ..errors import UserError
from .base import NativeModel
from .hf_config import text_config

# model_type in config.json -> family. Anything else runs on --engine hf.
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "esm", "llama", "qwen3", "t5")


def load_model(path: str, device: torch.device, dtype: torch.dtype) -> NativeModel:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    model_type = config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"--engine native does not support model type '{model_type}' (it runs "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}); use --engine hf")
    if model_type in ("qwen3_5_text", "qwen3_5"):
        from .qwen3_5 import Qwen3_5Model
        return Qwen3_5Model.from_checkpoint(path, text_config(config), device, dtype)
    if model_type == "esm":
        from .esm import EsmModel
        return EsmModel.from_checkpoint(path, config, device, dtype)
    if model_type == "t5":   # the encoder (ProtT5, ProstT5, Ankh), of T5EncoderModel or whole T5 checkpoints
        from .t5 import T5Encoder
        return T5Encoder.from_checkpoint(path, config, device, dtype)
    from .llama import LlamaModel
    arch = (getattr(config, "architectures", None) or [model_type])[0]
    return LlamaModel.from_checkpoint(path, config, device, dtype, arch, qk_norm=model_type == "qwen3")

