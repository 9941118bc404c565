"""Turn a scheduled step into tensors, run the model on them, and own the caches the layers read.

The KV cache is one `[pages, page_size, Hkv, D]` pair per attention layer (encoders, which never carry
keys from one step to the next, share one pair across layers); the delta-rule state is one conv-window
tensor and one float32 recurrent tensor per Gated DeltaNet layer, indexed by state slot.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from triton_kernels import pointwise
from triton_kernels._device import target_of, torch_path_on_cpu

from ..models.base import NativeModel
from ..models.layers.attention import cache_head_dim
from .block_manager import BlockManager
from .config import INVARIANT_SPLIT, EngineConfig
from ..models.step import StepContext
from ..models.transfers import to_device
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: NativeModel, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.spec = model.spec
        self.triton = config.triton_kernels(device)
        self._allocated = False

    def allocate(self) -> None:
        """Create the caches (once; their sizes were validated by EngineConfig.resolve)."""
        if self._allocated:
            return
        c, s = self.config, self.spec
        shape = (c.num_pages, c.page_size, s.num_kv_heads, cache_head_dim(s.head_dim, self.triton))
        layers = self.model.attention_layers()
        shared = None
        for attn in layers:
            if s.is_causal or shared is None:
                shared = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device))
            attn.kv = shared
        for layer in self.model.delta_layers():
            d = s.delta
            layer.state = (
                torch.zeros(c.num_state_slots, d.conv_width, d.conv_channels, dtype=self.dtype, device=self.device),
                torch.zeros(c.num_state_slots, d.num_v_heads, d.head_k_dim, d.head_v_dim, dtype=torch.float32,
                            device=self.device))
            layer.kernel_args = self._delta_rule_knobs()
        self._allocated = True

    def _delta_rule_knobs(self) -> dict:
        """Launch knobs of the delta-rule layers' kernels (the causal conv's too), by function: with Triton,
        the launch table's row for this GPU (triton_kernels/launch_config.py) under the config's explicit
        ones; else just those."""
        c = self.config
        chunk = dict(c.gdn_launch.get("chunk_gated_delta_rule", {}))
        decode = dict(c.gdn_launch.get("fused_recurrent_gated_delta_rule", {}))
        conv = dict(c.gdn_launch.get("causal_conv1d", {}))
        if self.triton:
            from triton_kernels.causal_conv import conv_knobs
            from triton_kernels.gated_delta_rule.op import chunk_knobs, decode_knobs
            chunk = dict(vars(chunk_knobs(self.device, **chunk)))
            decode = dict(vars(decode_knobs(self.device, **decode)))
            conv = dict(vars(conv_knobs(self.device, **conv)))
        return {"chunk_gated_delta_rule": dict(chunk_size=c.gdn_chunk_size, batch_invariant=c.batch_invariant, **chunk),
                "fused_recurrent_gated_delta_rule": decode, "causal_conv1d": conv}

    def prepare(self, step: list[ScheduledSeq], blocks: BlockManager) -> StepContext:
        """Host-side arrays of one step, sent to the device in one copy that does not wait for it.

        One pass over the step's sequences reads five numbers each; everything else is vectorised: the
        block table is a gather of the sequences' rows of blocks.tables (written once at admission)."""
        page, S = self.config.page_size, len(step)
        info = np.array([(s.start, s.num_tokens, s.seq.row, s.seq.slot, s.seq.num_prompt) for s in step],
                        np.int64).reshape(S, 5)
        prior, q_lens, rows, slots, prompts = info.T
        T = int(q_lens.sum())
        if T == S:   # decode steps (and one-token prefills): the token at each sequence's position
            ids = np.array([s.seq.token_ids[s.start] for s in step], np.int64)
        else:
            ids = np.concatenate([np.asarray(s.seq.token_ids[s.start:s.end], np.int64) for s in step])
        cu = np.zeros(S + 1, np.int32)
        np.cumsum(q_lens, out=cu[1:])
        seg = np.repeat(np.arange(S), q_lens)
        positions = np.arange(T, dtype=np.int64) + (prior - cu[:-1])[seg]
        assert (blocks.table_lens[rows] > 0).all(), "a sequence in the step holds no pages"
        tables = blocks.block_tables(rows)
        slot_mapping = tables[seg, positions // page].astype(np.int64) * page + positions % page
        state_read = state_write = None
        if self.spec.delta is not None:
            read = np.flatnonzero(prior > 0)
            write = np.flatnonzero(slots >= 0)
            assert (slots[read] >= 0).all(), "a sequence continues without a state slot"
            state_read = (read, slots[read]) if len(read) else None
            state_write = (write, slots[write]) if len(write) else None
        # One staging buffer and one copy for all of them (pinned on a GPU: the copy never waits for the device).
        ids_d, positions_d, cu_d, kv_lens_d, tables_d, slots_d, seg_d = to_device(
            [ids, positions, cu, (prior + q_lens).astype(np.int32), tables, slot_mapping, seg], self.device)
        ctx = StepContext(
            input_ids=ids_d, positions=positions_d, cu_seqlens=cu_d, kv_lens=kv_lens_d,
            block_tables=tables_d, slot_mapping=slots_d, q_lens=q_lens, prior_lens=prior,
            state_read=state_read, state_write=state_write, triton_kernels=self.triton,
            attention_launch=self._launch(step, q_lens, tables.shape[1]),
            invariant_block=INVARIANT_SPLIT if self.config.batch_invariant else 0,
            decoding=prior >= prompts, host_ids=ids, host_positions=positions)
        ctx.memo["segment_ids"] = seg_d
        return ctx

    def _launch(self, step, q_lens: np.ndarray, width: int) -> dict:
        if not self.triton or not self.spec.num_attention_layers:
            return {}
        if self.config.attention_launch is not None:
            return dict(self.config.attention_launch)
        from triton_kernels.paged_attention import default_launch
        attn = self.model.attention_layers()[0]
        rule = default_launch(num_q_tokens=int(q_lens.sum()), num_seqs=len(step), num_q_heads=attn.num_heads,
                              num_kv_heads=attn.num_kv_heads, head_dim=cache_head_dim(attn.head_dim, True),
                              page_size=self.config.page_size, max_kv_len=width * self.config.page_size,
                              target=target_of(self.device), relative_bias=attn.relative_bias)
        return dict(block_q=rule.block_q, pages_per_tile=rule.pages_per_tile, num_warps=rule.num_warps,
                    num_stages=rule.num_stages, num_kv_splits=rule.num_kv_splits)

    def run(self, ctx: StepContext, capture: frozenset[int], rows: np.ndarray | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(final norm output [T, D], {layer: hidden [T, D]}) for the step's tokens; with `rows` (host int64,
        grouped by sequence in step order) the final output at those rows only, [len(rows), D]."""
        self.allocate()
        index = None
        if rows is not None:
            index = ctx.on_device("rows", rows)
            # Per sequence, how many rows: from the host's own arrays (the model must not read `index` back).
            ctx.row_counts = np.bincount(ctx.host_segment_ids()[rows], minlength=ctx.num_seqs)
        on_cpu = torch_path_on_cpu() if not self.triton else contextlib.nullcontext()
        with on_cpu, torch.inference_mode(), pointwise.batch_invariant(self.config.batch_invariant):
            if index is None:
                return self.model(ctx, capture)
            if self.model.computes_rows:
                return self.model(ctx, capture, index)
            out, captured = self.model(ctx, capture)
            return out[index], captured
