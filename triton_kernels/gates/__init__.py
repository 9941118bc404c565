"""Qwen3.5's gates in one pass each: the gated attention's `o * sigmoid(gate)` read from the projection
(`sigmoid_gate`) and the delta-rule layers' g and beta from a, b, A_log and dt_bias (`delta_rule_gates`).

kernel.py holds the Triton kernels and the public functions, torch_path.py what CPU tensors run (the unfused
ops in plain torch).
"""
from triton_kernels.gates.kernel import delta_rule_gates, gate_knobs, sigmoid_gate
from triton_kernels.gates.torch_path import delta_rule_gates_torch, sigmoid_gate_torch

__all__ = ["sigmoid_gate", "delta_rule_gates", "gate_knobs", "sigmoid_gate_torch", "delta_rule_gates_torch"]
