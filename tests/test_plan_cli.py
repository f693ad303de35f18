"""`pcie-a2a plan` end to end: the CLI on the topology fixtures, the JSON schema, the
recommendation's stability under small input changes, the probe/bench adapter, --tables,
and every built-in model and GPU."""

from __future__ import annotations

import argparse
import json

import pytest

from pcie_a2a.configplan import cli as plan_cli
from pcie_a2a.configplan import topo as topo_mod
from pcie_a2a.configplan.api import Inputs, make_plan
from pcie_a2a.configplan.configs import Config
from pcie_a2a.configplan.memory import Memory
from pcie_a2a.configplan.models import BUILTIN
from pcie_a2a.configplan.predict import TERMS, Step
from pcie_a2a.configplan.run import Result, recommend
from pcie_a2a.moe.config import parse_config
from topology_fixtures import FIXTURES

BOX = "8x-rtxpro6000-dual-epyc9575f-broadcom-pex890xx"
TOPO = FIXTURES / f"{BOX}.topo.txt"
P2P = FIXTURES / f"{BOX}.p2p.txt"


@pytest.fixture(autouse=True)
def _no_env_topology(monkeypatch):
    monkeypatch.delenv("PCIE_A2A_TOPO_FILE", raising=False)


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pcie-a2a")
    plan_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def box_doc():
    """The JSON plan of Kimi K2.6 on the Broadcom fixture (computed once)."""
    from pcie_a2a.configplan import report

    p = make_plan(Inputs(model="kimi-k2.6", gpus=8, topo=str(TOPO), probe=str(P2P)))
    return json.loads(report.to_json(p)), report.text(p)


def test_text_on_the_broadcom_fixture(box_doc):
    _, out = box_doc
    for row in (
        "TP8 ",
        "PP8 ",
        "TP8+EP8 all-reduce",
        "DP8+EP8 NCCL a2a",
        "DP8+EP8 pcie_a2a",
        "DP8+EP8 AG/RS",
        "TP4xPP2",
        "TP2xPP4",
    ):
        assert row in out
    assert out.startswith("pcie-a2a plan: kimi-k2.6 on 8 x")
    assert "every throughput and time below is predicted" in out.splitlines()[0]
    assert "in-sample TP8 C=1: measured 92.4" in out
    assert "held out  TP8 C=128 [kimi-k26-v4]: measured 2222.6" in out
    assert "held out  TP8 C=128 [kimi-k26-v3]: measured 2310.2" in out
    assert "band on every predicted figure: x" in out
    assert "cannot run (configurations users try, with the reason):" in out
    assert "TP16: needs 16 GPUs, 8 available" in out
    assert "measured for 56 of 56 pairs" in out
    assert "throughput recommendation (TPOT <= 50 ms):" in out
    assert "latency choice (lowest TPOT at C=1):" in out
    # the tuned stack's numbers assume its NCCL setting: the lines carry it
    assert "  sglang: NCCL_P2P_LEVEL=SYS python -m sglang.launch_server --model-path " in out
    assert "--context-length 5120" in out and "--max-model-len 5120" in out  # 4096 + 1024
    assert "  vllm: " in out and "vllm serve moonshotai/Kimi-K2.6" in out
    assert "--moe-a2a-backend pcie" in out and "PCIE_A2A_VLLM=1" in out
    for term in TERMS:
        assert term in out
    assert "overhead" not in out.split("where the numbers come from")[0]


