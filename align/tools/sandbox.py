"""Users' tools run in a sandbox: a worker process of their own, never the trainer's or the decoder's.

    box = Sandbox("tools.py", ["lookup", "convert"], timeout=5.0, memory_mb=512)
    box.schemas          # each function's JSON schema, read from its type hints and docstring (transformers'
                         # get_json_schema, what apply_chat_template(tools=...) renders), by the worker
    box.call("lookup", {"key": "x"})   -> ("ok", "result text"); ("error", "error: no tool named ...") for a
                                          call that names no tool; ("failed", "error: timed out after 5 s") when the
                                          function raised, hung, crashed, ran out of memory or returned garbage
    box.close()

The worker is a fresh interpreter (`python -I`: no user site, no PYTHONPATH) started in its own user and network
namespaces (`unshare --user --net`: no network at all), with an address-space limit (`memory_mb`) and a CPU-time
limit; it imports the user's file — so even the file's top level runs only there — and answers one call at a
time over a pipe (JSON lines). A function that raises, returns what is not text or a number, runs past `timeout`
seconds (the worker is killed and started again for the next call), exhausts its memory or kills the worker has
"failed": the episode ends (align.tools.functions). The run never sees an exception. A machine that cannot isolate (no `unshare`, or user namespaces disabled) is refused up front, with
what to do, before any model is built.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from functools import cache

from align.errors import UserError

MAX_RESULT = 4000  # characters of a tool's answer kept (the episode's --max-tool-tokens cut it further)

# argv: MEMORY_MB PATH NAMES; MEMORY_MB "schema": import the file, answer its functions' schemas and exit (no memory
# limit: transformers' get_json_schema imports torch); otherwise serve calls within MEMORY_MB
WORKER = r"""
import importlib.util, json, os, resource, sys
memory, path, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if memory != "schema" and int(memory):
    resource.setrlimit(resource.RLIMIT_AS, (int(memory) << 20, int(memory) << 20))
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what a tool prints goes to stderr, not into the answers
def send(**msg):
    out.write(json.dumps(msg) + "\n"); out.flush()
try:
    spec = importlib.util.spec_from_file_location("user_tools", path)
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    fns = {n: getattr(module, n) for n in names}
    if memory == "schema":
        from transformers.utils import get_json_schema
        send(ok=True, schemas=[get_json_schema(fns[n]) for n in names]); sys.exit(0)
except BaseException as e:
    send(ok=False, error=f"{type(e).__name__}: {e}"[:500]); sys.exit(1)
send(ok=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        value = fns[req["name"]](**req["arguments"])
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            send(ok=False, fatal=True, error=f"returned {type(value).__name__}, not text or a number")
        else:
            send(ok=True, result=str(value)[:%d])
    except MemoryError:
        send(ok=False, fatal=True, error="out of memory")
    except BaseException as e:
        send(ok=False, fatal=True, error=f"{type(e).__name__}: {e}"[:500])
""" % MAX_RESULT


@cache
def isolation() -> list[str] | None:
    """The command prefix that gives a process no network (its own user and network namespaces), if this machine
    can: `unshare` present and user namespaces allowed (tried once); None otherwise."""
    tool = shutil.which("unshare")
    if not tool:
        return None
    prefix = [tool, "--user", "--net", "--map-root-user"]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return prefix if ok else None


def require_isolation(flag: str) -> list[str]:
    prefix = isolation()
    if prefix is None:
        raise UserError(f"{flag}: this machine cannot isolate a user's tool (no `unshare`, or unprivileged user "
                        "namespaces are disabled: sysctl kernel.unprivileged_userns_clone=1), and align runs no "
                        "user tool with network access; use the built-in calculator, or a machine that can.")
    return prefix


class Sandbox:
    """A user's tool functions in a worker process (see the module's docstring)."""

    def __init__(self, path: str, names: list[str], *, timeout: float = 5.0, memory_mb: int = 1024,
                 cpu_seconds: int = 600, flag: str = "--tools"):
        self.path, self.names, self.timeout, self.memory_mb = os.path.abspath(path), list(names), timeout, memory_mb
        self.cpu_seconds, self.flag = cpu_seconds, flag
        self.prefix = require_isolation(flag)
        self.proc: subprocess.Popen | None = None
        self.schemas = self._start(schema=True)["schemas"]  # a worker of its own, gone once it answered
        self._start()

    def _start(self, schema: bool = False) -> dict:
        cpu = self.cpu_seconds

        def limits():
            import resource

            os.setsid()  # its own process group: a timeout kills what the tool started too
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

        memory = "schema" if schema else str(self.memory_mb)
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-I", "-c", WORKER, memory, self.path,
                                      ",".join(self.names)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, preexec_fn=limits)
        hello = self._read(max(self.timeout, 60.0))  # the first answer imports the file (and transformers' schema)
        if schema:
            self.proc.wait()
        if hello is None or not hello.get("ok"):
            why = "no answer" if hello is None else hello.get("error", "")
            self._kill()
            raise UserError(f"{self.flag} {self.path}:{','.join(self.names)}: the tool file did not load in its "
                            f"sandbox ({why}). Check that it imports on its own (python {self.path}) and defines "
                            "these functions.")
        if schema:
            self.proc = None
        return hello

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None

    def call(self, name: str, arguments: dict) -> tuple[str, str]:
        """(status, text): ("ok", the answer), ("error", "error: ...": the call named no tool or gave no arguments
        object: the policy's mistake) or ("failed", "error: ...": the function raised, hung, crashed, ran out of
        memory or returned garbage). Never raises for what the tool does."""
        if name not in self.names:
            return "error", f"error: no tool named {name!r} (tools: {', '.join(self.names)})"
        if not isinstance(arguments, dict):
            return "error", "error: the arguments must be an object"
        if self.proc is None or self.proc.poll() is not None:
            try:
                self._start()
            except UserError:
                return "failed", "error: the tool's sandbox did not start"
        try:
            self.proc.stdin.write(json.dumps({"name": name, "arguments": arguments}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, TypeError, ValueError) as e:
            self._kill()
            return "failed", f"error: {type(e).__name__}"
        answer = self._read(self.timeout)
        if answer is None:
            timed_out = self.proc.poll() is None
            self._kill()
            return "failed", f"error: timed out after {self.timeout:g} s" if timed_out else "error: the tool crashed"
        if answer.get("ok"):
            return "ok", answer["result"]
        return ("failed" if answer.get("fatal") else "error"), f"error: {answer.get('error', '')}"

    def close(self) -> None:
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
