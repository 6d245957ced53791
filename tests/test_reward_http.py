"""Rewards served over HTTP: `--reward http://HOST:PORT/PATH[:WEIGHT]` (align.reward_http, the client) and `align
reward serve` (align.reward_serve, the server). The spec and how a URL is shown (credentials hidden); the client
against small stdlib servers that misbehave on purpose (hang, 500, a wrong count, dying), each counting the calls
it got; the server's answers; and GRPO on the tiny model scoring through a server exactly as it scores in-process,
and going on, or stopping with one line naming the URL, as --on-reward-error says when the server fails."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from align.errors import UserError
from align.reward_http import redact, redact_arg, redacted, split_spec
from align.reward_serve import RewardServer, load_scorer
from align.rewards import RewardError, call_rewards, parse_rewards, probe
from tests.conftest import ROOT, align_env, assert_same_training, run_align, small_data

REWARDS = '''\
def parity(prompt, completion, **row):
    return float(len(completion) % 2)

def flaky(prompt, completion, **row):
    if completion == "bad":
        raise ValueError("not this one")
    return 0.5

def boom(completions, **kwargs):
    raise RuntimeError("kaput")

def nan(prompt, completion, **row):
    return float("nan")

def chat(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"] == a) + len(p) for p, c, a in zip(prompts, completions, answer)]
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The reward file every server here serves (its parity is served.parity, as GRPO names it in-process)."""
    f = tmp_path_factory.mktemp("http") / "served.py"
    f.write_text(REWARDS)
    return f


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    """Retries 10 ms apart (the default is 0.5 s, doubled): the tests count them, not wait for them."""
    monkeypatch.setenv("ALIGN_REWARD_BACKOFF", "0.01")
    monkeypatch.delenv("ALIGN_REWARD_TOKEN", raising=False)


