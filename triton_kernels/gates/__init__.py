"""Qwen3.5's gates in one pass each: the gated attention's `o * sigmoid(gate)` read from the projection
(`sigmoid_gate`) and the delta-rule layers' g and beta from a, b, A_log and dt_bias (`delta_rule_gates`).

op.py holds the public functions (their checks and dispatch), kernel.py the Triton kernels (imported only when a
kernel runs), torch_path.py what CPU tensors run (the unfused ops in plain torch).
"""
from triton_kernels.gates.op import delta_rule_gates, gate_knobs, sigmoid_gate
from triton_kernels.gates.torch_path import delta_rule_gates_torch, sigmoid_gate_torch

__all__ = ["sigmoid_gate", "delta_rule_gates", "gate_knobs", "sigmoid_gate_torch", "delta_rule_gates_torch"]
