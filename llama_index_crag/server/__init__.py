"""The query server of ``llama-crag serve``: the app, its routes and its metrics (the ``[server]`` extra).

The library never imports this package; ``require_extra`` says what to install when the
server's packages are missing, before anything else of the server is imported.
"""

from __future__ import annotations

import importlib

from llama_index_crag.errors import MissingDependency

#: The command that installs what the server needs.
INSTALL = "pip install 'llama-index-crag[server]'"
#: The packages of the ``[server]`` extra, by import name.
EXTRA_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")


def require_extra() -> None:
    """Import the server's packages, or raise an ``ImportError`` naming the missing one and the install command."""
    for name in EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise MissingDependency(f"the query server needs {name}, which is not installed: {INSTALL}") from exc
