"""Each algorithm's whole loss (align.objectives: grpo_loss, ppo_policy_loss, ppo_value_loss, dpo_loss, rm_loss)
against the formula written out by hand with math on scalars, its metrics' values and masks, and its gradient
(gradcheck in float64). The stages call these once per micro-batch; their wiring is pinned in the *_wiring tests."""

import math

import pytest
import torch

from align.objectives.grpo import GRPOBatch, GRPOCoefs, grpo_loss
from align.objectives.ppo import PPOPolicyBatch, ppo_policy_loss, ppo_value_loss
from align.objectives.preference import Pairs, dpo_loss
from align.objectives.reward import rm_loss

D = torch.float64


def t(*rows):
    return torch.tensor(rows, dtype=D)


def k3(lp, ref):
    r = ref - lp
    return math.exp(r) - r - 1


def clip_term(lp, old, a, lo, hi):
    rho = math.exp(lp - old)
    return -min(rho * a, min(max(rho, 1 - lo), 1 + hi) * a)


# two completions × three positions; the second's last position is padding
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -9.0]]
OLD = [[-1.2, -0.5, -1.0], [-0.3, -0.2, -9.0]]
REF = [[-0.8, -0.9, -2.5], [-0.6, -1.0, -9.0]]
ADV = [1.5, -0.5]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def coefs(**kw):
    c = dict(policy_loss="clip", eps_low=0.2, eps_high=0.28, beta=0.3, tis_cap=0.0, distill_coef=1.0,
             loss_agg="token-mean", max_len=3)
    return GRPOCoefs(**{**c, **kw})


def test_grpo_loss_is_the_clipped_surrogate_plus_beta_k3_over_the_global_token_count():
    b = GRPOBatch(t(*LOGP), t(*OLD), t(*ADV), t(*MASK), ref_logp_NT=t(*REF))
    loss, m = grpo_loss(b, coefs(), n_tokens=10.0, n_seqs=4.0)  # the global batch holds more tokens than this share
    want = sum(clip_term(LOGP[i][j], OLD[i][j], ADV[i], 0.2, 0.28) + 0.3 * k3(LOGP[i][j], REF[i][j])
               for i in range(2) for j in range(3) if MASK[i][j]) / 10.0
    assert loss.item() == pytest.approx(want, rel=1e-12)
    # ratios: e^0.2 = 1.22 (A > 0: within 1 + 0.28), e^-1 = 0.37 (A > 0: not clipped below), e^-1 = 0.37 (A < 0:
    # clipped below)
    low, kept = m["clip_ratio/low"]
    assert low.tolist() == [[False, False, False], [False, True, False]] and torch.equal(kept, t(*MASK))
    assert not m["clip_ratio/high"][0].any() and torch.equal(m["clip_ratio"][0], low)
    kl, kl_mask = m["kl"]
    assert kl[0, 0].item() == pytest.approx(k3(-1.0, -0.8)) and torch.equal(kl_mask, t(*MASK))
    assert "distill/reverse_kl" not in m


def test_grpo_loss_seq_mean_and_seq_sum_normalisers():
    b = GRPOBatch(t(*LOGP), t(*OLD), t(*ADV), t(*MASK))
    per = [[clip_term(LOGP[i][j], OLD[i][j], ADV[i], 0.2, 0.28) * MASK[i][j] for j in range(3)] for i in range(2)]
    seq_mean, _ = grpo_loss(b, coefs(loss_agg="seq-mean-token-mean"), n_tokens=5.0, n_seqs=4.0)
    assert seq_mean.item() == pytest.approx((sum(per[0]) / 3 + sum(per[1]) / 2) / 4.0)
    seq_sum, _ = grpo_loss(b, coefs(loss_agg="seq-sum", max_len=8), n_tokens=5.0, n_seqs=4.0)
    assert seq_sum.item() == pytest.approx((sum(per[0]) + sum(per[1])) / (4.0 * 8))


