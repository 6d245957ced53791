"""align: post-training for causal language models (SFT, RM, PPO-ptx, DPO, GRPO) on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"
