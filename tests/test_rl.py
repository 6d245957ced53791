"""RL objectives and estimators against hand-computed values and numerical gradients (align/objectives,
align/rewards.py)."""

import math

import pytest
import torch

from align import objectives
from align.errors import UserError
from align.objectives import advantages as A
from align.objectives import kl as K
from align.objectives import policy as P
from align.objectives import shaping as S
from align.objectives.distill import reverse_kl_distill
from align.objectives.moments import masked_sums
from align.objectives.offpolicy import rollout_mismatch, truncated_is_weights
from align.objectives.tokens import entropy_from_logits
from align.rewards import RewardError, call_reward, parse_rewards
from align.rollout.batch import distinct_n, rollout_batch
from align.rollout.generation import Completion


# ---- advantages
def test_zscore_advantage_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5; unbiased std = sqrt((4 * 0.25) / 3) = 0.57735
    a = A.zscore_advantages(r, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025]]), atol=1e-5, rtol=0)


def test_zscore_advantage_default_eps_and_an_exactly_flat_group():
    # the default eps 1e-4 in the denominator: 0.5 / (sqrt(1/3) + 1e-4) = 0.865875
    a = A.zscore_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0, -1.0, 1.0]]) * 0.5 / (math.sqrt(1 / 3) + 1e-4))
    # three rewards 0.1 (float64): their mean is 0.10000000000000002, not 0.1; the group has no spread, so A is
    # exactly 0 (r − mean would be −1.4e-17, and divided by eps −1.4e-13)
    flat = torch.tensor([[0.1, 0.1, 0.1]], dtype=torch.float64)
    for mode in ("zscore", "mean", "rloo", "batch"):
        assert (objectives.get("advantage", mode).fn(flat) == 0).all(), mode


def test_group_advantages_with_a_skipped_sample_by_hand():
    """Group [3, 1, (skipped, placeholder 100), 2]: the valid rewards have mean 2, unbiased std
    sqrt((1 + 1 + 0) / 2) = 1 and count 3; the skipped sample gets 0. Group [0.1, 0.1, 0.1, (skipped 5)]: no spread
    among the valid ones, every A is 0."""
    r = torch.tensor([[3.0, 1.0, 100.0, 2.0], [0.1, 0.1, 0.1, 5.0]], dtype=torch.float64)
    valid = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]])
    by_hand = {
        "mean": [1.0, -1.0, 0.0, 0.0],  # r − 2
        "zscore": [1 / (1 + 1e-4), -1 / (1 + 1e-4), 0.0, 0.0],  # (r − 2) / (1 + eps)
        # leave-one-out: 3 − mean(1, 2) = 1.5, 1 − mean(3, 2) = −1.5, 2 − mean(3, 1) = 0
        "rloo": [1.5, -1.5, 0.0, 0.0],
    }
    for mode, want in by_hand.items():
        a = objectives.get("advantage", mode).fn(r, valid)
        torch.testing.assert_close(a, torch.tensor([want, [0.0] * 4], dtype=torch.float64), msg=mode)


def test_mean_advantage_by_hand():
    r = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 3.0]])
    a = A.mean_advantages(r)
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0, 0.0], [-1.0, -1.0, 2.0]]))


