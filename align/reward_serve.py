"""`align reward serve REWARD --port P [--host H]`: a reward over HTTP, for `--reward http://HOST:P/NAME` (the
protocol: align.reward_http, docs/rewards.md).

REWARD is what --reward takes — file.py:FUNCTION (per sample or batched), a registered name (math, exact, ...),
rg:TASK — or an `align rm train` artifact, scored as `align rm score` scores (its normalised score). One request at
a time reaches the function (a lock: a function written for one caller stays correct), each served by a thread of
a stdlib ThreadingHTTPServer. Answers: 200 {"rewards": [...]} (with "errors" where a per-sample function failed on
some completions), 400 on a body that is not the protocol's, 401 without ALIGN_REWARD_TOKEN (when the server has
one), 404 on another path, 500 with the error when the function fails on the whole batch.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from align.config import Options, opt
from align.errors import UserError
from align.reward_http import TOKEN_ENV, is_url
from align.rewards import GROUP_REWARDS, RewardError, call_rewards, parse_rewards

MAX_BODY = 64 << 20  # bytes: a larger request is refused (413)
FLAG = "align reward serve"


@dataclass(frozen=True)
class ServeConfig(Options):
    reward: str = opt("", "The reward to serve: file.py:FUNCTION (per sample or batched), a registered reward (math, "
                          "exact, sort, ...), rg:TASK, or an `align rm train` artifact (its normalised score).")
    port: int = opt(8000, "The port to listen on (0: a free one, printed).", ge=0, le=65535)
    host: str = opt("127.0.0.1", "The address to listen on: 127.0.0.1 (this machine only), or 0.0.0.0 (every "
                                 "interface: set ALIGN_REWARD_TOKEN so that only your runs are answered).")

    def validate(self):
        super().validate()
        if not self.reward:
            raise UserError("align reward serve REWARD: name the reward to serve (file.py:FUNCTION, a registered "
                            "reward such as math, or an `align rm train` artifact).", option="reward")


@dataclass
class Scorer:
    """What a server scores with: `name` (its URL's path), `score(rows, completions, ids)` -> one value per
    completion (a float, None or a RewardError), `batched`: a failure of the whole call fails the request (500)."""

    name: str
    score: Callable[[list, list, list], list]
    batched: bool


def load_scorer(spec: str) -> Scorer:
    """The Scorer of REWARD: an `align rm train` artifact (a directory), else a --reward spec (parse_rewards);
    a group reward (length, env), a URL or a weight is refused (UserError)."""
    if Path(spec).is_dir():
        return _reward_model(spec)
    if spec in GROUP_REWARDS or is_url(spec):
        raise UserError(f"{FLAG} {spec}: " + ("a URL is served already." if is_url(spec) else
                        f"{spec} is computed by the stage itself, from a whole group; serve a reward function."),
                        option="reward")
    (r,) = parse_rewards([spec], FLAG)
    if r.weight != 1.0:
        raise UserError(f"{FLAG} {spec}: serve it without a weight; the client weighs it (--reward "
                        f"http://HOST:PORT/{r.name}:{r.weight:g}).", option="reward")
    return Scorer(r.name, lambda rows, texts, ids: call_rewards(r, rows, texts, ids), r.batched)


def _reward_model(spec: str) -> Scorer:
    """An `align rm train` artifact's normalised score of prompt + completion, as `align rm score` gives it, on the
    GPU when there is one (fp32)."""
    import torch

    from align.models import load_tokenizer, resolve
    from align.reward_model import load_reward_model, require_trained, score

    source = require_trained(resolve(spec, expect="reward"), spec, FLAG)
    tok = load_tokenizer(source)
    model = load_reward_model(source, tok, torch.float32).eval()
    model.to("cuda" if torch.cuda.is_available() else "cpu")

    class Plain:  # what reward_model.score_ids takes: the model as `.module`, called like it
        module = model

        def __call__(self, **batch):
            return model(**batch)

    def scores(rows, texts, ids):
        return score(Plain(), tok, [row["prompt"] for row in rows], texts).tolist()

    return Scorer(Path(spec).resolve().name, scores, True)


class BadRequest(ValueError):
    """A body that is not the protocol's request: answered 400 with this text."""


def _text(completion) -> str:
    """A completion as text: as sent, or the content of the assistant messages it is sent as (conversational)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                            for m in completion):
        return "".join(m["content"] for m in completion)
    raise BadRequest(f"a completion is a string or a list of {{role, content}} messages, not {completion!r:.60}")


def parse_request(body: bytes) -> tuple[list[dict], list[str], list]:
    """(rows, completions as text, completion_ids) of a request's body; BadRequest naming what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not isinstance(
            data.get("completions"), list):
        raise BadRequest('the body is a JSON object with lists "prompts" and "completions" (and "rows": {column: '
                         "list}), one entry per completion")
    prompts, completions = data["prompts"], data["completions"]
    n = len(completions)
    columns, ids = data.get("rows") or {}, data.get("completion_ids")
    if len(prompts) != n:
        raise BadRequest(f"{len(prompts)} prompts for {n} completions: send one prompt per completion")
    if not isinstance(columns, dict) or any(not isinstance(v, list) or len(v) != n for v in columns.values()):
        raise BadRequest(f'"rows" is an object of lists of {n} values, one per completion')
    if ids is not None and (not isinstance(ids, list) or len(ids) != n):
        raise BadRequest(f'"completion_ids" is a list of {n} token lists (or nulls)')
    rows = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
    return rows, [_text(c) for c in completions], ids if ids is not None else [None] * n


