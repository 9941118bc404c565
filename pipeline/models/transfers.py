"""Copies between host and device that never make the host wait for the device.

Host -> device: `to_device` packs numpy arrays into one pinned staging buffer and sends it with one
non-blocking copy; the step's tensors are views of the one device buffer. Device -> host: `HostCopy` copies
tensors (non-blocking) into pinned buffers and records an event after them; `wait()` is the one wait, done
when the arrays are needed (a batch later in the worker). A copy from pageable memory, or one without
non_blocking, would make the host wait for every kernel queued before it.

Pinned buffers come from torch's caching host allocator, which reuses a buffer only once the copies that
read or wrote it have run. On the CPU (no pinned memory there) the same code runs on ordinary buffers,
registered as standing for pinned ones, so that the sync audit (engine/sync_audit.py) follows the same
copies on a CPU as on a GPU; the values are the same bits either way.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

ALIGN = 64   # bytes between the starts of arrays in a staging buffer (Triton specialises on 16-byte alignment)

# CPU buffers allocated where a GPU run allocates pinned memory, by id (values weak: gone with the tensor).
_STAND_INS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def pinned_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised host tensor for copies to and from `device`: pinned when `device` is a GPU."""
    if torch.device(device).type == "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    buffer = torch.empty(shape, dtype=dtype)
    _STAND_INS[id(buffer)] = buffer
    return buffer


def is_pinned(t: torch.Tensor) -> bool:
    """Pinned host memory, or (on a CPU run) a buffer allocated by pinned_empty, or a view of one."""
    if t.device.type != "cpu":
        return False
    if t.is_pinned():
        return True
    base = t if t._base is None else t._base
    return _STAND_INS.get(id(base)) is base


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`arrays` on `device` (same dtypes and shapes) through one pinned staging buffer and one non-blocking copy.

    The result is a copy on the CPU too (never a view of the staging buffer), so the buffer goes back to the
    allocator at once on either device."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-a.nbytes // ALIGN) * ALIGN
    staging = pinned_empty(max(end, 1), torch.uint8, device)
    host = staging.numpy()
    for a, start in zip(arrays, starts):
        host[start:start + a.nbytes] = a.reshape(-1).view(np.uint8)
    sent = staging.to(device, non_blocking=True, copy=True)
    return [sent[start:start + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, start in zip(arrays, starts)]


class HostCopy:
    """Device tensors on their way to the host: each copied (non-blocking) into a pinned buffer as it is given,
    then one event recorded after them all. `wait()` waits for that event and returns the numpy arrays; it is
    the only point where the host waits for the device's work up to the copies."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._buffers: dict[str, torch.Tensor] = {}
        device = None
        for name, t in tensors.items():
            device = t.device
            buffer = pinned_empty(t.shape, t.dtype, t.device)
            buffer.copy_(t, non_blocking=True)
            self._buffers[name] = buffer
        self._event = None
        if device is not None and device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> dict[str, np.ndarray]:
        """The arrays, once copied. From pinned memory they are copied again into ordinary memory, so pinned
        buffers go back to the allocator now rather than live as long as the rows (until a checkpoint)."""
        if self._event is not None:
            self._event.synchronize()
        pinned = self._event is not None
        return {name: b.numpy().copy() if pinned else b.numpy() for name, b in self._buffers.items()}


_TORCH_DTYPES = {np.dtype(k): v for k, v in (
    (np.bool_, torch.bool), (np.uint8, torch.uint8), (np.int8, torch.int8), (np.int16, torch.int16),
    (np.int32, torch.int32), (np.int64, torch.int64), (np.float16, torch.float16), (np.float32, torch.float32),
    (np.float64, torch.float64))}