@contextlib.contextmanager
def running(server):
    """`server` serving on a thread of its own, shut down afterwards."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def parity_of(completions) -> list[float]:
    return [float(len(c) % 2) for c in completions]


class Faulty(ThreadingHTTPServer):
    """A protocol server that misbehaves on purpose: `plan(call)` (1, 2, ...) says what call number `call` gets:
    ok (the parity of each completion), hang (no answer for `hang_s`), 500, short (one reward too few), 404, 307 (a
    redirect), die (answered, then the server shuts itself down). Counts its calls, keeps their headers and
    bodies."""

    daemon_threads = True

    def handle_error(self, request, client_address):  # a hung answer written to a client that left: no noise
        pass

    def __init__(self, plan, hang_s: float = 5.0):
        super().__init__(("127.0.0.1", 0), FaultyHandler)
        self.plan, self.hang_s, self.calls, self.headers, self.bodies = plan, hang_s, 0, [], []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/served.parity"


class FaultyHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.calls += 1
            call = s.calls
            s.headers.append(dict(self.headers))
            s.bodies.append(body)
        action = s.plan(call)
        rewards = parity_of(body["completions"])
        if action == "hang":
            time.sleep(s.hang_s)
        if action == "500":
            return self.send(500, {"error": "overloaded"})
        if action == "404":
            return self.send(404, {"error": "no such reward"})
        if action == "307":  # to another path of this server: a client that followed would call again
            self.send_response(307)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        self.send(200, {"rewards": rewards[:-1] if action == "short" else rewards})
        if action == "die":
            threading.Thread(target=lambda: (s.shutdown(), s.server_close())).start()


def client(url: str, **env):
    """The RewardFn of --reward `url`, its client made under the environment variables `env`."""
    with pytest.MonkeyPatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        (r,) = parse_rewards([url])
    return r


ROWS = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+3", "answer": "5"}, {"prompt": "4+4", "answer": "8"}]
TEXTS = ["2", "55", "8 "]


# ---- the spec and how a URL is shown


def test_a_url_spec_is_a_batched_reward_with_its_weight_after_the_path():
    cases = {"http://h:8000/score": ("http://h:8000/score", 1.0, "score"),
             "http://h:8000/score:0.5": ("http://h:8000/score", 0.5, "score"),
             "https://rewards.example.com/v1/served.parity:-2e-1": ("https://rewards.example.com/v1/served.parity",
                                                                     -0.2, "served.parity"),
             "http://h:8000": ("http://h:8000", 1.0, "h:8000"),  # no path: the :8000 is the port
             "http://h:8000/": ("http://h:8000/", 1.0, "h:8000"),
             "http://h/score?x=1:3": ("http://h/score?x=1", 3.0, "score")}
    for spec, (url, weight, name) in cases.items():
        assert split_spec(spec) == (url, weight), spec
        (r,) = parse_rewards([spec])
        assert (r.name, r.weight, r.spec, r.path, r.batched) == (name, weight, url, url, True), spec
    for bad in ("http://", "http://:80/x", "http://h:99999/x"):
        with pytest.raises(UserError, match="not a URL"):
            parse_rewards([bad])
    with pytest.raises(UserError, match="ALIGN_REWARD_RETRIES"):
        client("http://h/x", ALIGN_REWARD_RETRIES="-1")
    with pytest.raises(UserError, match="ALIGN_REWARD_TOKEN: holds white space") as e:
        client("http://h/x", ALIGN_REWARD_TOKEN="s3cr3t\nX-Evil: 1")
    assert "s3cr3t" not in str(e.value)


def test_credentials_are_hidden_wherever_a_url_is_shown_or_recorded():
    assert redact("http://user:pa55@h:8000/s?token=abc&n=3&api_key=k3y&sig=x#f") == \
        "http://***@h:8000/s?token=***&n=3&api_key=***&sig=***#f"
    assert redact("https://t0k3n@h/s") == "https://***@h/s" and redact("http://h/s?n=1") == "http://h/s?n=1"
    (r,) = parse_rewards(["http://user:pa55@h:8000/s?key=k3y:0.5"])
    assert r.spec == "http://***@h:8000/s?key=***" and r.weight == 0.5 and "pa55" not in repr(r)
    settings = {"reward": ["math", "http://u:pa55@h/s"], "verifier": "https://h/v?token=t", "lr": 0.1, "model": "tiny"}
    assert redacted(settings) == {"reward": ["math", "http://***@h/s"], "verifier": "https://h/v?token=***",
                                  "lr": 0.1, "model": "tiny"}
    assert [redact_arg(a) for a in ("--reward", "http://u:pa55@h/s", "--verifier=https://h/v?key=k", "math")] == [
        "--reward", "http://***@h/s", "--verifier=https://h/v?key=***", "math"]  # the command --nproc prints


# ---- the client against faulty servers


def test_the_batch_goes_out_in_chunks_on_threads_and_comes_back_in_order(served):
    """5 completions, chunks of 2: 3 requests, the rows' columns and ids sliced alike; the values in order."""
    texts = ["a", "bb", "ccc", "dddd", "eeeee"]
    rows = [{"prompt": f"p{i}", "answer": str(i), "level": i} for i in range(5)]
    with running(Faulty(lambda call: "ok")) as s:
        r = client(s.url, ALIGN_REWARD_CHUNK="2", ALIGN_REWARD_WORKERS="3")
        assert call_rewards(r, rows, texts, [[i] for i in range(5)], 5.0) == parity_of(texts)
    assert s.calls == 3
    bodies = sorted(s.bodies, key=lambda b: b["prompts"][0])
    assert [b["completions"] for b in bodies] == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]
    assert bodies[1] == {"prompts": ["p2", "p3"], "completions": ["ccc", "dddd"], "completion_ids": [[2], [3]],
                         "rows": {"answer": ["2", "3"], "level": [2, 3]}}


def test_a_5xx_and_a_hang_are_tried_again_a_4xx_and_a_wrong_count_are_not():
    """Each failure is a RewardError of every completion of its request, one line naming the URL and what
    happened; the server counts the tries (ALIGN_REWARD_RETRIES 2: 3 tries). A redirect is not followed."""
    cases = [  # plan, client timeout, calls, kind, words
        (lambda call: "500" if call < 3 else "ok", 5.0, 3, None, ""),  # mended by the third try
        (lambda call: "500", 5.0, 3, "raised", "HTTP 500 (3 tries) on a request of 3 completions: overloaded"),
        (lambda call: "hang", 0.2, 3, "timeout", "no answer within 0.2 s (3 tries) on a request of 3 completions"),
        (lambda call: "404", 5.0, 1, "input", "HTTP 404 on a request of 3 completions: no such reward"),
        (lambda call: "short", 5.0, 1, "type", "returned 2 rewards for 3 completions"),
        (lambda call: "307", 5.0, 1, "input", ("HTTP 307 on a request of 3 completions: a redirect, not followed: "
                                               "give the URL it points to")),
    ]
    for plan, timeout, calls, kind, words in cases:
        with running(Faulty(plan, hang_s=1.0)) as s:
            values = call_rewards(client(s.url), ROWS, TEXTS, None, timeout)
        assert s.calls == calls, words
        if kind is None:
            assert values == parity_of(TEXTS)
            continue
        assert all(isinstance(v, RewardError) and v.kind == kind for v in values), values
        assert str(values[0]) == f"reward {s.url}: {words}"
        assert ("--on-reward-error" in values[0].fix()) == (kind != "type")