def test_json_schema(box_doc):
    doc, _ = box_doc
    assert doc["format"] == "pcie_a2a.configplan" and doc["version"] == 1
    for key in ("inputs", "model", "gpu", "stack", "constants", "configurations", "notes"):
        assert key in doc
    assert doc["gpu"]["key"] == "rtx-pro-6000" and doc["gpu"]["source"]
    cal = doc["stack"]["calibration"]
    # research/field_2026.md s1: kimi-k26-v4 and -v3, C = 1 and 128
    assert [c["measured_tok_s"] for c in cal] == [92.4, 2222.6, 91.4, 2310.2]
    for c in cal:
        assert c["residual"] == pytest.approx(c["model_tok_s"] / c["measured_tok_s"] - 1)
    loo = doc["stack"]["leave_one_out"]
    assert [c["measured_tok_s"] for c in loo] == [92.4, 2222.6, 91.4, 2310.2]
    worst_up = max(c["residual"] for c in loo)
    worst_down = min(c["residual"] for c in loo)
    band = doc["stack"]["band"]
    assert band["low"] == pytest.approx(1 / (1 + max(worst_up, 0)))
    assert band["high"] == pytest.approx(1 / (1 + min(worst_down, 0)))
    parts = {p["name"] for p in doc["stack"]["parts"]}
    assert parts >= {"framework", "cuda graphs", "all-reduce", "MTP"}
    assert doc["stack"]["mtp"] is None  # vllm-tuned: no speculative decoding
    assert doc["max_model_len"] == 4096 + 1024
    for value in doc["constants"].values():  # every constant carries its source
        if isinstance(value, dict):
            assert all(isinstance(v[1], str) and v[1] for v in value.values())
        else:
            assert isinstance(value[1], str) and value[1]
    names = set()
    for c in doc["configurations"]:
        names.add(c["name"])
        assert set(c["frameworks"]) == {"sglang", "vllm"}
        for fw in c["frameworks"].values():
            assert fw["ok"] == (not fw["reasons"]) == (fw["launch"] is not None)
        assert c["runs"] <= any(f["ok"] for f in c["frameworks"].values())
        if not c["runs"]:
            assert c["why_not"]
        if c["decode"] is None:
            continue
        assert set(c["decode"]) == {"1", "8", "32", "128"}
        for s in c["decode"].values():
            assert s["tok_s"] == pytest.approx(s["concurrency"] / s["tpot_ms"] * 1e3)
            assert sum(s["terms_ms"].values()) == pytest.approx(s["step_ms"])
            assert set(s["terms_ms"]) == {
                "attention", "experts", "shared", "comm", "imbalance", "other", "launch",
                "framework",
            }  # fmt: skip
            # the routed experts name their model: the INT4 grid model here (Kimi K2.6's
            # INT4 experts on RTX PRO 6000 at decode), the roofline otherwise
            assert s["sources"]["experts"]["source"].startswith("INT4 grid model")
            assert s["tokens_per_step"] == 1.0 and s["rows_per_request"] == 1
            for src in s["sources"].values():
                assert src["kind"] in (
                    "measured",
                    "predicted",
                    "derived",
                    "model",
                    "assumed",
                    "none",
                )
        if c["runs"]:
            assert c["peak"]["tok_s"] >= max(
                s["tok_s"] for k, s in c["decode"].items() if int(k) <= c["max_concurrency"]
            ) * (1 - 1e-9)
    rec = doc["recommendation"]
    assert rec["throughput"] in names and rec["latency"] in names
    best = next(c for c in doc["configurations"] if c["name"] == rec["throughput"])
    assert best["runs"]
    cap = best["under_tpot_cap"]
    assert cap["concurrency"] / cap["tok_s"] * 1e3 <= rec["max_tpot_ms"] == 50.0
    assert rec["latency_launch"]["vllm"] or rec["latency_launch"]["sglang"]


