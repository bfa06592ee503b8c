"""One stream over HTTP against `pie run` on the same engine, alternated in one run.

    python examples/bench_http_vs_run.py [--rounds 6] [--max-tokens 128] [--prompt-tokens 128] [--threads 2]
                                         [--weights int4] [--profile DIR]

Starts one `pie serve --listen ipc://...` (its engine also reachable by address), then per round: one
streaming chat completion over HTTP (greedy, ``ignore_eos``, a fresh prompt) and one
`pie run text-completion --chat --stream` process (the `inferlet` runner) on the server's engine with the same
kind of request. Both prompts are new to the prefix cache. Rates:

- ``http``: the client's decode rate (tokens after the first over the first-to-last content chunk, as
  `pie bench serve` counts it);
- ``run``: the inferlet's own ``stats.decode_tokens_per_s`` (the baseline `pie bench serve --runs 1` uses).

``--profile DIR``: runs ``py-spy record`` on the server, the inferlet host and the engine over the HTTP rounds
(flame graphs as speedscope JSON under DIR). Prints one line a round and the median ratio, and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", default="int4")
    p.add_argument("--profile", type=Path, default=None)
    a = p.parse_args()
    model = DEFAULT_MODEL
    texts = prompts(model, 2 * a.rounds + 1, a.prompt_tokens)
    engine = f"ipc://{tempfile.gettempdir()}/pie-bench-http-{os.getpid()}.sock"
    port = free_port()
    cmd = [sys.executable, "-m", "pie_runtime.cli.main", "serve", "--model", model, "--http", f"127.0.0.1:{port}"]
    cmd += ["--listen", engine, "--threads", str(a.threads), "--weights", a.weights]
    server = ServerChild("pie serve", f"http://127.0.0.1:{port}", cmd)
    try:
        http_rate(server.base, model, texts[-1], 8)  # first-call costs
        run_rate(engine, texts[-1], 8)
        spies = profile(server.proc.pid, a.profile, 60) if a.profile else []
        pids = roles(server.proc.pid)
        ratios = []
        for r in range(a.rounds):
            before = {k: cpu_s(v) for k, v in pids.items()} | {"client": time.process_time()}
            h = http_rate(server.base, model, texts[2 * r], a.max_tokens)
            after = {k: cpu_s(v) for k, v in pids.items()} | {"client": time.process_time()}
            cpu = " ".join(f"{k} {(after[k] - before[k]) / a.max_tokens * 1e3:.2f}" for k in after)
            e0 = cpu_s(pids["engine"])
            u = run_rate(engine, texts[2 * r + 1], a.max_tokens)
            e1 = cpu_s(pids["engine"])
            ratios.append(h / u)
            print(f"round {r}: http {h:.1f} tok/s, pie run {u:.1f} tok/s, ratio {h / u:.3f}; "
                  f"CPU ms/token over HTTP: {cpu}; engine under pie run {(e1 - e0) / a.max_tokens * 1e3:.2f}",
                  flush=True)  # fmt: skip
        for s in spies:
            s.wait()
        print(f"median ratio http/run {statistics.median(ratios):.3f} over {len(ratios)} rounds; "
              f"load average {os.getloadavg()}")  # fmt: skip
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