def test_the_probe_refuses_a_server_that_is_gone_or_breaks_the_protocol_and_warns_of_one_that_fails():
    """Before any model is built: nothing listening (connection refused, kind input) and a wrong count (type) stop
    the command, naming the URL without its password; a 500 on every probe request is only warned of."""
    with running(Faulty(lambda call: "ok")) as s:
        url = s.url.replace("127.0.0.1", "u:pa55@127.0.0.1")
    r = client(url)  # the server is gone: nothing listens on its port
    (value, *_) = call_rewards(r, ROWS, TEXTS, None, 1.0)
    shown = url.replace("u:pa55@", "***@")
    assert value.kind == "input"
    assert str(value) == f"reward {shown}: connection refused (3 tries) on a request of 3 completions"
    with pytest.raises(UserError) as e:
        probe([r], ROWS, timeout=1.0, where="data.jsonl")
    assert f"reward {shown}: connection refused" in str(e.value) and "before any model is built" in str(e.value)
    with running(Faulty(lambda call: "short")) as s, pytest.raises(UserError) as e:
        probe([client(s.url)], ROWS, timeout=1.0, where="data.jsonl")
    assert "returned 2 rewards for 3 completions" in str(e.value) and 'answer {"rewards": [...]}' in str(e.value)
    assert "def " not in str(e.value)  # the protocol, not the two forms of a Python function
    warned = []
    with running(Faulty(lambda call: "500")) as s, pytest.MonkeyPatch.context() as m:
        m.setattr("align.console.warn", lambda msg, once=False: warned.append(msg))
        probe([client(s.url)], ROWS, timeout=1.0, where="data.jsonl")
    assert len(warned) == 1 and "HTTP 500 (3 tries)" in warned[0] and s.calls == 2 * 3  # answers, empty text: 3 tries each


