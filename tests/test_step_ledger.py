"""bench/step_ledger.py: one engine step of each shape planned on the meta device, its kernels and bytes counted
right on cases checked by hand, and ESM-2 650M's budgets after the fused kernels (issue 35, item 4)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from .run_helpers import require_triton
from .tiny_models import REPO


def _load():
    spec = importlib.util.spec_from_file_location("step_ledger", REPO / "bench" / "step_ledger.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


step_ledger = _load()
GB = 1e9


@pytest.fixture(scope="module")
def ledgers():
    return {name: step_ledger.ledger(name) for name in ("esm2-650m", "esm2-3b", "prott5-xl", "ankh-large",
                                                        "qwen35-0.8b")}


def test_every_shape_runs_one_full_step(ledgers):
    for name, r in ledgers.items():
        assert 30000 <= r["tokens"] <= 32768, name
        assert r["families"]["GEMM"]["kernels_per_layer"] == 4, name   # every shape: 4 products per layer
        assert r["kernels_per_layer"] == (r["aten_kernels"] + r["triton_launches"]) / r["layers"]
        assert sum(f["kernels"] for f in r["families"].values()) == r["aten_kernels"] + r["triton_launches"]
        assert r["non_gemm_bytes"] == sum(f["bytes"] for k, f in r["families"].items() if k != "GEMM")
        assert r["predicted_step_ms"] == pytest.approx(sum(r["predicted_ms"].values()))
        assert r["triton"], name   # attention (and the delta rule) took the Triton path
    assert set(ledgers["qwen35-0.8b"]["triton"]) >= {"_chunk_prep_kernel", "_chunk_walk_kernel", "_causal_conv_kernel"}
    assert ledgers["qwen35-0.8b"]["families"]["delta rule"]["bytes"] > 0
    # ESM-2 3B is ESM-2 650M scaled: the same kernels per layer, twice the GEMM FLOPs per token-d
    assert ledgers["esm2-3b"]["kernels_per_layer"] == pytest.approx(ledgers["esm2-650m"]["kernels_per_layer"], abs=0.2)


def test_a_two_layer_step_counted_by_hand():
    lengths = [10, 20]
    r = step_ledger.ledger("esm2-650m", layers=2, lengths=lengths)
    T, d, ffn, L = 30, 1280, 5120, 2
    assert (r["tokens"], r["sequences"], r["layers"]) == (T, 2, L)
    products = [(d, 3 * d), (d, d), (d, ffn), (ffn, d)]   # (in, out): qkv, attention output, fc1, fc2; all with bias
    gemm = r["families"]["GEMM"]
    assert gemm["kernels"] == 4 * L
    assert gemm["read"] == L * sum(2 * (T * k + n * k + n) for k, n in products)   # bf16 input, weight, bias
    assert gemm["written"] == L * sum(2 * T * n for _, n in products)
    assert r["gemm_flops"] == L * sum(2 * T * k * n for k, n in products)
    heads, head_dim = 20, 64
    assert r["attention_flops"] == 4 * (10 * 10 + 20 * 20) * heads * head_dim * L   # bidirectional: every pair
    embedding = r["ops"]["other: embedding"]
    # the ids and the rows it picks from the table (not the whole table) in, the rows out
    assert (embedding["count"], embedding["read"], embedding["written"]) == (1, 8 * T + 2 * T * d, 2 * T * d)


def test_the_recorder_counts_kernels_not_views():
    meta = torch.device("meta")
    recorder = step_ledger._Recorder(meta)
    with torch.inference_mode():
        x = torch.empty(8, 4, 16, device=meta, dtype=torch.bfloat16)
        w = torch.empty(32, 64, device=meta, dtype=torch.bfloat16)
        host = torch.arange(8)
        with recorder:
            flat = x.view(8, 64)                      # a view: no kernel
            q, k = x.unbind(1)[:2]                    # views
            y = torch.nn.functional.linear(flat, w)   # [8, 32] product: 2 * 8 * 64 * 32 FLOPs
            f = q.float()                             # a copy of a strided view: its 8 * 16 elements
            f.add_(1.0)
            x.contiguous()                            # already contiguous: no kernel
            k.contiguous()                            # strided: a copy
            on_device = host.to(meta)                 # host to device
            back = on_device.tolist()                 # read back: its host values, counted as a read
    names = [(o.name, o.family, o.read, o.written) for o in recorder.ops]
    assert names == [("linear", "GEMM", 8 * 64 * 2 + 32 * 64 * 2, 8 * 32 * 2), ("to", "copies", 8 * 16 * 2, 8 * 16 * 4),
                     ("add_", "other", 8 * 16 * 4, 8 * 16 * 4), ("contiguous", "copies", 8 * 16 * 2, 8 * 16 * 2),
                     ("to", "copies", 8 * 8, 8 * 8)]
    assert recorder.ops[0].flops == 2 * 8 * 64 * 32
    assert back == list(range(8)) and len(recorder.host_reads) == 1
    assert recorder.host_reads[0].startswith("tests/test_step_ledger.py:")


def test_triton_launches_are_counted_by_each_kernel_s_bytes_model():
    from triton_kernels import write_kv_cache
    from triton_kernels._launch import H100, dry_run
    meta = torch.device("meta")
    T, H, D, pages = 24, 4, 64, 10
    k = torch.empty(T, H, D, device=meta, dtype=torch.bfloat16)
    cache = torch.empty(pages, 16, H, D, device=meta, dtype=torch.bfloat16)
    with dry_run(H100) as launches:
        write_kv_cache(k, k, cache, cache.clone(), torch.empty(T, device=meta, dtype=torch.int64))
    step = step_ledger.StepLengths(np.array([T]), np.array([T]))
    read, written, exact = step_ledger.launch_bytes(launches[0], step, caches=set())
    assert (read, written, exact) == (2 * T * H * D * 2 + 8 * T, 2 * T * H * D * 2, True)
    # A kernel the ledger has no model for: its tensor arguments other than the caches, flagged as an estimate
    unknown = step_ledger.Launch(object(), (1,), (k, cache, 3))
    assert step_ledger.launch_bytes(unknown, step, caches={step_ledger._storage(cache)}) == (T * H * D * 2, 0, False)
    assert step_ledger.kernel_family("_fused_add_layer_norm") == "norm"
    assert step_ledger.kernel_family("_qk_rotary_scale") == "rotary"


def test_the_gate_kernels_and_the_qk_pass_are_counted_by_hand():
    """Qwen3.5's fused gates and the one-launch q/k norm + rotary, their bytes from views of one projection row."""
    from triton_kernels._launch import H100, dry_run
    from triton_kernels.gates import delta_rule_gates, sigmoid_gate
    from triton_kernels.rotary import norm_rotate_qk_
    meta, bf16 = torch.device("meta"), torch.bfloat16
    T, H, Hk, D, rd, HV = 24, 4, 2, 64, 16, 6
    qkv = torch.empty(T, 2 * H * D + 2 * Hk * D, device=meta, dtype=bf16)
    qg = qkv[:, :2 * H * D].view(T, H, 2 * D)
    q, gate, k = qg[..., :D], qg[..., D:], qkv[:, 2 * H * D:(2 * H + Hk) * D].view(T, Hk, D)
    proj = torch.empty(T, 100 + 2 * HV, device=meta, dtype=bf16)
    w, cos = torch.empty(D, device=meta, dtype=bf16), torch.empty(T, rd, device=meta, dtype=bf16)
    params = torch.empty(HV, device=meta, dtype=bf16)
    with dry_run(H100) as launches:
        sigmoid_gate(torch.empty(T, H, D, device=meta, dtype=bf16), gate)
        delta_rule_gates(proj[:, -HV:], proj[:, -2 * HV:-HV], params, params)
        norm_rotate_qk_(q, k, cos, cos, w, w, 1e-6, zero_centred=True, head_dim=D)
    step = step_ledger.StepLengths(np.array([T]), np.array([T]))
    bytes_of = [step_ledger.launch_bytes(launch, step, caches=set()) for launch in launches]
    assert [step_ledger.kernel_family(step_ledger.kernel_name(x)) for x in launches] == ["activation", "delta rule",
                                                                                       "rotary"]
    assert bytes_of[0] == (2 * T * H * D * 2, T * H * D * 2, True)                  # read o and the gate, write
    assert bytes_of[1] == (2 * T * HV * 2 + 2 * HV * 2, T * HV * (4 + 2), True)     # a, b, A_log, dt_bias -> g, beta
    rows = T * (H + Hk)   # every channel of every head read and written once; cos and sin per tensor; both weights
    assert bytes_of[2] == (rows * D * 2 + 2 * T * (rd // 2) * 2 * 2 + 2 * D * 2, rows * D * 2, True)


def test_ankh_large_is_its_published_config_and_its_step_is_fused(ledgers):
    """ankh-large: Ankh-large's published encoder values. Its layers fused on the Triton path (T5Layer.forward_fused):
    attention from the projection with the bias, each residual add with the RMS norm after it, and the gated-gelu
    feed-forward's gelu_new(gate) * up in one pass (gelu_tanh_mul: gate and up read, the product written, 15 d per
    token-layer at d_ff = 2.5 d; unfused, the gelu pass and mul_ were 25 d). Unfused: 18.1 kernels a layer, 96.3 d,
    200.3 ms predicted."""
    from tests.families.published_configs import PUBLISHED
    published = PUBLISHED["ankh_large"]
    assert {k: published[k] for k in step_ledger.ANKH_LARGE if k in published} == {
        k: v for k, v in step_ledger.ANKH_LARGE.items() if k in published}
    assert {"d_model", "d_ff", "num_heads", "d_kv", "num_layers", "feed_forward_proj"} <= published.keys()
    r = ledgers["ankh-large"]
    layers = r["layers"]
    assert (layers, r["hidden"]) == (48, 1536)
    assert r["families"]["GEMM"]["kernels_per_layer"] == 4
    act = r["triton"]["_act_mul_kernel"]
    assert act["count"] == layers and act["exact"] and act["family"] == "activation"
    assert r["families"]["activation"]["d_per_token_layer"] == pytest.approx(15.0)
    assert r["triton"]["_add_rms_norm_kernel"]["count"] == 2 * layers + 1
    assert "_write_kv_cache" not in r["triton"]
    assert not any(op.startswith(("activation:", "norm:", "residual:")) for op in r["ops"]), r["ops"]
    assert r["kernels_per_layer"] <= 8.5
    assert r["non_gemm_d_per_token_layer"] <= 50


def test_the_command_prints_the_tables_and_writes_json(tmp_path):
    require_triton()
    out = tmp_path / "ledger.json"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "step_ledger.py"), "esm2-650m", "--layers", "2",
                          "--tokens", "4096", "--json", str(out)], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "kernels per layer" in res.stdout and "| _paged_attention_fwd |" in res.stdout
    assert "predicted step time" in res.stdout
    data = json.loads(out.read_text())
    assert data[0]["model"] == "esm2-650m" and data[0]["layers"] == 2 and data[0]["tokens"] <= 4096


