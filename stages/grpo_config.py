"""`align grpo`'s options (stages/grpo.py runs them): a module of its own, light (no torch), so `align grpo --help`
and a config's checks are instant."""

from __future__ import annotations

import os
from dataclasses import dataclass

from align import objectives
from align.config import (ByModel, RLConfig, defaults, env_opt, max_tool_tokens_opt, max_turns_opt, opt,
                          positive_ints, read_rubric, tool_timeout_opt, tools_opt)
from align.errors import UserError
from align.objectives.catalog import LOSS_AGGREGATIONS
from align.rewards import parse_rewards


# the lr of a pretrained model: TRL GRPOConfig's
@dataclass(frozen=True)
@defaults(out="runs/grpo", max_steps=150, lr=ByModel(5e-5, pretrained=1e-6), schedule="constant", warmup_steps=5,
          micro_batch_size=0, eval_every=0)
class GRPOConfig(RLConfig):
    reward: list[str] = opt(["math"], "Reward NAME[:WEIGHT], file.py:FUNCTION[:WEIGHT], judge:MODEL[:WEIGHT] (an "
                                      "LLM judge's score in [0, 1]) or http://HOST:PORT/PATH[:WEIGHT] (a reward "
                                      "server: `align reward serve`); repeat for several. A function is per sample, "
                                      "fn(prompt, completion, **row) -> float, or batched as TRL's, fn(prompts, "
                                      "completions, **kwargs) -> list[float] (docs/rewards.md).",
                            code=True)
    reward_model: str = opt("", "An `align rm train` artifact as one more reward: its normalised score of prompt + "
                                "completion, times --reward-model-weight, added to --reward's ('' : none).", path=True)
    reward_model_weight: float = opt(1.0, "Weight of the --reward-model score.")
    on_reward_error: str = opt("fail", "A reward that raises, returns NaN / a non-number or runs past "
                                       "--reward-timeout: fail, skip (the sample leaves its group's statistics and "
                                       "the loss) or zero. rewards/errors logs the fraction of a step's samples "
                                       "whose reward failed. A wrong signature or return type fails before the "
                                       "model loads, whatever this says.", choices=("fail", "skip", "zero"))
    reward_timeout: float = opt(30.0, "Seconds a reward function may take on one completion (a batched function: "
                                      "this times its batch's completions; 0: no limit). A URL: each request's "
                                      "limit (0: 30).", ge=0)
    judge_rubric: str = opt("", "With --reward judge:MODEL: the judge's rubric, a text file with {prompt} and "
                                "{completion} where they go, ending where the judge writes its score digit 0-9 "
                                "(default: correctness, helpfulness and concision).", path=True, user_file=True)
    num_generations: int = opt(8, "G: completions per prompt (advantages are relative to the group).", ge=2)
    advantage: str = opt("zscore", "Advantage estimator:", choices=objectives.Choices("advantage"))
    loss: str = opt("clip", "Policy loss:", choices=objectives.Choices("policy_loss"))
    ratio: str = opt("token", "Importance ratio: token, or sequence (the same as --loss gspo).",
                     choices=("token", "sequence"))
    loss_agg: str = opt("token-mean", "seq-mean-token-mean (GRPO), token-mean (DAPO) or seq-sum (Dr. GRPO).",
                         choices=LOSS_AGGREGATIONS)
    epsilon: float = opt(0.2, "Clip range below 1 (and above, unless --epsilon-high).", gt=0)
    epsilon_high: float = opt(0.28, "Clip range above 1 (DAPO clip-higher).", gt=0)
    num_iterations: int = opt(1, "Updates per rollout batch (π_old ≠ π_θ after the first).", ge=1)
    beta: float = opt(0.0, "KL(π_θ‖π_ref) weight, k3 estimator; 0 loads no reference model.", ge=0)
    teacher: str = opt("", "On-policy distillation: a teacher model (same tokenizer) whose per-token reverse KL on the "
                           "policy's own samples is added to the loss, times --distill-coef ('' : none).", path=True)
    distill_coef: float = opt(1.0, "Weight of the --teacher's reverse-KL term.", gt=0)
    reinforce: bool = opt(False, "The same as --loss reinforce (nanochat's on-policy REINFORCE −A·log π: no ratio, "
                                 "clip or KL).")
    drop_zero_std_groups: bool = opt(True, "Drop groups without signal (every advantage 0: all rewards equal, except "
                                     "under reinforce++) from the loss; their tokens still count in its "
                                     "normaliser.")
    mask_truncated: bool = opt(False, "Drop completions that hit --max-new-tokens without EOS from the loss.")
    overlong_cache: int = opt(0, "Soft overlong penalty over the last N tokens of the budget (DAPO); 0: off.", ge=0)
    micro_batch_tokens: int = opt(16384, "With --micro-batch-size 0: the most tokens one micro-batch of the update "
                                         "and log-prob passes may hold, counting every row as long as the longest "
                                         "prompt + --max-new-tokens.", ge=1)
    eval_k: str = opt("1,4,8", "pass@k values (samples per problem = max k).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward (less memory, more compute).")
    max_staleness: int = opt(0, "Off-policy by K steps: step t trains on the rollout sampled from the weights of "
                                "step t−K (the first K from the start's), so the next rollouts can be sampled while "
                                "a step trains (with --rollout-gpus). 0: every rollout from the current weights. "
                                "Pair it with --tis-cap.", ge=0)
    rollout_gpus: int = opt(-1, "Disaggregated: this many of the processes (the last ranks) only sample rollouts, "
                                "on a plain copy of the policy the trainers update after every step; the other "
                                "processes train. 0: every process samples and trains. -1 (auto): on 2 or more "
                                "GPUs of one machine, half the processes decode, one step off (--max-staleness 1 "
                                "and --tis-cap 2 where left at 0); otherwise 0.", ge=-1)
    tools: str = tools_opt()
    max_turns: int = max_turns_opt()
    max_tool_tokens: int = max_tool_tokens_opt()
    tool_timeout: float = tool_timeout_opt()
    env: str = env_opt()

    @property
    def episode_tokens(self) -> int:
        """The most tokens a rollout adds after its prompt: --max-new-tokens, plus the tools' with --tools."""
        return self.max_new_tokens + (self.max_tool_tokens if self.tools or self.env else 0)

    @property
    def policy_loss(self) -> str:
        """The registered policy loss --loss names, or its older aliases --reinforce and --ratio sequence."""
        return "reinforce" if self.reinforce else "gspo" if self.ratio == "sequence" else self.loss

    def validate(self):
        super().validate()
        if self.ratio == "sequence" and self.loss not in ("clip", "gspo"):
            raise UserError("--ratio sequence (GSPO) clips the sequence ratio: use it with --loss clip.")
        if self.reinforce and (self.loss not in ("clip", "reinforce") or self.ratio != "token"):
            raise UserError("--reinforce has no importance ratio: leave --loss and --ratio at their defaults.")
        if self.overlong_cache > self.max_new_tokens:
            raise UserError(f"--overlong-cache {self.overlong_cache} must be at most --max-new-tokens "
                            f"{self.max_new_tokens}: the penalty covers the last N tokens of the budget.")
        if objectives.get("policy_loss", self.policy_loss).on_policy and (self.num_iterations != 1 or self.beta):
            name = "--reinforce" if self.reinforce else f"--loss {self.loss}"
            raise UserError(f"{name} is on-policy without KL: use it with --num-iterations 1 and --beta 0.")
        gpus = self.rollout().get("rollout_gpus", (self.rollout_gpus, ""))[0]
        if gpus:
            from align.rollout import disagg

            disagg.require_trainers(gpus, self.launched_world())
        self.ks()
        if self.tools or self.env:
            from align import tools

            tools.check(self.tools, env=self.env)
            if not self.gather and self.launched_world() > 1:
                raise UserError("--tools with --no-gather: episodes end after different numbers of turns, so the "
                                "processes cannot share each sharded forward; drop --no-gather.")
        parse_rewards(self.reward, judge_rubric=self.rubric())  # an unknown reward or a bad weight fails here
        if self.judge_rubric and not any(spec.split(":")[0] == "judge" for spec in self.reward):
            raise UserError("--judge-rubric goes with --reward judge:MODEL: add one, or drop --judge-rubric.",
                            option="judge_rubric")

    def rubric(self) -> str:
        """--judge-rubric's text ("" when not given): it must place the completion."""
        return read_rubric(self.judge_rubric, ("{completion}",), "write {prompt} and {completion} where the judge "
                                                                   "reads them")

    def launched_world(self) -> int:
        """Every process of the run, trainers and decoders: the launcher's count (kept in ALIGN_GLOBAL_WORLD once
        the roles are split), else the one --nproc × --nnodes will start."""
        return int(os.environ.get("ALIGN_GLOBAL_WORLD") or os.environ.get("WORLD_SIZE") or self.nproc * self.nnodes)

    def automatic(self) -> dict[str, tuple[object, str]]:
        return {**super().automatic(), **self.rollout()}

    def rollout(self) -> dict[str, tuple[object, str]]:
        """--rollout-gpus -1 (auto) made a number: on W >= 2 GPU processes of one machine, W // 2 decoders one step
        off with TIS (--max-staleness and --tis-cap where left at 0; measured fastest on 2 GPUs at 0.5B and 8B:
        docs/async.md); else 0 (synchronous, not said). Every process resolves it before the roles are split, so
        all of them agree."""
        if self.rollout_gpus >= 0:
            return {}
        import torch

        world = self.launched_world()
        gpus = world // 2 if world >= 2 and self.nnodes == 1 and torch.cuda.is_available() else 0
        if not gpus:
            return {"rollout_gpus": (0, "")}
        return {"rollout_gpus": (gpus, f"auto: half of {world} GPU processes decode"),
                **({} if self.max_staleness else {"max_staleness": (1, "auto: with --rollout-gpus")}),
                **({} if self.tis_cap else {"tis_cap": (2.0, "auto: with --rollout-gpus")})}

    def ks(self) -> list[int]:
        return positive_ints(self.eval_k, "--eval-k")