def test_cli_prints_and_writes_json_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (pip install matplotlib)")
    png = tmp_path / "plan.png"
    assert run("--topo", str(TOPO), "--json", "--plot", str(png), "--context", "1024") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["context"] == 1024
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "fixture, gpus",
    [
        ("8x-rtxpro6000-dual-epyc9124-direct.topo.txt", None),
        ("8x-rtxpro6000-threadripper-3switch-pxb.p2p.txt", None),
        ("8x-rtx4090-dual-xeon-broadcom-pix.nccl-paths.txt", None),
        ("4x-a100-pcie-azure-ncv4.nccl-topo.xml.txt", None),
        ("9x-rtx5090-rtxpro6000-dual-epyc9575f-patched.p2p.txt", "8"),
    ],
)
def test_cli_on_fixtures(fixture, gpus, capsys):
    args = ["--topo", str(FIXTURES / fixture), "--json"]
    if gpus:
        args += ["--gpus", gpus]
    assert run(*args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_gpus"] == int(gpus or doc["num_gpus"])
    runs = [c["name"] for c in doc["configurations"] if c["runs"]]
    assert doc["configurations"]
    assert (doc["recommendation"]["throughput"] is None) == (not runs)
    if runs:
        assert doc["recommendation"]["throughput"] in runs


def test_fixture_name_brings_its_measured_pairs(capsys):
    assert run("--topo", BOX) == 0
    out = capsys.readouterr().out
    assert f"{BOX}.p2p.txt used as --probe" in out
    assert "measured for 56 of 56 pairs" in out


def test_no_topology_assumes_a_box_and_says_so(monkeypatch, capsys):
    from pcie_a2a.topology import Topology

    monkeypatch.setattr(topo_mod, "current", lambda: Topology((), (), ()))
    assert run("--gpus", "4", "--model", "qwen3-30b-a3b", "--gpu", "rtx-4090") == 0
    out = capsys.readouterr().out
    assert "assumed 4 GPUs, every pair NODE-class P2P" in out
    assert "4 x NVIDIA GeForce RTX 4090" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "gpt-5"], "--model: got 'gpt-5'"),
        (["--gpu", "tpu"], "--gpu: got 'tpu'"),
        (["--stack", "trt"], "--stack: got 'trt'"),
        (["--context", "-1"], "--context: got -1"),
        (["--gpus", "9"], "--gpus 9: the topology"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: got 'int8'"),
        (["--skew", "-1"], "--skew: got -1"),
        (["--topo", "no-such-box"], "--topo: got 'no-such-box'"),
    ],
)
def test_bad_input_names_the_option(argv, fragment, capsys):
    assert run("--topo", str(TOPO), *argv) == 2 if argv[0] != "--topo" else run(*argv) == 2
    assert fragment in capsys.readouterr().err


# ---- recommendation -----------------------------------------------------------------------


def _result(cfg: Config, curve: list[tuple[int, float]], c1: float) -> Result:
    mem = Memory(1, 0, 0, 2, "", 1, 1, 1000)
    s = Step(1, {}, 1e6 / c1, c1, {}, 1)
    peak = max(curve, key=lambda ct: ct[1])
    r = Result(cfg, {"sglang": [], "vllm": []}, mem, {1: s}, peak[0], peak[1], curve)
    r.c_max = max(c for c, _ in curve)
    return r


def test_recommend_under_the_tpot_cap_with_ties_and_latency():
    tp, ours = Config(8), Config(8, 1, 8, 8, "pcie_a2a")
    # by hand: TPOT = C / tok/s; tp: C=32 at 800 tok/s is 40 ms, C=64 at 1000 is 64 ms;
    # ours: C=64 at 1400 is 45.7 ms, C=128 at 2000 is 64 ms
    a = _result(tp, [(1, 90), (32, 800), (64, 1000)], 90)
    b = _result(ours, [(1, 50), (64, 1400), (128, 2000)], 50)
    rec = recommend([a, b], cap_ms=50.0)
    assert rec.best.config == ours and rec.latency.config == tp
    assert rec.ties == [b]  # 800 x 1.2 < 1400: outside the band
    # with a cap of 70 ms tp reaches 1000 and ours 2000; a loose cap: both at their top
    assert recommend([a, b], cap_ms=70.0).best.config == ours
    # within 5% of each other: the simpler one is named, the other listed as a tie
    c = _result(ours, [(1, 50), (32, 820)], 50)
    rec = recommend([a, c], cap_ms=50.0, band=(0.9, 1.2))
    assert rec.best.config == tp and [r.config for r in rec.ties] == [tp, ours]
    assert "a tie" in rec.note
    # a band of x0.9..x1.2: 800 x 1.2 = 960 reaches 1000 x 0.9: a tie; 700 x 1.2 does not
    d = _result(Config(4, 2), [(1, 60), (32, 800)], 60)
    e = _result(Config(2, 4), [(1, 60), (32, 700)], 60)
    f = _result(ours, [(1, 50), (32, 1000)], 50)
    rec = recommend([d, e, f], cap_ms=50.0, band=(0.9, 1.2))
    assert [r.config for r in rec.ties] == [ours, Config(4, 2)]
    # nothing under the cap: no throughput answer, the latency choice still given
    rec = recommend([a, b], cap_ms=5.0)
    assert rec.best is None and rec.latency.config == tp and "5 ms" in rec.note
    assert recommend([]).best is None


