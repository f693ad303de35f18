"""`pcie-a2a plan`'s launch lines use only flags the pinned SGLang and vLLM parsers know.

Every option each generator can emit (over configurations that exercise every branch) is
looked up in the framework's own argument parser; `--moe-a2a-backend pcie` is checked
against SGLang's choices after pcie_a2a's plugin registered it."""

from __future__ import annotations

import argparse
import shlex

from fw_utils import import_framework

from pcie_a2a.configplan import launch
from pcie_a2a.configplan.configs import Config

CONFIGS = [
    Config(8),
    Config(4, 2),
    Config(8, ep=8, comm="allreduce", redundant=8),
    Config(8, 1, 8, 8, "ag-rs"),
    Config(8, 1, 8, 8, "ag-rs", redundant=8),
    Config(8, 1, 4, 8, "pcie_a2a"),
    Config(8, 1, 8, 8, "pcie_a2a", redundant=16),
]


def _options(line: str) -> list[str]:
    return [t for t in shlex.split(line) if t.startswith("--")]


def _lines(gen) -> list[str]:
    return [gen(c, "org/model", 4096, kv, 8192) for c in CONFIGS for kv in (False, True)]


def test_sglang_knows_every_flag():
    import_framework("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {o: a for a in parser._actions for o in a.option_strings}
    for line in _lines(launch.sglang):
        for opt in _options(line):
            assert opt in known, (opt, line)
    choices = known["--moe-a2a-backend"].choices
    if choices is not None and "pcie" not in choices:
        from pcie_a2a.integrations import sglang as plugin

        plugin.register()
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        known = {o: a for a in parser._actions for o in a.option_strings}
        choices = known["--moe-a2a-backend"].choices
    assert choices is None or "pcie" in choices


def test_vllm_knows_every_flag(monkeypatch):
    import_framework("vllm")
    import vllm.platforms as platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # the parser's defaults build a DeviceConfig, which needs a platform: vLLM's CPU one
    # here (there is no GPU), resolved afresh and put back afterwards
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setattr(platforms, "_current_platform", None)
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    known = {o for a in parser._actions for o in a.option_strings}
    for line in _lines(launch.vllm):
        for opt in _options(line):
            assert opt in known, (opt, line)
