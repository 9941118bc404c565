"""Which ops of some engine work would make the host wait for a GPU (a host-device synchronisation).

`SyncAudit` is a TorchDispatchMode, plus wrappers of the Tensor methods that dispatch does not show on a
CPU (`tolist`, `numpy`, `cpu`, `to`) and of the explicit waits. While it is active it records:

- syncs: a scalar read back (`.item()`, `int()`, `bool()`: `_local_scalar_dense`), `.tolist()`, `.cpu()`,
  `.numpy()`, `nonzero` (`torch.where(cond)`, `argwhere`), `unique`, `bincount`, `masked_select`,
  `repeat_interleave` with tensor repeats and no output_size, indexing or index_put with a boolean mask,
  `equal`, a device->host copy that is blocking or lands in pageable memory, a host->device copy that is
  blocking or leaves pageable memory, an op that mixes host and device tensors (an implicit copy), and
  `torch.cuda.synchronize` / a stream's or event's `synchronize`;
- transfers: copies that do not make the host wait (non_blocking, through pinned memory);
- waits: `HostCopy.wait` (models/transfers.py), the wait a batch makes for its results, one batch later.

On CUDA a tensor is on the device when it is on the audited device. On the CPU, where the model's device is
the CPU too, the audit follows where each tensor came from, so that a CPU run finds what a GPU run would:
host tensors are those made from host data (`torch.from_numpy`, `torch.tensor`: aten `lift_fresh`), pinned
buffers (transfers.pinned_empty), and what ops make of host tensors alone; everything else (the model's
weights, factory ops such as `torch.zeros(..., device=...)`, results of device tensors) is on the device, and
`.to(device)` of a host tensor is a host->device copy. (Limits on the CPU: `.to("cpu")` of a device tensor
reads as a no-op, since the devices are the same; write device->host copies as `.cpu()`, `.numpy()`,
`.tolist()` or a `copy_` into host memory, as this project does.)

Kernels are not audited inside: ops under the Triton package (the interpreter running a kernel on the CPU)
are skipped, and with `torch_kernels=True` (the engine's CPU path, where the torch implementations in
triton_kernels/ stand for the GPU kernels) so are ops under triton_kernels/. Audit the Triton path (a GPU, or
TRITON_INTERPRET=1 with kernels="triton") to see the kernel wrappers' own host code.

Budget (tests/test_sync_audit.py): a steady-state batch of embed or score (pseudo-log-likelihood included)
makes no sync from its first host->device copy to its last device->host copy, and its result costs one wait;
a generate step makes one sync, the sampled tokens' read-back that the next step's scheduling needs.
"""
from __future__ import annotations

import os
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..models import transfers as _transfers

SYNC_KINDS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "bincount", "masked_select", "repeat_interleave",
              "bool_index", "equal", "to_host", "to_device_blocking", "to_device_pageable", "implicit_copy",
              "synchronize")
TRANSFER_KINDS = ("to_host_async", "to_device_async")
WAIT = "wait"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(_transfers.__file__))
_TRITON_KERNELS = os.path.join(_REPO, "triton_kernels") + os.sep
_SITE = os.sep + "site-packages" + os.sep   # (a virtual environment inside the checkout is not its code)
_SCALAR_READS = {"_local_scalar_dense": "item", "nonzero": "nonzero", "argwhere": "nonzero", "_unique": "unique",
                 "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique",
                 "unique_dim_consecutive": "unique", "bincount": "bincount", "masked_select": "masked_select",
                 "equal": "equal"}
_INDEX_OPS = ("index", "index_put", "index_put_", "_index_put_impl_")


@dataclass(frozen=True)
class Event:
    kind: str     # one of SYNC_KINDS, TRANSFER_KINDS or WAIT
    op: str       # the aten op or the method
    where: str    # "path:line (function)" of the innermost frame of this project's code that made it

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}"