@pytest.mark.parametrize("stack", ["vllm-tuned", "sglang-stock"])
def test_recommendation_stable_under_small_input_changes(tmp_path, stack):
    """A small change in an input names the same configuration or one the base plan
    already listed as a tie (inside its band)."""
    base = Inputs(topo=str(TOPO), probe=str(P2P), stack=stack)
    rec = make_plan(base).recommendation
    allowed = {r.config.name for r in rec.ties} | {rec.best.config.name}
    eff = tmp_path / "eff.json"
    eff.write_text(json.dumps({"memory_efficiency": 0.86, "tensor_efficiency": 0.58}))
    for changed in (
        Inputs(**{**base.__dict__, "context": 3900}),
        Inputs(**{**base.__dict__, "context": 4300}),
        Inputs(**{**base.__dict__, "skew": 0.05}),
        Inputs(**{**base.__dict__, "tables": str(eff)}),
    ):
        assert make_plan(changed).recommendation.best.config.name in allowed, changed


# ---- measured numbers in --------------------------------------------------------------------


def test_generic_probe_pairs_and_exchanges(tmp_path):
    from pcie_a2a.configplan.measured import Measured, read_probe

    f = tmp_path / "probe.json"
    f.write_text(
        json.dumps(
            {
                "format": "someone.else.probe",
                "pairs": [
                    {"src": 0, "dst": 1, "push_gbps": 10.0, "pull_gbps": 40.0, "p2p_us": 1.5},
                    {"src": 1, "dst": 0, "push_gbps": 10.0, "pull_gbps": 40.0,
                     "direction": "push"},
                ],
                "exchanges": [
                    {"tokens_per_rank": 1, "dispatch_us": 20, "combine_us": 30},
                    {"tokens_per_rank": 100, "dispatch_us": 200, "combine_us": 300},
                ],
            }
        )
    )  # fmt: skip
    m = Measured()
    read_probe(str(f), m)
    assert m.probe.get(0, 1).p2p_gbps == 40.0 and m.probe.get(0, 1).p2p_us == 1.5
    assert m.probe.get(1, 0).p2p_gbps == 10.0
    ex = m.exchange("pcie_a2a", "fp8", 8, (7168, 384, 8))
    assert ex.kind == "predicted" and ex.dispatch(10) == pytest.approx(20 * 10**0.5)
    p = make_plan(Inputs(topo=str(TOPO), probe=str(f)))
    r = next(r for r in p.results if r.config.name == "DP8+EP8 pcie_a2a")
    kind, src = r.steps[8].sources["pcie_a2a"]
    assert kind == "predicted" and str(f) in src
    assert r.steps[8].terms["comm"] >= 60 * (20 + 30)  # 1 token per rank at C=8
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"pairs": [{"src": 0}]}))
    with pytest.raises(ValueError, match="expected an object with src and dst"):
        read_probe(str(bad), Measured())


def _bench_doc(backend: str) -> dict:
    def method(d, c):
        return {"phases": {"dispatch": {"p50_us": d}, "combine": {"p50_us": c}}}

    results = [
        {"tokens": t, "payload": "fp8", "routing": "uniform",
         "methods": {"pcie_a2a": method(10 + t, 20 + t), "a2a": method(50 + t, 60 + t)}}
        for t in (1, 16, 128)
    ]  # fmt: skip
    return {
        "config": {"hidden": 7168, "experts": 384, "topk": 8, "backend": backend},
        "machine": {"world": 8},
        "results": results,
    }


