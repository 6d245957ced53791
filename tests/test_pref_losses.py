"""Preference losses: hand-computed values and numerical gradients (gradcheck, float64)."""

from __future__ import annotations

import math

import pytest
import torch

from align import objectives
from align.errors import UserError
from align.objectives.preference import Pairs, kto_loss, log_odds, rpo_nll
from align.objectives.reward import bradley_terry_loss, centering_penalty, likelihood_reward
from align.objectives.tokens import sequence_logps

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def pref(name, pc, pr, rc=None, rr=None, *, beta, lengths=None, **options):
    """The preference loss registered as `align dpo --loss name` on pairs of summed log-probs (lengths: 1)."""
    cl, rl = lengths or (torch.ones_like(pc), torch.ones_like(pr))
    return objectives.get("preference", name).fn(Pairs(pc, pr, rc, rr, cl, rl), beta, **options)


def dpo_loss(pc, pr, rc, rr, beta, loss_type="sigmoid", label_smoothing=0.0, lengths=None):
    return pref(loss_type, pc, pr, rc, rr, beta=beta, lengths=lengths, label_smoothing=label_smoothing)


def test_bradley_terry_hand_values():
    # r_w − r_l = 0  -> −log σ(0) = log 2 = 0.693147
    # r_w − r_l = 2  -> −log σ(2) = log(1 + e^−2) = log(1.135335) = 0.126928
    # r_w − r_l = −1 -> log(1 + e^1) = log(3.718282) = 1.313262
    loss = bradley_terry_loss(t(1.0, 3.0, 0.0), t(1.0, 1.0, 1.0))
    assert torch.allclose(loss, t(math.log(2), 0.126928, 1.313262), atol=1e-6)
    # margin m = 2 on a gap of 2: −log σ(2 − 2) = log 2
    assert torch.allclose(bradley_terry_loss(t(3.0), t(1.0), t(2.0)), t(math.log(2)))
    # huge gaps stay finite (logsigmoid): gap −1000 -> 1000, gap +1000 -> 0
    assert torch.allclose(bradley_terry_loss(t(0.0, 1000.0), t(1000.0, 0.0)), t(1000.0, 0.0))


def test_centering_penalty_hand_values():
    # coef 0.01: (1 + 2)² = 9 -> 0.09; (−1 + 1)² = 0 -> 0; mean over pairs = 0.045
    p = centering_penalty(t(1.0, -1.0), t(2.0, 1.0), 0.01)
    assert torch.allclose(p, t(0.09, 0.0)) and abs(p.mean().item() - 0.045) < 1e-12


def test_sequence_logps_sums_response_tokens_only():
    # vocab 2, uniform logits -> every token has log π = log 0.5; 2 response tokens -> 2·log 0.5 = −1.386294
    logits = torch.zeros(1, 4, 2, dtype=D)
    labels = torch.tensor([[-100, -100, 1, 0]])
    assert torch.allclose(sequence_logps(logits, labels), t(2 * math.log(0.5)))
    # logits [0, ln 3] at the position predicting token 1: p = 3/4 -> log 0.75 = −0.287682; the other token
    # stays uniform (log 0.5 = −0.693147): sum = −0.980829 (summed, NOT averaged)
    logits[0, 1, 1] = math.log(3)
    assert torch.allclose(sequence_logps(logits, labels), t(math.log(0.75) + math.log(0.5)))
    # padding (−100 after the response) changes nothing
    padded = torch.cat([logits, torch.randn(1, 2, 2, dtype=D)], 1)
    assert torch.allclose(sequence_logps(padded, torch.tensor([[-100, -100, 1, 0, -100, -100]])),
                          sequence_logps(logits, labels))


