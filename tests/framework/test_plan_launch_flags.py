"""`pcie-a2a plan`'s launch lines use only flags the pinned SGLang and vLLM parsers know.

Every option each generator can emit (over configurations that exercise every branch) is
looked up in the framework's own argument parser; `--moe-a2a-backend pcie` is checked
against SGLang's choices after pcie_a2a's plugin registered it."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace

from fw_utils import import_framework

from pcie_a2a.configplan import ask, launch
from pcie_a2a.configplan.configs import Config
from pcie_a2a.configplan.nodes import multinode_flags
from pcie_a2a.configplan.stacks import STACKS

CONFIGS = [
    Config(8),
    Config(4, 2),
    Config(8, ep=8, comm="allreduce", redundant=8),
    Config(8, 1, 8, 8, "ag-rs"),
    Config(8, 1, 8, 8, "ag-rs", redundant=8),
    Config(8, 1, 4, 8, "pcie_a2a"),
    Config(8, 1, 8, 8, "pcie_a2a", redundant=16),
    Config(8, dcp=2),
    Config(8, ep=8, comm="allreduce", dcp=4, kv_fp8=True),
]
# a stack without CUDA graphs, so the lines carry the flag that turns them off
EAGER = replace(STACKS["vllm-tuned"], cuda_graphs=False)


def _options(line: str) -> list[str]:
    return [t for t in shlex.split(line) if t.startswith("--")]


def _lines(gen) -> list[str]:
    lines = [
        gen(c, "org/model", 4096, kv, 8192, stack)
        for c in CONFIGS
        for kv in (False, True)
        for stack in (None, STACKS["vllm-tuned"], EAGER, STACKS["vllm-tuned-mtp"])
    ]
    # `plan --nodes`: a pipeline stage per node, each node's line with the multi-node flags
    pp = gen(Config(4, 2), "org/model", 4096, False, 8192, STACKS["vllm-tuned"])
    return [*lines, f"{pp} {multinode_flags(gen.__name__, 2)}"]


def _asked(framework: str) -> list[str]:
    """The flags `plan --config` reads as this framework's, long and short spellings."""
    out = [f for f, (fw, _) in ask._INT_FLAGS.items() if fw == framework]
    out += [f for f, (fw, _) in ask._BOOL_FLAGS.items() if fw == framework]
    out += [f for f, (fw, _) in ask._STR_FLAGS.items() if fw in (framework, "")]
    return out


def test_sglang_knows_every_flag():
    import_framework("sglang")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {o: a for a in parser._actions for o in a.option_strings}
    for line in _lines(launch.sglang):
        for opt in _options(line):
            assert opt in known, (opt, line)
    assert "--disable-cuda-graph" in " ".join(_lines(launch.sglang))
    for opt in _asked("sglang"):  # known, or an abbreviation argparse resolves uniquely
        value = {"--moe-a2a-backend": ["none"], "--kv-cache-dtype": ["fp8_e4m3"]}
        args = [opt] if opt in ask._BOOL_FLAGS else [opt, *value.get(opt, ["2"])]
        _, rest = parser.parse_known_args(["--model-path", "m", *args])
        assert not rest, opt
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
    assert "--enforce-eager" in " ".join(_lines(launch.vllm))
    # the MTP stack's speculative config is JSON vLLM's parser reads (type json.loads)
    line = launch.vllm(Config(8), "org/model", 4096, False, 8192, STACKS["vllm-tuned-mtp"])
    words = shlex.split(line)
    spec = parser.parse_known_args(
        ["--speculative-config", words[words.index("--speculative-config") + 1]]
    )[0]
    assert spec.speculative_config["method"] == "eagle3"
    assert spec.speculative_config["num_speculative_tokens"] == 3
    for opt in _asked("vllm"):
        assert opt in known, opt