def answer(scorer: Scorer, values: list) -> tuple[int, dict]:
    """(status, JSON) of the values of a request: 500 naming the error when a batched scorer failed on the whole
    call; else 200 with the rewards (null where one failed) and, where some failed, their errors."""
    failed = [v for v in values if isinstance(v, RewardError)]
    if scorer.batched and values and len(failed) == len(values) and len({id(v) for v in failed}) == 1:
        return 500, {"error": str(failed[0]), "kind": failed[0].kind}
    body = {"rewards": [None if isinstance(v, RewardError) else v for v in values]}
    if failed:
        body["errors"] = [{"error": str(v), "kind": v.kind} if isinstance(v, RewardError) else None for v in values]
    return 200, body


class Handler(BaseHTTPRequestHandler):
    """The protocol's POST (and a GET that says what is served, for health checks)."""

    server: RewardServer
    server_version = "align-reward"

    def log_message(self, format, *args):  # the server logs each request its own way (RewardServer.log)
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refusal(self) -> tuple[int, str] | None:
        """(status, why) of a request refused before its body is read, or None."""
        path = urllib.parse.urlsplit(self.path).path
        if path not in self.server.paths:
            return 404, f"no reward at {path}; POST to {self.server.url}"
        token = self.server.token
        given = self.headers.get("Authorization", "").encode()
        if token and not hmac.compare_digest(given, f"Bearer {token}".encode()):
            return 401, f"this server needs Authorization: Bearer ${TOKEN_ENV}"
        return None

    def do_GET(self):
        refused = self._refusal()
        self._send(*(refused[0], {"error": refused[1]}) if refused else (200, {"reward": self.server.scorer.name,
                                                                               "url": self.server.url}))

    def do_POST(self):
        started = time.monotonic()
        status, body, n = self._post()
        self.server.log(status, n, time.monotonic() - started, body.get("error", ""))  # before the answer: in order
        self._send(status, body)

    def _post(self) -> tuple[int, dict, int]:
        if refused := self._refusal():
            return refused[0], {"error": refused[1]}, 0
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return 411, {"error": "send the body with a Content-Length"}, 0
        if not 0 <= length <= MAX_BODY:
            return 413, {"error": f"a body of {length} bytes; at most {MAX_BODY} (send fewer completions a request)"}, 0
        try:
            rows, texts, ids = parse_request(self.rfile.read(length))
        except BadRequest as e:
            return 400, {"error": str(e)}, 0
        try:
            with self.server.lock:
                values = self.server.scorer.score(rows, texts, ids)
        except Exception as e:  # a reward model that failed (a reward function's failures are values)
            return 500, {"error": f"{type(e).__name__}: {e}", "kind": "raised"}, len(texts)
        status, body = answer(self.server.scorer, values)
        return status, body, len(texts)


class RewardServer(ThreadingHTTPServer):
    """A Scorer served at http://HOST:PORT/NAME (and /): `url`, `serve_forever()`, `shutdown()`. Port 0: a free
    one. `token`: the Bearer token requests must carry (None: any request). `log(line)`: where each request is
    said (count, seconds)."""

    daemon_threads = True

    def __init__(self, scorer: Scorer, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 log: Callable[[str], None] = print):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)
        self.scorer, self.token, self._log = scorer, token, log
        self.lock = threading.Lock()
        self.path_name = "/" + urllib.parse.quote(scorer.name)
        self.paths = {"/", self.path_name}
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.server_address[1]}{self.path_name}"

    def log(self, status: int, n: int, seconds: float, error: str = "") -> None:
        said = f"{n} completions, {seconds:.3f} s" if status == 200 else f"HTTP {status}: {error}"
        self._log(f"{time.strftime('%H:%M:%S')} POST {self.path_name}: {said}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(cfg: ServeConfig) -> None:
    """`align reward serve`: load the reward, listen, print the URL, serve until Ctrl-C (or SIGTERM)."""
    from align.console import console

    scorer = load_scorer(cfg.reward)
    token = os.environ.get(TOKEN_ENV, "").strip() or None

    def log(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    try:
        server = RewardServer(scorer, cfg.host, cfg.port, token, log=log)
    except OSError as e:
        raise UserError(f"--host {cfg.host} --port {cfg.port}: cannot listen there ({e.strerror or e}); choose "
                        "another --port (0: any free one).", option="port") from None
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops it as Ctrl-C does
    console.print(f"serving {scorer.name} at {server.url} (POST JSON, docs/rewards.md"
                  f"{f'; requests need ${TOKEN_ENV}' if token else ''}); Ctrl-C stops", markup=False, highlight=False,
                  soft_wrap=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    console.print("stopped")
