"""The OS sandbox that uploaded inferlets run in: a host process per API key inside bubblewrap (``bwrap``).

``SandboxLauncher`` is a ``HostLauncher`` (host_launcher.py) that starts ``inferlet_host`` as::

    bwrap --unshare-{pid,net,ipc,uts,cgroup} --die-with-parent --new-session --clearenv ... \\
        -- [setpriv --reuid UID ...] python -m pie_runtime.serve.inferlet_host ... --reap

What the process inside sees and may do:

- **network**: a network namespace of its own (only a loopback with nothing on it); the two sockets it needs,
  its key's own engine listener and its pool's control socket, are ``ipc://`` files bind-mounted at
  ``/run/pie/``. Their outer folder (``Sandbox.private``) is the server's, mode 0700: no other local user
  reaches them by path;
- **files**: read-only views of the interpreter (``sys.base_prefix``), the venv (``sys.prefix``), the system
  libraries (``/usr``), the ``pie_runtime`` and ``inferlet`` packages and its own key's upload folder, each at
  its own path; a private ``/tmp`` (a size-capped tmpfs, its HOME and working folder); a fresh ``/dev`` and
  a ``/proc`` of its own pid namespace. Nothing else of the machine: no /etc, no /root, no /home, no other
  key's folder, no prompt-cache folder, no key file;
- **processes**: its own pid namespace (the server, the engine and other keys' hosts are not in it, so it
  can neither see nor signal them); ``--die-with-parent``: the kernel ends it when the server dies;
- **identity**: where the server runs as root, ``setpriv`` drops to an unprivileged uid/gid of the key's own
  (``uid_base + n``), with no supplementary groups, no capabilities and ``no_new_privs``; under a non-root
  server it keeps the server's unprivileged uid inside a user namespace;
- **environment and argv**: ``--clearenv`` and a handful of fixed variables; no key, token or path of the
  server's in either (``/proc/1/cmdline`` inside shows bwrap's own argv: the binds above, nothing secret).

Resource limits (address space, CPU seconds, open files, processes) are ``HostLimits`` the host applies to
itself before it loads anything (limits.py); with ``reap`` it also kills, after each run, every process of its
pid namespace but itself, so no fork outlives the run that made it.

``probe()`` starts a trivial sandbox the same way; ``pie serve --allow-upload`` refuses to start when it fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .host_launcher import LocalHostProcess, host_command
from .limits import HostLimits

INNER_ENGINE = "/run/pie/engine.sock"
INNER_CONTROL = "/run/pie/control.sock"
UNSHARE = ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/sbin")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEFAULT_UID_BASE = 200000  # key n's uid outside the sandbox when the server is root: no account uses it


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be made here; the message says why and what would fix it."""


def key_dir(key: str) -> str:
    """A folder name of a key's own (its digest: the key itself never appears in a path)."""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _import_roots() -> list[Path]:
    """The folders holding the packages a host imports from source (their parents go on PYTHONPATH)."""
    import inferlet
    import pie_runtime

    return [Path(pie_runtime.__file__).resolve().parent, Path(inferlet.__file__).resolve().parent]


