"""RL helpers shared by GRPO and PPO: loss aggregation, entropy, distinct-n, on-policy distillation, and PPO's
per-token rewards, GAE, whitening, clipped value loss and KL controllers. The selectable objectives (advantage
estimators, policy losses, KL estimators, reward shaping) are registered in align.objectives.

Every function is pure (tensors in, tensors out). Masks are float/bool tensors with 1 on response tokens the
loss may see and 0 on prompt, padding, post-EOS and dropped tokens.
"""

from __future__ import annotations

import torch

from align.objectives.kl import kl_k3
from align.objectives.moments import masked_sums, moments

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-sum")


def reverse_kl_distill(logp: torch.Tensor, teacher_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Agarwal et al. 2024, GKD with λ = 1; Thinking Machines 2025): per-token reverse
    KL(π_θ‖π_T) on the student's OWN samples. With y_t ~ π_θ, k1 = log π_θ(y_t) − log π_T(y_t) estimates it, and
    its policy gradient (each token's own log-ratio as a negative reward, no credit to later tokens) is

        ∇ KL ≈ sg(log π_θ − log π_T) · ∇ log π_θ,   so the per-token loss is sg(k1) · log π_θ.

    Returns (loss per token, k1 per token, detached: the logged `distill/reverse_kl`)."""
    k1 = (logp - teacher_logp).detach()
    return k1 * logp, k1


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights of the rollout's tokens (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"):

        w_t = min(π_train(a_t|s_t) / π_sampler(a_t|s_t), C) = min(exp(log π_old − log π_sampler), C)

    with π_old the trainer's log-probs of the rollout before the update and π_sampler the decoder's (its kernels,
    precision or a stale weight copy make them differ). Multiplying the per-token policy-gradient loss by w_t
    (no gradient through it) corrects the gradient for tokens drawn from π_sampler instead of π_train; the cap C
    bounds the variance. Detached, >= 0, [same shape as the inputs]."""
    return torch.exp(old_logp.detach() - sampler_logp).clamp(max=cap)


def rollout_mismatch(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(Σ|log π_sampler − log π_trainer|, Σ k3, Σ mask) over the masked response tokens: the sums behind
    rollout/logp_abs_diff (mean |Δ log p|) and rollout/kl, KL(π_sampler‖π_trainer) estimated with k3 on tokens drawn
    from the sampler (Schulman 2020: exp(r) − r − 1, r = log π_trainer − log π_sampler). Both are 0 when the
    decoder samples from exactly the trainer's distribution."""
    diff = (sampler_logp - trainer_logp.detach()).float()
    # k3 in float64: e^r − r − 1 of an fp32 r ~ 1e-7 cancels to ±1e-9, a "negative KL" on every healthy step
    k3 = kl_k3(sampler_logp.double(), trainer_logp.detach().double()) * mask
    return (diff.abs() * mask).sum(), k3.sum().float(), mask.sum()


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, *, n_tokens: float, n_seqs: float,
                   max_len: int) -> torch.Tensor:
    """Reduce a [N, T] per-token loss to a scalar. Counts are GLOBAL (all ranks, all micro-batches), so
    micro-batching and data parallelism do not change the objective.

    seq-mean-token-mean (GRPO): (1/N) Σ_i (1/|o_i|) Σ_t ℓ_it      — N = n_seqs
    token-mean (DAPO):          (1/Σ_i |o_i|) Σ_i Σ_t ℓ_it      — Σ|o_i| = n_tokens
    seq-sum (Dr. GRPO):         (1/(N·L_max)) Σ_i Σ_t ℓ_it       — a constant normaliser, no length bias
    """
    mask = mask.to(per_token.dtype)
    summed = per_token * mask
    if mode == "token-mean":
        return summed.sum() / max(n_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=1).clamp(min=1)
        return (summed.sum(dim=1) / lengths).sum() / max(n_seqs, 1.0)
    if mode == "seq-sum":
        return summed.sum() / (max(n_seqs, 1.0) * max_len)
    raise ValueError(f"loss aggregation {mode!r} not in {LOSS_AGGREGATIONS}")


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Per-position entropy H = logsumexp(z) − Σ softmax(z)·z, chunked over positions ([B, T, V] -> [B, T]).
    Differentiable (PPO's entropy bonus); pass detached logits when it is only a metric."""
    flat = logits.reshape(-1, logits.size(-1))
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, flat.shape[0], chunk):
        z = flat[i : i + chunk].float()
        out[i : i + chunk] = z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)
    return out.view(logits.shape[:-1])


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams / total n-grams over a set of generations."""
    unique, total = set(), 0
    for s in sequences:
        grams = list(zip(*(s[i:] for i in range(n))))
        unique.update(grams)
        total += len(grams)
    return len(unique) / total if total else 0.0


# ---- PPO (Schulman et al. 2017) for language models (Ziegler et al. 2019, Stiennon et al. 2020, Ouyang et al. 2022)

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

        δ_t = r_t + γ · m_{t+1} · V_{t+1} − V_t           (V after the last response token is 0: the episode ends)
        A_t = m_t · (δ_t + γλ · A_{t+1}),   returns R_t = A_t + V_t

    rewards, values, mask: [N, T]; the mask is 1 on one contiguous span of response tokens per row. Returns
    (advantages, returns), both 0 wherever the mask is 0.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    T = rewards.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        out.append(last)
        next_value = values[:, t]
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


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences"):

        e = clip(KL / KL_target − 1, −0.2, 0.2),   β ← β · (1 + e · n / horizon)

    KL is the batch's mean per-episode KL, n the episodes in the batch. β rises while KL > target and
    falls while KL < target, by at most 20% · n / horizon per update."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, kl: float, n_episodes: int) -> float:
        e = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + e * n_episodes / self.horizon
        return self.value


class FixedKLController:
    """A constant β (--fixed-kl)."""

    def __init__(self, init_kl_coef: float):
        self.value = init_kl_coef

    def update(self, kl: float, n_episodes: int) -> float:
        return self.value
