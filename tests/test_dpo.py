"""DPO end to end on a tiny model: log 2 at step 0, --precompute-ref == live reference, 2-process ZeRO-3 ==
1 process, pass@1 of policy and input model in the artifact, bad input (exit 2)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.errors import UserError
from tests.conftest import _DIST_ENV, ROOT, assert_user_error, run_align

PAIRS = ROOT / "data/prefs/train.jsonl"
ARGS = ["--max-steps", "3", "--batch-size", "8", "--eval-every", "0", "--lr", "1e-3", "--warmup-steps", "1",
        "--max-new-tokens", "8"]


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def steps(out: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def metrics(out: Path) -> dict:
    return json.loads((out / "artifact.json").read_text())["metrics"]


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def dpo(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("dpo")
    lines = PAIRS.read_text().splitlines()
    train = write_rows(root / "train.jsonl", [json.loads(x) for x in lines[:64]])
    test = write_rows(root / "test.jsonl", [json.loads(x) for x in lines[64:96]])
    probs = write_rows(root / "arith.jsonl", [json.loads(x) for x in (ROOT / "data/arithmetic/test.jsonl").read_text().splitlines()[:8]])
    common = ["--model", str(tiny_model_dir), "--data", str(train), "--eval-data", str(test), "--pass-data", str(probs), *ARGS]
    live, pre = root / "live", root / "pre"
    ok(run_align("dpo", *common, "--out", live, "--eval-samples", "8"))
    # ZeRO-2 here: its frozen reference engine is built as stage 0 (stage 2 needs an optimizer)
    ok(run_align("dpo", *common, "--out", pre, "--eval-samples", "0", "--precompute-ref", "--zero-stage", "2"))
    return root, live, pre, common


def test_step_zero_policy_equals_reference(dpo):
    _, live, _, _ = dpo
    first = steps(live)[0]  # logged from the forward before the first update: policy == reference
    assert abs(first["loss"] - math.log(2)) < 1e-5
    assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6
    assert abs(first["rewards/margins"]) < 1e-6 and first["rewards/accuracies"] == 0.0
    for k in ("logps/chosen", "logps/rejected", "grad_norm"):
        assert k in first
    assert first["logps/chosen"] < 0


def test_artifact_reports_pass_at_1_of_policy_and_reference(dpo):
    _, live, _, _ = dpo
    art = json.loads((live / "artifact.json").read_text())
    assert art["status"] == "complete" and art["model_kind"] == "policy"
    m = art["metrics"]
    assert 0 <= m["pass@1/policy"] <= 1 and 0 <= m["pass@1/reference"] <= 1
    assert 0 <= m["eval/rewards/accuracies"] <= 1
    answers = [json.loads(x) for x in (live / "eval_samples.jsonl").read_text().splitlines()]  # the final pass@1's
    assert len(answers) == 8 and {a["step"] for a in answers} == {3}
    assert sum(a["greedy_correct"] for a in answers) / 8 == m["pass@1/policy"]


def test_precomputed_reference_and_zero_2_give_the_same_losses(dpo):
    _, live, pre, _ = dpo
    a, b = steps(live), steps(pre)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert abs(x[k] - y[k]) <= 1e-4 * max(1.0, abs(x[k])), (k, a, b)
    assert abs(metrics(live)["eval/rewards/accuracies"] - metrics(pre)["eval/rewards/accuracies"]) < 1e-9
    assert "pass@1/policy" not in metrics(pre)  # --eval-samples 0 skips generation


def test_two_processes_match_one_process(dpo):
    from align.runtime import free_port

    root, live, _, common = dpo
    two = root / "two"
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["ALIGN_DIST_TIMEOUT"] = "120"
    ok(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                       "-m", "align", "dpo", *common, "--out", str(two), "--eval-samples", "0"],
                      capture_output=True, text=True, timeout=600, env=env))
    a, b = steps(live), steps(two)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * max(1.0, abs(x["loss"])), (a, b)
    assert json.loads((two / "artifact.json").read_text())["world_size"] == 2
    assert abs(metrics(live)["eval/rewards/accuracies"] - metrics(two)["eval/rewards/accuracies"]) < 1e-9


def test_missing_chosen_column(tmp_path, tiny_model_dir):
    data = write_rows(tmp_path / "p.jsonl", [{"prompt": "p", "rejected": "b"}])
    assert_user_error(run_align("dpo", "--model", tiny_model_dir, "--data", data, "--out", tmp_path / "o"),
                      "no 'chosen' column", "p.jsonl")
    assert not (tmp_path / "o").exists()


def test_bad_loss_name(tmp_path, tiny_model_dir):
    assert_user_error(run_align("dpo", "--model", tiny_model_dir, "--loss", "ppo", "--out", tmp_path / "o"),
                      "--loss must be one of sigmoid, ipo, ipo-mean, hinge")


def test_rpo_nll_term_is_added_and_keeps_the_chosen_answer_likely(dpo):
    """--nll-coef α: at step 0 (policy = reference, DPO loss log 2 per pair) the logged loss is log 2 + the mean
    per-token NLL of the chosen answers times α; after training the chosen answers' log-prob ends higher than
    under plain DPO from the same start (the `pre` run: same data, seed and settings)."""
    root, _, pre, common = dpo
    out = root / "rpo"
    ok(run_align("dpo", *common, "--out", out, "--eval-samples", "0", "--precompute-ref", "--zero-stage", "2",
                 "--nll-coef", "1.0"))
    first, last = steps(out)[0], steps(out)[-1]
    assert first["loss/nll"] > 0 and abs(first["loss"] - (math.log(2) + first["loss/nll"])) < 1e-5
    assert last["logps/chosen"] > steps(pre)[-1]["logps/chosen"], (last["logps/chosen"], steps(pre)[-1]["logps/chosen"])


@pytest.mark.parametrize("loss, beta", [("simpo", "2.0"), ("orpo", "0.1")])
def test_reference_free_losses_load_no_reference_and_learn(dpo, loss, beta):
    """--loss simpo / orpo: no reference engine is built; on the same 8 pairs every step the loss falls and the
    chosen answers' reward margin over the rejected ones grows; held-out accuracy is the loss's own reward's."""
    root, _, _, common = dpo
    eight = write_rows(root / "eight.jsonl", [json.loads(x) for x in PAIRS.read_text().splitlines()[:8]])
    out = root / loss
    proc = ok(run_align("dpo", *common, "--data", eight, "--out", out, "--eval-samples", "0", "--loss", loss,
                        "--beta", beta, "--max-steps", "6"))
    assert "reference none" in proc.stdout + proc.stderr
    s = steps(out)
    assert len(s) == 6 and s[-1]["loss"] < s[0]["loss"] and s[-1]["rewards/margins"] > s[0]["rewards/margins"]
    assert 0 <= metrics(out)["eval/rewards/accuracies"] <= 1
    from stages.dpo import DPOConfig

    with pytest.raises(UserError, match="uses no reference model"):
        DPOConfig(loss=loss, precompute_ref=True).validate()


