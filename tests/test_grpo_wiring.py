"""GRPO's wiring, pinned by values on the tiny model: which model is the reference (the frozen start), which terms
carry gradient (the KL term does, π_old does not), the clip on both sides (token ratio and GSPO's sequence ratio),
truncated IS with the sampler's log-probs aligned to the response tokens, the temperature of the sampler's
log-probs, the version tags of the off-policy queue, and which tokens count (response tokens only).

Every expected value is computed here by hand from plain copies of the models (their own forwards at the sampling
temperature), on batches built here from the completions (not with align.rollout.batch), and compared with what the
stage built in-process logs (its metrics, its gradient norm) or does (the weights it changes). Rollouts are fixed
completions handed to the stage's step in place of sampling (`fixed_rollouts`); rewards are the completions' text
read as a number (`value_reward`), so every advantage is chosen by the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from align.rollout.generation import Completion
from tests.conftest import applied_lrs, decay_groups, eos_prone, greedy_ids, small_data, stage_in_process

EOS, PAD = 2, 0  # the shipped tokenizer's


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


def value_reward(tmp_path: Path) -> str:
    """A --reward whose value is the completion's text read as a number: each test picks every reward."""
    f = tmp_path / "value_reward.py"
    f.write_text("def value(prompt, completion, **row):\n    return float(completion)\n")
    return f"{f}:value"


def grpo(tmp_path: Path, model, name: str = "g", **over):
    """The GRPO stage built in this process on the tiny model (ZeRO-0: its weights are plain tensors)."""
    from stages.grpo import GRPO, GRPOConfig

    kw = dict(model=str(model), out=str(tmp_path / name), eval_data="", data=str(small_data()["arith"]),
              reward=[value_reward(tmp_path)], prompts_per_step=2, num_generations=2, max_new_tokens=4,
              micro_batch_size=4, lr=1e-3, warmup_steps=0, zero_stage=0, loss_agg="token-mean", advantage="mean",
              epsilon=0.2, epsilon_high=0.2)
    kw.update(over)
    return stage_in_process(GRPOConfig(**kw), "grpo", GRPO)


def completions(algo, spec: list[list[tuple]]) -> list[Completion]:
    """Completions of the stage's first prompts: spec[p] = [(response ids, reward, finished), ...] per prompt."""
    return [Completion(algo.prompt_ids[p], list(ids), repr(float(reward)), finished)
            for p, group in enumerate(spec) for ids, reward, finished in group]


def fixed_rollouts(algo, make):
    """The stage's step samples `make(step)` (a list of Completions of its first prompts, prompt-major) instead of
    its own samples, and pairs them with those prompts' rows (its step's rows: the first ones)."""
    from align.rollout.batch import Rollout

    G, made = algo.cfg.num_generations, []

    def local_rollout(step):
        made[:] = make(step)
        return Rollout(algo.rows[: len(made) // G], made, G)

    algo.local_rollout = local_rollout
    algo.run.indices = lambda n, size, step, seed=None: list(range(len(made) // G))


def step(algo, s: int) -> dict:
    """One step of the stage: its reduced metrics and the policy's gradient norm."""
    metrics = algo.step(s).reduce("cpu")
    metrics.update(algo.policy.metrics())
    return metrics


def plain(model_dir, weights: dict | None = None):
    """A plain fp32 copy of the tiny model (the saved start, or `weights`), dropout off."""
    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(str(model_dir))
    m = load_causal_lm(source, load_tokenizer(source), torch.float32, 0)
    if weights is not None:
        m.load_state_dict(weights)
    return m.eval()


def weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def hand_batch(cs: list[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [N, L] right-padded, resp [N, L−1]: 1 where target token t+1 is one of the completion's own tokens)."""
    seqs = [c.prompt_ids + c.ids for c in cs]
    L = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs])
    resp = torch.zeros(len(cs), L - 1)
    for i, c in enumerate(cs):
        resp[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.ids)] = 1
    return ids, resp


def hand_logp(model, ids: torch.Tensor, T: float) -> torch.Tensor:
    """log softmax(z / T) of every next token [N, L−1] (with grad when the caller allows it)."""
    z = model(input_ids=ids).logits[:, :-1].float() / T
    return z.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def k3(logp, ref):
    r = ref - logp
    return torch.exp(r) - r - 1


def grad_norm(loss: torch.Tensor, model) -> float:
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def group_adv(rewards: list[list[float]]) -> torch.Tensor:
    """--advantage mean: r − the group's mean, one per completion [N, 1]."""
    r = torch.tensor(rewards)
    return (r - r.mean(1, keepdim=True)).reshape(-1, 1)


# ---- the reference model and the KL term

def test_the_reference_is_the_frozen_start_and_the_kl_term_is_beta_times_k3(tiny_model_dir, tmp_path):
    """With --beta > 0 the reference is a frozen copy of the start: after updates its log-probs still equal the
    saved model's and differ from the policy's. Step 0 (policy = reference) logs kl 0 and a loss of −A per token;
    step 1 logs kl = mean k3(π_θ1, π_ref) > 0 over the loss's tokens and a loss of the policy-gradient part plus
    β · k3, with the gradient of both (log-probs at T = 0.7), summed over two micro-batches; after --on-alarm's
    raise_kl(3) the KL part is 3β."""
    beta, T = 0.3, 0.7
    with grpo(tmp_path, tiny_model_dir, beta=beta, temperature=T, lr=1e-2, micro_batch_size=2) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, EOS], 0.0, True)],
                                [([43, 44, 45, 46], 2.0, False), ([47, EOS], 0.5, True)]])
        asked = []
        fixed_rollouts(algo, lambda s: asked.append(s) or cs)
        ids, resp = hand_batch(cs)
        adv = group_adv([[1.0, 0.0], [2.0, 0.5]])
        n_tokens = resp.sum()
        pg = (-adv * resp).sum() / n_tokens  # the clip loss at ratio 1
        theta0 = plain(tiny_model_dir)
        with torch.no_grad():
            ref = hand_logp(theta0, ids, T)
        got0 = step(algo, 0)
        assert got0["kl"] == pytest.approx(0.0, abs=1e-6)
        assert got0["loss"] == pytest.approx(pg.item(), rel=1e-5)

        for s, factor in ((1, 1.0), (2, 3.0)):
            if factor != 1.0:
                algo.raise_kl(factor)
            theta = plain(tiny_model_dir, weights(algo.policy))
            with torch.no_grad():
                ref_now = hand_logp(algo.reference, ids, T)
            assert (ref_now - ref)[resp.bool()].abs().max() < 1e-5  # the reference did not move
            lp = hand_logp(theta, ids, T)
            assert (lp - ref)[resp.bool()].abs().max() > 1e-3  # the policy did
            kl = k3(lp, ref) * resp
            loss = (-adv * torch.exp(lp - lp.detach()) * resp).sum() / n_tokens + beta * factor * kl.sum() / n_tokens
            norm = grad_norm(loss, theta)
            got = step(algo, s)
            assert got["kl"] == pytest.approx((kl.sum() / resp.sum()).item(), rel=1e-4) and got["kl"] > 1e-4
            assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
            assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert asked == [0, 1, 2]  # each step samples its own rollout


