"""Mutation check of the objectives and the monitor: do the tests fail when the math is wrong?

Each mutation below changes one line of align/objectives/*, align/rl.py, align/losses.py or align/monitor.py (drop
GAE's λ, flip a sign, drop GSPO's 1/|y|, let skipped samples into REINFORCE++'s statistics, move a monitor
threshold, drop an eps, ...). It is applied to a temporary copy of the repository (never to this checkout), the
test files it names run there (`pytest -x -q -n 0 FILES`), and the mutation is caught when they fail. A snippet
that no longer matches its file exactly once stops the script (exit 2): keep the list in step with the code.

    python -m benchmarks.mutations            # every mutation; prints the table, exit 1 if any survives
    python -m benchmarks.mutations -k gspo    # those whose name contains "gspo"

Not part of the test suite (a few minutes on 2 cores): run it after changing an objective, a monitor check or
their tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RL_TESTS = ("tests/test_rl.py",)
PPO_TESTS = ("tests/test_ppo_rl.py",)
PREF_TESTS = ("tests/test_pref_losses.py",)
MONITOR_TESTS = ("tests/test_monitor.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str  # must occur exactly once in `file`
    replacement: str
    tests: tuple[str, ...]


M = Mutation
MUTATIONS = [
    # ---- advantage estimators (align/objectives/advantages.py, moments.py)
    M("zscore: drop eps", "align/objectives/advantages.py", "return (centred / (std + eps))",
      "return (centred / std.clamp(min=1e-30))", RL_TESTS),
    M("group std: biased (n, not n − 1)", "align/objectives/advantages.py",
      "/ (n - 1).clamp(min=1)\n    return mean, var.sqrt(), n", "/ n.clamp(min=1)\n    return mean, var.sqrt(), n",
      RL_TESTS),
    M("zero spread: strict comparison", "align/objectives/advantages.py", "return (hi <= lo)", "return (hi < lo)",
      RL_TESTS),
    M("zero spread: not applied", "align/objectives/advantages.py",
      "keep = ~zero_spread(rewards, valid)[:, None] &", "keep = torch.ones_like(rewards, dtype=torch.bool)[:, :1] &",
      RL_TESTS),
    M("rloo: no G/(G−1)", "align/objectives/advantages.py", "return (centred * n / (n - 1).clamp(min=1))",
      "return (centred * 1.0)", RL_TESTS),
    M("rloo: G counts skipped samples", "align/objectives/advantages.py", "centred, _, n = _centred(rewards, valid)",
      "centred, _, n = _centred(rewards, valid); n = torch.full_like(n, rewards.shape[1])", RL_TESTS),
    M("batch: std over skipped samples too", "align/objectives/advantages.py",
      "sums = masked_sums(rewards, torch.ones_like(rewards) if valid is None else valid)",
      "sums = masked_sums(rewards, torch.ones_like(rewards))", RL_TESTS),
    M("reinforce++: skipped samples in mean/std", "align/objectives/advantages.py",
      "v = torch.ones_like(rewards) if valid is None else valid", "v = torch.ones_like(rewards)", RL_TESTS),
    M("reinforce++: a skipped sample gets an advantage", "align/objectives/advantages.py",
      "return torch.where(v.bool(), (rewards.double() - mean)", "return torch.where(True, (rewards.double() - mean)",
      RL_TESTS),
    M("moments: biased variance", "align/objectives/moments.py", "/ (n - 1).clamp(min=1)).clamp(min=0)",
      "/ n).clamp(min=0)", RL_TESTS + PPO_TESTS),
    # ---- policy losses (align/objectives/policy.py)
    M("clip: max instead of min", "align/objectives/policy.py", "loss = -torch.minimum(unclipped, clipped)",
      "loss = -torch.maximum(unclipped, clipped)", RL_TESTS),
    M("clip: no clip-higher", "align/objectives/policy.py", "clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv",
      "clipped = ratio.clamp(1 - eps_low, 1 + eps_low) * adv", RL_TESTS),
    M("clip: low flag ignores the sign of A", "align/objectives/policy.py", "low = (ratio < 1 - eps_low) & (adv < 0)",
      "low = ratio < 1 - eps_low", RL_TESTS),
    M("cispo: weight not detached", "align/objectives/policy.py",
      "weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()", "weight = ratio.clamp(1 - eps_low, 1 + eps_high)",
      RL_TESTS),
    M("cispo: weight not clipped", "align/objectives/policy.py",
      "weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()", "weight = ratio.detach()", RL_TESTS),
    M("gspo: no 1/|y| length normalisation", "align/objectives/policy.py",
      "s = torch.exp(((logp - old_logp) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))",
      "s = torch.exp(((logp - old_logp) * m).sum(dim=1))", RL_TESTS),
    M("gspo: masked tokens in the ratio", "align/objectives/policy.py",
      "s = torch.exp(((logp - old_logp) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))",
      "s = torch.exp((logp - old_logp).sum(dim=1) / m.sum(dim=1).clamp(min=1))", RL_TESTS),
    M("gspo: unclipped sequence ratio", "align/objectives/policy.py",
      "loss = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)", "loss = -(s * a)", RL_TESTS),
    M("reinforce: sign flipped", "align/objectives/policy.py", "return -adv * logp, none, none",
      "return adv * logp, none, none", RL_TESTS),
    # ---- KL estimators (align/objectives/kl.py)
    M("k1: sign flipped", "align/objectives/kl.py", "    return logp - ref_logp", "    return ref_logp - logp",
      RL_TESTS + PPO_TESTS),
    M("k3: ratio swapped", "align/objectives/kl.py", "r = (ref_logp - logp).clamp(max=clamp)",
      "r = (logp - ref_logp).clamp(max=clamp)", RL_TESTS),
    M("k3: clamped on both sides", "align/objectives/kl.py", "r = (ref_logp - logp).clamp(max=clamp)",
      "r = (ref_logp - logp).clamp(-clamp, clamp)", RL_TESTS),
    M("k3: no cap above", "align/objectives/kl.py", "r = (ref_logp - logp).clamp(max=clamp)", "r = ref_logp - logp",
      RL_TESTS),
    # ---- preference losses (align/objectives/preference.py, align/losses.py)
    M("dpo: label smoothing sign", "align/objectives/preference.py",
      "- label_smoothing * F.logsigmoid(-d)", "+ label_smoothing * F.logsigmoid(-d)", PREF_TESTS),
    M("dpo: rewards without β", "align/objectives/preference.py",
      "return loss, (beta * chosen).detach(), (beta * rejected).detach()",
      "return loss, chosen.detach(), rejected.detach()", PREF_TESTS),
    M("ipo: target 1/β instead of 1/(2β)", "align/objectives/preference.py",
      "return _dpo_rewards((c - r - 1 / (2 * beta)) ** 2, c, r, beta)\n\n\n@register(\"preference\", \"ipo-mean\"",
      "return _dpo_rewards((c - r - 1 / beta) ** 2, c, r, beta)\n\n\n@register(\"preference\", \"ipo-mean\"",
      PREF_TESTS),
    M("ipo-mean: rejected not length-normalised", "align/objectives/preference.py",
      "r = (pairs.policy_rejected - pairs.ref_rejected) / pairs.rejected_len",
      "r = (pairs.policy_rejected - pairs.ref_rejected)", PREF_TESTS),
    M("hinge: margin without β", "align/objectives/preference.py", "torch.relu(1 - beta * (c - r))",
      "torch.relu(1 - (c - r))", PREF_TESTS),
    M("simpo: γ added", "align/objectives/preference.py", "beta * l_w - beta * l_l - gamma",
      "beta * l_w - beta * l_l + gamma", PREF_TESTS),
    M("simpo/orpo: summed, not mean log-probs", "align/objectives/preference.py",
      "return self.policy_chosen / self.chosen_len, self.policy_rejected / self.rejected_len",
      "return self.policy_chosen, self.policy_rejected / self.rejected_len", PREF_TESTS),
    M("orpo: no chosen NLL", "align/objectives/preference.py",
      "-l_w - beta * F.logsigmoid(log_odds(l_w) - log_odds(l_l))", "-beta * F.logsigmoid(log_odds(l_w) - log_odds(l_l))",
      PREF_TESTS),
    M("log odds: not capped below 0", "align/objectives/preference.py", "ell = mean_logp.clamp(max=-1e-6)",
      "ell = mean_logp", PREF_TESTS),
    M("kto: reference point not floored at 0", "align/objectives/preference.py",
      "z0 = (kl_sums[0] / kl_sums[1].clamp(min=1)).clamp(min=0).detach()",
      "z0 = (kl_sums[0] / kl_sums[1].clamp(min=1)).detach()", PREF_TESTS),
    M("kto: weights swapped", "align/objectives/preference.py",
      "loss = torch.where(desirable, w_desirable *", "loss = torch.where(desirable, w_undesirable *", PREF_TESTS),
    M("bradley-terry: margin added", "align/losses.py", "diff = diff - margin", "diff = diff + margin", PREF_TESTS),
    M("centring: difference, not sum", "align/losses.py", "return coef * (r_chosen + r_rejected) ** 2",
      "return coef * (r_chosen - r_rejected) ** 2", PREF_TESTS),
    M("rpo: NLL not per token", "align/losses.py", "return -alpha * policy_chosen / chosen_len",
      "return -alpha * policy_chosen", PREF_TESTS),
    # ---- reward shaping (align/objectives/shaping.py)
    M("overlong: no floor at −1", "align/objectives/shaping.py",
      "else max(-1.0, (start - n) / cache) for n in lengths]", "else (start - n) / cache for n in lengths]", RL_TESTS),
    M("length reward: wrong answers keep λ > 0", "align/objectives/shaping.py",
      "return [lm if c else min(0.0, lm) for lm, c in zip(lam, correct)]", "return lam", RL_TESTS),
    # ---- PPO estimators and loss aggregation (align/rl.py)
    M("gae: λ dropped", "align/rl.py", "last = (delta + gamma * lam * last) * mask[:, t]",
      "last = (delta + gamma * last) * mask[:, t]", PPO_TESTS),
    M("gae: no bootstrap from V(t+1)", "align/rl.py", "delta = rewards[:, t] + gamma * next_value - values[:, t]",
      "delta = rewards[:, t] - values[:, t]", PPO_TESTS),
    M("token rewards: KL penalty sign", "align/rl.py", "rewards = -beta * kl * mask", "rewards = beta * kl * mask",
      PPO_TESTS),
    M("whiten: eps dropped", "align/rl.py", "out = (x - mean) * torch.rsqrt(var + eps)",
      "out = (x - mean) * torch.rsqrt(var)", PPO_TESTS),
    M("whiten: shift_mean ignored", "align/rl.py", "    if not shift_mean:\n        out = out + mean",
      "    if shift_mean:\n        out = out + mean", PPO_TESTS),
    M("value loss: min instead of max", "align/rl.py", "return 0.5 * torch.maximum(unclipped_sq, clipped_sq)",
      "return 0.5 * torch.minimum(unclipped_sq, clipped_sq)", PPO_TESTS),
    M("adaptive KL: error not clipped", "align/rl.py", "e = min(max(kl / self.target - 1.0, -0.2), 0.2)",
      "e = kl / self.target - 1.0", PPO_TESTS),
    M("aggregate seq-mean-token-mean: no per-sequence mean", "align/rl.py",
      "return (summed.sum(dim=1) / lengths).sum() / max(n_seqs, 1.0)", "return summed.sum() / max(n_seqs, 1.0)",
      RL_TESTS),
    M("aggregate seq-sum: no L_max", "align/rl.py", "return summed.sum() / (max(n_seqs, 1.0) * max_len)",
      "return summed.sum() / max(n_seqs, 1.0)", RL_TESTS),
    M("distillation: k1 not detached", "align/rl.py", "k1 = (logp - teacher_logp).detach()",
      "k1 = logp - teacher_logp", RL_TESTS),
    # ---- RLMonitor's checks (align/monitor.py)
    M("monitor above: >= instead of >", "align/monitor.py", "    m = _mean(xs[-window:])\n    if m > max_value:",
      "    m = _mean(xs[-window:])\n    if m >= max_value:", MONITOR_TESTS),
    M("monitor median above: >= instead of >", "align/monitor.py", "    m = statistics.median(last)\n    if m > max_value:",
      "    m = statistics.median(last)\n    if m >= max_value:", MONITOR_TESTS),
    M("monitor collapse: <= instead of <", "align/monitor.py", "    if not now < max_ratio * ref:",
      "    if not now <= max_ratio * ref:", MONITOR_TESTS),
    M("monitor nan: grad_norm not checked", "align/monitor.py", 'for key, xs in (("loss", loss), ("grad_norm", grad_norm)):',
      'for key, xs in (("loss", loss),):', MONITOR_TESTS),
    M("monitor spike: mean, not median", "align/monitor.py", "jump = factor * statistics.median(prev)",
      "jump = factor * statistics.mean(prev)", MONITOR_TESTS),
    M("monitor spike: min_value floor ignored", "align/monitor.py", "limit = max(min_value, jump)", "limit = jump",
      MONITOR_TESTS),
    M("monitor noise: no /2 of the successive differences", "align/monitor.py",
      "sum(d * d for d in diffs) / (2 * len(diffs))", "sum(d * d for d in diffs) / len(diffs)", MONITOR_TESTS),
    M("monitor drop test: z ignored", "align/monitor.py", "return drop > min_drop and drop > min_z * stderr, drop",
      "return drop > min_drop, drop", MONITOR_TESTS),
    M("monitor drift: shrinking not checked", "align/monitor.py", "if ratio > limit or ratio < 1 / limit:",
      "if ratio > limit:", MONITOR_TESTS),
    M("monitor held: strict >=", "align/monitor.py", "lambda x: x >= min_value", "lambda x: x > min_value",
      MONITOR_TESTS),
    M("monitor diversity: floor from the latest window", "align/monitor.py",
      "floor = max(min_value, min_ratio * _mean(xs[:window]))",
      "floor = max(min_value, min_ratio * _mean(xs[-2 * window:-window]))", MONITOR_TESTS),
    M("monitor held at most: strict <=", "align/monitor.py", "lambda x: x <= max_value", "lambda x: x < max_value",
      MONITOR_TESTS),
    M("monitor falling: against the start", "align/monitor.py",
      "before, after = xs[-2 * window : -window], xs[-window:]", "before, after = xs[:window], xs[-window:]",
      MONITOR_TESTS),
    M("monitor fell from start: against the previous window", "align/monitor.py",
      "first, last = xs[:window], xs[-window:]", "first, last = xs[-2 * window : -window], xs[-window:]",
      MONITOR_TESTS),
    M("monitor end: judged with the rule's window", "align/monitor.py",
      "res = rule.check(*series, window=len(series[0]), **rule.params)",
      "res = rule.check(*series, window=rule.window, **rule.params)", MONITOR_TESTS),
    M("monitor debounce: a quiet evaluation does not reset", "align/monitor.py",
      "                self._firing.discard(rule.name)\n", "", MONITOR_TESTS),
    M("monitor held-out hacking: SE of the start only", "align/monitor.py",
      "se = math.sqrt(max(g0 * (1 - g0) + g * (1 - g), 1e-12) / n)", "se = math.sqrt(max(2 * g0 * (1 - g0), 1e-12) / n)",
      MONITOR_TESTS),
    M("monitor reward hacking: gold slope sign", "align/monitor.py",
      "if sp > min_slope and sg < -min_slope and", "if sp > min_slope and sg < min_slope and", MONITOR_TESTS),
    M("monitor debounce: stop rules debounced", "align/monitor.py",
      'if rule.severity == "stop" or rule.name not in self._firing:', "if rule.name not in self._firing:",
      MONITOR_TESTS),
    M("monitor kl_high threshold", "align/monitor.py", 'check_median_above, "warn", 3, params={"max_value": 0.5}',
      'check_median_above, "warn", 3, params={"max_value": 0.6}', MONITOR_TESTS),
    M("monitor kl_high: the mean instead of the median", "align/monitor.py", "    m = statistics.median(last)\n",
      "    m = _mean(last)\n", MONITOR_TESTS),
    M("monitor entropy_collapse: without the fall test", "align/monitor.py",
      "if not (falling or (now < min_value and ref >= min_value / floor_ratio)):",
      "if not (True or (now < min_value and ref >= min_value / floor_ratio)):", MONITOR_TESTS),
    M("monitor entropy_collapse: the floor from any start", "align/monitor.py",
      "if not (falling or (now < min_value and ref >= min_value / floor_ratio)):",
      "if not (falling or now < min_value):", MONITOR_TESTS),
    M("monitor entropy_collapse: the floor after a halving, from any start", "align/monitor.py",
      "if not (falling or (now < min_value and ref >= min_value / floor_ratio)):",
      "if not (falling or (now < min_value and now < floor_ratio * ref)):", MONITOR_TESTS),
    M("monitor grad_explode: steps without an update in the median", "align/monitor.py",
      '"min_history": 5, "skip_zero": True}', '"min_history": 5, "skip_zero": False}', MONITOR_TESTS),
    M("monitor spike: skip_zero ignored", "align/monitor.py", "if not (skip_zero and v == 0)]", "if True]",
      MONITOR_TESTS),
    M("monitor held-out degradation: no sqrt(2) (one pass rate's SE)", "align/monitor.py",
      "se = math.sqrt(max(2 * p * (1 - p), 1e-12) / n)", "se = math.sqrt(max(p * (1 - p), 1e-12) / n)",
      MONITOR_TESTS),
    M("monitor held-out degradation: against the latest, not the best", "align/monitor.py",
      "ref = max(earlier) if vs_best else earlier[0]", "ref = earlier[-1] if vs_best else earlier[0]", MONITOR_TESTS),
    M("monitor held-out degradation: z ignored", "align/monitor.py", "if ref - g > min_z * se:", "if ref - g > se:",
      MONITOR_TESTS),
    M("monitor rollout mismatch: 16-bit tolerance for fp32", "align/monitor.py",
      'return MISMATCH_TOLERANCE["fp32" if precision in ("fp32", "auto", "") else "16-bit"]',
      'return MISMATCH_TOLERANCE["16-bit"]', MONITOR_TESTS),
    # ---- rollout/trainer agreement (align/rl.py)
    M("tis: uncapped", "align/rl.py", "return torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)",
      "return torch.exp(old_logp.detach() - sampler_logp)", RL_TESTS),
    M("tis: ratio inverted", "align/rl.py", "return torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)",
      "return torch.exp(sampler_logp - old_logp.detach()).clamp(max=cap)", RL_TESTS),
    M("rollout mismatch: signed difference", "align/rl.py", "return (diff.abs() * mask).sum(),",
      "return (diff * mask).sum(),", RL_TESTS),
    M("rollout mismatch: mask ignored", "align/rl.py", "return (diff.abs() * mask).sum(),",
      "return diff.abs().sum(),", RL_TESTS),
]


def copy_repo(dst: Path) -> None:
    """The repository's tracked and untracked-but-not-ignored files, copied to `dst`."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def check_snippets(mutations: list[Mutation]) -> None:
    """Every snippet occurs exactly once in its file (exit 2 naming the ones that do not)."""
    bad = [f"{m.name}: {m.file} holds its snippet {(ROOT / m.file).read_text().count(m.original)} times, not once"
           for m in mutations if (ROOT / m.file).read_text().count(m.original) != 1]
    if bad:
        sys.exit("mutations out of step with the code:\n  " + "\n  ".join(bad))