def test_batch_advantage_uses_the_batch_std():
    r = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # group means 0.5 and 1; batch std (unbiased) of [1, 0, 1, 1] = sqrt(0.75 / 3) = 0.5
    a = A.batch_advantages(r, eps=0.0)
    torch.testing.assert_close(a, torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    # with the other rank's rewards [[0, 0], [0, 0]] summed in by `reduce`: std of 8 values, 3 ones = sqrt(15/56)
    other = masked_sums(torch.zeros(2, 2), torch.ones(2, 2))
    a2 = A.batch_advantages(r, reduce=lambda s: s + other, eps=0.0)
    torch.testing.assert_close(a2, torch.tensor([[1.0, -1.0], [0.0, 0.0]]) * 0.5 / math.sqrt(15 / 56))


def test_rloo_advantage_leaves_each_sample_out_of_its_baseline():
    """RLOO (Kool et al. 2019): A_i = r_i − mean of the other G−1 rewards; written out for G = 4."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 6.0]])
    by_hand = torch.tensor([[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3], [3 - 3.0, 1 - 11 / 3, 2 - 10 / 3, 6 - 2.0]])
    torch.testing.assert_close(A.rloo_advantages(r), by_hand)
    torch.testing.assert_close(A.rloo_advantages(r), 4 / 3 * A.mean_advantages(r))  # = G/(G−1) · (r − mean)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(A.rloo_advantages, (x,))
    assert objectives.get("advantage", "rloo").fn is A.rloo_advantages  # --advantage rloo: the registration is all it takes


GROUP_RELATIVE = [m for m in objectives.Choices("advantage") if m != "reinforce++"]  # reinforce++ has no per-group baseline


@pytest.mark.parametrize("mode", GROUP_RELATIVE)
def test_all_equal_group_gives_exactly_zero_advantage_never_nan(mode):
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.7] * 4, [0.1] * 4])  # 0.7, 0.1: not exact in fp32
    a = objectives.get("advantage", mode).fn(r)
    assert torch.isfinite(a).all() and (a == 0).all()


@pytest.mark.parametrize("mode", GROUP_RELATIVE)
def test_a_skipped_sample_takes_no_part_in_its_group(mode):
    """--on-reward-error skip: [1, 1, skipped, 1] is a group without spread (A = 0, dropped as zero-std), not
    one whose 0.0 placeholder lifts the others to A = +0.5; and [1, 0, skipped] is the group [1, 0]."""
    r = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.5]])
    valid = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    a = objectives.get("advantage", mode).fn(r, valid)
    assert (a[0] == 0).all() and a[1, 2] == 0 and a[1, 3] == 0
    assert A.zero_spread(r, valid).tolist() == [True, False]
    if mode == "batch":  # its std is the batch's: of the 5 valid rewards [1, 1, 1, 1, 0]
        torch.testing.assert_close(a[1, :2], torch.tensor([0.5, -0.5]) / (torch.tensor([1.0, 1, 1, 1, 0]).std() + 1e-4))
    else:
        torch.testing.assert_close(a[1, :2], objectives.get("advantage", mode).fn(torch.tensor([[1.0, 0.0]]))[0])


# ---- KL estimators
def test_k1_and_k3_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(K.kl_k1(logp, ref), torch.tensor([0.5, -1.0]))
    # r = ref - logp = [-0.5, 1.0]; k3 = e^r - r - 1 = [0.606531 + 0.5 - 1, 2.718282 - 1 - 1]
    torch.testing.assert_close(K.kl_k3(logp, ref), torch.tensor([0.106531, 0.718282]), atol=1e-5, rtol=0)


def test_k3_is_zero_at_equality_nonnegative_and_capped_above():
    x = torch.randn(100)
    assert (K.kl_k3(x, x) == 0).all()
    assert (K.kl_k3(x, torch.randn(100)) >= 0).all()
    # log-ratio 50 (the reference far likelier) is capped at 20: e^20 - 20 - 1, finite
    assert K.kl_k3(torch.tensor([0.0]), torch.tensor([50.0])).item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


def test_k3_keeps_pulling_back_a_policy_far_ahead_of_the_reference():
    """log-ratio r = log π_ref − log π = −15 (the policy 15 nats likelier): k3 = e^−15 + 14, and its gradient
    d k3 / d log π = 1 − e^r is not zero (it was, with the log-ratio clamped at ±10)."""
    logp = torch.tensor([15.0], dtype=torch.float64, requires_grad=True)
    k3 = K.kl_k3(logp, torch.tensor([0.0], dtype=torch.float64))
    assert k3.item() == pytest.approx(math.exp(-15) + 14)
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    assert grad.item() == pytest.approx(1 - math.exp(-15)) and grad.item() > 0.99
    # 30 nats ahead, past the +20 cap's mirror image: still no cap below, k3 = e^−30 + 29, gradient 1 − e^−30
    logp = torch.tensor([30.0], dtype=torch.float64, requires_grad=True)
    k3 = K.kl_k3(logp, torch.tensor([0.0], dtype=torch.float64))
    assert k3.item() == pytest.approx(29.0)
    assert torch.autograd.grad(k3.sum(), logp)[0].item() == pytest.approx(1.0)


def test_k3_gradcheck():
    logp = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(6, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: K.kl_k3(x, ref), (logp,))


# ---- clipped surrogate
def test_clipped_surrogate_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))  # ratios
    adv = torch.tensor([1.0, -1.0, -2.0, 1.0])
    loss, low, high = P.clipped_surrogate(logp, old, adv, None, eps_low=0.2, eps_high=0.28)
    # ratio 1.5, A=+1: min(1.5, 1.28) -> -1.28 (clipped high)
    # ratio 0.5, A=-1: min(-0.5, -0.8) = -0.8 -> 0.8 (clipped low)
    # ratio 1.1, A=-2: min(-2.2, -2.2) -> 2.2 (inside)
    # ratio 0.7, A=+1: min(0.7, 0.8) = 0.7 -> -0.7 (below range but A>0: not clipped, gradient flows)
    torch.testing.assert_close(loss, torch.tensor([-1.28, 0.8, 2.2, -0.7]), atol=1e-6, rtol=0)
    assert high.tolist() == [True, False, False, False]
    assert low.tolist() == [False, True, False, False]


def test_cispo_by_hand_clips_the_detached_weight_not_the_gradient():
    """CISPO: L = −sg(clip(ρ, 0.8, 1.28))·A·log π. Ratios 1.5, 0.5, 1.1 (log π_old = 0): weights 1.28, 0.8, 1.1;
    every token keeps the gradient dL/dlog π = −w·A (PPO's clip zeroes the first two)."""
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, low, high = P.cispo_surrogate(logp, torch.zeros(3, dtype=torch.float64), adv, None, 0.2, 0.28)
    w = [1.28, 0.8, 1.1]
    want = [-w[0] * 1.0 * math.log(1.5), -w[1] * -1.0 * math.log(0.5), -w[2] * 2.0 * math.log(1.1)]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))  # −0.518995, −0.554518, −0.209682
    assert low.tolist() == [False, True, False] and high.tolist() == [True, False, False]
    loss.sum().backward()
    # with the weight's gradient (no sg), token 3 would get −A·log π·ρ more: −2.2 − 0.2097
    torch.testing.assert_close(logp.grad, torch.tensor([-1.28, 0.8, -2.2], dtype=torch.float64))