def test_esm2_650m_step_budget(monkeypatch):
    """Issue 35's budgets for ESM-2 650M with the fused rotary, add + LayerNorm, encoder attention and linear +
    GELU kernels (the unfused step: 26.7 kernels and ~137 d per token-layer; fused: 8.7 and 33 d). No KV-cache
    write, no GELU pass, and the rotary is one launch per layer."""
    from dataclasses import replace

    import pipeline.models.esm as esm
    knobs = esm.gemm_knobs
    monkeypatch.setattr(esm, "gemm_knobs", lambda device, **k: replace(knobs(device, **k), epilogue_gelu=True))
    r = step_ledger.ledger("esm2-650m")
    assert r["kernels_per_layer"] <= 12
    assert r["non_gemm_d_per_token_layer"] <= 40
    assert "_write_kv_cache" not in r["triton"]
    assert r["triton"]["_rotate_qk_kernel"]["count"] == r["layers"]
    assert r["triton"]["_linear_gelu_kernel"]["count"] == r["layers"]


def test_esm2_650m_step_as_the_h100_runs_it(ledgers):
    """The launch table's choice for the H100: cuBLAS for the first MLP product and a GELU pass after it (measured
    faster per step than the GELU in our product's epilogue, launch_config.py). The GELU pass is the whole
    difference from the fully fused step: one more kernel and 16 d per token-layer (read and write [T, 4d])."""
    r = ledgers["esm2-650m"]
    assert r["kernels_per_layer"] <= 12
    assert "_linear_gelu_kernel" not in r["triton"] and "_write_kv_cache" not in r["triton"]
    assert r["families"]["activation"]["kernels_per_layer"] == 1
    assert r["families"]["activation"]["d_per_token_layer"] == pytest.approx(16, rel=0.01)
    assert r["non_gemm_d_per_token_layer"] <= 40 + 16