def test_the_answers_values_null_errors_non_numbers_and_nan_are_read_per_completion():
    """null: does not apply (None); an "errors" entry fails its completion alone, with the server's kind; a string
    is a type error and NaN a value error of that completion; the others keep their values."""

    class Answers(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"rewards": [None, 1, "x"], "errors": [None, None, None]} if self.path == "/a" else
                              {"rewards": [math.nan, True, 0.25],  # Python's json writes NaN
                               "errors": [None, None, {"error": "bad", "kind": "value"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    with running(ThreadingHTTPServer(("127.0.0.1", 0), Answers)) as s:
        base = f"http://127.0.0.1:{s.server_address[1]}"
        a = call_rewards(client(base + "/a"), ROWS, TEXTS, None, 5.0)
        b = call_rewards(client(base + "/b"), ROWS, TEXTS, None, 5.0)
    assert a[:2] == [None, 1.0] and a[2].kind == "type" and "'x' (not a number) for completion '8 '" in str(a[2])
    assert b[0].kind == "value" and "returned nan" in str(b[0]) and b[1] == 1.0
    assert b[2].kind == "value" and str(b[2]) == f"reward {base}/b: bad"


def test_the_token_goes_in_a_header_and_nowhere_else():
    with running(Faulty(lambda call: "404")) as s:
        value = call_rewards(client(s.url, ALIGN_REWARD_TOKEN="s3cr3t"), ROWS, TEXTS, None, 5.0)[0]
        call_rewards(client(s.url.replace("127.0.0.1", "us%40r:pa55@127.0.0.1")), ROWS, TEXTS, None, 5.0)
    assert s.headers[0]["Authorization"] == "Bearer s3cr3t" and "s3cr3t" not in str(value) + value.fix()
    assert s.headers[1]["Authorization"] == "Basic dXNAcjpwYTU1"  # base64 of us@r:pa55


# ---- the server


@pytest.fixture(scope="module")
def parity_server(served):
    lines = []
    with running(RewardServer(load_scorer(f"{served}:parity"), port=0, token="s3cr3t", log=lines.append)) as s:
        yield s, lines


def post(url: str, body, token: str | None = "s3cr3t") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_server_answers_the_protocol_and_refuses_what_is_not(parity_server):
    s, lines = parity_server
    assert s.url.endswith("/served.parity")
    ok = {"prompts": ["a", "b"], "completions": ["x", "yy"], "rows": {"answer": ["1", "2"]}}
    assert post(s.url, ok) == (200, {"rewards": [1.0, 0.0]})
    assert re.fullmatch(r"\d\d:\d\d:\d\d POST /served\.parity: 2 completions, \d+\.\d{3} s", lines[-1]), lines[-1]
    refused = {"error": "this server needs Authorization: Bearer $ALIGN_REWARD_TOKEN"}
    assert post(s.url, ok, token=None) == (401, refused)
    assert post(s.url.replace("served.parity", "other"), ok)[0] == 404
    for bad, words in ((b"{not json", "not JSON"), ({"prompts": ["a"], "completions": ["x", "y"]}, "1 prompts for 2"),
                       ({"prompts": ["a"], "completions": ["x"], "rows": {"answer": []}}, '"rows"'),
                       ({"completions": ["x"]}, '"prompts" and "completions"'), ({"prompts": ["a"], "completions": [3]},
                                                                                "a completion is a string")):
        status, answer = post(s.url, bad)
        assert status == 400 and words in answer["error"], (bad, answer)
    assert "HTTP 400" in lines[-1]


def test_the_server_says_which_completions_failed_and_fails_a_batch_that_raised(served):
    """A per-sample function's failures are per completion (200, errors); a batched one that raised is a 500 with
    its error and kind; conversational completions reach a batched function as messages, as in-process."""
    with running(RewardServer(load_scorer(f"{served}:flaky"), log=lambda line: None)) as s:
        status, answer = post(s.url, {"prompts": ["a", "b"], "completions": ["ok", "bad"]}, token=None)
    assert status == 200 and answer["rewards"] == [0.5, None] and answer["errors"][0] is None
    assert answer["errors"][1] == {"error": "reward 'served.flaky' raised ValueError: not this one on completion 'bad'",
                                   "kind": "raised"}
    with running(RewardServer(load_scorer(f"{served}:boom"), log=lambda line: None)) as s:
        assert post(s.url, {"prompts": ["a"], "completions": ["x"]}, token=None) == (500, {
            "error": "reward 'served.boom' raised RuntimeError: kaput on a batch of 1 completions, the first 'x'",
            "kind": "raised"})
    chat_rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "2"}] * 2
    local = parse_rewards([f"{served}:chat"])[0]
    with running(RewardServer(load_scorer(f"{served}:chat"), log=lambda line: None)) as s:
        assert call_rewards(client(s.url), chat_rows, ["2", "3"], None, 5.0) == \
            call_rewards(local, chat_rows, ["2", "3"]) == [2.0, 1.0]
    for spec, words in (("math:0.5", "without a weight"), ("length", "computed by the stage"),
                        ("http://h/x", "served already")):
        with pytest.raises(UserError, match=words):
            load_scorer(spec)


def test_a_reward_model_is_served_with_its_normalised_score(tiny_reward_model_dir, shipped_tokenizer):
    import torch

    from align.models import resolve
    from align.reward_model import load_reward_model, score

    prompts, texts = ["1+1=", "2+2="], ["2", "five"]
    with running(RewardServer(load_scorer(str(tiny_reward_model_dir)), log=lambda line: None)) as s:
        got = call_rewards(client(s.url), [{"prompt": p} for p in prompts], texts, None, 30.0)
    model = load_reward_model(resolve(str(tiny_reward_model_dir), expect="reward"), shipped_tokenizer, torch.float32)

    class Plain:
        module = model

        def __call__(self, **batch):
            return model(**batch)

    assert got == pytest.approx(score(Plain(), shipped_tokenizer, prompts, texts).tolist(), abs=1e-6)
    assert got[0] != got[1]


def test_align_reward_serve_prints_its_url_serves_and_stops_on_ctrl_c(served):
    # as a terminal starts it: SIGINT at its default (a test worker may ignore it, and a child inherits that)
    proc = subprocess.Popen([sys.executable, "-m", "align", "reward", "serve", f"{served}:parity", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=align_env(), cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        url = line.split(" at ", 1)[1].split()[0]
        assert line.startswith("serving served.parity at http://127.0.0.1:") and url.endswith("/served.parity"), line
        assert post(url, {"prompts": ["a"], "completions": ["xyz"]}, token=None) == (200, {"rewards": [1.0]})
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "POST /served.parity: 1 completions" in out and out.rstrip().endswith("stopped")
    assert "Traceback" not in out


# ---- GRPO through a server


ARGS = ["--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4", "--eval-samples", "0",
        "--micro-batch-size", "4", "--lr", "1e-3", "--warmup-steps", "0", "--data", str(small_data()["arith"])]


def grpo(tmp_path, model, name: str, reward: str, steps: int, *more, env: dict | None = None):
    """A short GRPO run of the tiny model (in a forked `align` process) with --reward `reward`."""
    out = tmp_path / name
    proc = run_align("grpo", "--model", model, "--out", out, "--reward", reward, "--max-steps", steps, *ARGS, *more,
                     env={"ALIGN_REWARD_BACKOFF": "0.01", **(env or {})})
    return proc, out, proc.stdout + proc.stderr


def steps_of(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward" in r]


def test_grpo_scores_through_a_server_as_it_does_in_process(tmp_path, served, tiny_model_dir):
    """The same run, the reward in-process and served (in chunks of 3 on 2 threads, with a token and a key in the
    URL): every metric of every step and the weights alike; the credentials in no file and no line."""
    lines = []
    local, local_out, said = grpo(tmp_path, tiny_model_dir, "local", f"{served}:parity", 2)
    assert local.returncode == 0, said[-3000:]
    with running(RewardServer(load_scorer(f"{served}:parity"), port=0, token="s3cr3t", log=lines.append)) as s:
        proc, out, said = grpo(tmp_path, tiny_model_dir, "http", f"{s.url}?api_key=k3y", 2,
                               env={"ALIGN_REWARD_TOKEN": "s3cr3t", "ALIGN_REWARD_CHUNK": "3"})
    assert proc.returncode == 0, said[-3000:]
    assert_same_training(local_out, out, tiny_model_dir)
    assert "rewards/served.parity" in steps_of(out)[0]
    assert len(lines) == 3 * 2  # the probe's 4 rows, then 2 steps of 4 completions: each in chunks of 3 and 1
    art = (out / "artifact.json").read_text()
    assert json.loads(art)["config"]["reward"] == [f"{s.url}?api_key=***"]
    for where in (art, said, (out / "metrics.jsonl").read_text()):
        assert "s3cr3t" not in where and "k3y" not in where


def test_a_server_dying_mid_run_stops_it_with_one_line_naming_the_url(tmp_path, tiny_model_dir):
    """--on-reward-error fail: the server answers the probe and step 1, then is gone; step 2's request is refused
    3 times, and the run exits 2 with one line naming the URL (its password hidden) and what happened, no
    traceback; step 1's metrics are kept and the artifact is failed with that reason."""
    with running(Faulty(lambda call: "die" if call == 2 else "ok")) as s:
        url = s.url.replace("127.0.0.1", "u:pa55@127.0.0.1")
        proc, out, said = grpo(tmp_path, tiny_model_dir, "die", url, 3)
    shown = url.replace("u:pa55@", "***@")
    assert s.calls == 2 and "Traceback" not in said and "pa55" not in said + (out / "artifact.json").read_text()
    errors = [line for line in said.splitlines() if line.startswith("error:")]
    line = (f"error: reward {shown}: connection refused (3 tries) on a request of 4 completions. Check the server, "
            "or pass --on-reward-error skip|zero.")
    assert proc.returncode == 2 and errors == [line], said[-3000:]
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "failed" and f"reward {shown}: connection refused (3 tries)" in art["reason"]
    assert [(r["step"], r["rewards/errors"]) for r in steps_of(out)] == [(1, 0.0)]


def test_a_failing_server_scores_zero_under_on_reward_error_zero_and_the_run_goes_on(tmp_path, tiny_model_dir):
    """--on-reward-error zero, --reward-timeout 0.5: step 2's request is answered 500 three times, step 3's with
    one reward too few, step 4's not within 0.5 s three times (the server would answer after 3 s); those steps
    score every sample 0 and count it in rewards/errors, steps 1 and 5 are scored. The server counts the tries."""
    faults = {3: "500", 4: "500", 5: "500", 6: "short", 7: "hang", 8: "hang", 9: "hang"}  # call 1: the probe
    with running(Faulty(lambda call: faults.get(call, "ok"), hang_s=3.0)) as s:
        proc, out, said = grpo(tmp_path, tiny_model_dir, "zero", s.url, 5, "--on-reward-error", "zero",
                               "--reward-timeout", "0.5")
    assert proc.returncode == 0 and "Traceback" not in said, said[-3000:]
    assert s.calls == 10
    steps = steps_of(out)
    assert [r["rewards/errors"] for r in steps] == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert all(r["reward"] == r["rewards/served.parity"] == 0.0 for r in steps[1:4])
    for r in (steps[0], steps[4]):
        assert r["reward"] == r["rewards/served.parity"] and not math.isnan(r["reward"])
