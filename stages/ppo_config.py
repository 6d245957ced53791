"""`align ppo`'s options (stages/ppo.py runs them): a module of its own, light (no torch), so `align ppo --help`
and a config's checks are instant."""

from __future__ import annotations

import os
from dataclasses import dataclass

from align import objectives
from align.config import (ByModel, RLConfig, check_judge, defaults, max_tool_tokens_opt, max_turns_opt, opt,
                          read_rubric, tool_timeout_opt, tools_opt)
from align.errors import UserError
from align.paths import DATA_DIR
from align.rewards import parse_rewards

DEFAULT_SFT, DEFAULT_RM = "runs/arithmetic/sft", "runs/arithmetic/rm"  # pipelines/arithmetic.toml's, as --data's default


# the lr of a pretrained model: as GRPO's (TRL GRPOConfig's), for the same policy-gradient updates
@dataclass(frozen=True)
@defaults(out="runs/ppo", max_steps=50, prompts_per_step=64, micro_batch_size=16, schedule="constant", warmup_steps=0,
          eval_every=5, lr=ByModel(1e-4, pretrained=1e-6))
class PPOConfig(RLConfig):
    model: str = opt(DEFAULT_SFT, "Policy to train (an sft artifact); also the reference unless --ref-model.", path=True)
    ref_model: str = opt("", "Frozen reference policy for the KL penalty (default: --model).", path=True)
    reward_model: str = opt(DEFAULT_RM, "Reward model: an `align rm train` artifact (normalised scores); '' : none "
                                        "(then --judge gives the score).", path=True)
    judge: str = opt("", "An LLM judge (a causal LM: an artifact, a model directory, a preset) scoring each episode "
                         "through --judge-rubric: its expected score in [0, 1], times --judge-coef, is added to the "
                         "reward model's score, or is the whole score with --reward-model '' ('' : none).",
                     path=True)
    judge_coef: float = opt(1.0, "Weight of the --judge score in the score PPO trains on.", gt=0)
    judge_rubric: str = opt("", "With --judge: its rubric, a text file with {prompt} and {completion} where they go, "
                                "ending where the judge writes its score digit 0-9 (default: correctness, helpfulness "
                                "and concision).", path=True, user_file=True)
    value_model: str = opt("", "Value network init (default: the reward model; without one, the policy; a policy "
                               "gets a new scalar head).", path=True)
    gold_reward: str = opt("math", "Verifier for the gold reward when the prompts carry an `answer` (a grpo "
                                   "--reward spec, per sample or batched; '' : off).", code=True)
    gold_reward_coef: float = opt(0.0, "Weight of the gold reward in the score PPO trains on: s = RM score + "
                                        "c·(gold − the batch's other episodes' mean gold) (0: the gold reward is "
                                        "only logged; needs --gold-reward and an `answer` column).", ge=0)
    ptx_data: str = opt(str(DATA_DIR / "arithmetic/train.jsonl"), "ptx data: pretraining text {text} (loss on every "
                        "token) or SFT data {prompt, completion} (loss on the completion).", path=True)
    ptx_coef: float = opt(0.1, "γ: weight of the pretraining LM loss (PPO-ptx); 0: plain PPO.", ge=0)
    ptx_batch_size: int = opt(8, "Pretraining texts per optimiser step (all processes).", ge=1)
    ptx_max_length: int = opt(128, "Max tokens per pretraining text (cut on the right).", ge=1)
    minibatch_size: int = opt(32, "Episodes per optimiser step (all processes).", ge=1)
    ppo_epochs: int = opt(4, "Passes over each rollout batch.", ge=1)
    max_prompt_length: int = opt(512, "Prompts longer than this many tokens are dropped (all of them: exit 2).",
                                   ge=1)
    vf_lr: float = opt(3e-4, "Value network learning rate (its own AdamW).", gt=0)
    cliprange: float = opt(0.2, "ε of the clipped surrogate.", gt=0)
    cliprange_value: float = opt(0.2, "ε_v of the clipped value loss.", gt=0)
    vf_coef: float = opt(0.1, "Value loss coefficient.", ge=0)
    ent_coef: float = opt(0.0, "Entropy bonus coefficient (0: off).", ge=0)
    gamma: float = opt(1.0, "GAE discount γ.", ge=0, le=1)
    lam: float = opt(0.95, "GAE λ.", ge=0, le=1)
    kl_estimator: str = opt("k1", "Per-token KL penalty estimator:", choices=objectives.Choices("kl"))
    init_kl_coef: float = opt(0.1, "Initial β of the KL penalty.", ge=0)
    target_kl: float = opt(2.0, "Adaptive controller target: mean KL per episode (nats, summed over tokens).",
                            gt=0)
    kl_horizon: float = opt(200.0, "Adaptive controller horizon (episodes).", gt=0)
    fixed_kl: bool = opt(False, "Keep β fixed at --init-kl-coef (no adaptive controller).")
    max_approx_kl: float = opt(0.0, "Stop a step's epoch loop once an epoch's approx-KL(π_old‖π_θ) exceeds this "
                                     "(0: off).", ge=0)
    missing_eos_penalty: float = opt(0.0, "Subtracted from the score of responses that never emit EOS.", ge=0)
    reward_clip: float = opt(0.0, "Clip the score to [−c, c] (0: off).", ge=0)
    offload_frozen: bool = opt(False, "ZeRO-3: keep the frozen reference and reward model parameters on the CPU.")
    tools: str = tools_opt()
    max_turns: int = max_turns_opt()
    max_tool_tokens: int = max_tool_tokens_opt()
    tool_timeout: float = tool_timeout_opt("unfinished: --missing-eos-penalty applies")

    @property
    def episode_tokens(self) -> int:
        """The most tokens a rollout adds after its prompt: --max-new-tokens, plus the tools' with --tools."""
        return self.max_new_tokens + (self.max_tool_tokens if self.tools else 0)

    def validate(self):
        super().validate()
        if self.prompts_per_step % self.minibatch_size:
            raise UserError(f"--minibatch-size {self.minibatch_size} must divide --prompts-per-step "
                            f"{self.prompts_per_step}.")
        if self.tools:
            from align import tools

            tools.check(self.tools)
            if not self.gather and int(os.environ.get("WORLD_SIZE") or self.nproc * self.nnodes) > 1:
                raise UserError("--tools with --no-gather: episodes end after different numbers of turns, so the "
                                "processes cannot share each sharded forward; drop --no-gather.")
        if not self.reward_model and not self.judge:
            raise UserError("--reward-model '' leaves PPO nothing to train on: name a reward model, or an LLM judge "
                            "with --judge MODEL.", option="reward_model")
        check_judge(self.judge, self.judge_rubric, self.judge_coef != 1.0)
        self.rubric()
        if self.gold_reward:
            parse_rewards([self.gold_reward], "--gold-reward")
        elif self.gold_reward_coef:
            raise UserError(f"--gold-reward-coef {self.gold_reward_coef} trains on the gold reward, but --gold-reward "
                            "is off; name a verifier (e.g. --gold-reward math) or set --gold-reward-coef 0.")

    def rubric(self) -> str:
        """--judge-rubric's text ("" when not given): it must place the completion."""
        return read_rubric(self.judge_rubric, ("{completion}",), "write {prompt} and {completion} where the judge "
                                                                   "reads them")