def test_likelihood_reward_is_beta_times_the_mean_response_log_prob():
    # the same logits as above: response tokens log 0.75 and log 0.5 -> mean (−0.287682 − 0.693147)/2 = −0.490415;
    # β = 5 -> −2.452073
    logits = torch.zeros(2, 6, 2, dtype=D)
    logits[:, 1, 1] = math.log(3)
    labels = torch.tensor([[-100, -100, 1, 0, -100, -100],  # prompt, 2 response tokens, padding
                           [-100, -100, 1, 0, 1, 1]])       # the same prompt, 4 response tokens (2 more at log 0.5)
    r = likelihood_reward(logits, labels, beta=5.0)
    assert torch.allclose(r[0], t(5 * (math.log(0.75) + math.log(0.5)) / 2))
    # a mean, not a sum: 4 tokens -> (log 0.75 + 3 log 0.5) / 4, the longer answer is not penalised per token
    assert torch.allclose(r[1], t(5 * (math.log(0.75) + 3 * math.log(0.5)) / 4))
    # prompt and padding logits do not matter (masks): change them, the reward stays
    noisy = logits.clone()
    noisy[0, 0] += torch.randn(2, dtype=D)  # predicts the prompt token at position 1
    noisy[0, 3:] += torch.randn(3, 2, dtype=D)  # predicts padding
    assert torch.allclose(likelihood_reward(noisy, labels, 5.0)[0], r[0])
    x = torch.randn(1, 5, 3, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: likelihood_reward(z, torch.tensor([[-100, 2, 0, 1, -100]]), 2.0), (x,))


def test_rpo_nll_hand_values_and_gradient():
    # log π(y_w) = −6 over 3 tokens -> per-token NLL 2; α = 0.5 -> 1.0. log π = −1 over 4 tokens, α 0.5 -> 0.125
    assert torch.allclose(rpo_nll(t(-6.0, -1.0), t(3.0, 4.0), 0.5), t(1.0, 0.125))
    # d/d logπ = −α/|y_w|: raising the chosen answer's log-prob lowers the loss
    x = t(-6.0, -1.0).requires_grad_()
    rpo_nll(x, t(3.0, 4.0), 0.5).sum().backward()
    assert torch.allclose(x.grad, t(-0.5 / 3, -0.5 / 4))


def test_dpo_hand_values():
    # pc=−1, pr=−3, rc=−2, rr=−2: Δ = (−1+2) − (−3+2) = 1 − (−1) = 2; β = 0.5 -> βΔ = 1
    args = (t(-1.0), t(-3.0), t(-2.0), t(-2.0))
    loss, rc, rr = dpo_loss(*args, beta=0.5)
    assert torch.allclose(loss, t(math.log(1 + math.exp(-1))))  # −log σ(1) = 0.313262
    assert torch.allclose(rc, t(0.5)) and torch.allclose(rr, t(-0.5))  # β·1, β·(−1)
    # cDPO ε = 0.1: 0.9·0.313262 + 0.1·(−log σ(−1) = 1.313262) = 0.281936 + 0.131326 = 0.413262
    loss, _, _ = dpo_loss(*args, beta=0.5, label_smoothing=0.1)
    assert torch.allclose(loss, t(0.413262), atol=1e-6)
    # IPO: (Δ − 1/(2β))² = (2 − 1)² = 1
    assert torch.allclose(dpo_loss(*args, beta=0.5, loss_type="ipo")[0], t(1.0))
    # hinge: max(0, 1 − βΔ) = max(0, 1 − 1) = 0; with β = 0.25: 1 − 0.5 = 0.5
    assert torch.allclose(dpo_loss(*args, beta=0.5, loss_type="hinge")[0], t(0.0))
    assert torch.allclose(dpo_loss(*args, beta=0.25, loss_type="hinge")[0], t(0.5))
    # policy == reference: Δ = 0 -> sigmoid loss log 2, implicit rewards 0
    loss, rc, rr = dpo_loss(t(-5.0), t(-7.0), t(-5.0), t(-7.0), beta=0.1)
    assert torch.allclose(loss, t(math.log(2))) and rc.item() == 0 and rr.item() == 0
    with pytest.raises(KeyError, match="registered: sigmoid, ipo"):
        dpo_loss(*args, beta=0.5, loss_type="nope")


def _rand(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dtype=D, generator=g, requires_grad=True) for _ in range(4)]


