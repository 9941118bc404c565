"""The engine's GPU code path: the same tiny models through the Triton kernels (compiled on a GPU, else
the Triton interpreter on CPU) agree with the kernels' torch paths the CPU engine runs.

Covers what only that path does: head dims padded to a kernel size (ESM and T5 here have 16), launch knobs
forwarded per step, chunk size 64 for the delta rule, the recurrent kernel for decode steps, the Triton
causal conv of the delta-rule layers with its windows carried across chunked prefill and decode. float32:
both paths are measured against transformers in float64 and held to transformers' own float32 error, as
in test_models_parity.py (the two paths round differently, by amounts that depend on the CPU or GPU).
"""
from __future__ import annotations

import pytest
import torch

from pipeline.engine.native import NativeEngine, SamplingParams
from pipeline.engine.hf import HFEngine
from triton_kernels import causal_conv1d
from tests.float64_reference import Float64Transformers, assert_rows_as_accurate
from tests.interpreter_bfloat16 import installed as bfloat16_mended
from tests.run_helpers import triton_test_device
from tests.tiny_checkpoints import random_sequences, write_tiny

DEVICE = triton_test_device()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kind", ("qwen3_5", "esm2", "qwen3", "llama"))
def test_triton_path_matches_torch_path(tmp_path, monkeypatch, kind):
    import pipeline.models.layers.gated_deltanet as gdn
    convs = []   # the delta-rule layers' conv runs the Triton kernel here, chunked prefill included (70 > 48)
    monkeypatch.setattr(gdn, "causal_conv1d", lambda *a, **k: convs.append(k) or causal_conv1d(*a, **k))
    path = str(write_tiny(kind, tmp_path / kind))
    triton = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=48, kernels="triton")
    torch_path = NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=48)
    assert triton.runner.triton and not torch_path.runner.triton
    batch = random_sequences([70, 9, 1, 20], seed=1)
    logprobs = kind != "esm2"
    layers = [1, triton.info.num_layers]
    hf = HFEngine(path, torch.device("cpu"), torch.float32, logprobs=logprobs).forward(batch, layers, logprobs)
    exact = Float64Transformers(path, logprobs).forward(batch, layers, logprobs)
    for engine in (triton, torch_path):
        assert_rows_as_accurate(engine.forward(batch, layers, logprobs), hf, exact, layers, logprobs)
    assert (kind == "qwen3_5") == any(k["has_initial_state"] is not None for k in convs)


@pytest.mark.parametrize("kind", ("prott5", "ankh"))
def test_t5_triton_path_matches_torch_path(tmp_path, monkeypatch, kind):
    """T5 encoders: the relative-position bias in the kernel (a 150-token sequence reaches offsets past
    max_distance 128), against transformers' T5EncoderModel like the torch path. Each layer fused: attention read
    from the projection with the bias (no KV-cache write, no paged gather), each residual add with the norm after
    it (the first layer's norm alone, the last add with the final norm), Ankh's gelu_new(gate) * up one pass. The engine launches the attention with
    the launch table's bias tiles (wider ones spill registers on sm_80)."""
    import pipeline.models.layers.attention as attention
    import pipeline.models.layers.norms as norms
    from tests.t5_reference import T5EncoderReference
    from tests.test_t5_native import t5_sequences
    from triton_kernels._device import target_of
    from triton_kernels.launch_config import launch_row
    from triton_kernels.paged_attention.varlen import CONTIGUOUS_PAGE
    import pipeline.models.t5 as t5
    calls = {name: [] for name in ("varlen_attention", "write_kv_cache", "paged_attention", "add_rms_norm",
                                   "gelu_tanh_mul")}

    def count(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls[name].append(k) or fn(*a, **k))

    for name in ("varlen_attention", "write_kv_cache", "paged_attention"):
        count(attention, name)
    count(norms, "add_rms_norm")
    count(t5, "gelu_tanh_mul")
    path = str(write_tiny(kind, tmp_path / kind))
    triton = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=256, kernels="triton")
    torch_path = NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=256)
    batch = t5_sequences([150, 9, 1, 40], seed=1)
    layers = [1, triton.info.num_layers]
    hf = T5EncoderReference(path, torch.float32).forward(batch, layers)
    exact = T5EncoderReference(path, torch.float64).forward(batch, layers)
    assert_rows_as_accurate(torch_path.forward(batch, layers, False), hf, exact, layers, False)
    assert not any(calls.values()), "the torch path runs none of the fused kernels"
    assert_rows_as_accurate(triton.forward(batch, layers, False), hf, exact, layers, False)
    n = triton.info.num_layers
    steps = len(calls["varlen_attention"]) // n
    assert steps >= 1 and len(calls["varlen_attention"]) == steps * n
    assert len(calls["add_rms_norm"]) == steps * (2 * n + 1)
    assert len(calls["gelu_tanh_mul"]) == (steps * n if kind == "ankh" else 0)   # Ankh's gated-gelu in one pass
    assert not calls["write_kv_cache"] and not calls["paged_attention"]
    tile_keys = launch_row(target_of(DEVICE)).attention.bias_tile_keys
    assert all(k["rel_bias_table"] is not None and k["pages_per_tile"] * CONTIGUOUS_PAGE <= tile_keys
               for k in calls["varlen_attention"])


