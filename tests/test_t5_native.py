"""T5 encoders on the native engine (ProtT5, ProstT5, Ankh and ProtT5's float16 encoder-only checkpoint,
tests/tiny_checkpoints.py: published config values, sizes shrunk) against transformers' T5EncoderModel as
the model cards run it (tests/t5_reference.py).

float32 on CPU, every layer's hidden states held to transformers' own float32 error against float64
(tests/float64_reference.py: FACTOR x theirs + FLOOR, as for every native family in
test_models_parity.py). Token ids are passed directly (the tokenizer's conventions are not this engine's).
Lengths reach 300 tokens, past the bias's max_distance of 128, so every kind of bucket is used; step budgets
of 512 and 4096 put several sequences, ragged, in one step.
"""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.engine.native import NativeEngine
from pipeline.errors import UserError
from tests.float64_reference import assert_rows_as_accurate
from tests.t5_reference import T5EncoderReference
from tests.tiny_checkpoints import T5_KINDS, write_tiny

CPU = torch.device("cpu")
LENGTHS = [300, 40, 5, 0, 130, 250, 1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return {kind: write_tiny(kind, root / kind) for kind in T5_KINDS}


def t5_sequences(lengths, seed: int) -> list[list[int]]:
    """Random ids (3..127, in every checkpoint's vocabulary) closed by </s> (1), as ProtT5's and Ankh's
    tokenizers end a sequence (no start token)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() + [1] for n in lengths]


@pytest.mark.parametrize("kind", T5_KINDS)
def test_hidden_states_of_every_layer_match_transformers(checkpoints, kind):
    path = str(checkpoints[kind])
    native = NativeEngine.load(path, CPU, torch.float32, "", max_tokens_per_step=512)
    assert type(native.model).__name__ == "T5Encoder"
    batch = t5_sequences(LENGTHS, seed=1)
    layers = list(range(native.info.num_layers + 1))
    assert_rows_as_accurate(native.forward(batch, layers, False),
                            T5EncoderReference(path, torch.float32).forward(batch, layers),
                            T5EncoderReference(path, torch.float64).forward(batch, layers), layers, False)


def test_whole_t5_and_encoder_only_checkpoints_load_the_same_model(checkpoints, tmp_path):
    """A T5ForConditionalGeneration checkpoint (shared.*, encoder.*, decoder.*, lm_head) and the
    T5EncoderModel saved from it give the same bits."""
    from transformers import T5EncoderModel
    whole = checkpoints["ankh"]
    encoder_only = tmp_path / "ankh-enc"
    T5EncoderModel.from_pretrained(whole).save_pretrained(encoder_only)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (encoder_only / name).write_bytes((whole / name).read_bytes())
    assert json.loads((encoder_only / "config.json").read_text())["architectures"] == ["T5EncoderModel"]
    batch = t5_sequences([70, 3], seed=2)
    a = NativeEngine.load(str(whole), CPU, torch.float32, "").forward(batch, [1, 3], False)
    b = NativeEngine.load(str(encoder_only), CPU, torch.float32, "").forward(batch, [1, 3], False)
    assert torch.equal(a.hidden[1], b.hidden[1]) and torch.equal(a.hidden[3], b.hidden[3])


@pytest.mark.parametrize("kind", ["prott5", "ankh"])
def test_ragged_batches_give_the_rows_each_sequence_gets_alone(checkpoints, kind):
    """Sequences of different lengths in ragged steps (budgets 4096 and 512, in two orders) against each run
    alone: the same bits (the CPU engine is batch-invariant)."""
    batch = t5_sequences(LENGTHS, seed=3)
    alone = NativeEngine.load(str(checkpoints[kind]), CPU, torch.float32, "", max_tokens_per_step=4096)
    single = [alone.forward([ids], [2, 3], False) for ids in batch]
    for budget, order in ((4096, range(len(batch))), (512, reversed(range(len(batch))))):
        engine = NativeEngine.load(str(checkpoints[kind]), CPU, torch.float32, "", max_tokens_per_step=budget)
        members = list(order)
        out = engine.forward([batch[i] for i in members], [2, 3], False)
        assert engine.stats.sequences > engine.stats.steps   # several sequences shared a step
        for j, i in enumerate(members):
            a, b = out.cu_seqlens[j], out.cu_seqlens[j + 1]
            for k in (2, 3):
                assert torch.equal(out.hidden[k][a:b], single[i].hidden[k]), (kind, budget, LENGTHS[i], k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["prott5", "ankh"])
def test_16_bit_is_as_close_to_float64_as_transformers_own(checkpoints, kind, dtype):
    """`--dtype bfloat16` / `float16` on CPU: the final hidden states' distance to float64 against
    transformers' own in the same dtype (which, in float16, keeps `wo` in float32, as the engine does).
    Both land at 1e-3..1e-2 relative RMS; the bound, 2x transformers' plus 1e-2, is far below the order-1
    errors of a real mistake (a wrong bucket, a lost bias)."""
    path = str(checkpoints[kind])
    native = NativeEngine.load(path, CPU, dtype, "", max_tokens_per_step=512)
    if dtype == torch.float16:
        assert all(layer.ff.wo.weight.dtype == torch.float32 for layer in native.model.layers)
    batch = t5_sequences([200, 3, 64, 17, 1], seed=4)
    final = native.info.num_layers
    ref = T5EncoderReference(path, torch.float64).forward(batch, [final]).hidden[final]

    def rel_rms(out):
        return ((out.hidden[final].double() - ref).norm() / ref.norm()).item()

    ours = rel_rms(native.forward(batch, [final], False))
    theirs = rel_rms(T5EncoderReference(path, dtype).forward(batch, [final]))
    assert ours <= 2 * theirs + 1e-2, f"native {dtype} {ours:.3g} vs transformers {theirs:.3g}"


@pytest.mark.parametrize("change, message", [
    (dict(feed_forward_proj="tanh"), "feed_forward_proj 'tanh'"),
    (dict(is_decoder=True), "is_decoder"),
])
def test_configs_the_native_engine_does_not_run_are_refused_by_field(checkpoints, tmp_path, change, message):
    import shutil
    path = tmp_path / "changed"
    shutil.copytree(checkpoints["prott5"], path)
    config = json.loads((path / "config.json").read_text())
    for derived in ("dense_act_fn", "is_gated_act"):   # written by save_pretrained, absent from hub configs
        config.pop(derived)
    (path / "config.json").write_text(json.dumps(dict(config, **change)))
    with pytest.raises(UserError, match=message) as e:
        NativeEngine.load(str(path), CPU, torch.float32, "")
    assert "--engine hf" in str(e.value)
