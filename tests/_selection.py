"""What this pytest run selected (its tier, ``-k``), for the module-scoped jobs that compute
many cases at once in spawned or fresh processes (test_script's saved modules, test_rpc's
jobs): they compute only the cases whose tests will read them."""
from __future__ import annotations

from pathlib import Path
from typing import Any, List


def selected(request: Any, test: str, param: str) -> List[str]:
    """The values of ``param`` of the selected items of test function ``test`` in the module
    of ``request`` (another module may have a test of the same name)."""
    here = Path(str(request.module.__file__)).resolve()
    return sorted({item.callspec.params[param] for item in request.session.items
                   if getattr(item, "originalname", None) == test and hasattr(item, "callspec")
                   and Path(str(item.fspath)).resolve() == here})