def test_the_kl_term_alone_pulls_the_policy_back_to_the_reference(tiny_model_dir, tmp_path):
    """The KL term carries gradient: with every advantage 0 (--no-drop-zero-std-groups keeps the groups in the loss)
    and a policy moved away from the reference, a step with β > 0 has exactly the gradient of β · token-mean k3 and
    brings the policy's log-probs closer to the reference's (the mean k3 falls); with β = 0 the step's gradient is
    0 and the weights stay where they are."""
    beta, T = 0.5, 0.8
    with grpo(tmp_path, tiny_model_dir, beta=beta, temperature=T, lr=3e-4, drop_zero_std_groups=False,
              grad_clip=0.0) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, EOS], 1.0, True)],
                                [([43, 44, 45, 46], 0.0, False), ([47, EOS], 0.0, True)]])
        fixed_rollouts(algo, lambda s: cs)
        ids, resp = hand_batch(cs)
        with torch.no_grad():  # the policy leaves the reference (the optimiser has no state yet)
            g = torch.Generator().manual_seed(0)
            for p in algo.policy.module.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
            ref = hand_logp(plain(tiny_model_dir), ids, T)

        def mean_kl(w):
            with torch.no_grad():
                return ((k3(hand_logp(plain(tiny_model_dir, w), ids, T), ref) * resp).sum() / resp.sum()).item()

        algo.load_state_dict({"beta": 0.0})  # β = 0 (the state a checkpoint restores)
        before = weights(algo.policy)
        got = step(algo, 0)
        assert got["grad_norm"] == 0.0 and got["loss"] == 0.0
        assert all(torch.equal(before[k], v) for k, v in weights(algo.policy).items())

        algo.load_state_dict({"beta": beta})
        theta = plain(tiny_model_dir, before)
        kl = k3(hand_logp(theta, ids, T), ref) * resp
        loss = beta * kl.sum() / resp.sum()
        norm = grad_norm(loss, theta)
        got = step(algo, 1)
        assert got["kl"] == pytest.approx((kl.sum() / resp.sum()).item(), rel=1e-4)
        assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-4) and norm > 0
        after = weights(algo.policy)
        assert mean_kl(after) < 0.9 * mean_kl(before), (mean_kl(before), mean_kl(after))


# ---- π_old and the clip

def clip_loss(lp, old, adv, mask, lo, hi, sequence: bool, agg: str):
    """The clipped surrogate by hand: per token (ratio π_θ/π_old), or GSPO's per sequence (the geometric mean of
    the ratios over the sequence's tokens); aggregated token-mean or seq-mean-token-mean."""
    if sequence:
        ratio = torch.exp(((lp - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)).expand_as(lp)
    else:
        ratio = torch.exp(lp - old)
    per_tok = -torch.minimum(ratio * adv, ratio.clamp(1 - lo, 1 + hi) * adv) * mask
    if agg == "token-mean":
        return per_tok.sum() / mask.sum()
    return (per_tok.sum(1) / mask.sum(1)).mean()


@pytest.mark.parametrize("variant", [dict(), dict(ratio="sequence", loss_agg="seq-mean-token-mean")],
                         ids=["token", "gspo"])
def test_old_logprobs_are_the_pre_update_policy_and_the_ratio_is_clipped_on_both_sides(tiny_model_dir, tmp_path,
                                                                                       variant):
    """--num-iterations 2: the second pass over the batch compares π_θ1 with π_old = the policy before the step
    (θ0, at the sampling temperature, no gradient through it), and clips the ratio to [1 − ε, 1 + ε_high]
    (--epsilon, --epsilon-high): its loss and gradient are the clipped surrogate computed by hand from θ0 and θ1
    (the weights the update pass saw), where tokens — or, with --ratio sequence (GSPO), whole sequences — are
    clipped below and above; the first pass is at ratio 1. Two micro-batches per pass: the optimiser steps once
    per pass. clip_ratio, clip_ratio/low and /high are the fractions of both passes' tokens clipped."""
    T, agg = 0.9, variant.get("loss_agg", "token-mean")
    sequence = variant.get("ratio") == "sequence"
    eps, eps_high = (0.1, 0.15) if sequence else (0.1, 0.25)
    with grpo(tmp_path, tiny_model_dir, temperature=T, lr=1e-4, num_iterations=2, epsilon=eps, epsilon_high=eps_high,
              micro_batch_size=2, **variant) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, 43, EOS], 0.0, True)],
                                [([44, 45, 46, 47], 2.0, False), ([48, EOS], 0.5, True)]])
        fixed_rollouts(algo, lambda s: cs)
        ids, resp = hand_batch(cs)
        adv = group_adv([[1.0, 0.0], [2.0, 0.5]])
        calls = []
        backward = algo.policy.backward

        def spy(loss):  # what each update pass saw: its loss, and the weights its forward ran at
            calls.append((loss.item(), weights(algo.policy)))
            backward(loss)

        algo.policy.backward = spy
        start = weights(algo.policy)
        got = step(algo, 0)
        assert len(calls) == 4  # 2 passes x 2 micro-batches, one optimiser step per pass
        same = [all(torch.equal(start[k], v) for k, v in w.items()) for _, w in calls]
        assert same == [True, True, False, False]
        assert all(torch.equal(calls[2][1][k], v) for k, v in calls[3][1].items())
        loss0, loss1, theta1 = calls[0][0] + calls[1][0], calls[2][0] + calls[3][0], calls[2][1]
        with torch.no_grad():
            old = hand_logp(plain(tiny_model_dir), ids, T)
        assert loss0 == pytest.approx(clip_loss(old, old, adv, resp, eps, eps_high, sequence, agg).item(), rel=1e-5)
        assert got["loss"] == pytest.approx(loss0, rel=1e-6)
        model = plain(tiny_model_dir, theta1)
        lp = hand_logp(model, ids, T)
        want = clip_loss(lp, old, adv, resp, eps, eps_high, sequence, agg)
        others = {"unclipped": (9.0, 9.0), "symmetric": (eps, eps), "swapped": (eps_high, eps),
                  "no low": (9.0, eps_high), "no high": (eps, 9.0)}
        for name, (lo, hi) in others.items():  # the batch tells each of these apart from the right clip
            other = clip_loss(lp, old, adv, resp, lo, hi, sequence, agg).item()
            assert abs(other - want.item()) > 1e-3 * abs(want.item()), name
        assert loss1 == pytest.approx(want.item(), rel=1e-5)
        assert got["grad_norm"] == pytest.approx(grad_norm(want, model), rel=1e-4)
        assert "kl" not in got  # β = 0: no reference, no KL term
        # the clip fractions over both passes' tokens (the first pass, at ratio 1, clips nothing)
        ratio = (torch.exp(((lp - old) * resp).sum(1, keepdim=True) / resp.sum(1, keepdim=True)).expand_as(lp)
                 if sequence else torch.exp(lp - old))
        a = adv.expand_as(lp)
        low, high = (ratio < 1 - eps) & (a < 0), (ratio > 1 + eps_high) & (a > 0)
        for name, flags in (("clip_ratio/low", low), ("clip_ratio/high", high), ("clip_ratio", low | high)):
            assert got[name] == pytest.approx(((flags.float() * resp).sum() / (2 * resp.sum())).item(), abs=1e-6), name
        assert got["clip_ratio/low"] > 0 and got["clip_ratio/high"] > 0


