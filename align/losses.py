"""Losses and log-probabilities as small pure functions (each with its formula)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def _at_least_fp32(t: torch.Tensor) -> torch.dtype:
    """bf16/fp16 logits are upcast for the softmax; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Token t is predicted from positions < t: logits[:, t-1] scores labels[:, t]."""
    return labels[:, 1:]


def completion_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood over completion tokens and their count.

    NLL = −Σ_t m_t · log p_θ(y_t | y_<t), with m_t = 1 on completion tokens (labels ≠ −100) and 0 on prompt
    and padding. Returning the sum and the count lets the caller normalise by the token count of the whole
    global batch (every rank, every micro-batch), so the gradient does not depend on how the batch is split.
    """
    target = shift_labels(labels)
    logits = logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)).to(_at_least_fp32(logits)), target.reshape(-1),
                          ignore_index=IGNORE, reduction="sum")
    return nll, (target != IGNORE).sum()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log π(ids_t | ·) for every position: log_softmax(logits)[ids], computed `chunk` rows at a time so the
    full B×T×V fp32 log-softmax never exists at once. logits: [B, T, V], ids: [B, T] -> [B, T]."""
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_ids = ids.reshape(-1)
    dtype = _at_least_fp32(logits)
    out = torch.empty(flat_ids.shape, dtype=dtype, device=logits.device)
    for i in range(0, flat_ids.numel(), chunk):
        lg = flat_logits[i : i + chunk].to(dtype)
        out[i : i + chunk] = lg.gather(-1, flat_ids[i : i + chunk, None]).squeeze(-1) - lg.logsumexp(-1)
    return out.view(ids.shape)


# ---- preference losses (reward model, DPO)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair reward-model loss −log σ(r_w − r_l − m) (Bradley–Terry preference model as used for RLHF reward
    models: Stiennon et al. 2020, Ouyang et al. 2022 "InstructGPT"; the optional margin m is Llama 2's).
    Computed with logsigmoid, stable for any reward gap. Returns one value per pair (the caller normalises)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def centering_penalty(r_chosen: torch.Tensor, r_rejected: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-pair reward-centring regulariser coef · (r_w + r_l)² (its mean over pairs is the usual
    coef · mean((r_w + r_l)²), Eisenstein et al. 2023): keeps the rewards near zero, since BT sees only differences."""
    return coef * (r_chosen + r_rejected) ** 2


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed response log-probability log π(y|x) = Σ_t m_t · log π(y_t | x, y_<t) per row (NOT averaged: the DPO
    objective is on sequence likelihoods), m_t = 1 where labels ≠ −100. logits [B, T, V], labels [B, T] -> [B]."""
    target = shift_labels(labels)
    mask = target != IGNORE
    lp = token_logprobs(logits[:, :-1], target.clamp(min=0))
    return (lp * mask).sum(-1)


def likelihood_reward(logits: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """A reward read from the language-model head: r(x, y) = β · (1/|y|) Σ_t log π_φ(y_t | x, y_<t), the mean
    response log-probability (the reference-free implicit reward of SimPO, Meng et al. 2024), used as the
    Bradley–Terry score r of a likelihood reward model. Averaged over the |y| response tokens (labels ≠ −100), so
    it does not favour short answers. logits [B, T, V], labels [B, T] -> [B]."""
    n = (shift_labels(labels) != IGNORE).sum(-1).clamp(min=1)
    return beta * sequence_logps(logits, labels) / n


def rpo_nll(policy_chosen: torch.Tensor, chosen_len: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-pair NLL term of RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization"):
    α · (−log π_θ(y_w|x) / |y_w|), added to the preference loss. DPO only widens the gap between the two
    answers and on near-identical pairs (a right and a wrong digit) it lowers the likelihood of both; the NLL term
    keeps the chosen answer likely. Inputs are per pair: summed log-probs and response lengths."""
    return -alpha * policy_chosen / chosen_len


DPO_LOSSES = ("sigmoid", "ipo", "ipo-mean", "hinge")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # `align dpo --loss` without a reference model
UNPAIRED_LOSSES = ("kto",)  # `align dpo --loss` on {prompt, completion, label} rows


