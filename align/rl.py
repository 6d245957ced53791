"""RL estimators shared by GRPO and PPO: advantages, KL estimators, the clipped surrogate, loss aggregation,
and PPO's per-token rewards, GAE, whitening, clipped value loss and KL controllers.

Every function is pure (tensors in, tensors out). Masks are float/bool tensors with 1 on response tokens the
loss may see and 0 on prompt, padding, post-EOS and dropped tokens.
"""

from __future__ import annotations

import torch

LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-sum")


# ---- group-relative advantages: rewards [P prompts, G samples] -> advantages [P, G]. Each is registered in
# ADVANTAGES under its --advantage name. `valid` [P, G] (default: all) marks the samples whose reward exists (a
# reward function that failed under --on-reward-error skip): the others neither enter their group's statistics
# nor get an advantage. `reduce` (an all-reduce sum) makes a statistic the global batch's.


def zero_spread(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[P] bool: groups whose valid rewards are all equal (no signal; tested exactly, not by a std near 0)."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    hi = rewards.masked_fill(~valid, float("-inf")).max(dim=1).values
    lo = rewards.masked_fill(~valid, float("inf")).min(dim=1).values
    return (hi <= lo) | ~valid.any(dim=1)


def group_moments(rewards: torch.Tensor, valid: torch.Tensor | None = None):
    """(mean, unbiased std, count) of each group's valid rewards, each [P, 1], in float64."""
    r = rewards.double()
    m = torch.ones_like(r) if valid is None else valid.double()
    n = m.sum(dim=1, keepdim=True)
    mean = (r * m).sum(dim=1, keepdim=True) / n.clamp(min=1)
    var = (((r - mean) * m) ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    return mean, var.sqrt(), n


def _centred(rewards: torch.Tensor, valid: torch.Tensor | None):
    """(r − group mean, std, count), float64; exactly 0 for invalid samples and for groups without spread."""
    mean, std, n = group_moments(rewards, valid)
    keep = ~zero_spread(rewards, valid)[:, None] & (True if valid is None else valid.bool())
    return torch.where(keep, rewards.double() - mean, 0.0), std, n


def zscore_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_ij = (r_ij − mean_j r_ij) / (std_j r_ij + eps), std the unbiased
    sample std of the group (as in TRL). A group whose rewards are all equal gets A = 0."""
    centred, std, _ = _centred(rewards, valid)
    return (centred / (std + eps)).to(rewards.dtype)


def mean_advantages(rewards: torch.Tensor, valid=None, reduce=None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025; nanochat): A_ij = r_ij − mean_j r_ij, no division by the group's std."""
    return _centred(rewards, valid)[0].to(rewards.dtype)


def batch_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """The group-centred reward over the std of the WHOLE batch (REINFORCE++-style, Hu 2025):
    A_ij = (r_ij − mean_j r_ij) / (std(r) + eps), std unbiased over every valid sample of every rank."""
    sums = masked_sums(rewards, torch.ones_like(rewards) if valid is None else valid)
    std = moments(reduce(sums) if reduce else sums)[1].sqrt()
    return (_centred(rewards, valid)[0] / (std + eps)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, valid=None, reduce=None) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian
    et al. 2024, RLOO): each sample's baseline is the mean reward of the OTHER G − 1 samples of its group,
    A_ij = r_ij − (1/(G−1)) Σ_{k≠j} r_ik  (= G/(G−1) · (r_ij − mean_j r_ij)): an unbiased baseline."""
    centred, _, n = _centred(rewards, valid)
    return (centred * n / (n - 1).clamp(min=1)).to(rewards.dtype)


def reinforce_pp_advantages(rewards: torch.Tensor, valid=None, reduce=None, eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): no per-prompt baseline; the rewards are whitened over the WHOLE global batch,
    A_ij = (r_ij − mean(r)) / (std(r) + eps), mean and unbiased std over every valid sample of every rank. A group
    whose rewards are all equal still carries signal here (its samples sit above or below the batch)."""
    v = torch.ones_like(rewards) if valid is None else valid
    sums = masked_sums(rewards, v)
    mean, var = moments(reduce(sums) if reduce else sums)
    return torch.where(v.bool(), (rewards.double() - mean) / (var.sqrt() + eps), 0.0).to(rewards.dtype)


ADVANTAGES = {"zscore": zscore_advantages, "mean": mean_advantages, "batch": batch_advantages,
              "rloo": rloo_advantages, "reinforce++": reinforce_pp_advantages}


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log π(a|s) − log π_ref(a|s): unbiased per-token estimate of KL(π‖π_ref), can be negative
    (Schulman 2020, "Approximating KL divergence")."""
    return logp - ref_logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: float = 20.0) -> torch.Tensor:
    """k3 = exp(r) − r − 1 with r = log π_ref − log π: unbiased, always >= 0, low variance (Schulman 2020);
    GRPO's KL term. r is capped at +clamp (e^20 ≈ 5e8 stays finite in fp32 where the reference is far likelier);
    below there is no cap, so however far the policy runs ahead of the reference (r → −∞, k3 ≈ −r − 1) the
    gradient keeps pulling it back."""
    r = (ref_logp - logp).clamp(max=clamp)
    return torch.exp(r) - r - 1


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float = 0.2,
                      eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped objective as a per-token loss (Schulman et al. 2017), with DAPO's clip-higher
    (Yu et al. 2025: eps_high > eps_low lets low-probability tokens grow):

        ρ = exp(log π_θ − log π_old),  L = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A)

    Returns (loss, low_clipped, high_clipped): where the clip is active, i.e. ρ < 1 − ε_low with A < 0,
    and ρ > 1 + ε_high with A > 0 (there the gradient is zero). `adv` broadcasts against `logp`.
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    low = (ratio < 1 - eps_low) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, low, high


def cispo_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float = 0.2,
                    eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): clip the importance-sampling WEIGHT, not the update, and stop its gradient:

        ρ = exp(log π_θ − log π_old),  L = −sg(clip(ρ, 1 − ε_low, 1 + ε_high)) · A · log π_θ

    Every token keeps a gradient (−sg(ρ̂)·A·∇log π): PPO's clip zeroes it for the clipped tokens, often the rare,
    high-ratio "fork" tokens of a reasoning trace. MiniMax-M1 sets no lower bound (ε_low ≥ 1) and tunes ε_high.
    Returns (loss, low, high): where the weight was clipped from below / above."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
    return -weight * adv * logp, ratio < 1 - eps_low, ratio > 1 + eps_high


def sequence_clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                               eps_low: float = 0.2, eps_high: float | None = None):
    """GSPO (Zheng et al. 2025, Group Sequence Policy Optimization): one importance ratio per SEQUENCE, the
    length-normalised likelihood ratio, clipped as a whole:

        s_i = (π_θ(y_i|x) / π_old(y_i|x))^(1/|y_i|) = exp((1/|y_i|) Σ_t (log π_θ − log π_old)),
        ℓ_i = −min(s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i)

    `adv` [N] or [N, 1], `mask` [N, T] the tokens y_i counts. ℓ_i is returned on every token of sequence i, so
    `--loss-agg seq-mean-token-mean` gives GSPO's (1/N) Σ_i ℓ_i (token-mean weights sequences by length). The
    paper's clip ranges are ~1e3 times smaller than PPO's (3e-4 / 4e-4): a sequence ratio is a geometric mean.
    Returns (per-token loss [N, T], low, high [N, T] bool)."""
    eps_high = eps_low if eps_high is None else eps_high
    m = mask.to(logp.dtype)
    s = torch.exp(((logp - old_logp) * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))
    a = adv.reshape(-1)
    loss = -torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
    low, high = (s < 1 - eps_low) & (a < 0), (s > 1 + eps_high) & (a > 0)
    return (loss[:, None].expand_as(logp), low[:, None].expand(mask.shape), high[:, None].expand(mask.shape))


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
    return (diff.abs() * mask).sum(), (kl_k3(sampler_logp.float(), trainer_logp.detach().float()) * mask).sum(), mask.sum()


POLICY_LOSSES = {"clip": clipped_surrogate, "cispo": cispo_surrogate}  # token-level; --ratio sequence: GSPO


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


def overlong_penalty(length: int, max_len: int, cache: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_len − cache, then falls linearly to −1 at max_len."""
    start = max_len - cache
    if length <= start:
        return 0.0
    return max(-1.0, (start - length) / cache)


def length_rewards(lengths: list[int], correct: list[bool]) -> list[float]:
    """Kimi k1.5 length reward within a group: λ = 0.5 − (len − min_len)/(max_len − min_len);
    correct answers get λ, wrong ones min(0, λ). All equal lengths give 0."""
    lo, hi = min(lengths), max(lengths)
    if hi == lo:
        return [0.0] * len(lengths)
    lam = [0.5 - (n - lo) / (hi - lo) for n in lengths]
    return [l if c else min(0.0, l) for l, c in zip(lam, correct)]


# ---- PPO (Schulman et al. 2017) for language models (Ziegler et al. 2019, Stiennon et al. 2020, Ouyang et al. 2022)

KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of a [N, T] mask (0 for an all-zero row)."""
    T = mask.shape[1]
    return (T - 1 - mask.flip(1).to(torch.float32).argmax(dim=1)).clamp(min=0) * (mask.sum(1) > 0)


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


def masked_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[Σ m·x, Σ m·x², Σ m] in float64: the sufficient statistics of a masked mean/variance. Sum them over
    ranks (all-reduce) to get the moments of the global batch."""
    m, x = mask.to(torch.float64), x.to(torch.float64)
    return torch.stack([(m * x).sum(), (m * x * x).sum(), m.sum()])


def moments(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance) from `masked_sums`."""
    s, s2, n = sums[0], sums[1], sums[2].clamp(min=1)
    mean = s / n
    var = ((s2 - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0)
    return mean, var


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