def test_qwen35_08b_step_budget(ledgers):
    """Qwen3.5-0.8B with the fused RMS-norm kernels on the Triton path (docs/kernels/rms_norm.md): unfused, 41.0
    kernels and 252.8 d per token-layer (norm 122.3 d, activation 37.0, residual 12.0); with the residual + norm,
    gated norm and silu_mul kernels, 25.4 and 142.1 d (norm 37.7, rotary 3.0 in 3.3 kernels, activation 23.0);
    with the attention layers' q/k norms and rotary in one pass each too (norm_rotate_), 20.4 and 129.2 d (norm
    25.2, rotary 2.7 in 0.8 kernels: the tables' five ops and the pass), 84.7 ms predicted; with the delta rule
    reading q, k, v in place too (column views of the conv's output, docs/kernels/gated_delta_rule.md: no
    `contiguous` copies, delta rule 69.8 -> 51.8 d), 18.1 and 111.2 d, 79.9 ms; with the gates fused
    (docs/kernels/gates.md: the attention's output gate one pass instead of a copy, a sigmoid and a mul; the
    delta-rule gates one kernel instead of eight; q and k one norm_rotate_qk_ launch), 12.1 and 107.0 d (delta rule
    51.5 d in 3.0 kernels, activation 24.0 d, rotary 2.7 d in 0.54, no copies, nothing in "other" but the
    embedding), 78.8 ms. Budgets a few percent above. Every residual add rides with a norm, and no norm, gate or
    delta-rule op is left to aten."""
    r = ledgers["qwen35-0.8b"]
    layers, attention_layers = r["layers"], 6
    delta_layers = layers - attention_layers
    assert r["kernels_per_layer"] <= 12.5
    assert r["non_gemm_d_per_token_layer"] <= 110
    assert r["families"]["delta rule"]["d_per_token_layer"] <= 53
    assert r["families"]["delta rule"]["kernels_per_layer"] == pytest.approx(4 * delta_layers / layers)
    assert not any(op.endswith(": contiguous") for op in r["ops"])
    assert r["families"]["norm"]["d_per_token_layer"] <= 26
    assert r["families"]["rotary"]["d_per_token_layer"] <= 2.8
    assert r["families"]["rotary"]["kernels_per_layer"] <= 0.6
    assert r["families"]["activation"]["d_per_token_layer"] <= 25
    assert "residual" not in r["families"] or r["families"]["residual"]["bytes"] == 0
    assert "copies" not in r["families"] or r["families"]["copies"]["kernels"] == 0
    assert r["triton"]["_add_rms_norm_kernel"]["count"] == 2 * layers + 1
    assert r["triton"]["_gated_rms_norm_kernel"]["count"] == delta_layers
    assert r["triton"]["_act_mul_kernel"]["count"] == layers
    assert r["triton"]["_norm_rotate_kernel"]["count"] == attention_layers   # q and k in one launch
    assert r["triton"]["_sigmoid_gate_kernel"]["count"] == attention_layers
    assert r["triton"]["_delta_rule_gates_kernel"]["count"] == delta_layers
    assert not any(op.startswith(("norm:", "delta rule:", "activation:", "copies:")) for op in r["ops"]), r["ops"]
    assert [op for op in r["ops"] if op.startswith("other:")] == ["other: embedding"], r["ops"]
    assert r["predicted_step_ms"] <= 81