def kto_loss(policy: torch.Tensor, ref: torch.Tensor, kl_sums: torch.Tensor, desirable: torch.Tensor, beta: float,
             w_desirable: float = 1.0, w_undesirable: float = 1.0):
    """KTO (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") on unpaired rows:

        r = log π(y|x) − log π_ref(y|x)   (summed response log-probs),
        z0 = max(0, mean over the batch of log π(y'|x) − log π_ref(y'|x))   (mismatched x, y': the reference
             point, an estimate of KL(π‖π_ref); no gradient),
        desirable y:   λ_D · (1 − σ(β(r − z0))),   undesirable y:   λ_U · (1 − σ(β(z0 − r))).

    `kl_sums` = [Σ (log π − log π_ref) over the mismatched rows, their count], already summed over every rank
    (the reference point is the global batch's). Returns (loss per row, β·r detached, z0)."""
    z0 = (kl_sums[0] / kl_sums[1].clamp(min=1)).clamp(min=0).detach()
    r = policy - ref
    loss = torch.where(desirable, w_desirable * (1 - torch.sigmoid(beta * (r - z0))),
                       w_undesirable * (1 - torch.sigmoid(beta * (z0 - r))))
    return loss, (beta * r).detach(), z0


def simpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, lengths: tuple[torch.Tensor, torch.Tensor],
               beta: float, gamma: float):
    """SimPO (Meng et al. 2024, "Simple Preference Optimization with a Reference-Free Reward"): the reward is the
    length-normalised log-likelihood, no reference model,

        r(y) = (β/|y|)·log π(y|x),   loss = −log σ(r(y_w) − r(y_l) − γ)   (γ: a target reward margin).

    Inputs per pair: summed log-probs and response lengths (|y_w|, |y_l|). Returns (loss per pair, r(y_w), r(y_l));
    the rewards are detached. The paper's β is ~2-2.5 with γ/β ~0.5: much larger than DPO's."""
    chosen_len, rejected_len = lengths
    r_w, r_l = beta * policy_chosen / chosen_len, beta * policy_rejected / rejected_len
    return -F.logsigmoid(r_w - r_l - gamma), r_w.detach(), r_l.detach()


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(P / (1 − P)) for P = exp(mean_logp) < 1, as log P − log(1 − P) = ℓ − log(−expm1(ℓ)) (exact near P → 1;
    ℓ is capped just below 0, where the odds are infinite)."""
    ell = mean_logp.clamp(max=-1e-6)
    return ell - torch.log(-torch.expm1(ell))


def orpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, lengths: tuple[torch.Tensor, torch.Tensor],
              lam: float):
    """ORPO (Hong et al. 2024, "Monolithic Preference Optimization without Reference Model"): SFT on the chosen
    answer plus an odds-ratio term, no reference model,

        ℓ(y) = log π(y|x) / |y|  (per-token mean; P(y|x) = e^ℓ as in the paper's code),  odds(y) = P / (1 − P)
        loss = −ℓ(y_w) + λ·(−log σ(log odds(y_w) − log odds(y_l)))

    Inputs per pair: summed log-probs and response lengths. Returns (loss per pair, λ·ℓ(y_w), λ·ℓ(y_l)) with the
    rewards detached (TRL's logged rewards)."""
    chosen_len, rejected_len = lengths
    l_w, l_r = policy_chosen / chosen_len, policy_rejected / rejected_len
    loss = -l_w - lam * F.logsigmoid(log_odds(l_w) - log_odds(l_r))
    return loss, (lam * l_w).detach(), (lam * l_r).detach()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             lengths: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Per-pair DPO loss and implicit rewards from summed sequence log-probs.

    Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))
      sigmoid   −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)   (Rafailov et al. 2023, DPO; ε > 0 is conservative DPO, cDPO)
      ipo       (Δ − 1/(2β))²                      (Azar et al. 2023, IPO, on summed log-probs as in the DPO
                                                     authors' implementation)
      ipo-mean  the same on per-token MEAN log-probs, log π(y)/|y| (TRL's IPO): `lengths` = (|y_w|, |y_l|);
                the same β means a much stronger pull to the reference than with `ipo`
      hinge     max(0, 1 − βΔ)                      (Zhao et al. 2023, SLiC-HF)
    Returns (loss per pair, implicit reward of chosen β(log π − log π_ref)(y_w), of rejected β(...)(y_l)); the
    rewards are detached (per token for ipo-mean).
    """
    if loss_type == "ipo-mean":
        chosen_len, rejected_len = lengths
        policy_chosen, ref_chosen = policy_chosen / chosen_len, ref_chosen / chosen_len
        policy_rejected, ref_rejected = policy_rejected / rejected_len, ref_rejected / rejected_len
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif loss_type in ("ipo", "ipo-mean"):
        loss = (delta - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of {', '.join(DPO_LOSSES)}")
    return loss, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()