def test_gradcheck_bradley_terry_and_centering():
    a, b, m, _ = _rand()
    assert torch.autograd.gradcheck(lambda x, y, z: bradley_terry_loss(x, y, z), (a, b, m))
    assert torch.autograd.gradcheck(lambda x, y: bradley_terry_loss(x, y), (a, b))
    assert torch.autograd.gradcheck(lambda x, y: centering_penalty(x, y, 0.3), (a, b))


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0), ("hinge", 0.0)])
def test_gradcheck_dpo(loss_type, eps):
    ins = _rand(seed=1)
    if loss_type == "hinge":  # stay away from the kink at βΔ = 1
        ins = [x.detach().mul(0.1).requires_grad_() for x in ins]
    assert torch.autograd.gradcheck(lambda *x: dpo_loss(*x, beta=0.7, loss_type=loss_type, label_smoothing=eps)[0],
                                    tuple(ins))


def test_gradcheck_sequence_logps():
    logits = torch.randn(2, 5, 4, dtype=D, requires_grad=True)
    labels = torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 0, 1, 2]])
    assert torch.autograd.gradcheck(lambda lg: sequence_logps(lg, labels), (logits,))


def test_ipo_on_summed_and_on_mean_log_probs():
    """--loss ipo: (Δ − 1/(2β))² on summed log-probs (the DPO authors' IPO); --loss ipo-mean: the same on per-token
    mean log-probs (TRL's IPO). Chosen: 4 tokens, rejected: 2."""
    pc, pr, rc, rr = torch.tensor([-4.0]), torch.tensor([-6.0]), torch.tensor([-6.0]), torch.tensor([-5.0])
    lengths = (torch.tensor([4.0]), torch.tensor([2.0]))
    summed, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")
    assert summed.item() == pytest.approx((3.0 - 1.0) ** 2)  # Δ = (−4 + 6) − (−6 + 5) = 3
    mean, rw_c, rw_r = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo-mean", lengths=lengths)
    assert mean.item() == pytest.approx((1.0 - 1.0) ** 2)  # Δ = (−1 + 1.5) − (−3 + 2.5) = 1
    assert rw_c.item() == pytest.approx(0.25) and rw_r.item() == pytest.approx(-0.25)