class Sandbox:
    """The server's sandbox settings and its private folder of sockets (mode 0700, removed by ``close()``)."""

    def __init__(self, scratch_bytes: int = 64 << 20, uid_base: int = DEFAULT_UID_BASE) -> None:
        self.bwrap = shutil.which("bwrap")
        self.setpriv = shutil.which("setpriv")
        self.scratch_bytes = scratch_bytes
        self.uid_base = uid_base
        self.private = Path(tempfile.mkdtemp(prefix="pie-sandbox-"))
        os.chmod(self.private, 0o700)
        self._uids: dict[str, int] = {}

    def engine_address(self, key: str) -> str:
        """The ipc:// listener the engine opens for ``key``'s sandboxed hosts (``--tenant-listen``): its
        connections are one engine identity, whatever uid the hosts run as (engine/identities.py)."""
        return f"ipc://{self.private}/{key_dir(key)}.engine.sock"

    def control_dir(self, key: str) -> Path:
        return self.private / key_dir(key)

    def uid(self, key: str) -> int | None:
        """The key's uid outside the sandbox when the server is root (one per key: RLIMIT_NPROC counts per
        uid, so one key's processes never use up another's); None when the server is not root."""
        if os.geteuid() != 0:
            return None
        return self._uids.setdefault(key, self.uid_base + len(self._uids))

    def command(self, inner: list[str], binds: list[tuple[str, str]], ro: list[Path], uid: int | None) -> list[str]:
        """The bwrap command line that runs ``inner`` with sockets ``binds`` (outer, inner) and the read-only
        folders ``ro`` (at their own paths)."""
        if self.bwrap is None:
            raise SandboxUnavailable("bwrap (bubblewrap) is not installed: apt-get install bubblewrap")
        cmd = [self.bwrap, *UNSHARE, "--die-with-parent", "--new-session", "--clearenv"]
        if uid is None:
            cmd += ["--unshare-user"]  # not as root: a user namespace maps uid 0 only, and setpriv could not drop
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                cmd += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                cmd += ["--ro-bind", d, d]
        for f in SYSTEM_FILES:
            cmd += ["--ro-bind-try", f, f]
        # the scratch first: a folder bound below /tmp (the uploads') must land on it, not be hidden by it
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        cmd += ["--perms", "1777", "--size", str(self.scratch_bytes), "--tmpfs", "/tmp"]
        seen: set[str] = set()
        for path in [Path(sys.base_prefix), Path(sys.prefix), *_import_roots(), *ro]:
            path = path.resolve()
            if str(path) in seen or str(path).startswith(SYSTEM_DIRS):
                continue
            for parent in reversed(path.parents[:-1]):  # made 0700 by bwrap otherwise: not traversable
                if str(parent) not in seen:
                    seen.add(str(parent))
                    cmd += ["--perms", "0755", "--dir", str(parent)]
            seen.add(str(path))
            cmd += ["--ro-bind", str(path), str(path)]
        cmd += ["--perms", "0755", "--dir", "/run/pie"]
        for outer, inside in binds:
            cmd += ["--bind", outer, inside]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": ":".join(str(r.parent) for r in _import_roots()),
        }
        for name, value in env.items():
            cmd += ["--setenv", name, value]
        cmd += ["--chdir", "/tmp"]
        if uid is not None:
            if self.setpriv is None:
                raise SandboxUnavailable("setpriv (util-linux) is needed to drop root inside the sandbox")
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--", self.setpriv]
            cmd += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
            cmd += ["--no-new-privs", *inner]
        else:
            cmd += ["--", *inner]
        return cmd

    def probe(self) -> None:
        """Starts a trivial sandbox as the hosts' are started; raises SandboxUnavailable saying why not."""
        inner = [sys.executable, "-c", "import inferlet, pie_runtime.serve.limits"]
        try:
            cmd = self.command(inner, [], [], self.uid(""))
        except SandboxUnavailable:
            raise
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxUnavailable(f"bwrap could not run: {e}") from None
        finally:
            self._uids.clear()
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            hint = " (bwrap needs unprivileged user namespaces, or to run as root)" if "bwrap" in tail else ""
            raise SandboxUnavailable(f"a sandbox could not be made: {tail}{hint}")

    def close(self) -> None:
        shutil.rmtree(self.private, ignore_errors=True)


class SandboxLauncher:
    """Starts one key's hosts inside the sandbox (a HostLauncher): its upload folder read-only, the engine's
    sandbox listener and the pool's control socket bound in at ``/run/pie/``."""

    def __init__(self, sandbox: Sandbox, key: str, folder: Path) -> None:
        self.sandbox = sandbox
        self.key = key
        self.folder = folder

    async def spawn(self, args: list[str], extra_env: dict[str, str], limits: HostLimits | None) -> LocalHostProcess:
        import asyncio

        del extra_env  # no token goes in: a sandbox's engine listener is an ipc:// one without it
        args = list(args)
        binds: list[tuple[str, str]] = []
        for flag, inside in (("--control", INNER_CONTROL), ("--engine", INNER_ENGINE)):
            i = args.index(flag)
            outer = args[i + 1].removeprefix("ipc://")
            with contextlib.suppress(OSError):
                os.chmod(outer, 0o666)  # reachable only through the 0700 private folder, or the bind inside
            binds.append((outer, inside))
            args[i + 1] = f"ipc://{inside}"
        inner = [*host_command(args, 1), "--reap"]  # its parent inside is the namespace's init, pid 1
        cmd = self.sandbox.command(inner, binds, [self.folder], self.sandbox.uid(self.key))
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env={"PATH": os.defpath}
        )
        return LocalHostProcess(proc)