def test_gspo_clips_the_sequence_ratio_below_and_above():
    """GSPO's objective (align.objectives' "gspo"): the ratio of each sequence is exp(mean log-ratio over ITS
    masked tokens), clipped to [1 − ε, 1 + ε_high] pessimistically: s = 1.3 with A > 0 is clipped at
    1 + ε_high = 1.25 (flagged high); s = 1.15 (inside the upper bound, outside 1 + ε) is not; s = 0.8 with A < 0 is
    clipped at 1 − ε = 0.9 (flagged low); s = 1.4 with A < 0 keeps its unclipped (larger) loss. Masked tokens
    (log-ratio 5 there) take no part."""
    from align import objectives

    fn = objectives.get("policy_loss", "gspo").fn
    s = torch.tensor([1.3, 1.15, 0.8, 1.4])
    adv = torch.tensor([[1.0], [2.0], [-1.0], [-0.5]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    spread = torch.tensor([[0.1, -0.1, 0.0], [0.2, -0.1, -0.1], [0.0, 0.0, 0.0], [-0.3, 0.3, 0.0]])
    log_ratio = (s.log()[:, None] + spread) * mask + 5.0 * (1 - mask)
    old = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    loss, low, high = fn(old + log_ratio, old, adv, mask, 0.1, 0.25)
    want = torch.tensor([-1.25 * 1.0, -1.15 * 2.0, 0.9 * 1.0, 1.4 * 0.5])
    assert torch.allclose(loss, want[:, None].expand(4, 3), rtol=1e-5)
    assert high[:, 0].tolist() == [True, False, False, False] and low[:, 0].tolist() == [False, False, True, False]


# ---- the sampler's log-probs: truncated IS, the mismatch metrics, the temperature

def test_truncated_is_weights_the_pg_term_by_the_sampler_logprobs_of_each_response_token(tiny_model_dir, tmp_path):
    """--tis-cap C: each response token's policy-gradient loss is multiplied by
    min(exp(log π_old − log π_sampler), C), π_sampler being the log-prob the sampler reported for THAT token (offsets
    that differ from token to token, some past the cap: a sampler log-prob placed one position off changes the
    value), the KL term unweighted; rollout/logp_abs_diff and rollout/kl compare the sampler's and the trainer's
    log-probs on every response token (the dropped group's too), k3 of KL(π_sampler‖π_trainer). Two steps
    (β > 0: the KL term is 0 at the start)."""
    cap, beta, T = 1.5, 0.2, 0.7
    with grpo(tmp_path, tiny_model_dir, temperature=T, tis_cap=cap, beta=beta, lr=1e-3) as algo:
        spec = [[([40, 41, EOS], 1.0, True), ([42, 43, 44, EOS], 0.0, True)],
                [([45, 46, 47, 48], 0.5, False), ([49, EOS], 0.5, True)]]  # group 1: no signal (dropped)
        base = completions(algo, spec)
        ids, resp = hand_batch(base)
        n = int(resp.sum())
        delta = torch.zeros_like(resp)
        delta[resp.bool()] = torch.tensor([((7 * k) % 11 - 5) / 6 for k in range(n)])  # in [-5/6, 5/6]
        sampled = {}

        def make(s):  # the sampler's log-probs: the current policy's (sampled now) + delta
            with torch.no_grad():
                sampled[s] = hand_logp(plain(tiny_model_dir, weights(algo.policy)), ids, T)
            lp = sampled[s] + delta
            return [Completion(c.prompt_ids, c.ids, c.text, c.finished,
                               lp[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.ids)].tolist())
                    for i, c in enumerate(base)]

        fixed_rollouts(algo, make)
        adv = group_adv([[1.0, 0.0], [0.5, 0.5]])
        keep = resp * torch.tensor([[1.0], [1.0], [0.0], [0.0]])
        with torch.no_grad():
            ref = hand_logp(plain(tiny_model_dir), ids, T)
        w = torch.exp(-delta).clamp(max=cap)
        assert (w[resp.bool()] == cap).any() and (w[resp.bool()] < 1).any()
        for s in range(2):
            model = plain(tiny_model_dir, weights(algo.policy))
            lp = hand_logp(model, ids, T)
            ratio = torch.exp(lp - lp.detach())
            loss = ((-adv * ratio * w + beta * k3(lp, ref)) * keep).sum() / n
            norm = grad_norm(loss, model)
            got = step(algo, s)
            assert (sampled[s] - lp.detach())[resp.bool()].abs().max() < 1e-5
            assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
            assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
            assert got["rollout/logp_abs_diff"] == pytest.approx((delta.abs() * resp).sum().item() / n, rel=1e-5)
            want_kl = ((torch.exp(-delta) + delta - 1) * resp).sum().item() / n
            assert got["rollout/kl"] == pytest.approx(want_kl, rel=1e-4)
        assert got["kl"] > 1e-4  # step 1's KL term is not 0: the TIS weight does not multiply it


# ---- the off-policy queue (--max-staleness)

@pytest.mark.parametrize("K", [0, 1, 2])
def test_the_queue_tags_each_rollout_with_the_weights_it_was_sampled_from(K):
    """align.rollout.queue.Rollouts with a sampler that reports the weights it samples from (the number of updates so
    far): from the first step on, step t trains on rollout t, sampled from the weights of step max(0, t − K), and
    its tag (`version`) says so; every rollout is sampled once, none past --max-steps; a queue saved after step 2
    and loaded into a new one (a resume) gives steps 3.. the same rollouts; going back to step 2 with that queue
    (of later rollouts) samples rollout 2 anew, from the current weights."""
    from align.rollout.queue import LocalSampler, Rollouts

    updates, requested, max_steps = [0], [], 6

    def sample(j):
        requested.append(j)
        return [Completion([1, 5], [10 + j], str(updates[0]), True)]  # the text: the weights it was sampled from

    def run(queue, steps):
        seen = []
        for t in steps:
            times = {}
            p = queue.before_update(t, times)
            seen.append((t, p.step, p.version, int(p.completions[0].text), p.completions[0].ids))
            updates[0] = t + 1  # the update of step t
            queue.after_update(times)
        return seen

    q = Rollouts(K, max_steps, LocalSampler(sample))
    seen = run(q, range(3))
    saved = q.state_dict()
    seen += run(q, range(3, max_steps))
    assert seen == [(t, t, max(0, t - K), max(0, t - K), [10 + t]) for t in range(max_steps)]
    assert sorted(requested) == list(range(max_steps)) and not q.queue
    resumed = Rollouts(K, max_steps, LocalSampler(sample))
    resumed.load_state_dict(saved)
    updates[0] = 3
    assert run(resumed, range(3, max_steps)) == seen[3:]
    back = Rollouts(K, max_steps, LocalSampler(sample))  # back to step 2 holding the queue of step 3's start
    back.load_state_dict(saved)
    updates[0], requested[:] = 2, []
    assert run(back, [2]) == [(2, 2, 2, 2, [12])] and requested[0] == 2  # rollout 2 sampled anew, from θ_2


def test_a_run_one_step_off_trains_each_step_on_the_rollout_of_the_weights_before(tiny_model_dir, tmp_path):
    """--max-staleness 1 through the stage, from the first step: rollouts 0 and 1 are sampled from the start's
    weights, rollout t ≥ 2 from the weights after update t − 2 (those of step t − 1); rollout/staleness logs
    0, 1, 1; step 0's rollout is fresh (rollout/logp_abs_diff ~ 0), later ones are logged as stale:
    rollout/stale_logp_abs_diff = mean |log π_sampler − log π_θt| over the response tokens, measured here; each
    step's rewards are those of its rollout's completions with their own data rows."""
    T = 0.8
    f = tmp_path / "pair_reward.py"  # of the completion AND its data row: a rollout paired with another step's rows
    f.write_text("def pair(prompt, completion, **row):\n    return (len(completion) % 2) * len(prompt) / 100\n")
    with grpo(tmp_path, tiny_model_dir, temperature=T, max_staleness=1, tis_cap=2.0, lr=1e-3,
              reward=[f"{f}:pair"], max_steps=3, num_generations=4, micro_batch_size=8) as algo:
        sampled, at_step = {}, []
        local_rollout = algo.local_rollout

        def spy(j):  # the real rollout, and the weights it was sampled from
            sampled[j] = (weights(algo.policy), local_rollout(j))
            return sampled[j][1]

        algo.local_rollout = spy
        got = []
        for t in range(3):
            at_step.append(weights(algo.policy))
            got.append(step(algo, t))
        assert not all(torch.equal(at_step[1][k], v) for k, v in at_step[0].items())  # the updates moved it
        assert sorted(sampled) == [0, 1, 2]
        for j, (w, _) in sampled.items():
            assert all(torch.equal(at_step[max(0, j - 1)][k], v) for k, v in w.items()), j
        assert [g["rollout/staleness"] for g in got] == [0, 1, 1]
        for t in range(3):  # step t scores rollout t's completions against rollout t's rows
            r = sampled[t][1]
            G = algo.cfg.num_generations  # sample i is of prompt i // G (prompt-major)
            want = [(len(c.text) % 2) * len(r.rows[i // G]["prompt"]) / 100 for i, c in enumerate(r.completions)]
            assert len({len(row["prompt"]) for row in r.rows}) > 1
            assert got[t]["reward"] == pytest.approx(sum(want) / len(want))
        assert got[0]["rollout/logp_abs_diff"] < 1e-5 and "rollout/stale_logp_abs_diff" not in got[0]
        for t in (1, 2):
            assert "rollout/logp_abs_diff" not in got[t]
            cs = sampled[t][1].completions
            ids, resp = hand_batch(cs)
            sampler = torch.zeros_like(resp)
            for i, c in enumerate(cs):
                sampler[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.ids)] = torch.tensor(c.logps)
            with torch.no_grad():
                lp = hand_logp(plain(tiny_model_dir, at_step[t]), ids, T)
            want = ((sampler - lp).abs() * resp).sum() / resp.sum()
            assert got[t]["rollout/stale_logp_abs_diff"] == pytest.approx(want.item(), rel=1e-4) and want > 1e-4


def test_the_samplers_logprobs_are_the_trainers_at_the_sampling_temperature(tiny_model_dir, tmp_path):
    """The log-prob the sampler reports for each sampled token is log softmax(z / T)[token] of the trainer's
    logits z at the stage's temperature T = 0.6 (not at T = 1), unfiltered by --top-k 20: for the stage's own
    rollouts (HF generate, the CPU path) and for the fast decoder (align.rollout.fast, eager on CPU) sampling
    from the policy. Each step samples with keys of its own: the same prompt at the same weights gives other
    samples at the next step."""
    from align.rollout.generation import generate_local

    T = 0.6
    data = tmp_path / "one.jsonl"  # one prompt: every step samples it
    data.write_text('{"prompt": "Tom has 3 apples and buys 4 more. How many apples does Tom have?"}\n')
    with grpo(tmp_path, tiny_model_dir, temperature=T, top_k=20, max_new_tokens=6, num_generations=8,
              prompts_per_step=1, micro_batch_size=8, data=str(data)) as algo:
        hf = algo.local_rollout(0).completions
        again = algo.local_rollout(1).completions  # the same prompt and weights, the next step's sampling keys
        assert [c.ids for c in again] != [c.ids for c in hf]
        assert len({tuple(c.ids) for c in hf}) > 1  # each sample of a group has its own key
        fast = generate_local(algo.policy.module, algo.tok, [c.prompt_ids for c in hf],
                              algo.sampling_of(0), 8, "cpu", fast=True)
        model = plain(tiny_model_dir, weights(algo.policy))
    for cs in (hf, fast):
        assert all(c.logps is not None and len(c.logps) == len(c.ids) for c in cs)
        ids, resp = hand_batch(cs)
        sampler = torch.zeros_like(resp)
        for i, c in enumerate(cs):
            sampler[i, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.ids)] = torch.tensor(c.logps)
        with torch.no_grad():
            at_t, at_1 = hand_logp(model, ids, T), hand_logp(model, ids, 1.0)
        m = resp.bool()
        assert (sampler - at_t)[m].abs().max() < 1e-4
        assert (at_1 - at_t)[m].abs().min() > 1e-3  # T matters for every token


# ---- which tokens count

def overlong(n: int, max_len: int, cache: int) -> float:
    start = max_len - cache
    return 0.0 if n <= start else max(-1.0, (start - n) / cache)


@pytest.mark.parametrize("agg, mask_truncated, drop", [("token-mean", False, True), ("seq-mean-token-mean", True, True),
                                                       ("seq-sum", False, False)])
def test_lengths_and_loss_masks_count_response_tokens_only(tiny_model_dir, tmp_path, agg, mask_truncated, drop):
    """Three groups of two (prompts of different lengths; completions ended by EOS, or cut at --max-new-tokens 4):
    the overlong penalty (--overlong-cache 3) counts a completion's response tokens (a truncated one as 5), so group
    0's rewards differ only by it; completions/mean_length, clipped_ratio, mean_terminated_length and tokens count
    response tokens; the loss (clip at ratio 1 plus β·k3, the policy moved off the reference) and its gradient take
    the response tokens only (not the prompt, nor the padding after EOS); the reward function's weight (2) scales
    its part of the reward; --mask-truncated drops the cut completions from the loss and its normaliser,
    --drop-zero-std-groups drops group 1 (equal rewards) from the loss but not from the normaliser, --loss-agg
    picks the normaliser; entropy is over every response token, kl over the loss's."""
    T, beta, max_len, cache = 0.9, 0.1, 4, 3
    with grpo(tmp_path, tiny_model_dir, temperature=T, beta=beta, loss_agg=agg, mask_truncated=mask_truncated,
              drop_zero_std_groups=drop, overlong_cache=cache, max_new_tokens=max_len, prompts_per_step=3,
              micro_batch_size=6, reward=[value_reward(tmp_path) + ":2"]) as algo:
        spec = [[([40, EOS], 1.0, True), ([41, 42, 43, 44], 1.0, False)],
                [([45, EOS], 0.5, True), ([46, EOS], 0.5, True)],
                [([47, 48, EOS], 0.0, True), ([49, 50, 51, 52], 0.0, False)]]
        cs = completions(algo, spec)
        assert len({len(c.prompt_ids) for c in cs}) > 1  # the rows are padded differently
        fixed_rollouts(algo, lambda s: cs)
        with torch.no_grad():  # the policy leaves the reference: the KL term is not 0
            g = torch.Generator().manual_seed(1)
            for p in algo.policy.module.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        ids, resp = hand_batch(cs)
        lengths = [len(c.ids) for c in cs]
        finished = torch.tensor([float(c.finished) for c in cs])
        rewards = [[2 * r + overlong(len(i) if f else max_len + 1, max_len, cache) for i, r, f in group]
                   for group in spec]
        assert rewards[0][0] != rewards[0][1] and rewards[1][0] == rewards[1][1]
        adv = group_adv(rewards)
        counted = finished if mask_truncated else torch.ones(6)
        keep = counted * torch.tensor([1.0, 1, 0, 0, 1, 1] if drop else [1.0] * 6)
        loss_mask, counted_mask = resp * keep[:, None], resp * counted[:, None]
        n_tokens, n_seqs = counted_mask.sum(), counted.sum()
        model = plain(tiny_model_dir, weights(algo.policy))
        with torch.no_grad():
            ref = hand_logp(plain(tiny_model_dir), ids, T)
        lp = hand_logp(model, ids, T)
        per_tok = (-adv * torch.exp(lp - lp.detach()) + beta * k3(lp, ref)) * loss_mask
        if agg == "token-mean":
            loss = per_tok.sum() / n_tokens
        elif agg == "seq-mean-token-mean":
            loss = (per_tok.sum(1) / loss_mask.sum(1).clamp(min=1)).sum() / n_seqs
        else:
            loss = per_tok.sum() / (n_seqs * max_len)
        norm = grad_norm(loss, model)
        with torch.no_grad():
            z = model(input_ids=ids).logits[:, :-1] / T
            entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
        got = step(algo, 0)
    assert got["reward"] == pytest.approx(sum(map(sum, rewards)) / 6, rel=1e-6)
    assert got["reward_std"] == pytest.approx(torch.tensor(rewards).flatten().std().item(), rel=1e-5)
    assert got["rewards/value_reward.value"] == pytest.approx(sum(r for group in spec for _, r, _ in group) / 6)
    assert got["signal_frac"] == pytest.approx(((adv[:, 0] != 0).float() * counted).mean().item())
    assert got["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert got["completions/mean_length"] == pytest.approx(sum(lengths) / 6)
    assert got["completions/clipped_ratio"] == pytest.approx(2 / 6)
    assert got["completions/mean_terminated_length"] == pytest.approx((2 + 2 + 2 + 3) / 4)
    assert got["tokens"] == sum(lengths)
    grams = [g for c in cs for g in zip(c.ids, c.ids[1:])]
    assert got["distinct_1"] == pytest.approx(len({t for c in cs for t in c.ids}) / sum(lengths))
    assert got["distinct_2"] == pytest.approx(len(set(grams)) / len(grams))
    assert got["kept_token_frac"] == pytest.approx((loss_mask.sum() / n_tokens).item())
    assert got["entropy"] == pytest.approx(((entropy * resp).sum() / resp.sum()).item(), rel=1e-5)
    assert got["kl"] == pytest.approx(((k3(lp, ref) * loss_mask).sum() / loss_mask.sum()).item(), rel=1e-4)
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)


# ---- a whole step: the prompts it samples, the rewards it scores, the teacher it distils from

def test_a_whole_step_samples_its_prompts_skips_failed_rewards_and_distils_from_the_teacher(tiny_model_dir, tmp_path,
                                                                                            monkeypatch):
    """GRPO.step end to end (sampling replaced by fixed completions of the prompts it asks for): step s samples the
    prompts step_indices(n, --prompts-per-step 2, s, --seed 3) with G = --num-generations 3 under the stage's
    Sampling (--max-new-tokens 5, --temperature 0.7, --top-k 7, --top-p 0.9, the seed derived from (seed, s)); a
    reward that raises ("boom") under --on-reward-error skip takes its sample out of its group's mean/std
    (--advantage zscore over the other two), of the loss and of its normaliser, and of rewards/NAME's mean;
    rewards/errors is 1/6; the teacher
    (--teacher: the saved start, the policy moved off it) gives the per-token reverse-KL term
    --distill-coef 0.3 · sg(log π_θ − log π_T) · log π_θ on every counted token, those of group 1 too (no
    reward spread: dropped from the policy-gradient term by --drop-zero-std-groups, not from distillation). The
    loss, its gradient, distill/reverse_kl, reward, reward_std, signal_frac are computed by hand from the models' forwards, two steps."""
    import stages.grpo as grpo_module
    from align.engine.run import step_indices
    from align.rollout.batch import Rollout
    from align.rollout.sampling import derive

    T, coef, seed, G, P = 0.7, 0.3, 3, 3, 2
    texts = [["1.0", "boom", "0.25"], ["0.5", "0.5", "0.5"]]  # group 1: no reward spread (dropped from the PG term)
    resp_ids = [[[40, 41, EOS], [42, EOS], [43, 44, 45, EOS]], [[46, 47, 48, 49, 50], [51, EOS], [52, 53, EOS]]]
    asked = []

    def fake_sample(policy, tok, rows, prompt_ids, group_size, s, dist, gather=True, agent=None):
        asked.append(([r["prompt"] for r in rows], prompt_ids, group_size, s))
        cs = [Completion(prompt_ids[p], resp_ids[p][g], texts[p][g], resp_ids[p][g][-1] == EOS)
              for p in range(len(rows)) for g in range(group_size)]
        return Rollout(rows, cs, group_size)

    monkeypatch.setattr(grpo_module, "sample", fake_sample)
    with grpo(tmp_path, tiny_model_dir, teacher=str(tiny_model_dir), distill_coef=coef, on_reward_error="skip",
              advantage="zscore", seed=seed, num_generations=G, prompts_per_step=P, micro_batch_size=3,
              max_new_tokens=5, temperature=T, top_k=7, top_p=0.9, lr=1e-3) as algo:
        with torch.no_grad():  # the policy leaves the teacher (the saved start)
            g = torch.Generator().manual_seed(2)
            for p in algo.policy.module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        teacher = plain(tiny_model_dir)
        valid = torch.tensor([1.0, 0, 1, 1, 1, 1])
        r = torch.tensor([[1.0, 0.0, 0.25], [0.5, 0.5, 0.5]])
        v = valid.reshape(P, G)
        mean = (r * v).sum(1, keepdim=True) / v.sum(1, keepdim=True)
        std = (((r - mean) ** 2 * v).sum(1, keepdim=True) / (v.sum(1, keepdim=True) - 1)).sqrt()
        adv = ((r - mean) / (std + 1e-4) * v).reshape(-1, 1)
        n = len(algo.rows)
        for s in range(2):
            idx = step_indices(n, P, s, seed)
            model = plain(tiny_model_dir, weights(algo.policy))
            got = step(algo, s)
            prompts, prompt_ids, group_size, sampling = asked[-1]
            assert prompts == [algo.rows[i]["prompt"] for i in idx] and group_size == G
            assert prompt_ids == [algo.prompt_ids[i] for i in idx]
            assert (sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed) == \
                (5, T, 7, 0.9, derive(seed, s))
            cs = [Completion(prompt_ids[p], resp_ids[p][j], texts[p][j], True) for p in range(P) for j in range(G)]
            ids, resp = hand_batch(cs)
            counted = resp * valid[:, None]
            kept = counted * torch.tensor([1.0, 1, 1, 0, 0, 0])[:, None]
            lp = hand_logp(model, ids, T)
            with torch.no_grad():
                lt = hand_logp(teacher, ids, T)
            k1 = (lp - lt).detach()
            per_tok = -adv * torch.exp(lp - lp.detach()) * kept + coef * k1 * lp * counted
            loss = per_tok.sum() / counted.sum()
            norm = grad_norm(loss, model)
            assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
            assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
            assert got["distill/reverse_kl"] == pytest.approx(((k1 * counted).sum() / counted.sum()).item(), abs=1e-6)
            assert abs(got["distill/reverse_kl"]) > 1e-4
            good = r.flatten()[valid.bool()]
            assert got["reward"] == pytest.approx(good.mean().item(), rel=1e-6)
            assert got["reward_std"] == pytest.approx(good.std().item(), rel=1e-5)
            assert got["rewards/errors"] == pytest.approx(1 / 6)
            assert got["rewards/value_reward.value"] == pytest.approx(good.mean().item(), rel=1e-6)  # scored only
            # throughput: the rollout's tokens over the generation's time, not another phase's
            assert got["completions/tokens_per_s"] == pytest.approx(got["tokens"] / got["time/generate"], rel=1e-3)
            assert got["signal_frac"] == pytest.approx(5 / 6)
            assert got["kept_token_frac"] == pytest.approx((kept.sum() / counted.sum()).item())
            assert got["frac_reward_zero_std"] == pytest.approx(0.5)
        assert [a[0] for a in asked[:1]] != [a[0] for a in asked[1:]]  # each step its own prompts
        assert algo.raise_kl(2.0) is None and algo.state_dict() == {"beta": 0.0}  # β 0: nothing to raise


def two_rewards(tmp_path: Path) -> list[str]:
    """--reward value:1.5 (the text as a number; "slow" sleeps 1 s, then 5) and chars:0.5 (the text's length / 10)."""
    f = tmp_path / "two_rewards.py"
    f.write_text("import time\n\ndef value(prompt, completion, **row):\n    if completion == 'slow':\n"
                 "        time.sleep(1)\n        return 5.0\n    return float(completion)\n\n"
                 "def chars(prompt, completion, **row):\n    return len(completion) / 10\n")
    return [f"{f}:value:1.5", f"{f}:chars:0.5"]


def hand_advantages(name: str, r: torch.Tensor) -> torch.Tensor:
    """The --advantage estimators by hand, [P, G] rewards (every sample valid)."""
    centred = r - r.mean(1, keepdim=True)
    if name == "rloo":
        return centred * r.shape[1] / (r.shape[1] - 1)
    if name == "batch":
        return centred / (r.flatten().std() + 1e-4)
    if name == "reinforce++":
        return (r - r.mean()) / (r.flatten().std() + 1e-4)
    raise ValueError(name)


@pytest.mark.parametrize("advantage, loss", [("rloo", "cispo"), ("batch", "reinforce"), ("reinforce++", "clip"),
                                             ("rloo", "--reinforce")])
def test_rewards_errors_timeouts_the_reward_model_and_the_loss_choices_enter_the_step(
        tiny_model_dir, tiny_reward_model_dir, tmp_path, advantage, loss):
    """One step with two weighted rewards (1.5 · value + 0.5 · chars), --reward-model (its normalised score times
    --reward-model-weight 0.5), --on-reward-error zero (a reward that raises, "boom", or runs past --reward-timeout
    0.2 s, "slow", scores 0 for that function, the sample stays in its group and the loss): each sample's reward is
    checked through the advantages the loss receives (--advantage rloo / batch / reinforce++ by hand) and the logged
    reward parts; the loss is --loss's (cispo: −clip(ρ)·A·log π, reinforce or --reinforce: −A·log π, clip: −ρA,
    at ratio 1), its value and gradient by hand over token-mean."""
    from align.reward_model import score

    T = 0.8
    texts = [["1.0", "boom", "0.25"], ["2.0", "slow", "-1.0"]]
    with grpo(tmp_path, tiny_model_dir, reward=two_rewards(tmp_path), reward_model=str(tiny_reward_model_dir),
              reward_model_weight=0.5, on_reward_error="zero", reward_timeout=0.2, advantage=advantage,
              **(dict(reinforce=True) if loss == "--reinforce" else dict(loss=loss)),
              num_generations=3, micro_batch_size=6, temperature=T, drop_zero_std_groups=False) as algo:
        cs = [Completion(algo.prompt_ids[p], [40 + 3 * p + g] + [41] * g + [EOS], texts[p][g], True)
              for p in range(2) for g in range(3)]
        fixed_rollouts(algo, lambda s: cs)
        prompts = [algo.rows[i // 3]["prompt"] for i in range(6)]
        with torch.no_grad():
            rm = score(algo.rm, algo.rm_tok, prompts, [c.text for c in cs], 6).float().cpu()
        assert rm.std() > 1e-3
        value = torch.tensor([1.0, 0.0, 0.25, 2.0, 0.0, -1.0])
        chars = torch.tensor([len(t) / 10 for g in texts for t in g])
        r = (1.5 * value + 0.5 * chars + 0.5 * rm).reshape(2, 3)
        adv = hand_advantages(advantage, r).reshape(-1, 1)
        ids, resp = hand_batch(cs)
        model = plain(tiny_model_dir, weights(algo.policy))
        lp = hand_logp(model, ids, T)
        per_tok = -adv * (lp if loss in ("cispo", "reinforce", "--reinforce") else torch.exp(lp - lp.detach()))
        want = (per_tok * resp).sum() / resp.sum()
        norm = grad_norm(want, model)
        got = step(algo, 0)
    assert got["reward"] == pytest.approx(r.mean().item(), rel=1e-5)
    assert got["reward_std"] == pytest.approx(r.flatten().std().item(), rel=1e-5)
    assert got["rewards/errors"] == pytest.approx(2 / 6)
    assert got["rewards/two_rewards.value"] == pytest.approx(value.mean().item())
    assert got["rewards/two_rewards.chars"] == pytest.approx(chars.mean().item())
    assert got["rewards/reward_model"] == pytest.approx(rm.mean().item(), rel=1e-5)
    assert got["loss"] == pytest.approx(want.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_the_length_reward_shapes_each_group_and_evaluate_uses_the_eval_options(tiny_model_dir, tmp_path):
    """--reward math --reward length:0.5 (Kimi k1.5): within each group, λ = 0.5 − (len − min)/(max − min) of the
    completions' RESPONSE lengths, added times 0.5 to the correct ones, min(0, λ) to the wrong ones; each sample's
    reward enters the step's advantages (--advantage mean) and its loss by hand. evaluate() samples
    max(--eval-k 1,2) = 2 completions of the --eval-samples 2 rows with the stage's sampling at --seed 5 and logs
    exactly what align.rollout.evaluation.evaluate_policy gives for those settings (--verifier FILE:FUNCTION judging),
    under eval/, and saves the same sampled
    completions (OUT/eval_samples.jsonl, tagged with the step); final_metrics reports start/, the last eval/ and
    the gain in greedy pass@1. --micro-batch-size 0 takes the most rows that fit --micro-batch-tokens 200 (3)."""
    from align.rollout.evaluation import evaluate_policy
    from align.rollout.generation import Sampling

    T = 0.9
    accept = tmp_path / "accept.py"  # --verifier: every answer right (the tiny model's never are under `math`)
    accept.write_text("def judge(prompt, completion, **row):\n    return 1.0\n")
    with grpo(tmp_path, tiny_model_dir, reward=["math", "length:0.5"], num_generations=3,
              temperature=T, seed=5, eval_data=str(small_data()["arith_test"]), eval_samples=2, eval_k="1,2",
              max_new_tokens=5, top_k=9, micro_batch_size=0, micro_batch_tokens=200,
              verifier=f"{accept}:judge") as algo:
        longest = max(map(len, algo.prompt_ids)) + 5  # --micro-batch-size 0: the most rows of this length in 200
        assert 200 // 6 < longest <= 200 // 3 and algo.micro == 3
        answers = [str(algo.rows[p]["answer"]) for p in range(2)]
        spec = [[([40, EOS], True), ([41, 42, 43, EOS], False), ([44, 45, EOS], True)],
                [([46, 47, 48, 49, EOS], True), ([50, EOS], False), ([51, 52, EOS], False)]]
        cs = [Completion(algo.prompt_ids[p], ids, f"#### {answers[p] if ok else '99999'}", True)
              for p, group in enumerate(spec) for ids, ok in group]
        fixed_rollouts(algo, lambda s: cs)
        rewards = []
        for group in spec:
            n = [len(ids) for ids, _ in group]
            lam = [0.5 - (k - min(n)) / (max(n) - min(n)) for k in n]
            rewards.append([(1.0 + 0.5 * lm) if ok else 0.5 * min(0.0, lm) for lm, (_, ok) in zip(lam, group)])
        adv = group_adv(rewards)
        ids, resp = hand_batch(cs)
        model = plain(tiny_model_dir, weights(algo.policy))
        lp = hand_logp(model, ids, T)
        want = (-adv * torch.exp(lp - lp.detach()) * resp).sum() / resp.sum()
        norm = grad_norm(want, model)
        want_eval, want_recs = evaluate_policy(algo.policy.eng, algo.tok, algo.eval_rows, algo.run.dist, ks=[1, 2],
                                               samples=2, sampling=Sampling(5, T, 9, 1.0, seed=5), gather=True,
                                               verifier=f"{accept}:judge")
        got_eval = algo.evaluate(3)
        import json

        saved = [json.loads(line) for line in (Path(algo.run.out) / "eval_samples.jsonl").read_text().splitlines()]
        got = step(algo, 0)
    assert len(algo.eval_rows) == 2
    held = [json.loads(x) for x in Path(small_data()["arith_test"]).read_text().splitlines()[:2]]
    assert [r["prompt"] for r in algo.eval_rows] == [r["prompt"] for r in held]  # --eval-data's, in order
    train = [json.loads(x) for x in Path(small_data()["arith"]).read_text().splitlines()]
    assert [r["prompt"] for r in algo.rows] == [r["prompt"] for r in train]  # and the training prompts --data's
    assert got["rewards/math"] == pytest.approx(3 / 6)
    assert got["reward"] == pytest.approx(sum(map(sum, rewards)) / 6, rel=1e-6)
    assert got["loss"] == pytest.approx(want.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert got_eval == {f"eval/{k}": v for k, v in want_eval.items()}
    assert {"eval/pass@1", "eval/pass@2"} <= set(got_eval), sorted(got_eval)
    assert got_eval["eval/pass@1/greedy"] == got_eval["eval/pass@2"] == 1.0  # judged by --verifier
    assert saved == [{"step": 3, **rec} for rec in want_recs]  # the same samples: the same sampling and seed
    assert all(len(rec["samples"]) == 2 for rec in saved) and len({tuple(rec["samples"]) for rec in saved}) == 2
    last = {"eval/pass@1/greedy": 0.75, "eval/pass@2": 0.5, "reward": 1.25, "loss": 3.0}
    start = {"eval/pass@1/greedy": 0.25, "eval/pass@2": 0.125}
    assert algo.final_metrics(last, start) == {"start/pass@1/greedy": 0.25, "start/pass@2": 0.125,
                                               "eval/pass@1/greedy": 0.75, "eval/pass@2": 0.5, "reward": 1.25,
                                               "gain/pass@1/greedy": 0.5}


def test_reinforce_pp_keeps_groups_without_spread_and_skipped_samples_leave_the_batch_statistics(tiny_model_dir,
                                                                                                 tmp_path):
    """--advantage reinforce++ whitens over the whole batch's valid rewards (no group baseline), so under
    --drop-zero-std-groups a group of equal rewards still carries signal and stays in the loss; a sample whose reward
    raised (--on-reward-error skip) leaves the batch mean/std, the loss and its normaliser; frac_reward_zero_std counts
    the groups whose VALID rewards are all equal (group 0, and group 2 with one valid sample): 2/3."""
    T = 0.8
    with grpo(tmp_path, tiny_model_dir, advantage="reinforce++", on_reward_error="skip", prompts_per_step=3,
              micro_batch_size=6, temperature=T) as algo:
        texts = [["1.0", "1.0"], ["0.0", "2.0"], ["3.0", "boom"]]
        cs = [Completion(algo.prompt_ids[p], [40 + 2 * p + g] * (g + 1) + [EOS], texts[p][g], True)
              for p in range(3) for g in range(2)]
        fixed_rollouts(algo, lambda s: cs)
        valid = torch.tensor([1.0, 1, 1, 1, 1, 0])
        r = torch.tensor([1.0, 1, 0, 2, 3, 0])
        good = r[valid.bool()]
        adv = ((r - good.mean()) / (good.std() + 1e-4) * valid)[:, None]
        ids, resp = hand_batch(cs)
        counted = resp * valid[:, None]
        model = plain(tiny_model_dir, weights(algo.policy))
        lp = hand_logp(model, ids, T)
        want = (-adv * torch.exp(lp - lp.detach()) * counted).sum() / counted.sum()
        norm = grad_norm(want, model)
        got = step(algo, 0)
    assert got["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert got["kept_token_frac"] == pytest.approx(1.0)
    assert got["signal_frac"] == pytest.approx(5 / 6)
    assert got["loss"] == pytest.approx(want.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)


@pytest.mark.parametrize("fast", [False, True])
def test_rollouts_end_at_their_first_eos_kept_with_one_sampler_logprob_per_kept_token(tiny_model_dir, fast):
    """align.rollout.generation.generate_local (HF generate: fast=False, the CPU path of every stage's rollouts; the fast
    decoder: fast=True) on a tiny model made to emit EOS often, 12 rows in ONE batch that stop at different steps:
    a row that stopped is its tokens up to and INCLUDING its first EOS (finished), one that did not is exactly
    --max-new-tokens tokens without EOS (not finished); its text is those tokens decoded; its sampler log-probs
    are one per kept token (not the padded steps after its EOS while other rows went on), each log softmax(z / T)
    of the model's own logits z on that row alone. Greedy rows are the hand argmax continuation, EOS included."""
    from align.data import encode_prompts
    from align.models import load_tokenizer, resolve
    from align.rollout.generation import Sampling, generate_local

    tok = load_tokenizer(resolve(str(tiny_model_dir)))
    ps = encode_prompts(tok, ["What is 2+3?", "Tom has 3 apples and buys 4 more. How many?", "hi"])
    n_new, T = 8, 1.0
    model = eos_prone(tiny_model_dir, ps[1], 6.0)
    cs = generate_local(model, tok, [p for p in ps for _ in range(4)], Sampling(max_new_tokens=n_new, temperature=T,
                        seed=5), 12, "cpu", fast=fast)
    stopped = [c for c in cs if c.finished]
    assert 0 < len(stopped) < len(cs) and len({len(c.ids) for c in stopped}) > 1
    assert any(len(c.ids) < n_new for c in stopped)
    for c in cs:
        if c.finished:
            assert c.ids[-1] == EOS and EOS not in c.ids[:-1] and len(c.ids) <= n_new
        else:
            assert len(c.ids) == n_new and EOS not in c.ids
        assert c.text == tok.decode(c.ids, skip_special_tokens=True)
        assert c.logps is not None and len(c.logps) == len(c.ids)
        with torch.no_grad():
            want = hand_logp(model, torch.tensor([c.prompt_ids + c.ids]), T)[0, len(c.prompt_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(c.logps), want, atol=1e-4, rtol=1e-4)

    greedy_model = eos_prone(tiny_model_dir, ps[1], 2.0)
    gs = generate_local(greedy_model, tok, ps, Sampling(max_new_tokens=n_new, temperature=0), 3, "cpu", fast=fast)
    assert {g.finished for g in gs} == {True, False}
    for p, g in zip(ps, gs):
        want = greedy_ids(greedy_model, p, n_new, EOS)
        assert g.ids == want and g.finished == (want[-1] == EOS) and g.logps is None


def test_kl_is_logged_from_the_first_pass_of_num_iterations(tiny_model_dir, tmp_path):
    """--beta > 0 with --num-iterations 2: `kl` is the KL of the batch as sampled (the first pass), which at step 0
    is 0 exactly (policy = reference), however far the first pass's update moves the policy for the second."""
    with grpo(tmp_path, tiny_model_dir, beta=0.5, lr=1e-1, num_iterations=2) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, EOS], 0.0, True)],
                                [([43, 44, 45, 46], 2.0, False), ([47, EOS], 0.5, True)]])
        fixed_rollouts(algo, lambda s: cs)
        got = step(algo, 0)
        ids, resp = hand_batch(cs)
        with torch.no_grad():  # the second pass saw a policy away from the reference: a per-pass mean would not be 0
            moved = k3(hand_logp(plain(tiny_model_dir, weights(algo.policy)), ids, 1.0),
                       hand_logp(plain(tiny_model_dir), ids, 1.0))
    assert got["kl"] == 0.0
    assert (moved * resp).sum() / resp.sum() > 1e-4


def test_every_pass_of_num_iterations_carries_the_kl_term(tiny_model_dir, tmp_path):
    """--beta 0.3 with --num-iterations 2: the second pass's loss is the clipped surrogate against π_old = θ0 plus
    β · the token mean of k3(π_θ1, π_ref) (the reference the frozen start), and its gradient (the step's last
    grad_norm) is that loss's, computed by hand at the weights the pass saw (θ1)."""
    beta, eps, T = 0.3, 0.2, 1.0
    with grpo(tmp_path, tiny_model_dir, beta=beta, lr=3e-2, num_iterations=2, epsilon=eps, epsilon_high=eps) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, 43, EOS], 0.0, True)],
                                [([44, 45, 46, 47], 2.0, False), ([48, EOS], 0.5, True)]])
        fixed_rollouts(algo, lambda s: cs)
        calls, backward = [], algo.policy.backward

        def spy(loss):  # each update pass: its loss and the weights its forward ran at
            calls.append((loss.item(), weights(algo.policy)))
            backward(loss)

        algo.policy.backward = spy
        got = step(algo, 0)
    assert len(calls) == 2
    ids, resp = hand_batch(cs)
    adv = group_adv([[1.0, 0.0], [2.0, 0.5]])
    with torch.no_grad():
        old = hand_logp(plain(tiny_model_dir), ids, T)  # θ0: π_old and the reference
    model = plain(tiny_model_dir, calls[1][1])
    lp = hand_logp(model, ids, T)
    kl = (k3(lp, old) * resp).sum() / resp.sum()
    want = clip_loss(lp, old, adv, resp, eps, eps, False, "token-mean") + beta * kl
    assert beta * kl.item() > 1e-3 * abs(want.item())  # the KL term weighs in this pass
    assert calls[1][0] == pytest.approx(want.item(), rel=1e-5)
    assert got["grad_norm"] == pytest.approx(grad_norm(want, model), rel=1e-4)