def run_tests(root: Path, tests: tuple[str, ...]) -> bool:
    """Whether the tests pass in the copy at `root`."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=600).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only the mutations whose name contains this")
    args = ap.parse_args()
    mutations = [m for m in MUTATIONS if args.k in m.name]
    check_snippets(mutations)
    with tempfile.TemporaryDirectory(prefix="align-mutations-") as tmp:
        root = Path(tmp)
        copy_repo(root)
        baseline = tuple(sorted({t for m in mutations for t in m.tests}))
        if not run_tests(root, baseline):
            sys.exit(f"the tests fail without any mutation: {' '.join(baseline)}")
        rows, survived = [], 0
        for m in mutations:
            path = root / m.file
            original = path.read_text()
            path.write_text(original.replace(m.original, m.replacement))
            t = time.time()
            caught = not run_tests(root, m.tests)
            path.write_text(original)
            survived += not caught
            rows.append(f"| {m.name.replace('|', chr(92) + '|')} | {m.file} | {' '.join(Path(x).name for x in m.tests)} | "
                        f"{'caught' if caught else '**SURVIVED**'} | {time.time() - t:.0f} |")
    print("| mutation | file | tests | result | s |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(mutations) - survived} of {len(mutations)} mutations caught"
          f"{f', {survived} survived' if survived else ''}.")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