def test_reinforce_by_hand():
    """--loss reinforce (--reinforce): L = −A·log π per token, dL/dlog π = −A; nothing is clipped."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([[2.0], [-1.0]])
    loss, low, high = P.reinforce(logp, logp.detach() + 5.0, adv, torch.ones(2, 2))  # π_old plays no part
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, -3.0]]))
    assert not low.any() and not high.any() and low.shape == (2, 2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))


def test_clipped_surrogate_gradient_zero_where_clipped():
    old = torch.zeros(2, dtype=torch.float64)
    logp = torch.log(torch.tensor([1.5, 1.1], dtype=torch.float64)).requires_grad_()
    loss, _, _ = P.clipped_surrogate(logp, old, torch.tensor([1.0, 1.0], dtype=torch.float64), None, 0.2, 0.28)
    loss.sum().backward()
    # d/dlogp of -ratio*A = -ratio = -1.1 inside; 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -1.1], dtype=torch.float64))


def test_clipped_surrogate_gradcheck_inside_the_clip_range():
    old = torch.zeros(5, dtype=torch.float64)
    logp = (torch.rand(5, dtype=torch.float64) * 0.2 - 0.1).requires_grad_()
    adv = torch.randn(5, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: P.clipped_surrogate(x, old, adv, None, 0.2, 0.28)[0], (logp,))


# ---- loss aggregation
LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_aggregations_by_hand():
    # token-mean: (1+2+3+4+5)/5 = 3
    assert P.aggregate_loss(LOSS, MASK, "token-mean", n_tokens=5, n_seqs=2, max_len=4).item() == pytest.approx(3.0)
    # seq-mean-token-mean: ((1+2+3)/3 + (4+5)/2) / 2 = (2 + 4.5) / 2 = 3.25
    assert P.aggregate_loss(LOSS, MASK, "seq-mean-token-mean", n_tokens=5, n_seqs=2, max_len=4).item() == pytest.approx(3.25)
    # seq-sum (Dr. GRPO): 15 / (2 * 4) = 1.875
    assert P.aggregate_loss(LOSS, MASK, "seq-sum", n_tokens=5, n_seqs=2, max_len=4).item() == pytest.approx(1.875)


def test_aggregation_with_global_counts_splits_exactly():
    """Two micro-batches (or ranks) with global counts sum to the whole-batch value."""
    for mode in P.LOSS_AGGREGATIONS:
        whole = P.aggregate_loss(LOSS, MASK, mode, n_tokens=5, n_seqs=2, max_len=4)
        parts = sum(P.aggregate_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, n_tokens=5, n_seqs=2, max_len=4)
                    for i in range(2))
        assert parts.item() == pytest.approx(whole.item())


def test_masked_tokens_never_reach_the_loss():
    poisoned = LOSS.clone()
    poisoned[MASK == 0] = float("nan")
    for mode in P.LOSS_AGGREGATIONS:
        v = P.aggregate_loss(torch.nan_to_num(poisoned, nan=1e9) * MASK, MASK, mode, n_tokens=5, n_seqs=2, max_len=4)
        assert v.item() == pytest.approx(P.aggregate_loss(LOSS, MASK, mode, n_tokens=5, n_seqs=2, max_len=4).item())


def test_aggregation_gradcheck():
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    for mode in P.LOSS_AGGREGATIONS:
        assert torch.autograd.gradcheck(
            lambda t: P.aggregate_loss(t, MASK.double(), mode, n_tokens=5, n_seqs=2, max_len=4), (x,))


# ---- rollout masks
def test_response_mask_covers_response_and_eos_only():
    eos, pad = 2, 0
    comps = [Completion([1, 4, 7], [9, 9, eos], "", True), Completion([1, 5], [8], "", False)]
    b = rollout_batch(comps, pad, "cpu")
    assert b["input_ids"].tolist() == [[1, 4, 7, 9, 9, eos], [1, 5, 8, pad, pad, pad]]
    assert "attention_mask" not in b  # right-padded: causal attention never reads the padding of a used position
    # target t predicts token t+1: row 0 predicts tokens 3..5 (9, 9, EOS); row 1 predicts token 2 (8) only
    assert b["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]


# ---- misc estimators
def test_distinct_n_and_overlong_and_length_reward_by_hand():
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 1) == pytest.approx(4 / 6)
    assert distinct_n([[1, 2, 3], [1, 2, 4]], 2) == pytest.approx(3 / 4)  # (1,2) (2,3) (1,2) (2,4)
    # budget 20, cache 5: 0 up to 15 tokens, then (15 − n) / 5, floored at −1 (a truncated answer counts as 21)
    assert S.overlong_penalty([10, 15, 17, 20, 21, 25], max_len=20, cache=5) == pytest.approx([0, 0, -0.4, -1, -1, -1])
    # lengths 10, 20, 30: λ = 0.5, 0, -0.5; wrong answers get min(0, λ)
    assert S.length_rewards([10, 20, 30], [True, False, True]) == [0.5, 0.0, -0.5]
    assert S.length_rewards([10, 20, 30], [False, True, False]) == [0.0, 0.0, -0.5]
    assert S.length_rewards([5, 5], [True, False]) == [0.0, 0.0]


def test_entropy_from_logits_by_hand():
    z = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    # H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 1.0397
    assert entropy_from_logits(z).item() == pytest.approx(1.039721, abs=1e-5)


# ---- reward functions
def test_reward_specs_weights_and_user_functions(tmp_path):
    f = tmp_path / "myrewards.py"
    f.write_text("def short(prompt, completion, **row):\n    return 1.0 if len(completion) < 5 else 0.0\n"
                 "def broken(prompt, completion, **row):\n    raise ValueError('boom')\n"
                 "def nan(prompt, completion, **row):\n    return float('nan')\n"
                 "def text(prompt, completion, **row):\n    return 'yes'\n")
    fns = parse_rewards(["math", "answer_format:0.2", f"{f}:short:0.5"])
    assert [(r.name, r.weight) for r in fns] == [("math", 1.0), ("answer_format", 0.2), ("myrewards.short", 0.5)]
    row = {"prompt": "p", "answer": "68"}
    assert call_reward(fns[0], "p", "23 + 45 = 68. #### 68", row) == 1.0
    assert call_reward(fns[1], "p", "23 + 45 = 68. #### 68", row) == 1.0
    assert call_reward(fns[1], "p", "68", row) == 0.0
    assert call_reward(fns[2], "p", "abc", row) == 1.0
    for name, needle in (("broken", "ValueError: boom"), ("nan", "nan"), ("text", "not a number")):
        (bad,) = parse_rewards([f"{f}:{name}"])
        with pytest.raises(RewardError, match=needle) as e:
            call_reward(bad, "p", "the completion", row)
        assert "the completion" in str(e.value)


def test_reward_spec_errors(tmp_path):
    with pytest.raises(UserError, match="unknown reward"):
        parse_rewards(["nope"])
    with pytest.raises(UserError, match="not found"):
        parse_rewards([str(tmp_path / "missing.py") + ":fn"])
    with pytest.raises(UserError, match="add --reward math"):
        parse_rewards(["length"])


def test_reverse_kl_distill_is_an_unbiased_policy_gradient_of_the_reverse_kl():
    """On-policy distillation: the per-token loss sg(log π − log π_T)·log π, averaged over y ~ π, has the gradient
    of KL(π‖π_T) itself (checked exactly over a categorical), and its logged value is the k1 estimate."""
    torch.manual_seed(0)
    z = torch.randn(6, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(6, dtype=torch.float64).log_softmax(-1)
    logp = z.log_softmax(-1)
    kl = (logp.exp() * (logp - teacher)).sum()
    want = torch.autograd.grad(kl, z, retain_graph=True)[0]
    loss, k1 = reverse_kl_distill(logp, teacher)
    torch.testing.assert_close(k1, (logp - teacher).detach())
    probs = logp.exp().detach()
    got = sum(probs[y] * torch.autograd.grad(loss[y], z, retain_graph=True)[0] for y in range(6))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close((probs * k1).sum(), kl.detach())  # E_π[k1] = KL(π‖π_T)


def test_reinforce_pp_whitens_over_the_valid_samples_of_the_whole_batch_by_hand():
    """REINFORCE++: A = (r − mean) / (std + eps) over every VALID sample of the batch (unbiased std); a skipped
    sample's placeholder reward (here 100) takes no part in the mean or the std, and its advantage is 0."""
    r = torch.tensor([[1.0, 0.0, 100.0], [0.0, 0.0, 1.0]])
    valid = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # valid rewards 1, 0, 0, 0, 1: mean 0.4; unbiased variance ((0.6² · 2) + (0.4² · 3)) / 4 = (0.72 + 0.48) / 4 = 0.3
    std = math.sqrt(0.3)
    want = torch.tensor([[0.6, -0.4, 0.0], [-0.4, -0.4, 0.6]]) / (std + 1e-4)
    want[0, 2] = 0.0
    got = A.reinforce_pp_advantages(r, valid)
    assert torch.allclose(got, want, atol=1e-6)
    # an all-equal group still carries signal against the batch (no per-prompt baseline)
    assert (got[1, :2] != 0).all()