class SyncAudit(TorchDispatchMode):
    """Records syncs, transfers and waits of the work done inside `with SyncAudit(device):` (see the module)."""

    def __init__(self, device: torch.device, torch_kernels: bool = False):
        super().__init__()
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self.torch_kernels = torch_kernels
        self.events: list[Event] = []
        self._host: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._inside = 0   # > 0 inside a wrapped method: its own dispatches are not recorded again
        self._patched: list[tuple[object, str, object]] = []

    # ---- results ------------------------------------------------------------------------------------------

    @property
    def syncs(self) -> list[Event]:
        return [e for e in self.events if e.kind in SYNC_KINDS]

    @property
    def transfers(self) -> list[Event]:
        return [e for e in self.events if e.kind in TRANSFER_KINDS]

    @property
    def waits(self) -> list[Event]:
        return [e for e in self.events if e.kind == WAIT]

    def take(self) -> list[Event]:
        """The events so far, and start afresh (to audit the parts of a batch one at a time)."""
        events, self.events = self.events, []
        return events

    # ---- where tensors live -------------------------------------------------------------------------------

    def is_host(self, t: torch.Tensor) -> bool:
        if not self.on_cpu:
            return t.device.type == "cpu"
        return self._host.get(id(t)) is t or _transfers.is_pinned(t)

    def is_device(self, t: torch.Tensor) -> bool:
        if not self.on_cpu:
            return t.device == self.device or (t.device.type == self.device.type and self.device.index is None)
        return t.device.type == "cpu" and not self.is_host(t)

    def _mark(self, t, host: bool) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if host:
            self._host[id(t)] = t
        elif self._host.get(id(t)) is t:
            del self._host[id(t)]

    # ---- recording ----------------------------------------------------------------------------------------

    def _skip_dirs(self) -> list[str]:
        dirs = [_TRITON_KERNELS] if self.torch_kernels else []
        triton = sys.modules.get("triton")
        if triton is not None and getattr(triton, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(triton.__file__)) + os.sep)
        return dirs

    def _record(self, kind: str, op: str) -> None:
        where, frame, skip = "", sys._getframe(1), self._skip_dirs()
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if any(path.startswith(d) for d in skip):
                return   # inside a kernel (or what stands for one): not the engine's own host code
            if not where and path.startswith(_REPO) and path not in _OWN_FILES and _SITE not in path:
                where = f"{os.path.relpath(path, _REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"
            frame = frame.f_back
        self.events.append(Event(kind, op, where or "?"))

    def _transfer(self, op: str, to_host: bool, non_blocking: bool, host: torch.Tensor) -> None:
        """A copy between `host` (the host side) and the device, in either direction."""
        if non_blocking and _transfers.is_pinned(host):
            self._record("to_host_async" if to_host else "to_device_async", op)
        elif to_host:
            self._record("to_host", op)
        else:
            self._record("to_device_pageable" if non_blocking else "to_device_blocking", op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not self._inside:
            self._check(func, name, args, kwargs, inputs)
        if self.on_cpu:
            if name in ("lift_fresh", "lift_fresh_copy"):
                for t in tree_leaves(out):
                    self._mark(t, True)
            else:
                host = bool(inputs) and all(self.is_host(t) for t in inputs)
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and not any(t is i for i in inputs):
                        self._mark(t, host)
        return out

    def _check(self, func, name: str, args, kwargs, inputs: list[torch.Tensor]) -> None:
        if name == "copy_":
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if self.is_host(dst) and self.is_device(src):
                self._transfer("copy_", True, non_blocking, dst)
            elif self.is_device(dst) and self.is_host(src) and src.dim() > 0:
                self._transfer("copy_", False, non_blocking, src)
            return
        if name == "_to_copy":
            if not self.on_cpu:   # (on the CPU the `to` wrapper sees what the copy is for)
                self._cuda_to(args[0], kwargs.get("device"), bool(kwargs.get("non_blocking", False)), "_to_copy")
            return
        on_device = [t for t in inputs if self.is_device(t)]
        if not on_device:
            return
        if name in _SCALAR_READS:
            self._record(_SCALAR_READS[name], str(func))
        elif name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") and (
                kwargs.get("output_size") is None and self.is_device(args[0 if func._overloadname == "Tensor" else 1])):
            self._record("repeat_interleave", str(func))
        elif name in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        for i in (args[1] if len(args) > 1 else [])):
            self._record("bool_index", str(func))
        elif any(self.is_host(t) and t.dim() > 0 for t in inputs):
            self._record("implicit_copy", str(func))

    def _cuda_to(self, src: torch.Tensor, device, non_blocking: bool, op: str) -> None:
        if device is None:
            return
        target = torch.device(device)
        if src.device.type == "cpu" and target.type != "cpu":
            self._transfer(op, False, non_blocking, src)
        elif src.device.type != "cpu" and target.type == "cpu":
            # (torch allocates the result of a non-blocking device->host `to` in pinned memory)
            self._record("to_host_async" if non_blocking else "to_host", op)

    # ---- wrapped methods ----------------------------------------------------------------------------------

    def __enter__(self):
        self._wrap(torch.Tensor, "tolist", self._reading("tolist"))
        self._wrap(torch.Tensor, "numpy", self._reading("numpy"))
        self._wrap(torch.Tensor, "cpu", self._reading("cpu"))
        self._wrap(torch.Tensor, "to", self._to)
        self._wrap(torch.cuda, "synchronize", self._waiting("synchronize", "torch.cuda.synchronize"))
        self._wrap(torch.cuda.Event, "synchronize", self._waiting("synchronize", "Event.synchronize"))
        self._wrap(torch.cuda.Stream, "synchronize", self._waiting("synchronize", "Stream.synchronize"))
        self._wrap(_transfers.HostCopy, "wait", self._waiting(WAIT, "HostCopy.wait"))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._patched):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._patched.clear()

    def _wrap(self, owner, name: str, make) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        bound = getattr(owner, name)
        self._patched.append((owner, name, original))
        setattr(owner, name, make(bound))

    def _reading(self, method: str):
        """tolist / numpy / cpu: a device tensor's values brought to the host, waiting for them."""
        audit = self

        def make(original):
            def wrapper(t, *args, **kwargs):
                if not audit._inside and audit.is_device(t):
                    audit._record(method, f"Tensor.{method}")
                audit._inside += 1
                try:
                    return original(t, *args, **kwargs)
                finally:
                    audit._inside -= 1
            return wrapper
        return make

    def _waiting(self, kind: str, op: str):
        audit = self

        def make(original):
            def wrapper(*args, **kwargs):
                if not audit._inside:
                    audit._record(kind, op)
                audit._inside += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    audit._inside -= 1
            return wrapper
        return make

    def _to(self, original):
        audit = self

        def wrapper(t, *args, **kwargs):
            device, non_blocking = _to_arguments(args, kwargs)
            record = not audit._inside and device is not None
            sent = record and audit.on_cpu and torch.device(device).type == "cpu" and audit.is_host(t)
            if record and not audit.on_cpu:
                audit._cuda_to(t, device, non_blocking, "Tensor.to")
            elif sent:
                audit._transfer("Tensor.to", False, non_blocking, t)
            audit._inside += 1
            try:
                out = original(t, *args, **kwargs)
            finally:
                audit._inside -= 1
            if sent:
                audit._mark(out, False)   # now the device's (a host tensor sent without a copy becomes it)
            return out
        return wrapper


def _to_arguments(args, kwargs) -> tuple[object | None, bool]:
    """(target device or None, non_blocking) of a Tensor.to call, in any of its signatures."""
    device = kwargs.get("device")
    non_blocking = bool(kwargs.get("non_blocking", False))
    for a in args:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) and device is None:
            device = a
        elif isinstance(a, torch.Tensor) and device is None:
            device = a.device
        elif isinstance(a, bool):
            non_blocking = a
            break
    return device, non_blocking


def describe(events: list[Event]) -> str:
    """One event a line, for assertion messages."""
    return "\n".join(str(e) for e in events) or "(none)"
