"""Forward pre-hooks that wait for a running parameter sync, module by module.

:meth:`ZeroRedundancyOptimizer.sync_in_forward` installs them: each
submodule holding parameters waits, just before its forward, for the
broadcasts that write those parameters, and so does its ``state_dict()``
(also when called on a submodule, or on the model inside a DDP wrapper).  The hooks only call back into the optimizer (``wait_params``); they know
nothing of how the sync is done.
"""
from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch import Tensor

__all__ = ["ForwardSyncHandle", "install"]


class ForwardSyncHandle:
    """The hooks of one ``sync_in_forward`` call; :meth:`remove` takes them off."""

    def __init__(self, handles: List[Any], on_remove: Callable[[], None]):
        self._handles, self._on_remove = handles, on_remove

    def remove(self) -> None:
        """Remove the hooks (idempotent) and let the optimizer wait for a running sync."""
        if not self._handles:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        self._on_remove()


def install(module: torch.nn.Module, held: List[Tensor], wait_params: Callable[[List[Tensor]], None],
            on_remove: Callable[[], None]) -> ForwardSyncHandle:
    """A forward pre-hook and a state_dict pre-hook per submodule of ``module``
    that holds parameters, each calling ``wait_params(its own parameters)``;
    ``on_remove`` runs once the handle removed them.  ``held``: the optimizer's
    parameters; a module holding none of them is refused (ValueError)."""
    ids = {id(p) for p in held}
    if not any(id(p) in ids for p in module.parameters()):
        raise ValueError("sync_in_forward: the module holds none of this optimizer's parameters")

    def waiter(own: List[Tensor]) -> Callable[..., None]:
        def pre_hook(*args: Any, **kwargs: Any) -> None:
            wait_params(own)
        return pre_hook

    handles = []
    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if own:
            handles.append(m.register_forward_pre_hook(waiter(own)))
            handles.append(m.register_state_dict_pre_hook(waiter(own)))
    return ForwardSyncHandle(handles, on_remove)