@pytest.mark.parametrize("kind", ("prott5", "ankh"))
def test_t5_in_float16_runs_fused_with_wo_in_float32(tmp_path, monkeypatch, kind):
    """float16 T5 (ProtT5's model card runs the encoder in half precision on a GPU): `wo` stays float32, as
    transformers keeps it, so the residual stream is float32 from the first feed-forward on; the layers still run
    fused, each add + norm taking the float32 sum and giving the norm in float16 (T5LayerNorm's cast). A hidden
    state and the final one as close to float64 as transformers' own float16 (tests/test_t5_native.py's bound)."""
    import pipeline.models.layers.norms as norms
    from tests.t5_reference import T5EncoderReference
    from tests.test_t5_native import t5_sequences
    sums = []
    fused = norms.add_rms_norm
    monkeypatch.setattr(norms, "add_rms_norm", lambda x, y, *a, **k: sums.append(
        (x.dtype, None if y is None else y.dtype, k["out_dtype"])) or fused(x, y, *a, **k))
    path = str(write_tiny(kind, tmp_path / kind))
    engine = NativeEngine.load(path, DEVICE, torch.float16, "", max_tokens_per_step=256, kernels="triton")
    assert all(layer.ff.wo.weight.dtype == torch.float32 for layer in engine.model.layers)
    batch = t5_sequences([150, 9, 1, 40], seed=1)
    n = engine.info.num_layers
    layers = [2, n]
    out = engine.forward(batch, layers, False)
    exact = T5EncoderReference(path, torch.float64).forward(batch, layers)
    theirs = T5EncoderReference(path, torch.float16).forward(batch, layers)
    for k in layers:
        def rel_rms(hidden):
            return ((hidden[k].double().cpu() - exact.hidden[k]).norm() / exact.hidden[k].norm()).item()
        assert rel_rms(out.hidden) <= 2 * rel_rms(theirs.hidden) + 1e-2, k
    f16, f32 = torch.float16, torch.float32
    # the first norm alone, then layer 0's two adds (the second meets wo's float32), then float32 sums only
    assert sums[:3] == [(f16, None, f16), (f16, f16, f16), (f16, f32, f16)]
    assert set(sums[3:2 * n + 1]) == {(f32, f16, f16), (f32, f32, f16)} and len(sums) == 2 * n + 1


@pytest.mark.parametrize("kind", ("esm2", "qwen3_5", "qwen3", "llama", "prott5", "ankh"))
def test_triton_path_in_bfloat16_is_as_accurate_as_transformers_in_bfloat16(tmp_path, kind):
    """bfloat16, the native engine's default on a GPU: every fused kernel of the step in bfloat16 (on the CPU
    through tests/interpreter_bfloat16.py, which computes bfloat16 as a GPU does), each checked hidden state and
    the token log-probabilities as close to float64 as transformers' own bfloat16 (FACTOR x its error + FLOOR).
    Chunked prefill (70 tokens, 48 a step) and the delta rule's chunks included."""
    if DEVICE.type == "cpu" and not bfloat16_mended():
        pytest.skip("this Triton's interpreter computes bfloat16 wrongly and tests/interpreter_bfloat16.py cannot "
                    "mend it")
    path = str(write_tiny(kind, tmp_path / kind))
    t5 = kind in ("prott5", "ankh")
    triton = NativeEngine.load(path, DEVICE, torch.bfloat16, "", max_tokens_per_step=256 if t5 else 48,
                               kernels="triton")
    layers = [1, triton.info.num_layers]
    if t5:
        from tests.t5_reference import T5EncoderReference
        from tests.test_t5_native import t5_sequences
        batch, logprobs = t5_sequences([150, 9, 1, 40], seed=1), False
        theirs = T5EncoderReference(path, torch.bfloat16).forward(batch, layers)
        exact = T5EncoderReference(path, torch.float64).forward(batch, layers)
    else:
        batch, logprobs = random_sequences([70, 9, 1, 20], seed=1), kind != "esm2"
        theirs = HFEngine(path, torch.device("cpu"), torch.bfloat16, logprobs=logprobs).forward(batch, layers,
                                                                                               logprobs)
        exact = Float64Transformers(path, logprobs).forward(batch, layers, logprobs)
    assert triton.runner.triton
    ours = triton.forward(batch, layers, logprobs)
    assert all(h.dtype == torch.bfloat16 for h in ours.hidden.values())
    assert_rows_as_accurate(ours, theirs, exact, layers, logprobs)


