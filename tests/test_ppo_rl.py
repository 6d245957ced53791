"""PPO's pure estimators (align/objectives/ppo.py) against hand-computed values, numerical gradients and masks."""

import pytest
import torch

from align import objectives
from align.objectives import kl, ppo
from align.objectives.moments import masked_sums

# one prompt token, three response tokens, one pad | two prompt tokens, three response tokens to the end
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0]])


# ---- per-token rewards
def test_token_rewards_kl_on_every_response_token_score_on_the_last():
    kl = torch.tensor([[9.0, 0.5, 0.2, 0.1, 9.0], [9.0, 9.0, 0.3, 0.3, 0.3]])
    r = ppo.token_rewards(torch.tensor([2.0, -1.0]), kl, MASK, beta=0.1)
    torch.testing.assert_close(r, torch.tensor([[0.0, -0.05, -0.02, -0.01 + 2.0, 0.0],
                                                [0.0, 0.0, -0.03, -0.03, -0.03 - 1.0]]))


def test_token_rewards_row_without_response_gets_nothing_and_gradcheck():
    mask = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    kl = torch.rand(2, 3, dtype=torch.float64, requires_grad=True)
    score = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert (ppo.token_rewards(score, kl, mask, 0.2)[0] == 0).all()
    assert torch.autograd.gradcheck(lambda k, s: ppo.token_rewards(s, k, mask, 0.2), (kl, score))


def test_last_token_index():
    assert ppo.last_token_index(MASK).tolist() == [3, 4]
    assert ppo.last_token_index(torch.zeros(1, 4)).tolist() == [0]


def test_leave_one_out_mean_by_hand():
    x = torch.tensor([1.0, 0.0, 1.0, 1.0])
    torch.testing.assert_close(ppo.leave_one_out_mean(x, 3.0, 4), torch.tensor([2 / 3, 1.0, 2 / 3, 2 / 3]))
    # this process's two episodes of a batch of 4 whose other process holds [0, 0]: total 1, n 4
    torch.testing.assert_close(ppo.leave_one_out_mean(torch.tensor([1.0, 0.0]), 1.0, 4), torch.tensor([0.0, 1 / 3]))
    assert ppo.leave_one_out_mean(torch.tensor([1.0]), 1.0, 1).tolist() == [0.0]  # one episode: no baseline


def test_leave_one_out_baseline_leaves_the_policy_gradient_unbiased():
    """E[Σ_i ∇log π(a_i) · (g_i − b_i)] = E[Σ_i ∇log π(a_i) · g_i] when b_i does not depend on a_i: the exact
    expectation over every outcome of 3 independent Bernoulli(p) episodes (∇_p log π is 1/p for g = 1, −1/(1 − p)
    for g = 0). The plain batch mean (b_i includes g_i) shrinks the gradient by (n − 1)/n."""
    import itertools

    p, n = 0.3, 3

    def expected(baseline):
        total = 0.0
        for outcome in itertools.product([0.0, 1.0], repeat=n):
            x = torch.tensor(outcome)
            prob = float(torch.where(x > 0, p, 1 - p).prod())
            grad_logp = torch.where(x > 0, 1 / p, -1 / (1 - p))
            total += prob * float((grad_logp * (x - baseline(x))).sum())
        return total

    assert expected(lambda x: 0.0) == pytest.approx(n)  # d/dp E[Σ g_i] = n
    assert expected(lambda x: ppo.leave_one_out_mean(x, float(x.sum()), n)) == pytest.approx(n)
    assert expected(lambda x: x.mean()) == pytest.approx(n * (n - 1) / n)


def test_episode_score_rm_plus_centred_gold_minus_missing_eos_then_clip():
    rm, gold = torch.tensor([0.5, -1.0, 2.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    finished = torch.tensor([True, False, True, False])
    torch.testing.assert_close(ppo.episode_score(rm, gold, finished), rm)  # defaults: the RM's score alone
    torch.testing.assert_close(ppo.episode_score(rm, gold, finished, gold_coef=2.0, missing_eos_penalty=1.0),
                               torch.tensor([2.5, 0.0, 2.0, -1.0]))
    b = ppo.leave_one_out_mean(gold, 2.0, 4)  # [1/3, 1/3, 2/3, 2/3]
    torch.testing.assert_close(ppo.episode_score(rm, gold, finished, 3.0, b),
                               torch.tensor([0.5 + 2.0, -1.0 + 2.0, 2.0 - 2.0, 0.0 - 2.0]))
    torch.testing.assert_close(ppo.episode_score(rm, gold, finished, 2.0, 0.0, 1.0, clip=1.5),
                               torch.tensor([1.5, 0.0, 1.5, -1.0]))


# ---- GAE
def test_gae_by_hand_with_masks():
    rewards = torch.tensor([[0.0, 0.1, -0.2, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.3, 9.0], [9.0, 9.0, 1.0, 1.0, 1.0]])  # 9: outside the mask
    adv, ret = ppo.gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    # row 0: δ3 = 1 − 0.3 = 0.7; δ2 = −0.2 + 0.9·0.3 − 0.4 = −0.33, A2 = −0.33 + 0.72·0.7 = 0.174;
    #        δ1 = 0.1 + 0.9·0.4 − 0.5 = −0.04, A1 = −0.04 + 0.72·0.174 = 0.08528
    # row 1: δ4 = 2 − 1 = 1; δ3 = 0.9 − 1 = −0.1, A3 = −0.1 + 0.72 = 0.62; A2 = −0.1 + 0.72·0.62 = 0.3464
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.08528, 0.174, 0.7, 0.0], [0.0, 0.0, 0.3464, 0.62, 1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.58528, 0.574, 1.0, 0.0], [0.0, 0.0, 1.3464, 1.62, 2.0]]))