def test_prott5_xl_step_budget(ledgers):
    """ProtT5-XL with its layers fused on the Triton path (pipeline/models/t5.py T5Layer.forward_fused): unfused,
    17.2 kernels and 189.2 d per token-layer (attention 64.0 with the KV-cache write and the paged gather, norm 49.0
    in T5LayerNorm's casts, residual 12.0, the ReLU pass 64.0), 188.6 ms predicted; fused, 8.1 and 112.3 d: the
    attention reads q, k and v where the projection wrote them, with the relative-position bias (32 d: T5's inner
    dim is four times d_model), each residual add rides with the RMS norm after it (16.2 d), the ReLU pass is left;
    168.2 ms. Budgets a few percent above."""
    r = ledgers["prott5-xl"]
    layers = r["layers"]
    assert r["kernels_per_layer"] <= 8.5
    assert r["non_gemm_d_per_token_layer"] <= 115
    assert "_write_kv_cache" not in r["triton"]
    assert r["triton"]["_paged_attention_fwd"]["count"] == layers
    assert r["families"]["attention"]["d_per_token_layer"] == pytest.approx(32, rel=0.01)
    assert r["triton"]["_add_rms_norm_kernel"]["count"] == 2 * layers + 1
    assert r["families"]["norm"]["d_per_token_layer"] <= 17
    assert "residual" not in r["families"] or r["families"]["residual"]["bytes"] == 0
    assert not any(op.startswith(("norm:", "residual:")) for op in r["ops"]), r["ops"]
    assert r["predicted_step_ms"] <= 170


