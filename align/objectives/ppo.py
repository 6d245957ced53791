"""PPO for language models (Schulman et al. 2017; Ziegler et al. 2019, Stiennon et al. 2020, Ouyang et al. 2022
"InstructGPT"), as pure functions: the episode's score, per-token rewards with the KL penalty, GAE, whitening, and
the two losses of an update, the policy's (ppo_policy_loss) and the value network's (ppo_value_loss). The KL
estimators and the adaptive β controller are in align.objectives.kl.

Shapes: N episodes × T response positions; masks are 1 on the response tokens the loss may see and 0 on prompt,
padding and post-EOS positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.objectives.kl import kl_k3
from align.objectives.moments import masked_sums, moments
from align.objectives.offpolicy import truncated_is_weights
from align.objectives.policy import aggregate_loss, clipped_surrogate


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [N, T] mask (0 for an all-zero row)."""
    T = mask.shape[1]
    return (T - 1 - mask.flip(1).to(torch.float32).argmax(dim=1)).clamp(min=0) * (mask.sum(1) > 0)


def leave_one_out_mean(x: torch.Tensor, total: float, n: float) -> torch.Tensor:
    """The leave-one-out baseline (Kool et al. 2019; RLOO, Ahmadian et al. 2024) of each episode of a batch:

        b_i = (Σ_j x_j − x_i) / (n − 1)      the mean of the OTHER n − 1 episodes

    total, n: the sum and size of the whole batch (all processes); x: this process's episodes, [N]. b_i does not
    depend on episode i's own sample, so x_i − b_i keeps the policy gradient unbiased; n = 1 gives 0 (no baseline)."""
    if n <= 1:
        return torch.zeros_like(x)
    return (total - x) / (n - 1)


def episode_score(rm_score: torch.Tensor, gold: torch.Tensor, finished: torch.Tensor, gold_coef: float = 0.0,
                  gold_baseline: torch.Tensor | float = 0.0, missing_eos_penalty: float = 0.0,
                  clip: float = 0.0) -> torch.Tensor:
    """The score a PPO episode is trained on, from the reward model's normalised score and the verifier's:

        s = r_RM(x, y) + c_gold · (gold(x, y) − b) − p_eos · 1[y has no EOS],   clipped to [−clip, clip] if clip > 0

    c_gold = 0 is InstructGPT's PPO (the verifier, when there is one, only logged as the gold reward); c_gold > 0
    adds a verifiable reward to the learned one, as open-instruct's PPO does for Tülu 3's RLVR (Lambert et al.
    2024: the RM's score times a multiplier plus a fixed reward for a verified answer): where the RM scores the
    form of an answer more than its correctness, the verifier keeps PPO from buying RM score with wrong answers.
    b (leave_one_out_mean of the batch's gold) centres the added term: a shift that does not depend on the episode's
    own sample leaves the policy gradient unchanged, and the value network, initialised from the RM, starts on the
    RM's scale instead of c_gold · (mean gold) below every return (its clipped loss moves it ±ε_v per step).
    p_eos: a response cut off at the token limit loses p_eos (TRL's `missing_eos_penalty`). All [N]."""
    s = rm_score + gold_coef * (gold.to(rm_score.dtype) - gold_baseline)
    s = s - missing_eos_penalty * (1 - finished.to(rm_score.dtype))
    return s.clamp(-clip, clip) if clip else s