def test_with_a_teacher_the_kl_reference_is_still_the_frozen_start(tiny_model_dir, other_model_dir, tmp_path):
    """--beta 0.5 with --teacher another model: the KL term's reference is the policy's frozen start (kl 0 at step
    0, where the policy is the start), the teacher only the distillation term's (reverse KL to it above 0)."""
    with grpo(tmp_path, tiny_model_dir, beta=0.5, teacher=str(other_model_dir)) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, EOS], 0.0, True)],
                                [([43, 44, 45, 46], 2.0, False), ([47, EOS], 0.5, True)]])
        fixed_rollouts(algo, lambda s: cs)
        got = step(algo, 0)
    assert got["kl"] == 0.0 and got["distill/reverse_kl"] > 1e-3


def test_the_lr_schedule_warmup_weight_decay_and_betas_reach_grpos_optimiser(tiny_model_dir, tmp_path):
    """--schedule linear --warmup-steps 2 --max-steps 4 --weight-decay 0.1: the learning rate each optimiser step
    applies is lr·(0.5, 1, 1, 0.55); AdamW decays the matrices by 0.1 and no 1-D parameter, with GRPO's
    β = (0.9, 0.999)."""
    lr = 1e-3
    with grpo(tmp_path, tiny_model_dir, schedule="linear", warmup_steps=2, max_steps=4, weight_decay=0.1, lr=lr) as algo:
        cs = completions(algo, [[([40, 41, EOS], 1.0, True), ([42, EOS], 0.0, True)],
                                [([43, 44, 45, 46], 2.0, False), ([47, EOS], 0.5, True)]])
        fixed_rollouts(algo, lambda s: cs)
        opt = algo.policy.eng.optimizer
        with applied_lrs(opt) as (applied,):
            for s in range(4):
                step(algo, s)
        groups = decay_groups(opt)
    assert applied == pytest.approx([lr * f for f in (0.5, 1.0, 1.0, 0.55)])
    assert groups == {(0.1, "matrices", (0.9, 0.999)), (0.0, "1-d", (0.9, 0.999))}


def test_each_sample_of_a_rollout_is_of_its_own_rows_prompt(tiny_model_dir, tmp_path):
    """The stage's own rollout (HF sampling on the CPU): sample g of prompt p (row p·G + g, prompt-major) carries the
    token ids of row p's templated prompt, so every reward reads the row its completion answers."""
    from align import data as D

    with grpo(tmp_path, tiny_model_dir, prompts_per_step=3, num_generations=2, micro_batch_size=2) as algo:
        r = algo.local_rollout(0)
        want = D.encode_prompts(algo.tok, [row["prompt"] for row in r.rows])
    assert len({tuple(p) for p in want}) == 3  # three different prompts
    assert [c.prompt_ids for c in r.completions] == [p for p in want for _ in range(2)]
