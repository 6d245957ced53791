"""Rollouts: sampling completions from a policy, for the RL stages (grpo, ppo, online dpo) and the held-out
evaluations of every stage.

    sampling        keyed sampling: each prompt's random numbers from (seed, its index), top-k / top-p
    generation      the one generation path: `Sampling`, `Completion`, HF generate or the fast decoder
    fast/           the fast decoder (CUDA graphs of a compiled decode step over a static KV cache)
    batch           a rollout of P prompts × G samples, the tensors the losses see, its metrics
    queue           the rollouts sampled ahead of their step (--max-staleness) and the sampler that fills it
    disagg          decoder processes that only sample (--rollout-gpus)
    evaluation      held-out greedy pass@1 and sampled pass@k

Import what a stage needs from its module (`from align.rollout.batch import Rollout`): this file imports nothing.
"""
