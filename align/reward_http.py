"""Rewards served over HTTP: `--reward http://HOST:PORT/PATH[:WEIGHT]` (https too; grpo's --reward, ppo's
--gold-reward, any --verifier), the client that calls such a server, and how a URL is shown (credentials hidden).

The protocol (docs/rewards.md; `align reward serve` speaks it): a batch of completions is sent as one JSON POST
per chunk of at most ALIGN_REWARD_CHUNK completions,

    {"prompts": [...], "completions": [...], "completion_ids": [[int, ...] | null, ...],
     "rows": {"answer": [...], ...}}              every other data column, one value per completion

and answered with

    {"rewards": [number | null, ...]}             one per completion, in order; null: "does not apply" (TRL's None)

plus, optionally, "errors": [null | {"error": text, "kind": kind}, ...]: the completions whose reward failed on the
server (a per-sample function that raised on some of them). The client is a batched reward function
(`HttpReward`): the stage calls it as it calls a batched Python function, and it returns one value per completion
— a float, None, or a RewardError for a completion it could not score — never raising, so --on-reward-error does
for a URL what it does for a local function.

Each request has a time limit (the stage's --reward-timeout, else TIMEOUT_S); a request that gets no answer in
time, cannot connect in a way a retry may mend, or is answered 5xx is tried again (ALIGN_REWARD_RETRIES more
times, waiting ALIGN_REWARD_BACKOFF seconds, doubled each time); a 4xx or a malformed answer is not. Chunks go
out on at most ALIGN_REWARD_WORKERS threads. ALIGN_REWARD_TOKEN, when set, is sent as `Authorization: Bearer
TOKEN` (else a URL's user:password as HTTP Basic); neither is ever printed or recorded.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from align.errors import UserError
from align.reward_errors import RewardError, as_number

SCHEMES = ("http://", "https://")
TIMEOUT_S = 30.0  # a request's limit where the stage gives none (--reward-timeout 0, ppo, --verifier)
TOKEN_ENV = "ALIGN_REWARD_TOKEN"
# the client's knobs: environment variable, default, smallest value
SETTINGS = {"retries": ("ALIGN_REWARD_RETRIES", 2, 0), "backoff": ("ALIGN_REWARD_BACKOFF", 0.5, 0.0),
            "chunk": ("ALIGN_REWARD_CHUNK", 64, 1), "workers": ("ALIGN_REWARD_WORKERS", 4, 1)}
KINDS = ("raised", "input", "timeout", "value", "type")  # RewardError's
# a query parameter whose name says it holds a secret: its value is shown as ***
_SECRET = re.compile(r"token|key|secret|pass|pwd|auth|sig|credential|session", re.IGNORECASE)
_WEIGHT = re.compile(r":([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$")


def is_url(spec) -> bool:
    """Whether a --reward / --verifier spec is a URL (http:// or https://)."""
    return isinstance(spec, str) and spec.lower().startswith(SCHEMES)


def split_spec(spec: str) -> tuple[str, float]:
    """(URL, weight) of `http(s)://HOST[:PORT]/PATH[:WEIGHT]`: a number after a last ':' past the host is the
    weight ('http://h:8000/score:0.5' -> 0.5); without one, or without a path ('http://h:8000': the port), 1."""
    rest = spec.split("://", 1)[1]
    starts = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    if not starts:
        return spec, 1.0
    m = _WEIGHT.search(rest[min(starts):])
    return (spec[: len(spec) - len(m.group(0))], float(m.group(1))) if m else (spec, 1.0)


def redact(url: str) -> str:
    """The URL with its credentials hidden: user:password@ as ***@, and the value of a query parameter whose name
    says it is a secret (token=, key=, api_key=, password=, sig=, ...) as ***. What messages, logs and artifact.json
    show of a URL."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url.split("://", 1)[0] + "://***"
    netloc = ("***@" + parts.netloc.rsplit("@", 1)[1]) if "@" in parts.netloc else parts.netloc
    pairs = [(k + "=***" if eq and _SECRET.search(urllib.parse.unquote(k)) else k + eq + v)
             for k, eq, v in (p.partition("=") for p in parts.query.split("&"))] if parts.query else []
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "&".join(pairs), parts.fragment))


def redacted(value):
    """`value` (a config's settings: a dict, list or string) with every URL in it redacted (`redact`), for what
    artifact.json, checkpoints and trackers record."""
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v) for v in value]
    return redact(value) if is_url(value) else value


def redact_arg(arg: str) -> str:
    """A command-line word with a URL in it (`http://...`, `--reward=http://...`) redacted, for printed commands."""
    flag, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    return flag + eq + redact(value) if is_url(value) else arg


def reward_name(url: str) -> str:
    """The name a URL's reward goes by (rewards/NAME, the stage's lines): the last segment of its path, else its
    host ('http://h:8000/rewards.correct' -> rewards.correct, what a local rewards.py:correct is called)."""
    parts = urllib.parse.urlsplit(url)
    segment = next((s for s in reversed(parts.path.split("/")) if s), "") or parts.netloc.rsplit("@", 1)[-1]
    return re.sub(r"[^\w.:-]", "_", urllib.parse.unquote(segment))


def settings(env=os.environ) -> dict:
    """The client's knobs (SETTINGS) from the environment; a value that is no number, or too small, is a
    UserError naming the variable."""
    out = {}
    for name, (var, default, least) in SETTINGS.items():
        text = env.get(var, "").strip()
        try:
            value = type(default)(text) if text else default
        except ValueError:
            value = None
        if value is None or not value >= least or (isinstance(value, float) and not math.isfinite(value)):
            raise UserError(f"{var}={text!r}: must be a {'whole ' if isinstance(default, int) else ''}number >= "
                            f"{least} (default {default}).")
        out[name] = value
    return out


class HttpRewardError(RewardError):
    """A URL's reward that failed: its message names the URL (redacted) and what happened; `fix` says what to do."""

    def fix(self) -> str:
        if self.kind == "type":
            return ('The server must answer {"rewards": [...]} with one number (or null: does not apply) per '
                    "completion, in order (docs/rewards.md).")
        return "Check the server, or pass --on-reward-error skip|zero."


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed: a POST's body and its Authorization header go to the URL given, nowhere else
    (a 3xx is answered as an error naming the code)."""

    def redirect_request(self, *args, **kwargs):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class HttpReward:
    """The reward a URL serves, as a batched reward function: `timed(timeout, prompts=..., completions=...,
    completion_ids=..., **columns)` returns one value per completion (float, None or HttpRewardError), never
    raising; calling it returns the values or raises the first failure. `shown`: the URL as messages show it."""

    batched = True

    def __init__(self, url: str, flag: str = "--reward"):
        try:
            parts = urllib.parse.urlsplit(url)
            ok = bool(parts.hostname) and (parts.port is None or parts.port > 0)
        except ValueError:
            ok = False
        self.shown, self.name = redact(url), ""
        if not ok:
            raise UserError(f"{flag} {self.shown}: not a URL a reward can be served at; write "
                            "http://HOST:PORT/PATH[:WEIGHT] (or https://).", option=flag.lstrip("-").replace("-", "_"))
        self.name = reward_name(url)
        self._url = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path or "/",
                                             parts.query, ""))
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "align"}
        if token := os.environ.get(TOKEN_ENV, "").strip():
            if not re.fullmatch(r"[\x21-\x7e]+", token):  # said without the token: an error would quote the header
                raise UserError(f"{TOKEN_ENV}: holds white space or characters other than printable ASCII, which an "
                                "HTTP header cannot carry; set it to the token alone.")
            self._headers["Authorization"] = f"Bearer {token}"
        elif parts.username is not None:
            pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            self._headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        s = settings()
        self.retries, self.backoff, self.chunk, self.workers = s["retries"], s["backoff"], s["chunk"], s["workers"]

    def __repr__(self) -> str:  # never the headers
        return f"HttpReward({self.shown!r})"

    def __call__(self, **kwargs) -> list:
        values = self.timed(0.0, **kwargs)
        if failed := next((v for v in values if isinstance(v, RewardError)), None):
            raise failed
        return values

    def timed(self, timeout: float, prompts: list, completions: list, completion_ids: list | None = None,
              **columns) -> list:
        """One value per completion: the batch sent in chunks of at most `chunk` completions, `workers` at a time,
        each request limited to `timeout` seconds (0: TIMEOUT_S)."""
        n, limit = len(completions), timeout if timeout and timeout > 0 else TIMEOUT_S
        ids = completion_ids if completion_ids is not None else [None] * n
        spans = [(i, min(i + self.chunk, n)) for i in range(0, n, self.chunk)]

        def one(span):
            a, b = span
            body = {"prompts": prompts[a:b], "completions": completions[a:b], "completion_ids": ids[a:b],
                    "rows": {k: v[a:b] for k, v in columns.items()}}
            return self._score(body, completions[a:b], limit)

        if len(spans) <= 1 or self.workers == 1:
            chunks = [one(s) for s in spans]
        else:
            with ThreadPoolExecutor(min(self.workers, len(spans)), thread_name_prefix="align-reward") as pool:
                chunks = list(pool.map(one, spans))
        return [v for chunk in chunks for v in chunk]

    def _error(self, what: str, kind: str) -> HttpRewardError:
        return HttpRewardError(f"reward {self.shown}: {what}", kind)

    def _score(self, body: dict, completions: list, limit: float) -> list:
        """The values of one chunk: its request, then the answer read (`_values`); a request that failed fails each
        of its completions."""
        n = len(completions)
        try:
            data = json.dumps(body, default=_plain, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            why = f"cannot send the batch as JSON ({e}); make the data's columns JSON values"
            return [self._error(why, "input")] * n
        reply, failure = self._post(data, limit, n)
        return [failure] * n if failure else self._values(reply, completions)

    def _post(self, data: bytes, limit: float, n: int) -> tuple[bytes | None, HttpRewardError | None]:
        """(the answer's body, None) or (None, the failure): tried again after a timeout, a connection that failed
        and a 5xx, with exponential backoff; at once after a 4xx (or a redirect)."""
        tries, detail = self.retries + 1, ""
        for attempt in range(tries):
            try:
                request = urllib.request.Request(self._url, data=data, headers=self._headers, method="POST")
                with _OPENER.open(request, timeout=limit) as answer:
                    return answer.read(), None
            except urllib.error.HTTPError as e:
                what, kind, detail = f"HTTP {e.code}", _server_kind(e), _detail(e)
                if e.code < 500:
                    return None, self._error(f"{what} on a request of {n} completions{detail}", kind)
            except TimeoutError:
                what, kind, detail = f"no answer within {limit:g} s", "timeout", ""
            except urllib.error.URLError as e:
                if isinstance(e.reason, TimeoutError):
                    what, kind, detail = f"no answer within {limit:g} s", "timeout", ""
                else:  # nothing listens there, no such host: the request cannot be served
                    what, kind, detail = _reason(e.reason), "input", ""
            except (http.client.HTTPException, OSError) as e:  # the connection broke mid-request
                what, kind, detail = f"the connection failed ({_reason(e)})", "raised", ""
            except ValueError as e:  # a request http.client refuses to make; its words may quote the URL or a header
                return None, self._error(f"the request could not be made ({type(e).__name__})", "input")
            if attempt + 1 < tries:
                time.sleep(self.backoff * 2 ** attempt)
        times = f" ({tries} tries)" if tries > 1 else ""
        return None, self._error(f"{what}{times} on a request of {n} completions{detail}", kind)

    def _values(self, reply: bytes, completions: list) -> list:
        """The answer's values, one per completion: a number, None (null), or a HttpRewardError (the completion's
        error on the server, a value that is no number, NaN); an answer that is not {"rewards": [one per
        completion]} fails them all (kind type: the server does not speak the protocol)."""
        n = len(completions)
        try:
            data = json.loads(reply)
        except (ValueError, UnicodeDecodeError):
            return [self._error(f"answered {reply[:60]!r}, not JSON (a request of {n} completions)", "type")] * n
        rewards = data.get("rewards") if isinstance(data, dict) else None
        errors = data.get("errors") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            return [self._error(f'answered without a list "rewards" ({reply[:60]!r})', "type")] * n
        if len(rewards) != n:
            return [self._error(f"returned {len(rewards)} rewards for {n} completions", "type")] * n
        if errors is not None and (not isinstance(errors, list) or len(errors) != n):
            return [self._error(f'answered "errors" that is not a list of {n} (one per completion)', "type")] * n
        out = []
        for value, error, c in zip(rewards, errors or [None] * n, completions):
            number = as_number(value)
            if error is not None:
                text, kind = (error.get("error"), error.get("kind")) if isinstance(error, dict) else (error, "raised")
                out.append(self._error(_squash(str(text)), kind if kind in KINDS else "raised"))
            elif value is None:
                out.append(None)
            elif number is None:
                out.append(self._error(f"returned {value!r:.60} (not a number) for completion {c!r:.80}", "type"))
            elif not math.isfinite(number):
                out.append(self._error(f"returned {number} for completion {c!r:.80}", "value"))
            else:
                out.append(number)
        return out


def _plain(value):
    """json.dumps's fallback: a NumPy value or a tensor as its Python value."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not a JSON value")


def _squash(text: str, most: int = 200) -> str:
    """One line of at most `most` characters."""
    text = " ".join(text.split())
    return text if len(text) <= most else text[: most - 1] + "…"


def _body(e: urllib.error.HTTPError) -> dict | str:
    """An error answer's body: its JSON object, else its text (read once, at most 4 KiB)."""
    if not hasattr(e, "_align_body"):
        try:
            raw = e.read(4096).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            raw = ""
        try:
            e._align_body = json.loads(raw)
        except ValueError:
            e._align_body = raw
    return e._align_body


def _detail(e: urllib.error.HTTPError) -> str:
    """': what the server said' of an error answer (its JSON "error", else its text), or ''."""
    body = _body(e)
    text = str(body.get("error", "")) if isinstance(body, dict) else body
    if 300 <= e.code < 400:
        text = "a redirect, not followed: give the URL it points to"
    return f": {_squash(text)}" if text.strip() else ""


def _server_kind(e: urllib.error.HTTPError) -> str:
    """The RewardError kind of an error answer: the one the server names (`align reward serve` does), else raised
    for a 5xx and input for any other (the server refused the request: a wrong path, no authorisation)."""
    body = _body(e)
    kind = body.get("kind") if isinstance(body, dict) else None
    return kind if kind in KINDS else "raised" if e.code >= 500 else "input"


def _reason(reason) -> str:
    """Why a connection failed, in a few words ('connection refused')."""
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[0].lower() + reason.strerror[1:]
    return _squash(str(reason) or type(reason).__name__)