def test_esm1b_scales_its_scores_in_the_kernel_with_the_same_bits(tmp_path, monkeypatch):
    """ESM-1b / 1v (absolute positions, no rotary pass to carry the query scale): where head_dim^-0.5 is a power of
    two (heads of 64 at full size, 16 here) the attention kernel scales the scores instead of a pass over the
    queries: the same bits as with the pass, and as accurate as transformers against float64."""
    import pipeline.models.esm as esm
    import pipeline.models.layers.attention as attention
    assert (esm.kernel_scale(16), esm.kernel_scale(64), esm.kernel_scale(24), esm.kernel_scale(80)) == (
        0.25, 0.125, None, None)
    scales = []
    given = attention.PagedAttention.from_projection
    monkeypatch.setattr(attention.PagedAttention, "from_projection",
                        lambda self, *a, **k: scales.append(k.get("scale")) or given(self, *a, **k))
    path = str(write_tiny("esm1b", tmp_path / "esm1b"))
    engine = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=64, kernels="triton")
    batch = random_sequences([30, 9, 1], seed=4)
    layers = [1, engine.info.num_layers]
    folded = engine.forward(batch, layers, False)
    assert scales and set(scales) == {0.25}
    monkeypatch.setattr(esm, "kernel_scale", lambda head_dim: None)   # the pass over the queries instead
    passed = engine.forward(batch, layers, False)
    assert set(scales[len(scales) // 2:]) == {None}
    for k in layers:
        assert torch.equal(folded.hidden[k], passed.hidden[k]), k
    hf = HFEngine(path, torch.device("cpu"), torch.float32, logprobs=False).forward(batch, layers, False)
    assert_rows_as_accurate(folded, hf, Float64Transformers(path, False).forward(batch, layers, False), layers, False)


def test_triton_path_generates_what_the_torch_path_generates(tmp_path):
    path = str(write_tiny("qwen3_5", tmp_path / "q"))
    prompts = random_sequences([12, 30, 3], seed=2, eos=None)
    params = SamplingParams(max_new_tokens=6)
    triton = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=16, max_new_tokens=6,
                               kernels="triton")
    torch_path = NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=16,
                                   max_new_tokens=6)
    a = triton.generate(prompts, range(3), params)
    b = torch_path.generate(prompts, range(3), params)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]


def test_launch_knobs_from_the_engine_config_reach_the_kernels(tmp_path, monkeypatch):
    import pipeline.models.layers.attention as attention
    import pipeline.models.layers.gated_deltanet as gdn

    seen = {"attention": [], "delta": []}

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            seen[name].append(kwargs)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention, "paged_attention", spy("attention", attention.paged_attention))
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", spy("delta", gdn.chunk_gated_delta_rule))
    knobs = dict(block_q=16, pages_per_tile=2, num_warps=2, num_stages=1, num_kv_splits=1)
    engine = NativeEngine.load(str(write_tiny("qwen3_5", tmp_path / "q")), DEVICE, torch.float32, "",
                               kernels="triton", attention_launch=knobs,
                               gdn_launch={"chunk_gated_delta_rule": {"block_v": 16, "num_warps": 2}})
    engine.forward(random_sequences([20, 5], seed=3), [4], False)
    assert seen["attention"] and all(all(k[n] == v for n, v in knobs.items()) for k in seen["attention"])
    assert seen["delta"] and all(k["chunk_size"] == 64 and k["block_v"] == 16 and k["num_warps"] == 2
                                 for k in seen["delta"])