def test_grpo_loss_tis_weights_the_policy_term_only_and_distillation_covers_the_counted_tokens():
    sampler = [[-1.0, -1.5, -1.0], [-0.3, -0.2, -9.0]]
    teacher = [[-0.5, -0.5, -3.0], [-1.3, -0.2, -9.0]]
    kept = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # the second group was dropped (no signal) ...
    counted = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # ... but still counts, and still distils
    b = GRPOBatch(t(*LOGP), t(*OLD), t(*ADV), t(*kept), ref_logp_NT=t(*REF), sampler_logp_NT=t(*sampler),
                  teacher_logp_NT=t(*teacher), counted_mask_NT=t(*counted))
    loss, m = grpo_loss(b, coefs(tis_cap=2.0, distill_coef=0.7), n_tokens=5.0, n_seqs=2.0)
    want = 0.0
    for i in range(2):
        for j in range(3):
            w = min(math.exp(OLD[i][j] - sampler[i][j]), 2.0)
            rl = clip_term(LOGP[i][j], OLD[i][j], ADV[i], 0.2, 0.28) * w + 0.3 * k3(LOGP[i][j], REF[i][j])
            want += rl * kept[i][j] + 0.7 * (LOGP[i][j] - teacher[i][j]) * LOGP[i][j] * counted[i][j]
    assert loss.item() == pytest.approx(want / 5.0, rel=1e-12)
    d, d_mask = m["distill/reverse_kl"]
    assert torch.equal(d_mask, t(*counted)) and d[1, 0].item() == pytest.approx(-0.3 + 1.3)
    assert torch.equal(m["clip_ratio"][1], t(*kept))  # clip fractions over the kept tokens


def test_grpo_loss_gradient_matches_its_finite_differences_and_distillation_is_a_policy_gradient():
    ref, old, adv, mask = t(*REF), t(*OLD), t(*ADV), t(*MASK)

    def f(logp):
        return grpo_loss(GRPOBatch(logp, old, adv, mask, ref_logp_NT=ref), coefs(), n_tokens=5.0, n_seqs=2.0)[0]

    # off the clip boundaries: the surrogate is piecewise smooth
    assert torch.autograd.gradcheck(f, (t(*LOGP).requires_grad_(),))
    # the distillation term's gradient is sg(log π_θ − log π_T) · ∇log π_θ (no credit through its own log-ratio):
    # with A = 0 and β = 0 it is all that is left, c_d · (log π_θ − log π_T) / n_tokens on the counted tokens
    logp, teacher = t(*LOGP).requires_grad_(), t(*REF) - 0.1
    b = GRPOBatch(logp, old, torch.zeros(2, dtype=D), mask, teacher_logp_NT=teacher, counted_mask_NT=mask)
    grpo_loss(b, coefs(beta=0.0, distill_coef=0.7), n_tokens=5.0, n_seqs=2.0)[0].backward()
    torch.testing.assert_close(logp.grad, 0.7 * (t(*LOGP) - teacher) * mask / 5.0)


def test_ppo_policy_loss_with_entropy_bonus_and_tis():
    ent = t([0.9, 1.1, 0.4], [2.0, 0.5, 0.0])
    adv = t([1.0, -2.0, 0.5], [0.3, -0.1, 0.0])
    sampler = t([-1.0, -0.4, -1.0], [-0.3, -0.2, -9.0])
    b = PPOPolicyBatch(t(*LOGP), t(*OLD), adv, ent, t(*MASK), sampler_logp_NT=sampler)
    loss, m = ppo_policy_loss(b, cliprange=0.2, ent_coef=0.05, tis_cap=1.5, n_tokens=8.0)
    want, pg00 = 0.0, None
    for i in range(2):
        for j in range(3):
            w = min(math.exp(OLD[i][j] - sampler[i][j].item()), 1.5)
            pg = clip_term(LOGP[i][j], OLD[i][j], adv[i, j].item(), 0.2, 0.2) * w
            pg00 = pg if (i, j) == (0, 0) else pg00
            want += (pg - 0.05 * ent[i, j].item()) * MASK[i][j]
    assert loss.item() == pytest.approx(want / 8.0, rel=1e-12)
    assert m["loss"][0, 0].item() == pytest.approx(pg00) and torch.equal(m["loss"], m["loss/policy"])
    assert m["policy/approxkl"][0, 0].item() == pytest.approx(k3(-1.2, -1.0))  # k3(π_old‖π_θ): r = log π_θ − log π_old
    assert torch.equal(m["entropy"], ent)
    # the entropy bonus's sign: more entropy, lower loss; off at ent_coef 0
    more = PPOPolicyBatch(t(*LOGP), t(*OLD), adv, ent + 1.0, t(*MASK), sampler_logp_NT=sampler)
    assert ppo_policy_loss(more, cliprange=0.2, ent_coef=0.05, tis_cap=1.5, n_tokens=8.0)[0] < loss
    assert ppo_policy_loss(more, cliprange=0.2, ent_coef=0.0, tis_cap=1.5, n_tokens=8.0)[0] == \
        ppo_policy_loss(b, cliprange=0.2, ent_coef=0.0, tis_cap=1.5, n_tokens=8.0)[0]


