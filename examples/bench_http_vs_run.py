"""One stream over HTTP against `pie run` on the same engine, alternated in one run.

    python examples/bench_http_vs_run.py [--rounds 6] [--max-tokens 128] [--prompt-tokens 128] [--threads 2]
                                         [--weights int4] [--base TREE] [--base-env KEY=VALUE] [--profile DIR]

Starts one `pie serve --listen ipc://...` (its engine also reachable by address), then per round: one
streaming chat completion over HTTP (greedy, ``ignore_eos``, a fresh prompt) and one
`pie run text-completion --chat --stream` process (the `inferlet` runner) on the server's engine with the same
kind of request. Both prompts are new to the prefix cache. Rates:

- ``http``: the client's decode rate (tokens after the first over the first-to-last content chunk, as
  `pie bench serve` counts it);
- ``run``: the inferlet's own ``stats.decode_tokens_per_s`` (the baseline `pie bench serve --runs 1` uses).

``--base TREE``: a second server run from another source tree (an older commit's, unpacked), its HTTP stream
alternated with ours in each round: before and after in one run. ``--base-env KEY=VALUE`` (repeatable): the
second server (from this tree unless ``--base`` names one) runs with these variables set, say
``OMP_WAIT_POLICY=PASSIVE`` against the OpenMP runtime's default spin-wait. Each server's ``pie run`` runs on
its own engine, so each label's ratio compares HTTP and ``pie run`` on one engine. Each HTTP row also gives the
CPU milliseconds a token costs the server, the engine, the inferlet host and the client (less what each spends
idle), and each ``pie run`` row the engine's and the ``pie run`` process's.

``--profile DIR``: runs ``py-spy record`` on the server, the inferlet host and the engine over the HTTP rounds
(flame graphs as speedscope JSON under DIR). Prints one line a round and the median ratio, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pie_runtime.bench.llama_server import ServerChild, free_port
from pie_runtime.bench.prompts import NAMED, prompt_text
from pie_runtime.bench.serve_load import chat_prompts, chat_wave
from pie_runtime.launcher import resolve_inferlet
from pie_runtime.store import DEFAULT_MODEL, ModelStore


def prompts(model: str, count: int, length: int) -> list[str]:
    from inferlet.tokenizer import Tokenizer

    tok = Tokenizer((ModelStore().path(model) / "tokenizer.json").read_text(), [], None, None)
    return chat_prompts(tok, "\n".join(prompt_text(n) for n in NAMED), count, length, first=1000)


def http_rate(base: str, model: str, prompt: str, max_tokens: int) -> float:
    samples, _ = asyncio.run(chat_wave(base, model, [prompt], max_tokens))
    s = samples[0]
    if s.error:
        raise RuntimeError(s.error)
    return (s.tokens - 1) / s.decode_s


def run_rate(engine: str, prompt: str, max_tokens: int) -> float:
    """`pie run`'s own decode rate of one request on ``engine``."""
    path = resolve_inferlet("text-completion")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        words = ["--prompt", prompt, "--chat", "--max-tokens", str(max_tokens), "--ignore-eos", "--stream", "true"]
        cmd = [sys.executable, "-m", "inferlet", "--engine", engine, "--result", str(result), str(path), "--", *words]
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        out = json.loads(result.read_text())
    return float(out["result"]["stats"]["decode_tokens_per_s"])


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def roles(server_pid: int) -> dict[str, int]:
    """server / engine / host → pid."""
    out = {"server": server_pid}
    for pid in children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        out["host" if "inferlet_host" in cmdline else "engine" if "engine" in cmdline else f"child-{pid}"] = pid
    return out


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def profile(server_pid: int, folder: Path, seconds: int) -> list[subprocess.Popen]:
    """py-spy on the server and each of its children (the engine, the inferlet host)."""
    folder.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))
    procs = []
    for role, pid in roles(server_pid).items():
        cmd = [spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "200", "-f", "speedscope"]
        cmd += ["--threads", "-o", str(folder / f"{role}-{pid}.json")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def start_server(
    model: str, a: argparse.Namespace, tree: str | None, env: dict[str, str] | None = None
) -> tuple[ServerChild, str]:
    """A `pie serve` whose engine also listens on an ipc address; ``tree``: the source tree it runs from (its
    PYTHONPATH: the tree and the tree's sdk), else this one's; ``env``: variables set for it (and its engine)."""
    engine = f"ipc://{tempfile.gettempdir()}/pie-bench-http-{os.getpid()}-{free_port()}.sock"
    port = free_port()
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", model, "--http", f"127.0.0.1:{port}"]
    cmd += ["--listen", engine, "--threads", str(a.threads), "--weights", a.weights]
    saved = dict(os.environ)
    os.environ.update(env or {})
    if tree:
        os.environ["PYTHONPATH"] = f"{tree}:{tree}/sdk"
    try:
        return ServerChild("pie serve", f"http://127.0.0.1:{port}", cmd), engine
    finally:
        os.environ.clear()
        os.environ.update(saved)


def idle_rates(pids: dict[str, int], seconds: float = 3.0) -> dict[str, float]:
    """CPU seconds a second each process spends with no request (heartbeats, watchdogs)."""
    before = {k: cpu_s(v) for k, v in pids.items()}
    time.sleep(seconds)
    return {k: (cpu_s(v) - before[k]) / seconds for k, v in pids.items()}


def timed_http(base: str, model: str, prompt: str, a: argparse.Namespace, pids: dict[str, int], idle: dict) -> tuple:
    """(decode rate, CPU ms per token of each process less its idle rate, the client's included)."""
    t0 = time.perf_counter()
    before = {k: cpu_s(v) for k, v in pids.items()} | {"client": time.process_time()}
    rate = http_rate(base, model, prompt, a.max_tokens)
    after = {k: cpu_s(v) for k, v in pids.items()} | {"client": time.process_time()}
    wall = time.perf_counter() - t0
    cpu = {k: (after[k] - before[k] - idle.get(k, 0.0) * wall) / a.max_tokens * 1e3 for k in after}
    return rate, cpu


def timed_run(engine: str, prompt: str, a: argparse.Namespace, pids: dict[str, int], idle: dict) -> tuple:
    """(`pie run`'s decode rate, CPU ms per token of the engine less its idle rate and of the `pie run`
    process, start-up included)."""
    t0 = time.perf_counter()
    before, child = cpu_s(pids["engine"]), children_cpu_s()
    rate = run_rate(engine, prompt, a.max_tokens)
    wall = time.perf_counter() - t0
    engine_ms = (cpu_s(pids["engine"]) - before - idle.get("engine", 0.0) * wall) / a.max_tokens * 1e3
    return rate, {"engine": engine_ms, "run": (children_cpu_s() - child) / a.max_tokens * 1e3}


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fmt(cpu: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in cpu.items())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="int4")
    p.add_argument("--base", default=None, help="also a server run from this source tree, alternated with ours")
    p.add_argument("--base-env", action="append", default=[], help="KEY=VALUE set for the second server")
    p.add_argument("--profile", type=Path, default=None)
    a = p.parse_args()
    model = DEFAULT_MODEL
    second = a.base is not None or bool(a.base_env)
    texts = prompts(model, 4 * a.rounds + 1, a.prompt_tokens)
    base_env = dict(kv.split("=", 1) for kv in a.base_env)
    setups = {"http": (None, None)} | ({"http(base)": (a.base, base_env)} if second else {})
    servers = {}
    try:
        for label, (tree, env) in setups.items():
            servers[label] = start_server(model, a, tree, env)
            http_rate(servers[label][0].base, model, texts[-1], 8)  # first-call costs
            run_rate(servers[label][1], texts[-1], 8)
        pids = {k: roles(srv.proc.pid) for k, (srv, _) in servers.items()}
        idle = {k: idle_rates(v) for k, v in pids.items()}
        spies = profile(servers["http"][0].proc.pid, a.profile, 60) if a.profile else []
        ratios: dict[str, list[float]] = {k: [] for k in servers}
        cpus: dict[str, list[dict]] = {k: [] for k in servers}
        run_cpus: dict[str, list[dict]] = {k: [] for k in servers}
        n = 0
        for r in range(a.rounds):
            line = []
            for label, (srv, engine) in servers.items():
                rate, cpu = timed_http(srv.base, model, texts[n], a, pids[label], idle[label])
                u, ucpu = timed_run(engine, texts[n + 1], a, pids[label], idle[label])
                n += 2
                cpus[label].append(cpu)
                run_cpus[label].append(ucpu)
                ratios[label].append(rate / u)
                line.append(f"{label} {rate:.1f} tok/s (CPU ms/token: {fmt(cpu)}), pie run {u:.1f} ({fmt(ucpu)})")
            print(f"round {r}: " + "; ".join(line) + f"; load {os.getloadavg()[0]:.1f}", flush=True)
        for s in spies:
            s.wait()
        for label in servers:
            med = {k: round(statistics.median(c[k] for c in cpus[label]), 3) for k in cpus[label][0]}
            umed = {k: round(statistics.median(c[k] for c in run_cpus[label]), 3) for k in run_cpus[label][0]}
            print(f"{label}: median ratio to pie run {statistics.median(ratios[label]):.3f} over {a.rounds} rounds; "
                  f"median CPU ms/token {med}; pie run's {umed}")  # fmt: skip
        print(f"load average {os.getloadavg()}")
    finally:
        for srv, _ in servers.values():
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
