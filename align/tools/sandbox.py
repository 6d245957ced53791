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

# argv: MEMORY_MB PATH NAMES KIND (functions | env). MEMORY_MB "schema": import the file, answer what the trainer
# needs to know of it (functions: their JSON schemas; env: its class's `stops`) and exit (no memory limit:
# transformers' get_json_schema imports torch); otherwise serve requests within MEMORY_MB, one JSON line each:
# {"op": "call", "name", "arguments"}; {"op": "new", "id", "row"} (an environment per episode, its reset(row));
# {"op": "step", "id", "turn"}; {"op": "drop", "id"}
WORKER = r"""
import importlib.util, json, math, os, resource, sys
memory, path, names, kind = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
if memory != "schema" and int(memory):
    resource.setrlimit(resource.RLIMIT_AS, (int(memory) << 20, int(memory) << 20))
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what a tool prints goes to stderr, not into the answers
def send(**msg):
    out.write(json.dumps(msg) + "\n"); out.flush()
def text(value):
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"returned {type(value).__name__} as an observation, not text or None")
try:
    spec = importlib.util.spec_from_file_location("user_tools", path)
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    fns = {n: getattr(module, n) for n in names}
    if memory == "schema":
        if kind == "env":
            send(ok=True, stops=[str(x) for x in getattr(fns[names[0]], "stops", ())]); sys.exit(0)
        from transformers.utils import get_json_schema
        send(ok=True, schemas=[get_json_schema(fns[n]) for n in names]); sys.exit(0)
except BaseException as e:
    send(ok=False, error=f"{type(e).__name__}: {e}"[:500]); sys.exit(1)
send(ok=True)
envs = {}
for line in sys.stdin:
    req = json.loads(line)
    try:
        if req["op"] == "call":
            value = fns[req["name"]](**req["arguments"])
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise TypeError(f"returned {type(value).__name__}, not text or a number")
            send(ok=True, result=str(value)[:%d])
        elif req["op"] == "new":
            env = envs[req["id"]] = fns[names[0]]()
            send(ok=True, observation=text(env.reset(req["row"])))
        elif req["op"] == "step":
            result = envs[req["id"]].step(req["turn"])
            observation, reward, done = result
            if reward is not None and (isinstance(reward, bool) or not math.isfinite(float(reward))):
                raise TypeError(f"returned reward {reward!r}, not a finite number or None")
            send(ok=True, observation=text(observation), reward=None if reward is None else float(reward),
                 done=bool(done))
        else:
            envs.pop(req["id"], None)
            send(ok=True)
    except MemoryError:
        send(ok=False, error="out of memory")
    except BaseException as e:
        send(ok=False, error=f"{type(e).__name__}: {e}"[:500])
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
                 cpu_seconds: int = 600, flag: str = "--tools", kind: str = "functions"):
        self.path, self.names, self.timeout, self.memory_mb = os.path.abspath(path), list(names), timeout, memory_mb
        self.cpu_seconds, self.flag, self.kind = cpu_seconds, flag, kind
        self.prefix = require_isolation(flag)
        self.proc: subprocess.Popen | None = None
        self.about = self._start(schema=True)  # a worker of its own, gone once it answered
        self.schemas = self.about.get("schemas", [])
        self._start()

    def _start(self, schema: bool = False) -> dict:
        cpu = self.cpu_seconds

        def limits():
            import resource

            os.setsid()  # its own process group: a timeout kills what the tool started too
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

        memory = "schema" if schema else str(self.memory_mb)
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-I", "-c", WORKER, memory, self.path,
                                      ",".join(self.names), self.kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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
        answer = self.request({"op": "call", "name": name, "arguments": arguments})
        return ("ok", answer["result"]) if answer.get("ok") else ("failed", f"error: {answer['error']}")

    def request(self, req: dict) -> dict:
        """The worker's answer to `req`: {"ok": True, ...}, or {"ok": False, "error": why} — the function or
        environment raised, returned garbage, hung past the timeout (the worker is killed; the next request starts
        a fresh one) or crashed. Never raises for what the user's code does."""
        if self.proc is None or self.proc.poll() is not None:
            try:
                self._start()
            except UserError:
                return {"ok": False, "error": "the sandbox did not start"}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, TypeError, ValueError) as e:
            self._kill()
            return {"ok": False, "error": type(e).__name__}
        answer = self._read(self.timeout)
        if answer is None:
            timed_out = self.proc.poll() is None
            self._kill()
            return {"ok": False, "error": f"timed out after {self.timeout:g} s" if timed_out else "the tool crashed"}
        return answer

    def close(self) -> None:
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