def test_ppo_value_loss_is_the_clipped_squared_error_times_vf_coef():
    v, v_old, ret = t([0.5, 1.0], [2.0, 0.0]), t([0.0, 0.9], [1.0, 5.0]), t([1.0, 1.2], [3.0, 9.0])
    mask = t([1.0, 1.0], [1.0, 0.0])
    loss, m = ppo_value_loss(v, v_old, ret, mask, cliprange_value=0.2, vf_coef=0.5, n_tokens=4.0)
    # token 0: V_clip = 0.2, max((0.5−1)², (0.2−1)²) = 0.64 (clipped); token 1: V_clip = 1.0: 0.04, 0.04;
    # token 2: V_clip = 1.2: max(1, 3.24) = 3.24 (clipped)
    assert loss.item() == pytest.approx(0.5 * 0.5 * (0.64 + 0.04 + 3.24) / 4.0)
    assert m["val/clipfrac"].tolist()[0] == [True, False] and m["val/clipfrac"][1, 0]
    assert m["loss/value"][0, 0].item() == pytest.approx(0.32)

    def f(values):
        return ppo_value_loss(values, v_old, ret, mask, cliprange_value=0.2, vf_coef=0.5, n_tokens=4.0)[0]

    assert torch.autograd.gradcheck(f, (v.clone().requires_grad_(),))


def test_rm_loss_bradley_terry_with_margin_and_centring():
    rc, rr, margin = t(1.0, -0.5), t(0.2, 0.5), t(0.3, 0.0)
    loss, m = rm_loss(rc, rr, margin, center_coef=0.1)
    sp = lambda x: math.log1p(math.exp(-x))  # −log σ(x)  # noqa: E731
    assert loss.tolist() == pytest.approx([sp(1.0 - 0.2 - 0.3) + 0.1 * 1.2 ** 2, sp(-1.0) + 0.0])
    assert m["accuracy"].tolist() == [1.0, 0.0] and m["margin"].tolist() == pytest.approx([0.8, -1.0])
    assert torch.equal(m["loss"], loss) and rm_loss(rc, rr, margin)[0].tolist() == pytest.approx([sp(0.5), sp(-1.0)])
    x = torch.stack([rc, rr]).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: rm_loss(z[0], z[1], margin, center_coef=0.1)[0], (x,))


def test_dpo_loss_is_the_registered_loss_plus_rpo_nll_and_its_rewards_are_the_losss():
    pairs = Pairs(t(-3.0, -6.0), t(-5.0, -4.0), t(-3.5, -5.0), t(-4.5, -4.5), t(3.0, 4.0), t(2.0, 5.0))
    loss, m = dpo_loss(pairs, "sigmoid", 0.5, nll_coef=0.2)
    d = [0.5 * ((-3.0 + 3.5) - (-5.0 + 4.5)), 0.5 * ((-6.0 + 5.0) - (-4.0 + 4.5))]
    nll = [0.2 * 3.0 / 3.0, 0.2 * 6.0 / 4.0]
    assert loss.tolist() == pytest.approx([math.log1p(math.exp(-x)) + n for x, n in zip(d, nll)])
    assert m["loss/nll"].tolist() == pytest.approx(nll) and torch.equal(m["loss"], loss)
    assert m["rewards/chosen"].tolist() == pytest.approx([0.25, -0.5])
    assert m["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert m["rewards/margins"].tolist() == pytest.approx(d)
    assert m["logps/chosen"].tolist() == [-3.0, -6.0] and m["logps/rejected"].tolist() == [-5.0, -4.0]
    off, m0 = dpo_loss(pairs, "sigmoid", 0.5)
    assert "loss/nll" not in m0 and off.tolist() == pytest.approx([math.log1p(math.exp(-x)) for x in d])
    # ipo-mean's rewards are per-token means: what the held-out accuracy reads too
    _, mi = dpo_loss(pairs, "ipo-mean", 0.5)
    assert mi["rewards/chosen"].tolist() == pytest.approx([0.5 * 0.5 / 3.0, 0.5 * -1.0 / 4.0])
    x = torch.stack([pairs.policy_chosen, pairs.policy_rejected]).requires_grad_()

    def f(z):
        return dpo_loss(Pairs(z[0], z[1], pairs.ref_chosen, pairs.ref_rejected, pairs.chosen_len, pairs.rejected_len),
                        "sigmoid", 0.5, nll_coef=0.2)[0]

    assert torch.autograd.gradcheck(f, (x,))
