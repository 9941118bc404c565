"""Our GPU kernels are batch-invariant by design (issue #19 part 1), checked in the Triton interpreter: a
sequence's outputs are the same bits alone and among others, as long as the launch does not depend on
the batch (fixed attention knobs; the delta rule's walk never cut into segments under batch_invariant).

The engine does not rely on this on a GPU (cuBLAS matmuls choose algorithms by shape); it is the
kernels' half of the property, so a GPU engine with batch-invariant matmuls could have all of it.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.run_helpers import require_triton

require_triton()

import triton_kernels  # noqa: E402
from triton_kernels.gated_delta_rule import chunk as chunk_module, walk_layout  # noqa: E402
from triton_kernels.paged_attention import paged_attention  # noqa: E402

from tests.kernels.test_gated_delta_rule import make_inputs, random_cu_seqlens  # noqa: E402
from tests.kernels.test_paged_attention import make_batch  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="Triton on CPU needs TRITON_INTERPRET=1 (conftest.py)")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _alone(seqs, i, **kw):
    """Sequence i of `seqs` as a batch of its own, with the same keys, values and queries."""
    batch = make_batch(seqs, **kw)
    q, k_cache, v_cache, tables, cu, kv_lens = batch
    a, b = int(cu[i]), int(cu[i + 1])
    return (q[a:b], k_cache, v_cache, tables[i:i + 1], torch.tensor([0, b - a], dtype=torch.int32, device=q.device),
            kv_lens[i:i + 1]), batch, (a, b)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_rows_do_not_depend_on_the_other_sequences(splits):
    seqs = [(1, 37), (7, 50), (23, 23), (1, 16), (12, 64), (5, 5)]
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32, device=DEVICE)
    knobs = dict(block_q=4, pages_per_tile=2, num_kv_splits=splits)
    for i in range(len(seqs)):
        alone, batch, (a, b) = _alone(seqs, i, **kw)
        together = paged_attention(*batch, causal=True, **knobs)
        assert torch.equal(paged_attention(*alone, causal=True, **knobs), together[a:b]), seqs[i]


def test_delta_rule_sequences_do_not_depend_on_the_other_sequences(monkeypatch):
    """With batch_invariant the walk is never segmented (the number of segments follows the batch): a
    lone sequence long enough to be segmented on an H100 gives the bits it gives among others."""
    monkeypatch.setattr(walk_layout, "MIN_SEGMENT_TOKENS", 2)
    lengths = [320, 40, 130, 64]
    assert walk_layout.walk_segment_tokens([320], 2, 64, 132) is not None   # would be cut when alone
    segmented = []
    original = chunk_module._segmented_walk
    monkeypatch.setattr(chunk_module, "_segmented_walk", lambda *a, **k: segmented.append(1) or original(*a, **k))
    inputs = make_inputs(1, sum(lengths), 1, 2, 32, 32, l2norm=True, num_states=len(lengths), seed=3)
    cu = random_cu_seqlens(lengths)
    out, final = triton_kernels.chunk_gated_delta_rule(**inputs, cu_seqlens=cu, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True, batch_invariant=True)
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        one = {name: x[:, a:b] if name != "initial_state" else x[i:i + 1] for name, x in inputs.items()}
        o, f = triton_kernels.chunk_gated_delta_rule(**one, cu_seqlens=random_cu_seqlens([n]),
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                     batch_invariant=True)
        assert torch.equal(o, out[:, a:b]) and torch.equal(f[0], final[i]), n
    assert not segmented