def test_gae_across_a_tool_gap_by_hand():
    """A two-turn episode: policy tokens 1-2, the tool's output at 3-4 (mask 0), policy tokens 5-6, the reward on
    the last. The environment's tokens are no time step: V(t') after token 2 is token 5's, no discount across the
    gap, and the final reward reaches the first turn; the tool's tokens get no advantage nor return. The same
    episode with the gap removed gives the same advantages on the policy's tokens."""
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, -0.1, 0.0, 7.0, 7.0, 0.0, 1.0, 0.0]])  # 7: on the tool's tokens, ignored
    values = torch.tensor([[9.0, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 9.0]])
    adv, ret = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # δ6 = 1 − 0.5 = 0.5, A6 = 0.5;  δ5 = 0 + 0.9·0.5 − 0.4 = 0.05, A5 = 0.05 + 0.72·0.5 = 0.41
    # δ2 = 0 + 0.9·0.4 − 0.3 = 0.06 (V of token 5), A2 = 0.06 + 0.72·0.41 = 0.3552
    # δ1 = −0.1 + 0.9·0.3 − 0.2 = −0.03, A1 = −0.03 + 0.72·0.3552 = 0.225744
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.225744, 0.3552, 0.0, 0.0, 0.41, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.425744, 0.6552, 0.0, 0.0, 0.81, 1.0, 0.0]]))
    keep = mask[0] > 0
    flat_adv, _ = ppo.gae(rewards[:, keep], values[:, keep], mask[:, keep], gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, keep], flat_adv)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, -0.1, -0.1, 1.0, 0.0]])
    values = torch.tensor([[5.0, 0.2, 0.3, 0.4, 5.0]])
    adv, ret = ppo.gae(rewards, values, MASK[:1], gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.8, 0.9, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.6, 0.6, 0.6, 0.0]]))


def test_gae_ignores_everything_outside_the_mask_and_gradcheck():
    rewards, values = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    poisoned_r, poisoned_v = rewards.clone(), values.clone()
    poisoned_r[MASK == 0], poisoned_v[MASK == 0] = 1e6, -1e6
    a1, r1 = ppo.gae(rewards, values, MASK, 0.99, 0.95)
    a2, r2 = ppo.gae(poisoned_r, poisoned_v, MASK, 0.99, 0.95)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)
    assert (a1[MASK == 0] == 0).all() and (r1[MASK == 0] == 0).all()
    r, v = rewards.requires_grad_(), values.requires_grad_()
    assert torch.autograd.gradcheck(lambda r, v: ppo.gae(r, v, MASK.double(), 0.9, 0.8), (r, v))


# ---- whitening, explained variance
def test_whiten_by_hand_and_masked():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # mean 2, unbiased var 1
    torch.testing.assert_close(ppo.whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(ppo.whiten(x, m, shift_mean=False), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))
    xd = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ppo.whiten(t, MASK.double()), (xd,))


def test_whiten_of_a_constant_is_zero_not_nan():
    """Every masked advantage equal (variance 0): (x − μ)·(0 + eps)^−½ = 0, not 0/0; the masked-out entry is 0."""
    x, m = torch.tensor([[2.0, 2.0, 2.0, 7.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert ppo.whiten(x, m).tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert ppo.whiten(x, m, shift_mean=False).tolist() == [[2.0, 2.0, 2.0, 0.0]]


def test_whiten_with_a_reduce_uses_the_global_batch():
    """Two 'ranks' whose statistics are summed whiten exactly like the whole batch."""
    x, m = torch.randn(4, 6), (torch.rand(4, 6) > 0.3).float()
    total = masked_sums(x[:2], m[:2]) + masked_sums(x[2:], m[2:])
    parts = torch.cat([ppo.whiten(x[:2], m[:2], reduce=lambda s: total), ppo.whiten(x[2:], m[2:], reduce=lambda s: total)])
    torch.testing.assert_close(parts, ppo.whiten(x, m))


def test_explained_variance_by_hand():
    m = torch.ones(1, 3)
    # residual [0, 0, 1]: var 1/3; target [1, 2, 4]: var 7/3 -> 1 − 1/7
    assert ppo.explained_variance(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0, 2.0, 4.0]]), m) == pytest.approx(6 / 7)
    assert ppo.explained_variance(torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1.0, 2.0, 4.0]]), m) == pytest.approx(1.0)


