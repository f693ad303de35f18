"""pcie_a2a's launch checks on vLLM's real configuration path: ``EngineArgs(...)
.create_engine_config()`` (what ``vllm serve`` runs before it starts any engine), with the
plugin loaded through vLLM's own loader and ``PCIE_A2A_VLLM=1``.

    python vllm_cpu_config_check.py MODEL_DIR OUT.json

Run with vLLM's CPU build (tests/framework/test_vllm_server.py does).
"""

from __future__ import annotations

import json
import logging
import os
import sys

DP_EP = {"data_parallel_size": 2, "enable_expert_parallel": True}
CASES = {
    # name: EngineArgs overrides on top of DP=2 + EP
    "graphs_default": {},
    "eager": {"enforce_eager": True},
    "dbo": {"enable_dbo": True},
    "tp2": {"tensor_parallel_size": 2},
    "explicit_graphs": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
}


class _Capture(logging.Handler):  # our logger's INFO lines
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _listen(cap: _Capture) -> None:
    """(Re)attaches the capture: vLLM's logging setup resets child loggers' handlers."""
    ours = logging.getLogger("vllm.pcie_a2a")
    if cap not in ours.handlers:
        ours.addHandler(cap)
    ours.setLevel(logging.INFO)


def main(model: str, out_path: str) -> None:
    os.environ["PCIE_A2A_VLLM"] = "1"
    from vllm.engine.arg_utils import EngineArgs

    cap = _Capture()
    base = dict(model=model, dtype="bfloat16", max_model_len=256)
    results = {}
    # DP=1 first: it is not ours (nothing may be said), and it makes vLLM set up its
    # logging, which resets our logger's handlers, before the cases are listened to
    for name, extra in [("dp1", None), *CASES.items()]:
        _listen(cap)
        cap.lines.clear()
        args = dict(base) if extra is None else dict(base, **DP_EP, **extra)
        try:
            engine_args = EngineArgs(**args)  # loads the general plugins (first time)
            _listen(cap)
            cfg = engine_args.create_engine_config()
            results[name] = {"mode": cfg.compilation_config.cudagraph_mode.name}
        except Exception as exc:  # vLLM wraps our ValueError in its validation error
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["log"] = list(cap.lines)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