def test_esm_steps_run_fused_on_the_triton_path(tmp_path, monkeypatch):
    """An ESM step on the Triton path: per layer one rotary pass, attention read from the projection (no KV-cache
    write, no paged gather), two add + norm passes (the first layer's norm alone), and the first MLP product with
    its GELU where the launch table says so; the torch path (CPU) runs none of them."""
    import pipeline.models.esm as esm
    import pipeline.models.layers.attention as attention
    from triton_kernels.linear_gelu import gemm_knobs

    calls = {name: 0 for name in ("rotate_qk_", "add_layer_norm", "linear_gelu", "varlen_attention",
                                  "write_kv_cache", "paged_attention")}

    def count(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k))

    for name in ("rotate_qk_", "add_layer_norm", "linear_gelu"):
        count(esm, name)
    for name in ("varlen_attention", "write_kv_cache", "paged_attention"):
        count(attention, name)
    path = str(write_tiny("esm2", tmp_path / "esm2"))
    batch = random_sequences([30, 9, 1], seed=4)
    NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=64).forward(batch, [2], False)
    assert not any(calls.values()), calls
    engine = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=64, kernels="triton")
    engine.forward(batch, [engine.info.num_layers], False)
    layers = engine.info.num_layers
    fused_gelu = gemm_knobs(DEVICE).epilogue_gelu
    assert calls == dict(rotate_qk_=layers, add_layer_norm=2 * layers + 1, linear_gelu=layers if fused_gelu else 0,
                         varlen_attention=layers, write_kv_cache=0, paged_attention=0), calls


@pytest.mark.parametrize("kind", ("qwen3_5", "qwen3", "llama"))
def test_rms_norm_decoders_run_fused_on_the_triton_path(tmp_path, monkeypatch, kind):
    """A Qwen3.5, Qwen3 or Llama step on the Triton path: every norm but the first runs with the residual add before
    it (2 per layer + 1: the final norm rides with the last layer's add), the MLP's silu(gate) * up is one pass per
    layer, Qwen3.5's delta-rule layers run their gated output norm as one, and each attention layer's q and k run
    their norms (Qwen3.5, Qwen3; none in Llama) with the rotary in one launch for both; Qwen3.5's gates run one
    pass each (the attention's output gate, the delta-rule layers' g and beta); with fuse_elementwise off, and on
    the torch path (CPU), none of them run."""
    import pipeline.models.layers.gated_deltanet as gdn
    import pipeline.models.layers.mlp as mlp
    import pipeline.models.layers.norms as norms
    import pipeline.models.layers.rotary as rotary
    import pipeline.models.qwen3_5 as qwen3_5

    calls = {"add_rms_norm": 0, "gated_rms_norm": 0, "silu_mul": 0, "norm_rotate_qk_": 0,
             "sigmoid_gate": 0, "delta_rule_gates": 0}
    normed = []   # whether each norm_rotate_qk_ call normalised (weights) or only rotated

    def count(module, name):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k))

    count(norms, "add_rms_norm")
    count(gdn, "gated_rms_norm")
    count(mlp, "silu_mul")
    assert not hasattr(rotary, "norm_rotate_")   # q and k go through the one-launch form only
    count(rotary, "norm_rotate_qk_")
    count(qwen3_5, "sigmoid_gate")
    count(gdn, "delta_rule_gates")
    norm_rotate_qk_ = rotary.norm_rotate_qk_
    monkeypatch.setattr(rotary, "norm_rotate_qk_",
                        lambda *a, **k: normed.append(a[4] is not None) or norm_rotate_qk_(*a, **k))
    path = str(write_tiny(kind, tmp_path / kind))
    batch = random_sequences([30, 9, 1], seed=4)
    NativeEngine.load(path, torch.device("cpu"), torch.float32, "", max_tokens_per_step=64).forward(batch, [2], False)
    assert not any(calls.values()), calls
    engine = NativeEngine.load(path, DEVICE, torch.float32, "", max_tokens_per_step=64, kernels="triton")
    engine.runner.model.fuse_elementwise = False   # what a benchmark does to time the unfused layers
    engine.forward(batch[2:], [2], False)
    assert not any(calls.values()), calls
    engine.runner.model.fuse_elementwise = True
    engine.forward(batch, [engine.info.num_layers], False)
    layers = engine.info.num_layers
    delta = len(engine.runner.model.delta_layers())
    attention = len(engine.runner.model.attention_layers())
    assert (kind == "qwen3_5") == (delta > 0) and attention == layers - delta
    assert calls == dict(add_rms_norm=2 * layers + 1, gated_rms_norm=delta, silu_mul=layers,
                         norm_rotate_qk_=attention,
                         sigmoid_gate=attention if kind == "qwen3_5" else 0, delta_rule_gates=delta), calls
    assert normed == [kind != "llama"] * attention