# ---- clipped value loss
def test_clipped_value_loss_by_hand():
    old = torch.zeros(3)
    values = torch.tensor([0.5, 0.1, -0.5], requires_grad=True)
    returns = torch.tensor([1.0, 1.0, 0.0])
    loss, clipped = ppo.clipped_value_loss(values, old, returns, clip=0.2)
    # V_clip = [0.2, 0.1, −0.2]; (V−R)² = [0.25, 0.81, 0.25]; (V_clip−R)² = [0.64, 0.81, 0.04]
    torch.testing.assert_close(loss, torch.tensor([0.32, 0.405, 0.125]), atol=1e-6, rtol=0)
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    # token 0: the clipped term wins and V_clip is constant in V -> no gradient; else d/dV ½(V−R)² = V − R
    torch.testing.assert_close(values.grad, torch.tensor([0.0, -0.9, -0.5]))


def test_clipped_value_loss_gradcheck_inside_the_clip_range():
    old = torch.zeros(4, dtype=torch.float64)
    v = (torch.rand(4, dtype=torch.float64) * 0.2 - 0.1).requires_grad_()
    ret = torch.randn(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda t: ppo.clipped_value_loss(t, old, ret, 0.2)[0], (v,))


# ---- KL estimators and controllers
def test_kl_estimators_registered():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(objectives.get("kl", "k1").fn(logp, ref), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(objectives.get("kl", "k3").fn(logp, ref), torch.tensor([0.106531, 0.718282]), atol=1e-5, rtol=0)


def test_adaptive_kl_controller_by_hand():
    c = kl.AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert c.update(2.0, 10) == pytest.approx(0.1 * 1.02)  # e = clip(1, ±0.2) = 0.2: β·(1 + 0.2·10/100)
    assert c.update(1.1, 10) == pytest.approx(0.1 * 1.02 * 1.01)  # e = 0.1
    assert c.update(1.0, 10) == pytest.approx(0.1 * 1.02 * 1.01)  # on target: unchanged
    assert c.update(0.5, 10) == pytest.approx(0.1 * 1.02 * 1.01 * 0.98)  # e = −0.5 clips to −0.2


def test_adaptive_kl_controller_over_a_synthetic_stream():
    c = kl.AdaptiveKLController(0.05, target=2.0, horizon=1000)
    betas = [c.update(kl, 32) for kl in [3.0] * 20]  # above target: β rises every step
    assert all(b2 > b1 for b1, b2 in zip([0.05] + betas, betas))
    assert betas[-1] == pytest.approx(0.05 * (1 + 0.2 * 32 / 1000) ** 20)
    high = betas[-1]
    betas = [c.update(kl, 32) for kl in [1.5] * 20]  # below: falls, e = 1.5/2 − 1 = −0.25 -> −0.2
    assert all(b2 < b1 for b1, b2 in zip([high] + betas, betas))
    assert betas[-1] == pytest.approx(high * (1 - 0.2 * 32 / 1000) ** 20)
    fixed = kl.FixedKLController(0.05)
    assert [fixed.update(kl, 32) for kl in (0.0, 9.0)] == [0.05, 0.05]


def test_plain_logprobs_temperature_and_differentiable_entropy():
    """logprobs' plain path: log-probs of logits / T (as sampled) on the response positions, entropy detached
    unless entropy_grad."""
    from types import SimpleNamespace

    from align.logprobs import logprobs

    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 7)
    model = lambda input_ids, attention_mask, use_cache: SimpleNamespace(logits=emb(input_ids))  # noqa: E731
    batch = {"input_ids": torch.tensor([[1, 4, 2, 6]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
             "response_mask": torch.tensor([[0.0, 1.0, 1.0]])}
    logp, ent = logprobs(model, batch, with_entropy=True, temperature=0.5)
    want = (emb(batch["input_ids"])[:, :-1] / 0.5).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    assert torch.allclose(logp, want * batch["response_mask"], atol=1e-6) and not ent.requires_grad
    assert logp[0, 0] == 0 and ent[0, 0] == 0  # the prompt position is masked
    _, ent = logprobs(model, batch, with_entropy=True, entropy_grad=True)
    ent.sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.abs().sum() > 0
    assert logprobs(model, batch)[1] is None