def test_the_split_delta_rule_design_is_counted_by_its_kernels_bytes_models():
    """`--delta-design split`: the four kernels of the split design in place of the fused prep and walk, each by its
    bytes model; per token and value head they move more than the fused design (4,640 against 2,842 bytes in
    docs/kernels/gated_delta_rule.md), which the delta-rule family shows."""
    lengths = np.array([300, 200, 60])
    split = step_ledger.ledger("qwen35-0.8b", layers=4, lengths=lengths, delta_design="split")
    fused = step_ledger.ledger("qwen35-0.8b", layers=4, lengths=lengths)
    delta = {name: row for name, row in split["triton"].items() if row["family"] == "delta rule"}
    assert {"_split_solve_kernel", "_split_wu_kernel", "_split_state_kernel", "_split_output_kernel"} <= set(delta)
    assert not {"_chunk_prep_kernel", "_chunk_walk_kernel"} & set(split["triton"])
    assert {"_chunk_prep_kernel", "_chunk_walk_kernel"} <= set(fused["triton"])
    assert all(row["exact"] for row in delta.values())
    assert split["families"]["delta rule"]["bytes"] > fused["families"]["delta rule"]["bytes"]
    assert split["predicted_step_ms"] > fused["predicted_step_ms"]   # bytes only: occupancy is not in the model


def test_kv_cache_size_prints_what_benchmarks_records_for_qwen35():
    """bench/kv_cache_size.py, the script behind docs/BENCHMARKS.md's Qwen3.5-0.8B cache sizes: its table has the
    figures recorded there, and the cache sized for a 1,026-token record is the smaller on both devices."""
    res = subprocess.run([sys.executable, str(REPO / "bench" / "kv_cache_size.py"), "qwen35-0.8b", "--limit", "262144",
                          "--longest", "1026"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    recorded = (REPO / "docs" / "BENCHMARKS.md").read_text()
    for pages, size in (("16,896", "6.64 GB"), ("577", "0.23 GB"), ("18,688", "3.67 GB"), ("2,369", "0.47 GB")):
        assert f"| {pages} | {size} |" in res.stdout, res.stdout
        assert f"{pages} pages" in recorded and size in recorded
