"""A hostile tenant against one real `pie serve` (tiny model) with three API keys, uploads allowed, saved prompt
caches, the prefix cache on and a small per-key KV-page quota (issue 57). Each test is one of the issue's
findings, and fails on the server before it: the upload probe gets no key, token, other tenant's file or network
and cannot touch the engine or outlive its run; one key cannot see or touch another's uploads, prompt caches,
cached prefixes or runs; /metrics, /tokenize and the API schema need a key; an inferlet run passes the same
admission as a completion; a stream whose client stops reading loses its run; and after all of it another key's
greedy completion is the one it got on the quiet server. One server for the module (started once: the suite's
time)."""

from __future__ import annotations

import ast
import json
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from examples.hostile_tenant import FLOOD
from pie_runtime.engine.connections import MAX_IDENTITY_CONNECTIONS
from pie_runtime.engine.identities import MAX_IDENTITY_CHANNEL_BYTES
from pie_runtime.serve.sandbox import Sandbox
from tests.conftest import REPO, TINY
from tests.serve.server_proc import assert_refused_before_bind, children, start_serve

pytestmark = pytest.mark.e2e

K1, K2, K3 = "key-one-7f3a9c", "key-two-b81d44", "key-three-c0ffee"
SECRET = "s3cret-in-the-servers-env"


