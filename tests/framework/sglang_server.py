"""A real ``python -m sglang.launch_server`` on SGLang's CPU engine for tests, started from
its own venv (scripts/install_sglang_cpu_venv.sh), driven over loopback through its native
``/generate`` endpoint with token ids (no tokenizer), torn down like ``VllmServer``: SIGINT,
every process of its session gone, no shared-memory segment left (its private tmpfs
``/dev/shm`` where it can have one)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_server import VllmServer

HERE = Path(__file__).resolve().parent
STUBS = HERE.parent / "stubs"
PYTHON_ENV = "PCIE_A2A_SGLANG_CPU_PYTHON"
#: what SGLang 0.5.23 itself leaves in /dev/shm after SIGINT (seen here): its TP schedulers'
#: message queues, its expert-load records and multiprocessing semaphores. Reported, not ours.
SGLANG_SHM_PREFIXES = ("sgl_shm_mq_", "sglang_loads_", "sem.mp-")
#: pcie_a2a's own segments (Buffer, all-reduce): none may be left
OUR_SHM_PREFIX = "pcie_a2a"

CPU_ENGINE_ARGS = [
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--skip-tokenizer-init",
    "--max-total-tokens", "2048",  # the KV pool: 0.1 of memory is still ~2 GB per rank
]  # fmt: skip

CPU_ENGINE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # else the rotary embedding wants vLLM's kernels
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # two ranks on one NUMA node
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def path_dir(root: Path, baseline_wrap: bool) -> Path:
    """PYTHONPATH entry with pcie_a2a and its ``sglang.srt.plugins`` entry point, the
    test-only MLA attention choice for the CPU engine (``sglang_cpu_mla``), and, for the
    ``none`` baseline, the test-only CPU-EP wrap (``sglang_cpu_ep_baseline``)."""
    import pcie_a2a

    root.mkdir(parents=True, exist_ok=True)
    (root / "pcie_a2a").symlink_to(Path(pcie_a2a.__file__).resolve().parent)
    info = root / "pcie_a2a_test-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pcie_a2a_test\nVersion: 0.0.0\n")
    eps = "[sglang.srt.plugins]\npcie_a2a = pcie_a2a.integrations.sglang:register\n"
    eps += "pcie_a2a_test_cpu_mla = sglang_cpu_mla:register\n"
    if baseline_wrap:
        eps += "pcie_a2a_test_cpu_ep = sglang_cpu_ep_baseline:register\n"
    (info / "entry_points.txt").write_text(eps)
    return root


def server_pythonpath(root: Path, baseline_wrap: bool) -> str:
    # tests/stubs: torchvision; tests/stubs/sglang_cpu_engine: sgl_kernel (and the wrap)
    parts = [path_dir(root, baseline_wrap), STUBS, STUBS / "sglang_cpu_engine"]
    return ":".join(str(p) for p in parts)


class SglangServer(VllmServer):
    def __init__(self, python, model, args, env, log, port, ready_timeout_s=420.0):
        super().__init__(python, model, args, env, log, port, ready_timeout_s)
        self.cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model)]
        self.cmd += ["--host", "127.0.0.1", "--port", str(port), *CPU_ENGINE_ARGS, *args]

    def stop(self, grace_s: float = 90.0) -> None:
        super().stop(grace_s)
        left = self.report.get("shm_left", [])
        self.report["sglang_shm"] = [n for n in left if n.startswith(SGLANG_SHM_PREFIXES)]
        self.report["shm_left"] = [n for n in left if not n.startswith(SGLANG_SHM_PREFIXES)]
        if self.report.get("shm_scope", "").startswith("global"):
            for name in self.report["sglang_shm"]:  # SGLang's, not ours: cleaned here
                (Path("/dev/shm") / name).unlink(missing_ok=True)

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=180) as r:
            out = json.loads(r.read())
        ids = [int(t) for t in out["output_ids"]]
        if len(ids) != max_tokens:
            raise AssertionError(f"expected {max_tokens} tokens, got {out!r}")
        tops = out["meta_info"]["output_top_logprobs"]
        return {
            "tokens": ids,
            "margins": [t[0][0] - t[1][0] for t in tops],
            "dp_rank": out["meta_info"].get("dp_rank"),
        }

    def complete_all(self, prompts, max_tokens, concurrent):
        if not concurrent:
            return [self.complete(p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))
