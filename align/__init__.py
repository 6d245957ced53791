"""align: post-training for causal language models (SFT, RM, PPO-ptx, DPO, GRPO) on DeepSpeed ZeRO-3."""

__version__ = "0.1.0"


# the commands as functions (align.api): each word of `align rm train` joined by "_"; `export` and `report` are
# modules of this package, their functions are align.api.export / align.api.report
API = ("sft", "rm_train", "rm_eval", "rm_score", "ppo", "dpo", "grpo", "eval", "model_init", "data_make", "data_show",
       "Artifact", "load")


def __getattr__(name: str):
    """`align.sft(...)`, `align.grpo(...)`, ...: the Python API (align.api), imported on first use (`import align`
    stays instant and imports no torch). The package's one import up the layers (docs/engine.md)."""
    if name in API:
        from align import api

        return getattr(api, name)
    raise AttributeError(f"module 'align' has no attribute {name!r}")
