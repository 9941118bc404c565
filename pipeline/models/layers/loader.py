"""Read a Hugging Face checkpoint's tensors by name: one `model.safetensors` or a sharded set listed in
`model.safetensors.index.json`, else (as transformers, which prefers safetensors) PyTorch's
`pytorch_model.bin` or the set listed in `pytorch_model.bin.index.json`, the only weights of many published
checkpoints (ProtT5's, older ESM and ProtBert uploads). Tensors are read lazily, one at a time (a .bin file
memory-mapped), so a model is never held twice.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import UserError
from ..checkpoint_facts import weight_files


# Older names some checkpoints (and transformers' own legacy-format saves) still use for the same tensor.
LEGACY_NAMES = (("LayerNorm.weight", "LayerNorm.gamma"), ("LayerNorm.bias", "LayerNorm.beta"))


class CheckpointTensors:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        files, weight_map, _ = weight_files(self.path)
        if not files:
            raise UserError(f"{self.path} has no weights: no .safetensors file and no pytorch_model.bin (nor "
                            "the index of a sharded set of either)")
        if files[0].endswith(".safetensors"):
            from safetensors import safe_open
            self._handles = {f: safe_open(str(self.path / f), framework="pt", device="cpu") for f in files}
        else:
            self._handles = {f: _PickledTensors(self.path / f) for f in files}
        if weight_map is None:
            weight_map = {name: f for f, h in self._handles.items() for name in h.keys()}
        self._where = weight_map

    def names(self) -> list[str]:
        return list(self._where)

    def _stored_name(self, name: str) -> str | None:
        if name in self._where:
            return name
        for new, old in LEGACY_NAMES:
            if name.endswith(new) and name[:-len(new)] + old in self._where:
                return name[:-len(new)] + old
        return None

    def has(self, name: str) -> bool:
        return self._stored_name(name) is not None

    def get(self, name: str) -> torch.Tensor:
        stored = self._stored_name(name)
        try:
            file = self._where[stored]
        except KeyError:
            raise UserError(f"checkpoint {self.path} has no tensor '{name}'; is it the architecture its "
                            "config.json says? (--engine hf may load it)") from None
        return self._handles[file].get_tensor(stored)

    def with_prefix(self, candidates: list[str], probe: str) -> "PrefixedTensors":
        """The view under the first prefix that has `probe` (checkpoints nest the same model differently)."""
        for prefix in candidates:
            if self.has(prefix + probe):
                return PrefixedTensors(self, prefix)
        raise UserError(f"checkpoint {self.path}: no '{probe}' under any of the prefixes {candidates}")


class _PickledTensors:
    """A PyTorch weight file (`torch.save` of a state dict) with safetensors' `keys` and `get_tensor`: loaded
    with weights_only (no code of the file runs), memory-mapped where its format allows (the zip format
    of torch >= 1.6; older files are read whole)."""

    def __init__(self, file: Path):
        try:
            self._tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:   # the legacy (pre-zip) format cannot be memory-mapped
            self._tensors = torch.load(file, map_location="cpu", weights_only=True)

    def keys(self):
        return self._tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class PrefixedTensors:
    def __init__(self, tensors: CheckpointTensors, prefix: str):
        self.tensors, self.prefix = tensors, prefix

    def get(self, name: str) -> torch.Tensor:
        return self.tensors.get(self.prefix + name)

    def has(self, name: str) -> bool:
        return self.tensors.has(self.prefix + name)

    def root(self) -> CheckpointTensors:
        return self.tensors


def materialize(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate a meta-built module on `device` in `dtype` (floating-point tensors; others keep theirs),
    uninitialised: a loader then writes every parameter once, and `check_loaded` finds any it did not (by
    the parameter's version counter). Allocated with torch.empty rather than Module.to_empty, whose
    empty_like of meta tensors runs torch's Python reference and imports torch._dynamo (0.4 s of each
    worker's start). Not filled with a sentinel first: on CPU that pass and the scan for it after the load
    cost more than the copies themselves (ESM-2 650M: 5.5 -> 2.3 CPU seconds, docs/BENCHMARKS.md)."""
    made: dict[int, torch.Tensor] = {}
    params: dict[int, torch.nn.Parameter] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:   # a tensor shared by two modules stays shared
            made[id(t)] = torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        return made[id(t)]

    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in params:
                    params[id(p)] = torch.nn.Parameter(fresh(p), requires_grad=p.requires_grad)
                m._parameters[name] = params[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = fresh(b)


def embedding(num: int, dim: int) -> torch.nn.Embedding:
    """An embedding table whose weights come from the checkpoint: built without nn.Embedding's random
    init, which on the meta device runs torch's Python reference of normal_ and with it imports
    torch._dynamo (about 1.6 s of every worker's start, for numbers that are overwritten at once)."""
    return torch.nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def check_loaded(module: torch.nn.Module, what: str) -> None:
    """Every parameter of a `materialize`d module was written by the loader: an in-place write (`copy_`)
    bumps a tensor's version counter, so one still at 0 was never written and holds whatever its memory held.
    (A parameter the loader replaced by one already written, a tied embedding, counts as written.)"""
    missing = [n for n, p in module.named_parameters() if p.numel() and p._version == 0]
    assert not missing, f"{what}: parameters not loaded from the checkpoint: {missing[:5]}"


def decoder_from_checkpoint(build, path, config, device: torch.device, dtype: torch.dtype,
                            prefixes: list[str], mixer_of, what: str):
    """A pre-norm decoder (Llama, Qwen3, Qwen3.5) built by `build()` and filled from a checkpoint.

    The layout both families share: `embed_tokens`, per layer `input_layernorm`, a token mixer,
    `post_attention_layernorm` and `mlp`, then `norm`, and `lm_head` unless the embeddings are tied.
    `prefixes` are where checkpoints nest the model; `mixer_of(layer)` gives (mixer module, its name in
    the checkpoint, e.g. "self_attn."), each mixer loading its own tensors. The model is built on the meta
    device and allocated once in `dtype`, so it is never held twice.
    """
    from dataclasses import replace

    from ..base import eos_ids
    with torch.device("meta"):
        model = build()
    materialize(model, device, dtype)
    model.rotary.to(device)
    t = CheckpointTensors(path).with_prefix(prefixes, "embed_tokens.weight")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(t.get("embed_tokens.weight"))
        for i, layer in enumerate(model.layers):
            p = f"layers.{i}."
            layer.input_layernorm.weight.copy_(t.get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(t.get(p + "post_attention_layernorm.weight"))
            mixer, name = mixer_of(layer)
            mixer.load(t, p + name)
            layer.mlp.load(t, p + "mlp.")
        model.norm.weight.copy_(t.get("norm.weight"))
        if model.lm_head is not None:
            model.lm_head.weight.copy_(t.root().get("lm_head.weight"))
    check_loaded(model, what)
    model.spec = replace(model.spec, eos_token_ids=eos_ids(config, path))
    return model.eval()