def test_gspo_sequence_ratio_is_length_normalised_by_hand():
    """GSPO: s_i = exp((1/|y_i|) Σ_t (log π_θ − log π_old)) over the sequence's masked tokens, clipped per sequence;
    the loss −min(s·A, clip(s)·A) sits on every token of the sequence."""
    old = torch.zeros(3, 3)
    logp = torch.tensor([[0.3, 0.1, 9.0], [-0.6, 0.0, 0.0], [0.9, 0.9, 0.9]])  # row 0's third token is masked out
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0, 1.0])
    loss, low, high = P.sequence_clipped_surrogate(logp, old, adv, mask, eps_low=0.3, eps_high=0.3)
    s0 = math.exp((0.3 + 0.1) / 2)  # 1.2214, inside [0.7, 1.3] (unnormalised exp(0.4) = 1.49 would clip)
    s1 = math.exp(-0.6 / 3)  # 0.8187, inside (exp(-0.6) = 0.55 would clip)
    s2 = math.exp(0.9)  # 2.46: clipped at 1.3 (A > 0)
    want = torch.tensor([-s0 * 1.0, -(s1 * -2.0), -min(s2, 1.3) * 1.0])
    assert torch.allclose(loss, want[:, None].expand(3, 3), atol=1e-6)
    assert high.tolist() == [[False] * 3, [False] * 3, [True] * 3] and not low.any()


