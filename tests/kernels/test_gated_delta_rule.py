"""Gated delta rule: Triton kernels and the CPU torch path against the float64 per-token reference.

Triton runs on CUDA when present, else through the interpreter (switched on per test by
tests/kernels/conftest.py); the interpreter is slow, so Triton shapes are small and varied, not many.

Tolerances are relative RMS errors, ||x - ref|| / ||ref||, against the float64 reference computed from
the same (already rounded) inputs:
- float32, 1e-4: the chunked form only reassociates float32 sums (observed ~1e-6); the margin covers
  the conditioning of (I + A) and accumulation over long sequences.
- float16 / bfloat16, 5e-3: operands are rounded to 16 bits for every tensor-core product and the
  output is rounded (~3e-4 for float16, ~2e-3 for bfloat16 alone); fla holds its kernels to the same bound.
Where a test's point is agreement with another float32 computation (pieces against a whole-sequence run,
ours against transformers'), each is measured against float64 and ours must be within FACTOR times the
other's error plus FLOOR (tests/float64_reference.py); the two float32 results are never compared with
each other, since how each rounds depends on the device's kernels.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.nn.functional as F

from tests.run_helpers import require_triton

require_triton()

import triton_kernels  # noqa: E402
from triton_kernels.gated_delta_rule import chunk as chunk_module  # noqa: E402
from triton_kernels.gated_delta_rule import fused_recurrent as recurrent_module  # noqa: E402
from triton_kernels.gated_delta_rule import walk_layout  # noqa: E402
from triton_kernels.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402

from tests.float64_reference import FACTOR, FLOOR, float64_everywhere  # noqa: E402
from tests.kernels.float_cases import skip_interpreter_bf16  # noqa: E402

chunk_gated_delta_rule = triton_kernels.chunk_gated_delta_rule
fused_recurrent_gated_delta_rule = triton_kernels.fused_recurrent_gated_delta_rule

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"  # where the Triton kernels run
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-3}
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (bfloat16 at realistic sizes: too slow for the interpreter; test_16_bit runs it small)")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def torch_path(monkeypatch):
    """CPU tensors take the torch path, as in the engine on a machine without TRITON_INTERPRET."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(B, T, H, HV, K, V, *, dtype=torch.float32, device=DEVICE, l2norm=False, num_states=None,
                gates="normal", seed=0):
    """Random inputs shaped like a Gated DeltaNet layer's. Keys are unit rows unless the kernel normalises
    them: raw keys make (I + A) ill-conditioned, which is the math, not the kernel."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2norm:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    if gates == "normal":
        g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    else:  # half the tokens barely decay (g ~ -1e-6), half wipe the state (g down to -1e4)
        tiny = -1e-6 * torch.rand(B, T, HV, generator=gen)
        huge = -torch.exp(torch.empty(B, T, HV).uniform_(1.0, 9.2, generator=gen))
        g = torch.where(torch.rand(B, T, HV, generator=gen) < 0.5, tiny, huge)
    h0 = None if num_states is None else 0.5 * torch.randn(num_states, HV, K, V, generator=gen)
    to = lambda x, dt=dtype: x.to(device=device, dtype=dt)  # noqa: E731
    return dict(q=to(q), k=to(k), v=to(v), g=to(g, torch.float32), beta=to(beta),
                initial_state=None if h0 is None else to(h0, torch.float32))


def random_cu_seqlens(lengths, device=DEVICE):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def check(fn, inputs, *, cu_seqlens=None, l2norm=False, tol=None, **knobs):
    """Run fn and the float64 reference on the same inputs; assert output and final state agree."""
    ref_o, ref_s = naive_recurrent_gated_delta_rule(
        **inputs, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm)
    o, s = fn(**inputs, output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm, **knobs)
    tol = TOL[inputs["q"].dtype] if tol is None else tol
    assert o.dtype == inputs["q"].dtype and o.shape == ref_o.shape
    assert s.dtype == torch.float32 and s.shape == ref_s.shape
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o, ref_o) < tol, f"output rel RMS {rel_rms(o, ref_o):.2e} >= {tol}"
    assert rel_rms(s, ref_s) < tol, f"final state rel RMS {rel_rms(s, ref_s):.2e} >= {tol}"
    return o, s


# (K, V, H, HV, batch, lengths, initial state, l2norm): every K and V in {16, 32, 64, 128}, HV/H in
# {1, 2, 4}, lengths off the chunk grid, batched and packed (varlen) inputs.
TRITON_SWEEP = [
    (16, 16, 1, 1, 1, [100], False, False),
    (16, 128, 2, 4, 2, [70], True, True),
    (32, 64, 1, 4, None, [1, 63, 64, 65, 130], True, False),
    (64, 32, 2, 2, 1, [150], True, True),
    (64, 64, 2, 8, None, [5, 40, 1, 77], False, True),
    (128, 16, 1, 4, 1, [90], False, False),
    (128, 128, 2, 2, 1, [129], True, True),
    (32, 32, 4, 8, 3, [33], True, False),
]


def _sweep_inputs(K, V, H, HV, batch, lengths, use_h0, l2norm, dtype=torch.float32, device=DEVICE, seed=0):
    if batch is None:  # packed variable-length batch
        cu = random_cu_seqlens(lengths, device)
        inputs = make_inputs(1, sum(lengths), H, HV, K, V, dtype=dtype, device=device, l2norm=l2norm,
                             num_states=len(lengths) if use_h0 else None, seed=seed)
        return inputs, cu
    inputs = make_inputs(batch, lengths[0], H, HV, K, V, dtype=dtype, device=device, l2norm=l2norm,
                         num_states=batch if use_h0 else None, seed=seed)
    return inputs, None


@pytest.mark.parametrize("K,V,H,HV,batch,lengths,use_h0,l2norm", TRITON_SWEEP)
def test_chunk_matches_reference(K, V, H, HV, batch, lengths, use_h0, l2norm):
    inputs, cu = _sweep_inputs(K, V, H, HV, batch, lengths, use_h0, l2norm)
    check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=l2norm)


# The split design (issue 36: design="split") on a few of the sweep's cases: K and V unequal and off 64, value
# heads sharing key heads, batched and packed, with and without initial state and l2norm (the interpreter is slow).
@pytest.mark.parametrize("K,V,H,HV,batch,lengths,use_h0,l2norm", [TRITON_SWEEP[i] for i in (1, 2, 5)])
def test_split_design_matches_reference(K, V, H, HV, batch, lengths, use_h0, l2norm):
    inputs, cu = _sweep_inputs(K, V, H, HV, batch, lengths, use_h0, l2norm)
    check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=l2norm, design="split")


@pytest.mark.parametrize("K,V,H,HV,batch,lengths,use_h0,l2norm", TRITON_SWEEP[1::2])
def test_fused_recurrent_matches_reference(K, V, H, HV, batch, lengths, use_h0, l2norm):
    inputs, cu = _sweep_inputs(K, V, H, HV, batch, lengths, use_h0, l2norm, seed=1)
    check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=l2norm, block_v=V)


@pytest.mark.parametrize("num_seqs,design", [(3, "fused"), (20, "fused"), (20, "split")])
def test_varlen_batches_with_short_sequences(num_seqs, design):
    """Packed sequences of 1-60 tokens (a length-1 one included) each start from their own state."""
    rng = random.Random(num_seqs)
    lengths = [1] + [rng.randint(1, 60) for _ in range(num_seqs - 1)]
    rng.shuffle(lengths)
    inputs = make_inputs(1, sum(lengths), 1, 2, 32, 32, num_states=num_seqs, l2norm=True, seed=num_seqs)
    cu = random_cu_seqlens(lengths)
    check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True, design=design)
    if design == "fused":
        check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True)


def float32_gamma_floor(inputs: dict, chunk_size: int) -> dict:
    """The inputs with each gate replaced by what a chunked method sees at best: the difference of the
    chunk-local cumulative sums (exact) each rounded to float32 once. The float64 recurrence on these is
    the floor of any float32 chunked method's error (its gammas cannot be nearer the exact sums)."""
    g = inputs["g"].double().cpu()
    seen = torch.empty_like(g)
    for c0 in range(0, g.shape[1], chunk_size):
        gamma = g[:, c0:c0 + chunk_size].cumsum(1).float().double()
        seen[:, c0:c0 + chunk_size] = gamma - torch.cat([torch.zeros_like(gamma[:, :1]), gamma[:, :-1]], 1)
    return {**inputs, "g": seen.to(inputs["g"].device)}


