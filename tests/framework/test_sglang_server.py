"""A real SGLang server (``python -m sglang.launch_server``, SGLang 0.5.23's CPU engine) with
``--moe-a2a-backend pcie``, in CI.

SGLang's CPU engine lives in its own venv (``scripts/install_sglang_cpu_venv.sh``; SGLang
pins torch 2.14.1, we run 2.13.0 CPU), named by ``PCIE_A2A_SGLANG_CPU_PYTHON``. Without it
these tests skip with that reason, except under ``PCIE_A2A_REQUIRE_FRAMEWORKS=1`` (CI),
where they fail. torchvision and sgl_kernel have no CPU wheel: the server gets the
stand-ins of tests/stubs on its PYTHONPATH (their functions raise if ever called).

Two tiny random-weight checkpoints are written by the test (tiny_moe_models.py): a Qwen3-MoE
(8 experts, top-2) and a DeepSeek-V3-shaped one (MLA attention, a shared expert, sigmoid
scores with grouped top-k and a non-zero ``e_score_correction_bias``, ``routed_scaling_factor``
2.5). MLA on the CPU engine's ``torch_native`` attention needs SGLang's absorbed-MLA method
for prefill too (test-only plugin ``tests/stubs/sglang_cpu_engine/sglang_cpu_mla.py``, in every
server). One server per checkpoint and configuration, each sent the same serial and
concurrent requests:

- ``--tp 2 --ep 2 --moe-a2a-backend none``: SGLang's own EP, the baseline (its CPU expert
  loop crashes on the -1 ids of experts held elsewhere; the test-only plugin
  ``tests/stubs/sglang_cpu_engine/sglang_cpu_ep_baseline.py`` applies the same fix ours does);
- ``--tp 2 --ep 2 --moe-a2a-backend pcie`` (TP attention) and ``--tp 2 --ep 2 --dp 2
  --enable-dp-attention --moe-a2a-backend pcie`` (DP attention).

Every server's greedy tokens must equal the baseline's and an fp32 transformers reference
computed here. Random models have near-ties: the prompts are chosen (from a fixed seeded
pool) so that the fp32 greedy token wins every step by at least ``MIN_MARGIN`` in logprob,
far above what bf16 rounding or a different summation order moves, so a correct server
cannot flip one. Each server must shut down leaving no process and no shared-memory
segment of ours (SGLang's own ``sgl_shm_mq_*`` queues, left when it is stopped by a signal,
are reported and removed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fw_utils import REQUIRE_ENV
from sglang_server import CPU_ENGINE_ENV, PYTHON_ENV, SglangServer, server_pythonpath
from vllm_server import run_script

from dist_utils import free_port

HERE = Path(__file__).resolve().parent
PY = os.environ.get(PYTHON_ENV, "")

if not PY or not os.access(PY, os.X_OK):
    _reason = (
        f"{PYTHON_ENV} is not set to SGLang's CPU-engine venv python (got {PY!r}); create it "
        "with scripts/install_sglang_cpu_venv.sh DIR and set it to DIR/bin/python"
    )
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {_reason}", pytrace=False)
    pytest.skip(_reason, allow_module_level=True)

MAX_TOKENS = 6
MIN_MARGIN = 0.25  # logprob; bf16 vs fp32 moves these tiny models' logprobs by < 0.05
NUM_PROMPTS = 6
VOCAB = 384  # tiny_moe_models.VOCAB; ids 0-3 are specials
TP_EP = ["--tp", "2", "--ep", "2"]
DP_ATTN = [*TP_EP, "--dp", "2", "--enable-dp-attention"]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param)
    run_script(PY, HERE / "tiny_moe_models.py", [str(out), request.param], CPU_ENGINE_ENV, 300)
    return out


@pytest.fixture(scope="module")
def prompts(model) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts whose fp32 greedy path wins each step by >= MIN_MARGIN, and that path."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    chosen, paths = [], []
    with torch.no_grad():
        for seed in range(80):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(4, VOCAB, (3 + seed % 7,), generator=g).tolist()
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=1,
            )  # fmt: skip
            lp = [torch.log_softmax(s[0].float(), -1).topk(2).values for s in out.scores]
            if min(float(v[0] - v[1]) for v in lp) >= MIN_MARGIN:
                chosen.append(ids)
                paths.append(out.sequences[0, len(ids) :].tolist())
            if len(chosen) == NUM_PROMPTS:
                break
    assert len(chosen) == NUM_PROMPTS, f"only {len(chosen)} prompts with a clear greedy path"
    return chosen, paths


def _serve(model, args, backend, tmp_path_factory, prompts) -> dict:
    name = f"{model.name}_{backend}_{'dp' if '--enable-dp-attention' in args else 'tp'}"
    root = tmp_path_factory.mktemp(name)
    env = {**CPU_ENGINE_ENV, "PYTHONPATH": server_pythonpath(root / "path", backend == "none")}
    srv_args = [*args, "--moe-a2a-backend", backend]
    with SglangServer(PY, model, srv_args, env, root / "server.log", free_port()) as srv:
        res = {
            "serial": srv.complete_all(prompts, MAX_TOKENS, concurrent=False),
            "concurrent": srv.complete_all(prompts, MAX_TOKENS, concurrent=True),
        }
    report = srv.report
    res["log"] = srv.log_text()
    print(f"{name}: {json.dumps(report)}")
    assert report["leftover_pids"] == [], (report, srv.tail())
    assert report["shutdown_clean"], ("the server did not exit after SIGINT", srv.tail())
    assert report["shm_left"] == [], (f"shared memory left ({report['shm_scope']})", report)
    return res


@pytest.fixture(scope="module")
def baseline(model, prompts, tmp_path_factory) -> dict:
    return _serve(model, TP_EP, "none", tmp_path_factory, prompts[0])


def _check(res: dict, want: list[list[int]], what: str) -> None:
    for kind in ("serial", "concurrent"):
        got = [r["tokens"] for r in res[kind]]
        assert got == want, f"{what} {kind}: {got} != {want}"


def test_baseline_matches_fp32_reference(baseline, prompts):
    assert "pcie_a2a: --moe-a2a-backend pcie active" not in baseline["log"]
    _check(baseline, prompts[1], "--moe-a2a-backend none vs fp32 reference")


@pytest.mark.parametrize("attention", ["tp", "dp"])
def test_pcie_server_matches_baseline(model, prompts, baseline, tmp_path_factory, attention):
    args = TP_EP if attention == "tp" else DP_ATTN
    res = _serve(model, args, "pcie", tmp_path_factory, prompts[0])
    log = res["log"]
    assert "pcie_a2a: --moe-a2a-backend pcie active: EP over the TP group (2 ranks" in log, log
    assert f"attention DP {1 if attention == 'tp' else 2}" in log
    assert "MoE layers use PcieA2ADispatcher" in log
    want = [r["tokens"] for r in baseline["serial"]]
    _check(res, want, f"pcie ({attention} attention) vs none")
    _check(res, prompts[1], f"pcie ({attention} attention) vs fp32 reference")
    if attention == "dp":  # both DP ranks served requests
        ranks = {r["dp_rank"] for r in res["concurrent"] + res["serial"]}
        print(f"dp ranks seen: {ranks}")