def test_truncated_is_weights_by_hand():
    """w = min(π_train / π_sampler, C): 0.5 / 0.25 = 2 capped at 1.5; 0.2 / 0.4 = 0.5; equal: 1. No gradient."""
    old = torch.log(torch.tensor([0.5, 0.2, 0.3], requires_grad=True))
    sampler = torch.log(torch.tensor([0.25, 0.4, 0.3]))
    w = truncated_is_weights(old, sampler, cap=1.5)
    assert w.tolist() == pytest.approx([1.5, 0.5, 1.0])
    assert not w.requires_grad
    assert truncated_is_weights(old, sampler, cap=3.0).tolist() == pytest.approx([2.0, 0.5, 1.0])


def test_rollout_mismatch_by_hand():
    """|Δ log p| and k3 = exp(r) − r − 1 (r = log π_trainer − log π_sampler) summed over the masked tokens only."""
    sampler = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    trainer = torch.tensor([[-1.5, -2.0, -9.0, -3.7]])  # Δ = +0.5, 0, (masked), −0.3
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    abs_sum, k3_sum, n = rollout_mismatch(sampler, trainer, mask)
    assert abs_sum.item() == pytest.approx(0.8) and n.item() == 3  # |+0.5| + |−0.3|, not their sum 0.2
    assert k3_sum.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1 + math.exp(0.3) - 0.3 - 1)
    assert rollout_mismatch(trainer, trainer, mask)[:2] == (0.0, 0.0)