def test_simpo_loss_by_hand_and_gradcheck():
    """SimPO: r(y) = (β/|y|)·log π(y|x), loss = −log σ(r_w − r_l − γ); no reference."""
    pc, pr = torch.tensor([-6.0, -2.0], dtype=torch.float64), torch.tensor([-12.0, -1.0], dtype=torch.float64)
    lengths = (torch.tensor([3.0, 2.0], dtype=torch.float64), torch.tensor([4.0, 1.0], dtype=torch.float64))
    loss, r_w, r_l = pref("simpo", pc, pr, beta=2.0, lengths=lengths, gamma=0.5)
    # pair 0: r_w = 2·(−2) = −4, r_l = 2·(−3) = −6, margin 2 − 0.5 = 1.5; pair 1: r_w = −2, r_l = −2, −0.5
    torch.testing.assert_close(r_w, torch.tensor([-4.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(r_l, torch.tensor([-6.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor([math.log1p(math.exp(-1.5)), math.log1p(math.exp(0.5))], dtype=torch.float64))
    x = torch.randn(2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: pref("simpo", a, b, beta=2.0, lengths=lengths, gamma=0.5)[0], (x, y))


def test_orpo_loss_by_hand_and_gradcheck():
    """ORPO: −ℓ_w − λ·log σ(log odds_w − log odds_r), ℓ the per-token mean log-prob, odds = e^ℓ / (1 − e^ℓ)."""
    pc, pr = torch.tensor([-1.2], dtype=torch.float64), torch.tensor([-6.0], dtype=torch.float64)
    lengths = (torch.tensor([2.0], dtype=torch.float64), torch.tensor([3.0], dtype=torch.float64))
    loss, rw, rr = pref("orpo", pc, pr, beta=0.1, lengths=lengths)
    l_w, l_r = -0.6, -2.0
    odds = lambda l: math.log(math.exp(l) / (1 - math.exp(l)))  # noqa: E731
    want = -l_w + 0.1 * math.log1p(math.exp(-(odds(l_w) - odds(l_r))))
    torch.testing.assert_close(loss, torch.tensor([want], dtype=torch.float64))
    torch.testing.assert_close((rw, rr), (torch.tensor([0.1 * l_w], dtype=torch.float64), torch.tensor([0.1 * l_r], dtype=torch.float64)))
    assert torch.isfinite(log_odds(torch.tensor([0.0, -1e-9]))).all()  # P → 1: capped, not inf
    x = -torch.rand(2, dtype=torch.float64).add(0.1).requires_grad_()
    y = -torch.rand(2, dtype=torch.float64).add(0.1).requires_grad_()
    two = (torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda a, b: pref("orpo", a, b, beta=0.1, lengths=two)[0], (x, y))


def test_kto_loss_by_hand_and_gradcheck():
    """KTO: r = log π − log π_ref, z0 = max(0, mean mismatched log-ratio) (no gradient); desirable λ_D(1 − σ(β(r − z0))),
    undesirable λ_U(1 − σ(β(z0 − r)))."""
    pol = torch.tensor([-3.0, -5.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-4.0, -4.0, -2.5], dtype=torch.float64)
    good = torch.tensor([True, False, False])
    kl_sums = torch.tensor([1.2, 4.0], dtype=torch.float64)  # mean 0.3 over 4 mismatched rows (every rank)
    loss, reward, z0 = kto_loss(pol, ref, kl_sums, good, beta=0.5, w_desirable=1.0, w_undesirable=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [1 - sig(0.5 * (1.0 - 0.3)), 2 * (1 - sig(0.5 * (0.3 + 1.0))), 2 * (1 - sig(0.5 * (0.3 - 0.5)))]
    torch.testing.assert_close(loss, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(reward, torch.tensor([0.5, -0.5, 0.25], dtype=torch.float64))
    assert z0.item() == pytest.approx(0.3)
    neg = kto_loss(pol, ref, torch.tensor([-2.0, 4.0], dtype=torch.float64), good, 0.5)[2]
    assert neg.item() == 0.0  # a negative KL estimate is clamped: the reference point never goes below 0
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p: kto_loss(p, ref, kl_sums, good, 0.5, 1.0, 2.0)[0], (x,))


def test_unpaired_rows_and_the_mismatched_kto_batch(shipped_tokenizer):
    from align import data as D

    tok = shipped_tokenizer
    pairs = [{"prompt": "1 + 1?", "chosen": "2", "rejected": "3"}, {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}]
    ex = D.unpaired_examples(tok, pairs, max_length=64)
    assert [e["label"] for e in ex] == [True, False, True, False]  # chosen desirable, rejected not
    rows = [{"prompt": "1 + 1?", "completion": "2", "label": "true"}, {"prompt": "2 + 2?", "completion": "5", "label": 0}]
    ex = D.unpaired_examples(tok, rows, max_length=64)
    assert [e["label"] for e in ex] == [True, False]
    with pytest.raises(UserError, match="not true/false"):
        D.unpaired_examples(tok, [{"prompt": "a", "completion": "b", "label": "maybe"}], max_length=64)
    b = D.collate_kto(ex, pad_id=tok.pad_token_id)
    assert b["input_ids"].shape[0] == 4 and b["desirable"].tolist() == [True, False]
    seq = [x for x in b["input_ids"][2].tolist()]
    want = ex[1]["prompt_ids"] + ex[0]["completion_ids"]  # row 0's completion after row 1's prompt
    assert seq[: len(want)] == want
    labels = b["labels"][2].tolist()
    assert labels[: len(ex[1]["prompt_ids"])] == [-100] * len(ex[1]["prompt_ids"])  # the prompt is never scored
    assert labels[len(ex[1]["prompt_ids"]): len(want)] == ex[0]["completion_ids"]
