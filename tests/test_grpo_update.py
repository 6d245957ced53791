"""GRPO's update against a loss written out by hand: log-probs at the sampling temperature (the policy gradient
of samples drawn at T is that of log softmax(z / T)), token-mean REINFORCE over the kept tokens only."""

import math

import pytest
import torch

from align.data import pad
from align.engine.run import StageRun
from align.engine.stats import Stats
from align.rollout.batch import Rollout
from align.rollout.generation import Completion
from stages.grpo import GRPO, GRPOConfig


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_update_loss_is_reinforce_on_temperature_scaled_log_probs(tiny_model_dir, tmp_path, temperature):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "g"), eval_data="", temperature=temperature,
                     reinforce=True, prompts_per_step=1, num_generations=2, micro_batch_size=2, max_new_tokens=4)
    cfg.validate()
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        prompt, eos = algo.prompt_ids[0], algo.tok.eos_token_id
        r = Rollout(algo.rows[:1], [Completion(prompt, [40, 41, eos], "", True), Completion(prompt, [42, eos], "", True)], 2)
        batch = r.batch(algo.tok.pad_token_id, "cpu")
        batch["loss_mask"] = batch["response_mask"] * torch.tensor([[1.0], [0.0]])  # the second sample is dropped
        adv = torch.tensor([1.5, -1.0])
        with torch.no_grad():
            # the masked forward: the update's mask-free one must give the same log-probs on response tokens
            attn = torch.tensor(pad([[1] * (len(c.prompt_ids) + len(c.ids)) for c in r.completions], 0))
            logits = algo.policy(input_ids=batch["input_ids"], attention_mask=attn).logits[:, :-1]
        lp = (logits / temperature).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        mask = batch["loss_mask"]
        want = -(adv[:, None] * lp * mask).sum() / mask.sum()  # token-mean over the kept tokens of the batch
        stats = Stats()
        algo.update(batch, adv, None, None, mask.sum().item(), 1.0, stats)
        got = stats.reduce("cpu")
    unset_hf_deepspeed_config()
    assert got["loss"] == pytest.approx(want.item(), rel=1e-5)
    want_entropy = -((logits / temperature).softmax(-1) * (logits / temperature).log_softmax(-1)).sum(-1)
    resp = batch["response_mask"]
    assert got["entropy"] == pytest.approx(((want_entropy * resp).sum() / resp.sum()).item(), rel=1e-5)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_dropping_groups_without_signal_does_not_rescale_the_step(tiny_model_dir, tmp_path, mask_truncated):
    """Group 0 has no reward spread (A = 0), group 1 has. --drop-zero-std-groups takes group 0's terms out of
    the loss but keeps its tokens in token-mean's normaliser, so with β = 0 the loss (and its gradient) is the
    same with and without dropping; --mask-truncated takes a truncated sample out of both."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    losses = {}
    for drop in (True, False):
        cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / f"g{drop}"), eval_data="", reinforce=True,
                         prompts_per_step=2, num_generations=2, micro_batch_size=4, max_new_tokens=4,
                         drop_zero_std_groups=drop, mask_truncated=mask_truncated, loss_agg="token-mean")
        cfg.validate()
        with StageRun(cfg, "grpo") as run:
            algo = GRPO(cfg, run)
            p0, p1, eos = algo.prompt_ids[0], algo.prompt_ids[1], algo.tok.eos_token_id
            r = Rollout(algo.rows[:2], [Completion(p0, [40, 41, eos], "", True), Completion(p0, [42, eos], "", True),
                                        Completion(p1, [43, eos], "", True), Completion(p1, [44, 45, 46], "", False)], 2)
            r.rewards, r.valid = torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.ones(2, 2)
            adv, keep, counted, zero_std = algo.advantages(r)
            assert zero_std.tolist() == [1.0, 0.0] and (adv[0] == 0).all()
            want_counted = [[1.0, 1.0], [1.0, 0.0 if mask_truncated else 1.0]]
            assert counted.tolist() == want_counted
            assert keep.tolist() == ([[0.0, 0.0], want_counted[1]] if drop else want_counted)
            batch = r.batch(algo.tok.pad_token_id, "cpu")
            batch["loss_mask"] = batch["response_mask"] * keep.flatten()[:, None]
            n_tokens = (batch["response_mask"] * counted.flatten()[:, None]).sum().item()
            assert n_tokens == 3 + 2 + 2 + (0 if mask_truncated else 3)  # every counted sample's tokens, EOS included
            stats = Stats()
            algo.update(batch, adv.flatten(), None, None, n_tokens, counted.sum().item(), stats)
            losses[drop] = stats.reduce("cpu")["loss"]
        unset_hf_deepspeed_config()
    assert losses[True] == pytest.approx(losses[False], rel=1e-6) and losses[True] != 0


def one_group(algo, rewards: list[float]):
    """A rollout of one prompt with two fixed completions and these rewards, as the step batches it:
    (advantages [1, 2], keep [1, 2], the batch with its loss and counted masks, counted tokens)."""
    prompt, eos = algo.prompt_ids[0], algo.tok.eos_token_id
    r = Rollout(algo.rows[:1], [Completion(prompt, [40, 41, eos], "", True), Completion(prompt, [42, eos], "", True)], 2)
    r.rewards, r.valid = torch.tensor([rewards]), torch.ones(1, 2)
    adv, keep, counted, _ = algo.advantages(r)
    batch = r.batch(algo.tok.pad_token_id, "cpu")
    batch["loss_mask"] = batch["response_mask"] * keep.flatten()[:, None]
    batch["counted_mask"] = batch["response_mask"] * counted.flatten()[:, None]
    return adv, keep, batch, batch["counted_mask"].sum().item()


@pytest.mark.parametrize("variant", [{"loss": "cispo"}, {"ratio": "sequence", "loss_agg": "seq-mean-token-mean"},
                                     {"advantage": "reinforce++"}])
def test_each_policy_objective_moves_probability_toward_the_rewarded_sample(tiny_model_dir, tmp_path, variant):
    """CISPO, GSPO and REINFORCE++ learn in the right direction: two updates (π_old ≠ π_θ in the second) on one
    group where the first sample earned 1 and the second 0 make the first likelier and the second less likely."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.logprobs import batched_logprobs

    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "g"), eval_data="", prompts_per_step=1,
                     num_generations=2, micro_batch_size=2, max_new_tokens=4, lr=1e-3, warmup_steps=0,
                     num_iterations=2, **variant)
    cfg.validate()
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        adv, _, batch, n_tokens = one_group(algo, [1.0, 0.0])
        before = batched_logprobs(algo.policy, batch, 2).sum(1)
        algo.update(batch, adv.flatten(), before.new_tensor(batched_logprobs(algo.policy, batch, 2)), None,
                    n_tokens, 2.0, Stats())
        after = batched_logprobs(algo.policy, batch, 2).sum(1)
    unset_hf_deepspeed_config()
    assert adv[0, 0] > 0 > adv[0, 1]
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_distillation_pulls_the_policy_to_the_teacher_even_without_reward_signal(tiny_model_dir, tmp_path):
    """--teacher: both samples earn the same reward (no policy-gradient signal, the group is dropped), yet updates
    bring the policy's log-probs of those tokens to the teacher's (another random init): on a fixed batch the loss
    sg(log π − log π_T)·log π lowers the tokens the policy overrates and raises those it underrates."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.logprobs import batched_logprobs
    from align.models import load_causal_lm, load_tokenizer, resolve

    tok = load_tokenizer(resolve("tiny"))
    load_causal_lm(resolve("tiny"), tok, torch.float32, seed=1).save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    cfg = GRPOConfig(model=str(tiny_model_dir), out=str(tmp_path / "g"), eval_data="", prompts_per_step=1,
                     num_generations=2, micro_batch_size=2, max_new_tokens=4, lr=1e-4, warmup_steps=0,
                     teacher=str(tmp_path / "teacher"), distill_coef=1.0)
    cfg.validate()
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        adv, keep, batch, n_tokens = one_group(algo, [1.0, 1.0])
        batch["teacher_logp"] = batched_logprobs(algo.teacher, batch, 2)
        gaps = []
        for _ in range(3):
            gap = (batched_logprobs(algo.policy, batch, 2) - batch["teacher_logp"]).abs() * batch["counted_mask"]
            gaps.append((gap.sum() / batch["counted_mask"].sum()).item())
            stats = Stats()
            algo.update(batch, adv.flatten(), None, None, n_tokens, 2.0, stats)
            assert "distill/reverse_kl" in stats.reduce("cpu")
    unset_hf_deepspeed_config()
    assert keep.sum() == 0 and (adv == 0).all()  # no reward signal: only the teacher moves the policy
    assert gaps[2] < gaps[1] < gaps[0], gaps


def test_a_stats_mean_over_nothing_is_its_empty_value():
    """completions/mean_terminated_length is a mean over the completions that ended: NaN when none did (0.0 stays the
    default of an empty mean), summed over micro-batches like any mean."""
    stats = Stats()
    stats.mean("none_ended", torch.tensor(0.0), torch.tensor(0.0), math.nan)
    stats.mean("default", 0.0, 0.0)
    stats.mean("two_ended", torch.tensor(6.0), torch.tensor(2.0), math.nan)
    stats.mean("two_ended", torch.tensor(4.0), torch.tensor(0.0), math.nan)
    out = stats.reduce("cpu")
    assert math.isnan(out["none_ended"]) and out["default"] == 0.0 and out["two_ended"] == 5.0