@pytest.mark.parametrize("design", ["fused", "split"])
def test_extreme_gates_stay_finite_and_exact(design):
    """g ~ -1e-6 (no decay) mixed with g down to -1e4 (state wiped): no inf/NaN, still matches. Gammas reach
    -1e5 here, where a float32 ulp is 0.008, so the chunked kernel's bound is the float32-gamma floor (1.2e-5
    here; a float32 scan on an H200 gave 7.6e-4), not the normal gates' 1e-4."""
    inputs = make_inputs(1, 150, 1, 2, 32, 32, gates="extreme", num_states=1, seed=3)
    ref_o, _ = naive_recurrent_gated_delta_rule(**inputs)
    floor_o, _ = naive_recurrent_gated_delta_rule(**float32_gamma_floor(inputs, 64))
    floor = rel_rms(floor_o, ref_o)
    assert floor > 1e-6   # the gates do reach where float32 gammas lose digits
    check(chunk_gated_delta_rule, inputs, tol=FACTOR * floor + FLOOR, design=design)
    if design == "fused":
        check(fused_recurrent_gated_delta_rule, inputs, block_v=32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("design", ["fused", "split"])
def test_16_bit(design, dtype):
    """float16 and bfloat16 (the GPU's default; on the CPU through tests/interpreter_bfloat16.py) at a small
    shape; bfloat16 at realistic sizes below, on a GPU."""
    skip_interpreter_bf16(dtype)
    inputs = make_inputs(1, 130, 1, 2, 64, 64, dtype=dtype, l2norm=True, num_states=1, seed=4)
    inputs["g"] = inputs["g"].to(dtype)  # the kernels accept any float dtype for g and beta
    check(chunk_gated_delta_rule, inputs, l2norm=True, design=design)
    if design == "fused":
        check(fused_recurrent_gated_delta_rule, inputs, l2norm=True, block_v=64)


@pytest.mark.parametrize("design", ["fused", "split"])
def test_chunk_size_128(design):
    inputs = make_inputs(1, 200, 1, 1, 32, 32, num_states=1, seed=5)
    check(chunk_gated_delta_rule, inputs, chunk_size=128, design=design)


def test_chunked_and_recurrent_forms_agree():
    """Both forms on the same inputs, each against the float64 reference (comparing the two float32
    results with each other would measure both roundings, which depend on the device's kernels)."""
    inputs = make_inputs(2, 150, 1, 2, 32, 32, l2norm=True, num_states=2, seed=6)
    check(chunk_gated_delta_rule, inputs, l2norm=True)
    check(fused_recurrent_gated_delta_rule, inputs, l2norm=True, block_v=32)


@pytest.mark.parametrize("design", ["fused", "split"])
def test_pieces_carried_by_state_equal_whole_sequence(design):
    """Chunked prefill: pieces off the chunk grid, each starting from the last one's state, then decode
    steps, are as accurate against the float64 reference as one run over the whole sequence (itself
    checked against it: a mistake shared by both runs must not loosen the bound)."""
    T, cuts = 203, [0, 50, 127, 200, 201, 202, 203]
    inputs = make_inputs(1, T, 1, 2, 32, 32, l2norm=True, num_states=1, seed=7)
    o_whole, s_whole = check(chunk_gated_delta_rule, inputs, l2norm=True, design=design)
    o_ref, s_ref = naive_recurrent_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    state, outs = inputs["initial_state"], []
    for a, b in zip(cuts, cuts[1:]):
        piece = {name: inputs[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        fn = functools.partial(chunk_gated_delta_rule, design=design) if b - a > 1 else fused_recurrent_gated_delta_rule
        o, state = fn(**piece, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    pieces = (torch.cat(outs, dim=1), state)
    for what, x, whole, ref in zip(("output", "state"), pieces, (o_whole, s_whole), (o_ref, s_ref)):
        err, bound = rel_rms(x, ref), FACTOR * rel_rms(whole, ref) + FLOOR
        assert err <= bound, f"{what}: pieces' rel RMS {err:.2e} > {bound:.2e}"


def test_empty_sequences_keep_their_state():
    lengths = [0, 5, 0, 70]
    inputs = make_inputs(1, sum(lengths), 1, 1, 16, 16, num_states=4, seed=8)
    cu = random_cu_seqlens(lengths)
    split = functools.partial(chunk_gated_delta_rule, design="split")
    for fn in (chunk_gated_delta_rule, split, fused_recurrent_gated_delta_rule):
        _, s = check(fn, inputs, cu_seqlens=cu)
        assert torch.equal(s[0], inputs["initial_state"][0]) and torch.equal(s[2], inputs["initial_state"][2])


def test_final_state_only_when_asked_and_inputs_untouched():
    inputs = make_inputs(1, 40, 1, 1, 16, 16, num_states=1, seed=9)
    before = {name: t.clone() for name, t in inputs.items()}
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        o, s = fn(**inputs)
        assert s is None and o.shape == (1, 40, 1, 16)
        assert all(torch.equal(inputs[name], before[name]) for name in inputs)


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's grid and keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_chunk_launch_knobs_reach_the_kernels(monkeypatch):
    prep = LaunchRecorder(chunk_module._chunk_prep_kernel)
    walk = LaunchRecorder(chunk_module._chunk_walk_kernel)
    monkeypatch.setattr(chunk_module, "_chunk_prep_kernel", prep)
    monkeypatch.setattr(chunk_module, "_chunk_walk_kernel", walk)
    inputs = make_inputs(2, 70, 1, 2, 16, 64, num_states=2, seed=10)
    check(chunk_gated_delta_rule, inputs, block_v=16, num_warps=8, num_stages=3, prep_num_warps=2)
    (prep_grid, prep_kw), = prep.launches
    (walk_grid, walk_kw), = walk.launches
    assert prep_grid == (2 * 2, 2) and prep_kw["num_warps"] == 2 and prep_kw["BT"] == 64
    assert walk_grid == (2 * 2 * (64 // 16),)
    assert (walk_kw["BV"], walk_kw["NV"], walk_kw["num_warps"], walk_kw["num_stages"]) == (16, 4, 8, 3)
    # Defaults are the launch table's (an H100's without a GPU): block_v 64 capped at V = 32, then narrowed
    # to min_block_v 16, since one sequence of one value head leaves the GPU idle; min_block_v = block_v
    # keeps the block as given.
    for knobs, block in ((dict(), 16), (dict(min_block_v=64), 32)):
        walk.launches.clear()
        prep.launches.clear()
        chunk_gated_delta_rule(**make_inputs(1, 10, 1, 1, 16, 32, seed=11), **knobs)
        (_, walk_kw), = walk.launches
        (_, prep_kw), = prep.launches
        assert (walk_kw["BV"], walk_kw["num_warps"], walk_kw["num_stages"], prep_kw["num_warps"]) == (block, 4, 2, 8)


def test_split_design_launch_knobs_reach_its_kernels(monkeypatch):
    """design="split" launches its four kernels (and none of the fused design's), each with its knobs: the prep's
    solve and W / U kernels (solve_num_warps; W / U over column blocks of K and V) and the output kernel
    (output_block_v, output_num_warps) over every chunk and value head, the state walk with the walk's knobs. The
    launch table keeps the fused design as the default."""
    from triton_kernels.gated_delta_rule import split as split_module
    from triton_kernels.launch_config import launch_row
    from triton_kernels._launch import A100, H100

    recorders = {}
    for module, name in ((split_module, "_split_solve_kernel"), (split_module, "_split_wu_kernel"),
                         (split_module, "_split_state_kernel"),
                         (split_module, "_split_output_kernel"), (chunk_module, "_chunk_prep_kernel"),
                         (chunk_module, "_chunk_walk_kernel")):
        recorders[name] = LaunchRecorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    inputs = make_inputs(2, 70, 1, 2, 16, 64, num_states=2, seed=10)
    check(chunk_gated_delta_rule, inputs, design="split", block_v=16, num_warps=8, num_stages=3, solve_num_warps=2,
          output_block_v=32, output_num_warps=1)
    assert not recorders["_chunk_prep_kernel"].launches and not recorders["_chunk_walk_kernel"].launches
    (prep_grid, prep_kw), = recorders["_split_solve_kernel"].launches
    (wu_grid, wu_kw), = recorders["_split_wu_kernel"].launches
    (walk_grid, walk_kw), = recorders["_split_state_kernel"].launches
    (out_grid, out_kw), = recorders["_split_output_kernel"].launches
    assert prep_grid == (2 * 2, 2) and prep_kw["num_warps"] == 2 and prep_kw["BT"] == 64
    # W: K = 16 columns in one block of 16; U: V = 64 columns in four
    assert wu_grid == (2 * 2, 2, 1 + 4) and (wu_kw["BW"], wu_kw["num_warps"]) == (16, 2)
    assert walk_grid == (2 * 2 * (64 // 16),) and walk_kw["STORE_CHUNKS"]
    assert (walk_kw["BV"], walk_kw["NV"], walk_kw["num_warps"], walk_kw["num_stages"]) == (16, 4, 8, 3)
    assert out_grid == (2 * 2, 2, 64 // 32) and (out_kw["BV"], out_kw["num_warps"]) == (32, 1)
    for target in (A100, H100):
        assert launch_row(target).chunk.design == "fused"
    with pytest.raises(ValueError, match="output_block_v"):
        chunk_gated_delta_rule(**inputs, design="split", output_block_v=48)
    with pytest.raises(ValueError, match="design must be one of"):
        chunk_gated_delta_rule(**inputs, design="fast")


def test_split_design_is_batch_invariant(monkeypatch):
    """batch_invariant with the split design (the fused one: tests/kernels/test_batch_invariant_kernels.py): a
    sequence's outputs and final state are the same bits alone and packed among others, even where alone it
    would be cut into segments (the number follows the batch); the engine may select either design."""
    design = "split"
    monkeypatch.setattr(walk_layout, "MIN_SEGMENT_TOKENS", 2)
    lengths = [200, 40, 64]
    assert walk_layout.walk_segment_tokens([200], 2, 64, 132) is not None   # would be cut when alone
    segmented = _count_segmented_walks(monkeypatch)
    inputs = make_inputs(1, sum(lengths), 1, 2, 16, 32, l2norm=True, num_states=len(lengths), seed=24)
    cu = random_cu_seqlens(lengths)
    knobs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, batch_invariant=True, design=design)
    out, final = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, **knobs)
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        one = {name: x[:, a:b] if name != "initial_state" else x[i:i + 1] for name, x in inputs.items()}
        o, f = chunk_gated_delta_rule(**one, cu_seqlens=random_cu_seqlens([n]), **knobs)
        assert torch.equal(o, out[:, a:b]) and torch.equal(f[0], final[i]), n
    assert not segmented


def test_recurrent_launch_knobs_reach_the_kernel(monkeypatch):
    kernel = LaunchRecorder(recurrent_module._recurrent_kernel)
    monkeypatch.setattr(recurrent_module, "_recurrent_kernel", kernel)
    inputs = make_inputs(3, 1, 1, 2, 16, 64, num_states=3, seed=12)
    check(fused_recurrent_gated_delta_rule, inputs, block_v=16, num_warps=1, num_stages=2)
    (grid, kw), = kernel.launches
    assert grid == (3 * 2 * 4,) and (kw["BV"], kw["num_warps"], kw["num_stages"]) == (16, 1, 2)


def test_bad_launch_knobs_and_inputs_are_rejected():
    inputs = make_inputs(2, 8, 1, 2, 16, 16, seed=13)
    with pytest.raises(ValueError, match="block_v"):
        chunk_gated_delta_rule(**inputs, block_v=24)
    with pytest.raises(ValueError, match="min_block_v"):
        chunk_gated_delta_rule(**inputs, min_block_v=8)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(**inputs, chunk_size=32)
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0, 8, 16], device=DEVICE))
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_gated_delta_rule(**{**inputs, "initial_state": torch.zeros(1, 2, 16, 16, device=DEVICE)})
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule(**{**inputs, "q": inputs["q"].repeat(1, 1, 3, 1), "k": inputs["k"].repeat(1, 1, 3, 1)})
    flat = {name: t[:1] if t.dim() else t for name, t in inputs.items() if t is not None}
    with pytest.raises(ValueError, match="end at the token count"):
        chunk_gated_delta_rule(**flat, cu_seqlens=torch.tensor([0, 3, 9], device=DEVICE))
    cu = torch.tensor([0, 3, 8], device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_cpu comes with cu_seqlens"):
        chunk_gated_delta_rule(**flat, cu_seqlens_cpu=cu.cpu())
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be"):
        chunk_gated_delta_rule(**flat, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="end at the token count"):   # the host copy's values are checked
        chunk_gated_delta_rule(**flat, cu_seqlens=cu, cu_seqlens_cpu=torch.tensor([0, 3, 9]))
    if DEVICE == "cpu":  # on the GPU the decode kernel trusts cu_seqlens (reading it would sync)
        with pytest.raises(ValueError, match="non-decreasing"):
            fused_recurrent_gated_delta_rule(**flat, cu_seqlens=torch.tensor([0, 5, 3, 8], device=DEVICE))


# --- the torch path (what the engine runs on CPU): fast, so a wider sweep ----------------------------

TORCH_SWEEP = [(K, V, group) for K, V in zip((16, 32, 64, 128, 16, 128), (16, 32, 64, 128, 128, 16))
               for group in (1, 2, 4)]


@pytest.mark.parametrize("K,V,group", TORCH_SWEEP)
def test_torch_path_matches_reference(torch_path, K, V, group):
    lengths = [1, 64, 97, 20]
    l2norm = group != 2
    inputs = make_inputs(1, sum(lengths), 2, 2 * group, K, V, device="cpu", l2norm=l2norm,
                         num_states=len(lengths), seed=K + V + group)
    cu = random_cu_seqlens(lengths, "cpu")
    check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=l2norm)
    check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=l2norm)


@pytest.mark.parametrize("chunk_size", [1, 16, 50, 64])
def test_torch_path_any_chunk_size_and_batch(torch_path, chunk_size):
    inputs = make_inputs(3, 77, 1, 2, 32, 16, device="cpu", num_states=3, gates="extreme", seed=chunk_size)
    check(chunk_gated_delta_rule, inputs, chunk_size=chunk_size)


@pytest.mark.parametrize("group_bytes", [1, 1 << 30])
def test_torch_path_sequence_groups(torch_path, monkeypatch, group_bytes):
    """The CPU path walks sequences in cache-sized groups: one sequence per group, or all in one."""
    from triton_kernels.gated_delta_rule import torch_path as torch_path_module

    monkeypatch.setattr(torch_path_module, "GROUP_BYTES", group_bytes)
    lengths = [70, 1, 130, 5, 64]
    inputs = make_inputs(1, sum(lengths), 2, 4, 32, 16, device="cpu", num_states=5, seed=18)
    check(chunk_gated_delta_rule, inputs, cu_seqlens=random_cu_seqlens(lengths, "cpu"))
    # The walk updates the states of the sequences still running at each step in place: sequences that
    # end at different steps, normal and extreme gates, small chunks (many steps).
    lengths = [70, 1, 130, 16, 5, 64, 33]
    for gates, chunk_size in (("normal", 16), ("extreme", 8)):
        inputs = make_inputs(1, sum(lengths), 2, 4, 16, 32, device="cpu", num_states=len(lengths), gates=gates,
                             l2norm=True, seed=20 + chunk_size)
        check(chunk_gated_delta_rule, inputs, cu_seqlens=random_cu_seqlens(lengths, "cpu"), l2norm=True,
              chunk_size=chunk_size)


def test_torch_path_exp_clamp_keeps_tiny_decays_exact(torch_path):
    """Decays below float32's normal range are clamped before exp (for speed); outputs still match the
    float64 reference when every gate sits in that range (g from -90 to -200 per token)."""
    inputs = make_inputs(2, 90, 1, 2, 32, 32, device="cpu", num_states=2, seed=22)
    inputs["g"] = -torch.empty_like(inputs["g"]).uniform_(90.0, 200.0)
    check(chunk_gated_delta_rule, inputs, chunk_size=32)
    inputs["g"] = -torch.empty_like(inputs["g"]).uniform_(0.5, 3.0)   # the sums cross -87 within a chunk
    check(chunk_gated_delta_rule, inputs, chunk_size=64)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_runs_under_inference_mode(path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    device = DEVICE if path == "triton" else "cpu"
    with torch.inference_mode():
        inputs = make_inputs(1, 20, 1, 1, 16, 16, device=device, num_states=2, seed=19)
        check(chunk_gated_delta_rule, inputs, cu_seqlens=random_cu_seqlens([7, 13], device))
        check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=random_cu_seqlens([7, 13], device))


def test_torch_path_float16_and_empty_sequences(torch_path):
    lengths = [0, 3, 130, 0, 1]
    inputs = make_inputs(1, sum(lengths), 1, 4, 64, 32, dtype=torch.float16, device="cpu", l2norm=True,
                         num_states=len(lengths), seed=14)
    cu = random_cu_seqlens(lengths, "cpu")
    for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
        _, s = check(fn, inputs, cu_seqlens=cu, l2norm=True)
        assert torch.equal(s[0], inputs["initial_state"][0])


# --- parity with transformers' reference functions (the engine's parity tests compare with them) ----

def _transformers_reference():
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    # inspect.unwrap: the decorator swaps in fla's kernels when fla is installed; we want the torch code.
    return inspect.unwrap(qwen.torch_chunk_gated_delta_rule), inspect.unwrap(qwen.torch_recurrent_gated_delta_rule)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_matches_transformers(path, monkeypatch):
    """Ours and transformers' functions in float32, both against transformers' in float64 (which equal
    the naive reference): ours at most FACTOR times as far off as theirs, plus FLOOR."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    device = DEVICE if path == "triton" else "cpu"
    hf_chunk, hf_recurrent = _transformers_reference()
    inputs = make_inputs(2, 100, 1, 2, 32, 32, device=device, l2norm=True, num_states=2, seed=15)
    in_float64 = {name: t.double() for name, t in inputs.items()}
    naive = naive_recurrent_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def run(fn, x):   # transformers' functions take q, k, v positionally
        return fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=True)

    for ours, theirs in ((chunk_gated_delta_rule, hf_chunk), (fused_recurrent_gated_delta_rule, hf_recurrent)):
        with float64_everywhere():   # transformers computes in float32 whatever the inputs' dtype
            exact = run(theirs, in_float64)
        assert all(x.dtype == torch.float64 and rel_rms(x, y) < 1e-12 for x, y in zip(exact, naive))
        for what, x, y, ref in zip(("output", "state"), run(ours, inputs), run(theirs, inputs), exact):
            err, bound = rel_rms(x, ref), FACTOR * rel_rms(y, ref) + FLOOR
            assert err <= bound, f"{ours.__name__} {what}: rel RMS {err:.2e} > {bound:.2e}"


# --- GPU only: bfloat16 at realistic sizes ---------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("design", ["fused", "split"])
@pytest.mark.parametrize("lengths", [[4096], [1, 17, 64, 700, 2000, 1314]])
def test_bfloat16_realistic_shapes(lengths, design):
    inputs = make_inputs(1, sum(lengths), 16, 32, 128, 128, dtype=torch.bfloat16, device="cuda", l2norm=True,
                         num_states=len(lengths), seed=16)
    cu = random_cu_seqlens(lengths, "cuda")
    check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True, design=design)
    if design == "fused":
        check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True)


@cuda_only
def test_bfloat16_decode_batch():
    inputs = make_inputs(1, 256, 2, 8, 128, 128, dtype=torch.bfloat16, device="cuda", l2norm=True,
                         num_states=256, seed=17)
    cu = torch.arange(257, dtype=torch.int32, device="cuda")  # 256 sequences, one new token each
    check(fused_recurrent_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True)


# --- few sequences, many tokens: narrower V blocks, then segments chained on the device (issues 20, 36) -------

@pytest.mark.parametrize("use_h0,design", [(False, "fused"), (True, "fused"), (True, "split")],
                         ids=["fresh", "initial-state", "split-initial-state"])
def test_segmented_walk_matches_reference(use_h0, design, monkeypatch):
    """Segments of 64 tokens (forced; the planner splits only long sequences): sequences of 1, 2 and 4
    segments, one ending off the chunk grid and an empty one (the shorter ones padded with empty segments),
    against the float64 reference; and the same bits when the offsets also come in host memory."""
    monkeypatch.setattr(walk_layout, "walk_segment_tokens", lambda *args: 64)
    lengths = [200, 64, 0, 100]
    inputs = make_inputs(1, sum(lengths), 2, 4, 32, 32, l2norm=True, num_states=4 if use_h0 else None, seed=21)
    cu = random_cu_seqlens(lengths)
    segmented = _count_segmented_walks(monkeypatch)
    o, s = check(chunk_gated_delta_rule, inputs, cu_seqlens=cu, l2norm=True, block_v=16, design=design)
    o2, s2 = chunk_gated_delta_rule(**inputs, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, block_v=16, design=design)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    assert segmented == {design: 2}


def _count_segmented_walks(monkeypatch) -> dict:
    """Counts the calls of each design's segmented walk (so a test knows the path it meant to take was taken)."""
    from triton_kernels.gated_delta_rule import split as split_module
    calls = {}
    for design, module, name in (("fused", chunk_module, "_segmented_walk"),
                                 ("split", split_module, "_segmented_state_walk")):
        original = getattr(module, name)

        def counted(*args, design=design, original=original, **kwargs):
            calls[design] = calls.get(design, 0) + 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("design", ["fused", "split"])
def test_segmented_walk_of_one_sequence(design, monkeypatch):
    """One sequence in three segments, the last off the chunk grid, without a final state asked for."""
    monkeypatch.setattr(walk_layout, "walk_segment_tokens", lambda *args: 64)
    segmented = _count_segmented_walks(monkeypatch)
    inputs = make_inputs(1, 150, 1, 2, 16, 32, num_states=1, seed=23)
    ref, _ = naive_recurrent_gated_delta_rule(**inputs)
    o, s = chunk_gated_delta_rule(**inputs, block_v=32, design=design)
    assert s is None and rel_rms(o, ref) < TOL[torch.float32]
    assert segmented == {design: 1}


def _walk_grids(target, batch, T, HV=16, K=128):
    """(grid, BV) of the walk launches chunk_gated_delta_rule makes for `target` (planned on meta tensors)."""
    from triton_kernels._launch import dry_run

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="meta")

    with dry_run(target) as launches:
        chunk_gated_delta_rule(empty(batch, T, HV, K), empty(batch, T, HV, K), empty(batch, T, HV, K),
                               empty(batch, T, HV, dtype=torch.float32), empty(batch, T, HV),
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    return [(launch.grid, launch.constexprs["BV"]) for launch in launches
            if launch.kernel.fn.__name__ == "_chunk_walk_kernel"]


def test_few_sequences_narrow_the_v_blocks_before_segmenting():
    """Qwen3.5-0.8B's 16 value heads of 128, one 32k-token sequence: whole, in blocks of 64, the walk would be
    32 programs; an H100 (132 SMs) walks it in blocks of 16 (128 programs), an A100 (108) in blocks of 32
    (64: blocks of 16 would need two waves). Neither segments it (three walks pay only at 4 segments or more
    in one wave). Two value heads (H100: 16 programs in blocks of 16) are cut into 8 segments of 8k, walked
    by up to 128 programs; an A100 cuts them into 4 of 16k (64 programs)."""
    from triton_kernels._launch import A100, H100

    assert _walk_grids(H100, 1, 32768) == [((128,), 16)]
    assert _walk_grids(A100, 1, 32768) == [((64,), 32)]
    assert _walk_grids(H100, 8, 32768) == [((8 * 16 * 2,), 64)]   # a full batch: the table's block_v
    # (local states of segments 0-6 and transitions of 1-7: 7 x 16 programs; then all 8 x 16)
    assert _walk_grids(H100, 1, 65536, HV=2) == [((112,), 16), ((112,), 16), ((128,), 16)]
    assert _walk_grids(A100, 1, 65536, HV=2) == [((48,), 16), ((48,), 16), ((64,), 16)]
    assert _walk_grids(H100, 1, 2048, HV=2) == [((16,), 16)]   # too short to split


def test_walk_plan_by_hand():
    """plan_walk's rule on small numbers: narrow while SMs are idle and the narrower walk fits one wave."""
    plan = walk_layout.plan_walk
    assert plan([16384], 32, 128, 64, block_v=64, min_block_v=16, num_sms=132) == walk_layout.WalkPlan(32, None, 1)
    assert plan([16384], 32, 128, 64, block_v=64, min_block_v=64, num_sms=132) == walk_layout.WalkPlan(64, None, 1)
    assert plan([16384], 32, 128, 64, block_v=64, min_block_v=16, num_sms=132,
                batch_invariant=True) == walk_layout.WalkPlan(64, None, 1)
    assert plan([100] * 70, 16, 128, 64, block_v=64, min_block_v=16, num_sms=132).block_v == 64
    assert plan([10], 1, 32, 64, block_v=64, min_block_v=16, num_sms=132) == walk_layout.WalkPlan(16, None, 1)
    # 1 x 10,000 tokens of 1 head: 8 programs; 16 segments would fit the SMs, 8 of 1,280 tokens keep >= 1,024 each
    assert plan([10000], 1, 128, 64, block_v=64, min_block_v=16, num_sms=132) == walk_layout.WalkPlan(16, 1280, 8)
    assert plan([10000, 5], 1, 128, 64, block_v=64, min_block_v=16, num_sms=132) == walk_layout.WalkPlan(16, 1280, 8)
    assert plan([10000], 4, 128, 64, block_v=64, min_block_v=16, num_sms=132) == walk_layout.WalkPlan(16, 2560, 4)
    assert plan([10000], 8, 128, 64, block_v=64, min_block_v=16, num_sms=132).segment is None   # 64 programs: 2 fit


def test_launch_tables_are_segment_major_and_longest_first():
    from triton_kernels.gated_delta_rule.layout import SequenceLayout

    layout = SequenceLayout((0, 300, 300, 420))   # lengths 300, 0, 120
    tables = walk_layout.launch_tables(layout, 64, 128, torch.device("cpu"))
    assert tables.chunks.tolist() == [list(c) for c in layout.chunk_bounds(64)]
    ranges, order = tables.walks["all"]   # 3 segments of each sequence, segment-major
    assert ranges.tolist() == [[0, 128], [300, 300], [300, 420],
                               [128, 256], [300, 300], [420, 420],
                               [256, 300], [300, 300], [420, 420]]
    assert order.tolist() == [0, 3, 2, 6, 1, 4, 5, 7, 8]
    assert walk_layout.launch_tables(layout, 64, 128, torch.device("cpu")) is tables   # cached per layout
    # the split design's state walk stores each row's chunk-start states from its first chunk's index on
    # (chunks: 0-4 of the first sequence, 5-6 of the third; an empty segment's index is never used)
    assert tables.first_chunks["all"].tolist() == [0, 5, 5, 2, 5, 6, 4, 5, 6]
    local, _ = tables.walks["local"]
    transition, _ = tables.walks["transition"]
    assert local.tolist() == ranges.tolist()[:6] and transition.tolist() == ranges.tolist()[3:]
    assert tables.first_chunks["local"].tolist() == tables.first_chunks["all"].tolist()[:6]
    assert tables.first_chunks["transition"].tolist() == tables.first_chunks["all"].tolist()[3:]
    whole_tables = walk_layout.launch_tables(layout, 64, None, torch.device("cpu"))
    whole, order = whole_tables.walks["all"]
    assert whole.tolist() == [[0, 300], [300, 300], [300, 420]] and order.tolist() == [0, 2, 1]
    assert whole_tables.first_chunks["all"].tolist() == [0, 5, 5]


def test_segment_starts_chain_on_the_device_as_the_affine_maps_say():
    """chain_segment_starts against the chain written out per sequence in float64."""
    gen = torch.Generator().manual_seed(5)
    pieces, N, HV, K, V = 4, 3, 2, 8, 4
    local = torch.randn((pieces - 1) * N, HV, K, V, generator=gen)
    transition = 0.3 * torch.randn((pieces - 1) * N, HV, K, K, generator=gen)
    h0 = torch.randn(N, HV, K, V, generator=gen)
    for initial in (None, h0):
        start = walk_layout.chain_segment_starts(local, transition, initial, pieces, N).double()
        for n in range(N):
            want = [torch.zeros(HV, K, V, dtype=torch.float64) if initial is None else h0[n].double(),
                    local[n].double()]   # segment 0 was walked from the initial state: A_0 is where it ends
            for j in range(2, pieces):   # S(j) = A_{j-1} + M_{j-1} S(j-1)
                want.append(local[(j - 1) * N + n].double() + transition[(j - 2) * N + n].double() @ want[-1])
            for j in range(pieces):
                assert torch.allclose(start[j * N + n], want[j], rtol=1e-5, atol=1e-5), (n, j)


# --- decode in place in a state pool (issue 20) -------------------------------------------------------

@pytest.mark.parametrize("path", ["triton", "torch"])
def test_in_place_decode_equals_gather_scatter_and_float64(path, monkeypatch):
    """Sequences decoding in slots of a state pool (slots out of order, others left alone), several steps in
    a row, one with two tokens for a sequence: the pool after the steps is bitwise what gathering each
    sequence's state, running the kernel and scattering the final states back gives, and matches the
    float64 reference carried the same way; slots no sequence owns are untouched."""
    if path == "torch":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    device = DEVICE if path == "triton" else "cpu"
    H, HV, K, V, num_slots = 1, 2, 16, 32, 7
    slots = torch.tensor([5, 0, 3, 6], device=device)
    pool = 0.5 * torch.randn(num_slots, HV, K, V, generator=torch.Generator().manual_seed(30)).to(device)
    gathered, ref = pool.clone(), pool.double()
    for step, lengths in enumerate(([1, 1, 1, 1], [1, 1, 1, 1], [1, 2, 1, 1], [1, 1, 1, 1])):
        inputs = make_inputs(1, sum(lengths), H, HV, K, V, device=device, l2norm=True, seed=40 + step)
        del inputs["initial_state"]
        cu = random_cu_seqlens(lengths, device)
        o, none = fused_recurrent_gated_delta_rule(**inputs, initial_state=pool, state_indices=slots,
                                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=True, block_v=16)
        assert none is None
        o_g, s_g = fused_recurrent_gated_delta_rule(**inputs, initial_state=gathered[slots], output_final_state=True,
                                                    cu_seqlens=cu, use_qk_l2norm_in_kernel=True, block_v=16)
        gathered[slots] = s_g
        o_ref, s_ref = naive_recurrent_gated_delta_rule(**inputs, initial_state=ref[slots], output_final_state=True,
                                                        cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        ref[slots] = s_ref
        assert torch.equal(o, o_g)
        assert rel_rms(o, o_ref) < TOL[torch.float32]
    assert torch.equal(pool, gathered)
    assert rel_rms(pool[slots], ref[slots]) < TOL[torch.float32]
    others = [s for s in range(num_slots) if s not in slots.tolist()]
    assert torch.equal(pool[others], ref[others].float())


def test_in_place_decode_rejects_bad_pools_and_indices():
    inputs = make_inputs(1, 3, 1, 2, 16, 16, device="cpu", seed=31)
    del inputs["initial_state"]
    cu = random_cu_seqlens([1, 1, 1], "cpu")
    pool = torch.zeros(4, 2, 16, 16)
    run = lambda **kw: fused_recurrent_gated_delta_rule(**{**inputs, "cu_seqlens": cu, **kw})  # noqa: E731
    with pytest.raises(ValueError, match="distinct"):
        run(initial_state=pool, state_indices=torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError, match="distinct"):
        run(initial_state=pool, state_indices=torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match=r"shape \[N\]"):
        run(initial_state=pool, state_indices=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32 state pool"):
        run(initial_state=pool.double(), state_indices=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="output_final_state"):
        run(initial_state=pool, state_indices=torch.tensor([0, 1, 2]), output_final_state=True)


# --- q, k, v read where the conv wrote them: column views of one wider tensor (issue 36) ----------------------

class ArgsRecorder:
    """Stands in for a Triton kernel: records each launch's positional arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(args)
            return self.kernel[grid](*args, **kwargs)

        return launch


def _as_conv_columns(inputs, batch, T):
    """q, k, v as the mixer makes them: column views of one [batch, T, 2 H K + HV V] tensor (the conv's output),
    split and reshaped; and that tensor."""
    q, k, v = (inputs[name] for name in ("q", "k", "v"))
    mixed = torch.cat([x.reshape(batch, T, -1) for x in (q, k, v)], dim=-1)
    qv, kv, vv = mixed.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1)
    return dict(inputs, q=qv.reshape(q.shape), k=kv.reshape(k.shape), v=vv.reshape(v.shape)), mixed


@pytest.mark.parametrize("design", ["fused", "split", "recurrent"])
def test_column_views_are_read_in_place_and_give_the_contiguous_bits(design, monkeypatch):
    """q, k, v as column views of the conv's output (packed sequences off the chunk grid, continued from a state,
    two value heads per key head) give exactly the outputs and final states of the same values passed contiguous,
    and every kernel that reads them is handed the views themselves (no copy before it); the result also matches
    the float64 reference."""
    from triton_kernels.gated_delta_rule import split as split_module
    names = {"fused": (chunk_module, ("_chunk_prep_kernel", "_chunk_walk_kernel")),
             "split": (split_module, ("_split_solve_kernel", "_split_wu_kernel", "_split_state_kernel",
                                      "_split_output_kernel")),
             "recurrent": (recurrent_module, ("_recurrent_kernel",))}
    module, kernels = names[design]
    lengths = [1, 2, 1] if design == "recurrent" else [70, 5, 64]
    inputs = make_inputs(1, sum(lengths), 1, 2, 16, 32, l2norm=True, num_states=len(lengths), seed=50)
    cu = random_cu_seqlens(lengths)
    if design == "recurrent":
        fn = functools.partial(fused_recurrent_gated_delta_rule, block_v=16)
    else:
        fn = functools.partial(chunk_gated_delta_rule, design=design, block_v=16)
    o, s = check(fn, inputs, cu_seqlens=cu, l2norm=True)
    views, mixed = _as_conv_columns(inputs, 1, sum(lengths))
    assert not views["q"].is_contiguous() and views["k"].data_ptr() == mixed.data_ptr() + 16 * mixed.element_size()
    recorders = {name: ArgsRecorder(getattr(module, name)) for name in kernels}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    o2, s2 = fn(**views, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    in_place = {views[x].data_ptr() for x in ("q", "k", "v")}
    for name, recorder in recorders.items():
        assert recorder.launches, name
        for args in recorder.launches:   # the tensors the kernel reads q, k or v from are views of `mixed`
            read = {a.data_ptr() for a in args if isinstance(a, torch.Tensor)} & (in_place | {mixed.data_ptr()})
            assert read and all(a.data_ptr() in in_place for a in args if isinstance(a, torch.Tensor)
                                and a.untyped_storage().data_ptr() == mixed.untyped_storage().data_ptr()), name


def test_batched_column_views_and_other_layouts_give_the_contiguous_bits():
    """A batch (B = 2, no cu_seqlens) of column views reads them in place too (the batch dim steps by T tokens);
    q with its channels two elements apart and v with its channels HV apart (heads next to each other) are copied
    first (the kernels take a token stride only), with the same bits; through the fused design and the recurrent
    kernel."""
    inputs = make_inputs(2, 20, 1, 2, 16, 16, l2norm=True, num_states=2, seed=51)
    views, _ = _as_conv_columns(inputs, 2, 20)
    wide = torch.stack([inputs["q"], torch.zeros_like(inputs["q"])], dim=-1)[..., 0]   # channel stride 2
    odd = dict(inputs, q=wide, v=inputs["v"].transpose(2, 3).contiguous().transpose(2, 3))   # heads 1 apart
    assert wide.stride(-1) == 2 and odd["v"].stride()[2:] == (1, 2) and torch.equal(odd["v"], inputs["v"])
    for fn in (functools.partial(chunk_gated_delta_rule, block_v=16),
               functools.partial(fused_recurrent_gated_delta_rule, block_v=16)):
        want = fn(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
        for given in (views, odd):
            got = fn(**given, output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_token_rows_keeps_views_whose_tokens_are_rows_and_copies_the_rest():
    from triton_kernels.gated_delta_rule.layout import token_rows
    mixed = torch.randn(2, 5, 3 * 4 * 8)
    q = mixed[..., 32:64].reshape(2, 5, 4, 8)
    x, stride = token_rows(q, 10, 4, 8)
    assert x.data_ptr() == q.data_ptr() and stride == 96 and torch.equal(x, q.reshape(10, 4, 8))
    cut = torch.randn(2, 6, 96)[:, :5, 32:64].reshape(2, 5, 4, 8)   # batch dim 6 tokens apart: reshape copies
    x, stride = token_rows(cut, 10, 4, 8)
    assert stride == 32 and x.is_contiguous() and torch.equal(x, cut.reshape(10, 4, 8))
    for odd in (q.transpose(2, 3).contiguous().transpose(2, 3), torch.randn(2, 5, 4, 16)[..., :8]):   # channels,
        assert not odd.is_contiguous()                                                               # heads apart
        x, stride = token_rows(odd, 10, 4, 8)
        assert stride == 32 and x.is_contiguous() and torch.equal(x, odd.reshape(10, 4, 8))
    one = torch.randn(1, 1, 96)[..., 32:64].reshape(1, 1, 4, 8)
    assert token_rows(one, 1, 4, 8)[1] == 32 and token_rows(one, 1, 4, 8)[0].data_ptr() == one.data_ptr()