def test_kto_on_unpaired_pairs_starts_at_one_half_and_separates_desirable_from_undesirable(dpo):
    """--loss kto on 8 pairs (16 unpaired rows): at step 1 the policy is the reference (r = 0, z0 = 0), so every row
    costs exactly 1 − σ(0) = 0.5; training raises the desirable rows' implicit reward above the undesirable ones'."""
    root, _, _, common = dpo
    eight = write_rows(root / "eight-kto.jsonl", [json.loads(x) for x in PAIRS.read_text().splitlines()[:8]])
    out = root / "kto"
    proc = ok(run_align("dpo", *common, "--data", eight, "--out", out, "--eval-samples", "0", "--loss", "kto",
                        "--beta", "0.5", "--max-steps", "6", "--batch-size", "16"))
    assert "16 rows for KTO (8 desirable, 8 undesirable, from preference pairs)" in " ".join((proc.stdout + proc.stderr).split())
    s = steps(out)
    assert s[0]["loss"] == pytest.approx(0.5, abs=1e-6) and s[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert s[-1]["rewards/desirable"] > s[-1]["rewards/undesirable"] and s[-1]["loss"] < 0.5
    m = metrics(out)
    assert 0 <= m["eval/rewards/accuracies"] <= 1 and "train/kl" in m
    from stages.dpo import DPOConfig

    with pytest.raises(UserError, match="drop --precompute-ref"):
        DPOConfig(loss="kto", precompute_ref=True).validate()


def test_live_reference_takes_a_steps_pairs_in_one_forward_and_matches_per_micro_batch(monkeypatch):
    """The live reference's log-probs of a step come from forwards of up to DPO_REF_TOKENS tokens (here: all 12
    short pairs in one), not one per policy micro-batch (micro 2: six), and equal the per-micro-batch values."""
    from types import SimpleNamespace

    import torch

    import stages.dpo as S
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.data import load_pairs

    tok = load_tokenizer(resolve("tiny"))
    model = load_causal_lm(resolve("tiny"), tok, torch.float32, seed=0).eval()
    pairs = load_pairs(str(PAIRS), "", tok, 256)[:12]
    d = S.DPO.__new__(S.DPO)
    d.cfg = SimpleNamespace(reference_free=False, packing=False)
    d.run = SimpleNamespace(dist=SimpleNamespace(device=torch.device("cpu")))
    d.ref_train, d.micro, d.reference, d.tok = None, 2, model, tok
    calls = []
    real = S.pair_logps
    monkeypatch.setattr(S, "pair_logps", lambda m, b, pack=False: calls.append(b["input_ids"].shape[0]) or real(m, b, pack))
    together = d.reference_logps(pairs, list(range(12)))
    assert calls == [24] and together.shape == (2, 12)
    monkeypatch.setattr(S, "DPO_REF_TOKENS", 1)  # at least a micro-batch per forward: the per-micro-batch passes
    calls.clear()
    apart = d.reference_logps(pairs, list(range(12)))
    assert calls == [4] * 6
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    assert S.DPO.reference_logps(SimpleNamespace(cfg=SimpleNamespace(reference_free=True), run=d.run), pairs, []) is None
