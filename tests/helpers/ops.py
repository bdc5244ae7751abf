"""Counting the ATen operations a piece of code dispatches (each one a kernel launch on a GPU)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# operations that make no kernel: views and uninitialised allocations
VIEWS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.permute", "aten.expand", "aten.slice",
         "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias", "aten.reshape",
         "aten.as_strided", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.empty", "aten.empty_like",
         "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"}


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as counter: ...``: ``counter.ops`` counts each operation by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        """The operations that are not views."""
        return sum(n for op, n in self.ops.items() if op not in VIEWS)