@pytest.fixture(scope="module")
def served(pie_home, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    keys = d / "keys.json"
    keys.write_text(json.dumps({"keys": {K1: {}, K3: {"concurrent": 1, "cache_bytes": 4096}}}))
    k2 = d / "k2.key"
    k2.write_text(K2 + "\n")
    caches = d / "caches"
    s = start_serve(
        pie_home,
        TINY,
        "--kv-pages",
        "512",
        "--pass-cost-rows",
        "0",
        "--keys",
        str(keys),
        "--api-key",
        f"@{k2}",
        "--key-kv-pages",
        "64",
        "--max-n",
        "8",
        "--max-tokens",
        "256",
        "--prompt-cache-dir",
        str(caches),
        "--allow-upload",
        "--upload-memory",
        "3072",
        "--stream-stall-timeout",
        "3",
        env={"PIE_TEST_SECRET": SECRET},
    )
    s.files = {"keys": keys, "k2": k2, "caches": caches}  # type: ignore[attr-defined]
    yield s
    s.stop()


def call(served, method: str, path: str, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{served.base}{path}", json=body, headers=headers, timeout=300)


def greedy(served, key: str) -> str:
    body = {"model": TINY, "prompt": "The tenants of the house", "max_tokens": 12, "temperature": 0}
    r = call(served, "POST", "/v1/completions", key, body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def quiet(served) -> str:
    """K1's greedy completion before any tenant misbehaves."""
    return greedy(served, K1)


def upload(served, key: str, name: str, source: str) -> None:
    r = call(served, "POST", "/v1/inferlets", key, {"name": name, "source": source})
    assert r.status_code == 200, r.text


def run(served, key: str, name: str, args: dict) -> httpx.Response:
    return call(served, "POST", f"/v1/inferlets/{name}/runs", key, {"args": args})


PROBE = """
import os
import signal
import socket
import sys
import time

import inferlet


def attempt(fn):
    try:
        return ["ok", repr(fn())[:2000]]
    except BaseException as e:
        return ["refused", type(e).__name__]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def write(path):
    with open(path, "w") as f:
        f.write("pwned")


def everything_readable():
    out = b""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for part in ("cmdline", "environ"):
                try:
                    out += read(f"/proc/{pid}/{part}")
                except OSError:
                    pass
    return out.decode(errors="replace")


def outlive():
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    return pid


def more_engine_connections(count):
    # hellos from `count` new connections to the engine socket in the sandbox: how each was answered
    import zmq

    from pie_runtime.protocol import messages as m
    from pie_runtime.protocol.codec import pack, unpack

    ctx = zmq.Context()
    socks, answers = [], []
    try:
        for i in range(count):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect("ipc:///run/pie/engine.sock")
            socks.append(s)
            s.send(pack({"id": i, "op": "hello", "version": m.PROTOCOL_VERSION}))
        for s in socks:
            if s.poll(10000):
                reply = unpack(s.recv())
                answers.append("ok" if reply["ok"] else reply["error"]["code"])
            else:
                answers.append("silent")
        # 64 MiB channels (at capacity) from every connection let in: the identity's total binds, not each one's
        big = {"op": "channel_open", "shape": [1 << 20], "dtype": "float32", "capacity": 16}
        for s, answer in zip(socks, answers):
            for i in range(8):
                if answer != "ok":
                    break
                s.send(pack({"id": 100 + i, **big}))
                reply = unpack(s.recv()) if s.poll(10000) else {"ok": False, "error": {"code": "silent"}}
                error = reply.get("error") or {}
                answers.append("channel" if reply["ok"] else f"{error['code']}:{error.get('message', '')[:40]}")
                if not reply["ok"]:
                    break
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    return answers


def connect(port):
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return "connected"


@inferlet.main
async def main(args: dict) -> dict:
    return {
        "uid": os.getuid(),
        "env": dict(os.environ),
        "proc": everything_readable(),
        "parent": attempt(lambda: read(f"/proc/{os.getppid()}/cmdline")),
        "keys": attempt(lambda: read(args["keys"])),
        "k2": attempt(lambda: read(args["k2"])),
        "caches": attempt(lambda: os.listdir(args["caches"])),
        "home": attempt(lambda: os.listdir(args["home"])),
        "socket": attempt(lambda: connect(args["port"])),
        "kill_engine": attempt(lambda: os.kill(args["engine"], signal.SIGKILL)),
        "write_shipped": attempt(lambda: write(os.path.join(args["shipped"], "text-completion.py"))),
        "write_own": attempt(lambda: write(__file__)),
        "scratch": attempt(lambda: write("/tmp/mine")),
        "fork": attempt(outlive),
        "engine_connections": more_engine_connections(8),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "me": os.getpid(),
    }
"""


def engine_pid(served) -> int:
    """The engine process: the server's child running `pie_runtime.cli.main engine`."""
    for pid in children(served.proc.pid):
        try:
            if b"engine" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3:5]:
                return pid
        except OSError:
            continue
    raise AssertionError("no engine process")


def test_the_upload_probe_gets_nothing(served, quiet):
    upload(served, K2, "probe", PROBE)
    engine = engine_pid(served)
    files = served.files
    args = {
        "keys": str(files["keys"]),
        "k2": str(files["k2"]),
        "caches": str(files["caches"]),
        "port": served.port,
        "engine": engine,
        "shipped": str(REPO / "inferlets"),
        "home": str(Path.home()),
    }
    shipped_before = (REPO / "inferlets" / "text-completion.py").read_bytes()
    r = run(served, K2, "probe", args)
    assert r.status_code == 200, r.text
    got = r.json()["result"]
    assert got["uid"] != 0
    seen = json.dumps(got["env"]) + got["proc"] + json.dumps(got["parent"])
    for secret_text in (K1, K2, K3, SECRET, str(files["keys"]), str(files["caches"])):
        assert secret_text not in seen
    for probe in ("keys", "k2", "caches", "socket", "kill_engine", "write_shipped", "write_own"):
        assert got[probe][0] == "refused", (probe, got[probe])
    # the home folder shows at most the way to the interpreter the sandbox binds, nothing of its own
    home = Path.home()
    allowed = {
        Path(p).relative_to(home).parts[0] for p in (sys.base_prefix, sys.prefix) if Path(p).is_relative_to(home)
    }
    listed = ast.literal_eval(got["home"][1]) if got["home"][0] == "ok" else []
    assert set(listed) <= allowed, listed
    assert got["scratch"][0] == "ok" and got["fork"][0] == "ok"
    # its uid's connections to the engine are capped: more sockets do not buy more per-client limits
    answers = got["engine_connections"]
    assert "limit_exceeded" in answers and answers.count("ok") < MAX_IDENTITY_CONNECTIONS, answers
    # and those connections share one identity's totals: its channel bytes, whatever connection asks
    assert answers.count("channel") == MAX_IDENTITY_CHANNEL_BYTES // (64 << 20), answers
    refusals = [a for a in answers if a.startswith("limit_exceeded:")]
    assert len(refusals) == answers.count("ok") and all("MAX_IDENTITY_CHANNEL_BYTES" in a for a in refusals), answers
    # the engine lives on, and the fork did not outlive its run: the next run's pid namespace holds only
    # the sandbox's init, its host and that run's own fork
    assert Path(f"/proc/{engine}").exists()
    again = run(served, K2, "probe", args).json()["result"]
    assert again["pids"] == sorted({1, again["me"], int(again["fork"][1])}), again
    assert (REPO / "inferlets" / "text-completion.py").read_bytes() == shipped_before
    assert greedy(served, K1) == quiet


SLEEPER = """
import asyncio

import inferlet


@inferlet.main
async def main(args: dict) -> dict:
    inferlet.emit("started")
    await asyncio.sleep(args.get("seconds", 60))
    return {"slept": True}
"""


def test_keys_do_not_see_each_others_uploads_caches_or_runs(served, quiet):
    upload(served, K1, "mine", SLEEPER)
    listed = {c["id"] for c in call(served, "GET", "/v1/inferlets", K2).json()["data"]}
    assert "mine" not in listed
    assert run(served, K2, "mine", {"seconds": 0}).status_code == 404
    assert run(served, K1, "mine", {"seconds": 0}).json()["result"] == {"slept": True}

    saved = call(served, "POST", "/v1/prompt_caches", K1, {"name": "vault", "prompt": "the vault of key one"})
    assert saved.status_code == 200, saved.text
    assert call(served, "GET", "/v1/prompt_caches", K2).json()["data"] == []
    assert call(served, "GET", "/v1/prompt_caches/vault", K2).status_code == 404
    assert call(served, "DELETE", "/v1/prompt_caches/vault", K2).status_code == 404
    body = {"model": TINY, "prompt": "x", "max_tokens": 1, "prompt_cache": "vault"}
    assert call(served, "POST", "/v1/completions", K2, body).status_code == 404
    assert run(served, K2, "prompt-cache", {"prompt": "x", "load": "vault", "max_tokens": 1}).status_code == 404
    mine = call(served, "POST", "/v1/prompt_caches", K2, {"name": "vault", "prompt": "key two writes"})
    assert mine.status_code == 200
    assert call(served, "GET", "/v1/prompt_caches/vault", K1).json() == saved.json()  # not overwritten

    # a run id belongs to its key: another key's cancel finds nothing, the owner's cancels it
    with httpx.stream(
        "POST",
        f"{served.base}/v1/inferlets/mine/runs",
        json={"args": {"seconds": 120}, "stream": True},
        headers={"authorization": f"Bearer {K1}"},
        timeout=300,
    ) as stream:
        run_id = stream.headers["x-pie-run-id"]
        assert call(served, "DELETE", f"/v1/inferlets/runs/{run_id}", K2).status_code == 404
        assert call(served, "DELETE", f"/v1/inferlets/runs/{run_id}", K1).json()["cancelled"] is True


def test_cached_prefixes_are_each_keys_own(served):
    body = {"model": TINY, "prompt": "A system prompt only key one knows. " * 12, "max_tokens": 1}

    def cached(key: str) -> int:
        r = call(served, "POST", "/v1/completions", key, body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(K1)
    assert cached(K1) > 0  # the cache is on: the key's second request reuses its first's pages
    assert cached(K2) == 0  # another key's hit would say K1 sent this prefix
    assert cached(K2) > 0


def test_metrics_tokenize_and_the_schema_need_a_key(served):
    for method, path, body in (
        ("GET", "/metrics", None),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/openapi.json", None),
        ("GET", "/docs", None),
    ):
        assert call(served, method, path, None, body).status_code == 401, path
        assert call(served, method, path, K3, body).status_code == 200, path
    assert call(served, "GET", "/health", None).status_code == 200


def test_an_inferlet_run_passes_the_same_admission_as_a_completion(served):
    flood = {"prompt": "hi", "n": 64, "max_tokens": 200, "ignore_eos": True}
    r = run(served, K2, "text-completion", flood)
    assert r.status_code == 400 and r.json()["error"]["param"] == "args.n"
    r = run(served, K2, "text-completion", {**flood, "n": 8})  # within --max-n, over the key's 64 pages
    assert r.status_code == 429 and r.json()["error"]["param"] == "kv_pages"
    r = run(served, K2, "text-completion", {**flood, "max_tokens": 100_000, "n": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "args.max_tokens"
    r = run(served, K2, "mtp-speculative-decoding", {"prompt": "hi", "tree": "64,64,64"})  # bounded in its Args
    assert r.status_code == 400 and "tree" in r.json()["error"]["message"]
    # saves have a byte quota: K3's 4 KiB holds no saved cache
    r = call(served, "POST", "/v1/prompt_caches", K3, {"name": "big", "prompt": "a cache too big for its key"})
    assert r.status_code == 429 and r.json()["error"]["param"] == "cache_bytes"
    assert call(served, "GET", "/v1/prompt_caches", K3).json()["data"] == []
    assert run(served, K2, "text-completion", {"prompt": "hi", "max_tokens": 4}).status_code == 200


def test_a_stream_nobody_reads_is_cancelled_frees_its_slot_and_ends_cleanly(served, quiet):
    upload(served, K3, "flood", FLOOD)
    upload(served, K3, "nap", SLEEPER)
    assert run(served, K3, "nap", {"seconds": 0}).status_code == 200  # K3's sandbox is up before the flood
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", served.port))
    body = json.dumps({"args": {}, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/inferlets/flood/runs HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {K3}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    try:
        # K3 may hold one run: the stalled stream's, until the server gives up on its reader
        small = {"model": TINY, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        time.sleep(1.0)  # the flood's request reaches the server and is admitted
        # an uploaded inferlet's run takes the same slot: uploading buys the key no runs beside its quota
        nap = run(served, K3, "nap", {"seconds": 0})
        assert nap.status_code == 429 and nap.json()["error"]["param"] == "concurrent", nap.text
        statuses = []
        for _ in range(600):  # a safety net, not a bound under test
            statuses.append(call(served, "POST", "/v1/completions", K3, small).status_code)
            if statuses[-1] != 429:
                break
            time.sleep(0.2)
        assert statuses[0] == 429 and statuses[-1] == 200, statuses
        # the server dropped the connection: what it had sent, then the end (no chunk after the stall's)
        sock.settimeout(60)
        while sock.recv(1 << 16):
            pass
    finally:
        sock.close()
    log = served.stderr()
    assert "read nothing for" in log  # the stall's warning, and nothing about a response left unfinished
    assert "ASGI callable returned without completing response" not in log
    assert greedy(served, K1) == quiet


def test_upload_refused_without_a_sandbox(pie_home, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert_refused_before_bind(pie_home, TINY, ["--allow-upload"], "bwrap")


def test_the_sandbox_command_binds_nothing_secret():
    sb = Sandbox()
    try:
        cmd = sb.command(["python"], [], [], 12345)
        assert "--unshare-net" in cmd and "--unshare-pid" in cmd and "--die-with-parent" in cmd and "--clearenv" in cmd
        assert "--reuid=12345" in cmd
        binds = {cmd[i + 1] for i, w in enumerate(cmd) if w in ("--bind", "--ro-bind", "--ro-bind-try")}
        assert not any(b in ("/", "/root", "/home", "/etc", "/tmp", str(Path.home())) for b in binds)
        assert os.stat(sb.private).st_mode & 0o777 == 0o700
    finally:
        sb.close()