def token_rewards(score: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token rewards of a response (Ziegler et al. 2019; InstructGPT's R(x, y) spread over tokens):

        r_t = −β · KL_t                 on every response token t (KL_t from kl_k1 or kl_k3)
        r_T = −β · KL_T + score         on the last response token T (the reward model's score)

    score: [N], kl and mask: [N, T]. Prompt, padding and post-EOS positions (mask 0) get 0.
    """
    mask = mask.to(kl.dtype)
    rewards = -beta * kl * mask
    rows = torch.arange(len(score), device=kl.device)
    has_response = (mask.sum(1) > 0).to(kl.dtype)
    return rewards.index_put((rows, last_token_index(mask)), score.to(kl.dtype) * has_response, accumulate=True)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens of each row:

        δ_t = r_t + γ · V_{t'} − V_t                      (t': the next response token; V after the last is 0)
        A_t = m_t · (δ_t + γλ · A_{t'}),   returns R_t = A_t + V_t

    rewards, values, mask: [N, T]. The mask is 1 on the tokens the policy sampled: one span per row, or several
    in a multi-turn episode, where the environment's tokens between two turns (a tool's output) are no time step
    of the policy's: the recursion skips them (no discount across the gap), so the final reward reaches every turn.
    Returns (advantages, returns), both 0 wherever the mask is 0.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    T = rewards.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * last
        out.append(a * m)
        last = torch.where(m > 0, a, last)  # across an environment token: carried to the previous policy token
        next_value = torch.where(m > 0, values[:, t], next_value)
    adv = torch.stack(out[::-1], dim=1)
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce=None, eps: float = 1e-8) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + eps) with μ, σ² over the masked entries (PPO's advantage normalisation);
    `reduce` (e.g. an all-reduce sum) makes them the global batch's. shift_mean=False keeps the mean.
    Masked-out entries come back 0."""
    sums = masked_sums(x, mask)
    mean, var = moments(reduce(sums) if reduce else sums)
    mean, var = mean.to(x.dtype), var.to(x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token (OpenAI baselines; Ziegler et al. 2019):

        V_clip = V_old + clip(V − V_old, −c, c),   L = ½ · max((V − R)², (V_clip − R)²)

    Returns (loss, clipped): `clipped` marks tokens where the clipped term is the larger one (no gradient
    flows through V there once |V − V_old| > c): TRL's val/clipfrac."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), clipped_sq > unclipped_sq


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, reduce=None) -> float:
    """1 − Var[target − pred] / Var[target] over the masked entries (1: perfect value function, 0: no better
    than a constant, < 0: worse). `reduce` sums the statistics over ranks. nan when Var[target] = 0."""
    r = reduce or (lambda s: s)
    var_y = moments(r(masked_sums(target, mask)))[1].item()
    var_res = moments(r(masked_sums(target - pred, mask)))[1].item()
    return 1.0 - var_res / var_y if var_y > 0 else float("nan")


@dataclass
class PPOPolicyBatch:
    """One micro-batch of the policy's update: log π_θ (carries the gradient), log π_old and the whitened
    advantages A of the rollout, the per-token entropy H (with a gradient when --ent-coef > 0), the response mask,
    and the decoder's sampling log-probs (None: sampled by the trainer itself). Each [N, T]."""

    logp_NT: torch.Tensor
    old_logp_NT: torch.Tensor
    adv_NT: torch.Tensor
    entropy_NT: torch.Tensor
    mask_NT: torch.Tensor
    sampler_logp_NT: torch.Tensor | None = None


def ppo_policy_loss(b: PPOPolicyBatch, *, cliprange: float, ent_coef: float, tis_cap: float,
                    n_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy's PPO loss on one micro-batch, a token mean over the `n_tokens` response tokens of the whole
    minibatch (every rank, every micro-batch):

        ρ_t = exp(log π_θ − log π_old),   pg_t = −min(ρ_t·A_t, clip(ρ_t, 1 − ε, 1 + ε)·A_t) · w_t
        L = (1/n_tokens) Σ_t m_t · (pg_t − c_H · H_t)

    with w_t the truncated IS weight min(π_old / π_sampler, C) where a decoder sampled (--tis-cap C; else 1) and
    c_H = --ent-coef (an entropy bonus: subtracting H makes higher entropy lower the loss). Returns (L, per-token
    metrics [N, T], detached: loss and loss/policy (pg), clip_ratio(/low, /high), policy/approxkl k3(π_old‖π_θ),
    entropy)."""
    pg, low, high = clipped_surrogate(b.logp_NT, b.old_logp_NT, b.adv_NT, b.mask_NT, cliprange)
    if tis_cap and b.sampler_logp_NT is not None:
        pg = pg * truncated_is_weights(b.old_logp_NT, b.sampler_logp_NT, tis_cap)
    per_tok = pg - ent_coef * b.entropy_NT if ent_coef else pg
    loss = aggregate_loss(per_tok, b.mask_NT, "token-mean", n_tokens=n_tokens, n_seqs=0, max_len=0)
    approx_kl = kl_k3(b.old_logp_NT, b.logp_NT.detach())  # approx-KL(π_old‖π_θ)
    pg = pg.detach()
    return loss, {"loss": pg, "loss/policy": pg, "clip_ratio": low | high, "clip_ratio/low": low,
                  "clip_ratio/high": high, "policy/approxkl": approx_kl, "entropy": b.entropy_NT.detach()}


def ppo_value_loss(values_NT: torch.Tensor, old_values_NT: torch.Tensor, returns_NT: torch.Tensor,
                   mask_NT: torch.Tensor, *, cliprange_value: float, vf_coef: float,
                   n_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The value network's loss on one micro-batch: c_V · (1/n_tokens) Σ_t m_t · ½·max((V − R)², (V_clip − R)²),
    clipped_value_loss with ε_V = --cliprange-value, c_V = --vf-coef, R the GAE returns. Returns (loss, per-token
    metrics [N, T]: loss/value, val/clipfrac)."""
    vf, vclip = clipped_value_loss(values_NT, old_values_NT, returns_NT, cliprange_value)
    loss = vf_coef * aggregate_loss(vf, mask_NT, "token-mean", n_tokens=n_tokens, n_seqs=0, max_len=0)
    return loss, {"loss/value": vf.detach(), "val/clipfrac": vclip}