def test_bench_numbers_replace_the_model(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(_bench_doc("cuda")))
    p = make_plan(Inputs(topo=str(TOPO), bench=str(f)))
    r = next(r for r in p.results if r.config.name == "DP8+EP8 pcie_a2a")
    kind, src = r.steps[128].sources["pcie_a2a"]
    assert kind == "measured" and "p50" in src
    # 16 tokens per rank: 26 + 36 µs per MoE layer, 60 MoE layers
    assert r.steps[128].terms["comm"] == pytest.approx(60 * (26 + 36) + 0.0, abs=60.0)
    a2a = next(r for r in p.results if r.config.name == "DP8+EP8 NCCL a2a")
    assert a2a.steps[8].sources["a2a-nccl"][0] == "measured"
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(_bench_doc("cpu")))
    with pytest.raises(ValueError, match="'--backend cuda' run"):
        make_plan(Inputs(topo=str(TOPO), bench=str(cpu)))


def test_tables_override(tmp_path):
    base = make_plan(Inputs(topo=str(TOPO), context=0))
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"memory_efficiency": 0.425, "custom_ar8": [[256, 5], [65536, 10]]}))
    slow = make_plan(Inputs(topo=str(TOPO), context=0, tables=str(f)))

    def tp8(p):
        return next(r for r in p.results if r.config.name == "TP8").steps[1]

    assert tp8(slow).terms["attention"] == pytest.approx(2 * tp8(base).terms["attention"])
    assert str(f) in tp8(slow).sources["all-reduce"][1]
    f.write_text(json.dumps({"flux_capacitor": 1}))
    with pytest.raises(ValueError, match="unknown table 'flux_capacitor'"):
        make_plan(Inputs(topo=str(TOPO), tables=str(f)))


# ---- models and GPUs --------------------------------------------------------------------------


def test_glm45_config_is_read_by_the_moe_reader():
    cfg = BUILTIN["glm-4.5"]["config"]
    spec = parse_config(cfg)
    assert (spec.num_experts, spec.top_k, spec.shared_intermediate) == (160, 8, 1536)
    assert spec.scoring == "sigmoid" and spec.correction_bias and spec.first_moe_layer == 3


@pytest.mark.parametrize(
    "model, gpu, gpus",
    [
        ("kimi-k2.6", "h200", 8),
        ("deepseek-v3", "h100-pcie", 8),
        ("glm-4.5", "l40s", 8),
        ("qwen3-235b-a22b-fp8", "rtx-5090", 8),
        ("mixtral-8x7b", "a6000", 4),
        ("qwen3-30b-a3b", "rtx-4090", 2),
    ],
)
def test_models_and_gpus(model, gpu, gpus):
    from pcie_a2a.topology import Topology

    p = make_plan(Inputs(model=model, gpu=gpu, gpus=gpus, topo=None))
    assert p.gpu.key == gpu and p.num_gpus == gpus
    modelled = [r for r in p.results if r.modelled]
    assert modelled and all(r.steps[1].tok_s > 0 for r in modelled)
    rec = p.recommendation
    assert (rec.best is None) == (not any(r.runs for r in p.results))
    del Topology


def test_config_json_path(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(BUILTIN["mixtral-8x7b"]["config"]))
    p = make_plan(
        Inputs(
            model=str(d), gpu="l40s", gpus=4, topo=str(FIXTURES / "4x-l40s-dual-socket.topo.txt")
        )
    )
    assert p.model.experts == 8 and p.model.attention == "gqa"


def test_probe_in_the_topology_packages_format(tmp_path):
    from pcie_a2a.configplan.measured import Measured, read_probe
    from pcie_a2a.topology import PairMeasurement, Probe

    f = tmp_path / "probe.json"
    f.write_text(Probe({(0, 1): PairMeasurement(p2p_gbps=60.0, p2p_us=2.0)}, "box").to_json())
    m = Measured()
    read_probe(str(f), m)
    assert m.probe.get(0, 1) == PairMeasurement(p2p_gbps=60.0, p2p_us=2.0)
    p = make_plan(Inputs(topo=str(TOPO), probe=str(f)))
    assert p.env.exchanges.topo_plan.pair(0, 1).gbps == 60.0  # faster than staging: P2P
    assert "measured for 1 of 56 pairs" in p.env.exchanges.pair_numbers()
