"""`align rm train|eval|score`'s options (stages/rm.py runs them): a module of its own, light (no torch), so
`align rm train --help` and a config's checks are instant."""

from __future__ import annotations

from dataclasses import dataclass

from align.config import ByModel, StageConfig, SupervisedConfig, defaults, held_out_opt, opt
from align.errors import UserError
from align.models import REWARD_HEADS as HEADS
from align.paths import DATA_DIR


# The defaults are the best recipe measured for the tiny model on data/prefs (50k pairs): held-out accuracy 0.87
# in 47 min on 2 CPU cores with --nproc 2, ~5 min on one GPU (the default pipeline runs 1,000 steps). A pretrained
# model's lr: pipelines/pretrained.toml's, measured on SmolLM2-135M.
@dataclass(frozen=True)
@defaults(out="runs/rm", max_steps=5000, batch_size=64, lr=ByModel(5e-4, pretrained=2e-5), warmup_steps=50,
          eval_every=500)
class RMConfig(SupervisedConfig):
    data: str = opt(str(DATA_DIR / "prefs/train.jsonl"), "Preference pairs: {prompt, chosen, rejected[, margin]}.", path=True)
    eval_data: str = held_out_opt(str(DATA_DIR / "prefs/test.jsonl"), "Held-out pairs for pairwise accuracy "
                                                                      "('' : none).")
    head: str = opt("scalar", f"Reward head: {' | '.join(HEADS)} (scalar: a value head at the last token; "
                               "likelihood: β · mean response log-prob under the model's own LM head).",
                       choices=HEADS)
    likelihood_beta: float = opt(5.0, "β of the likelihood head (the Bradley–Terry temperature of its score).", gt=0)
    center_coef: float = opt(0.0, "Reward-centring regulariser coefficient c · (r_w + r_l)² (0: off).", ge=0)
    normalize_samples: int = opt(512, "Reference responses for the normalisation (first N training pairs' chosen).",
                                 ge=1)
    normalize_on_policy: str = opt("", "Normalise on samples of this policy (artifact/dir) instead of chosen responses.", path=True)
    normalize_scale: bool = opt(False, "Also scale rewards to std 1 on the reference set.")
    max_new_tokens: int = opt(48, "Generation budget for --normalize-on-policy samples.", ge=1)


@dataclass(frozen=True)
class RMEvalConfig(StageConfig):
    model: str = opt("runs/rm", "Reward model: an `align rm train` artifact or a sequence-classifier dir.", path=True)
    out: str = opt("runs/rm-eval", "Output artifact directory (metrics, per-pair scores).", path=True)
    data: str = opt(str(DATA_DIR / "prefs/test.jsonl"), "Held-out preference pairs.", path=True)
    columns: str = opt("", "Rename columns: old=new,old2=new2 (each old name must be a column of --data).")
    max_length: int = opt(256, "Max tokens of prompt + the longer response; the prompt is cut from the left.", ge=1)
    batch_size: int = opt(64, "Pairs per forward per process.", ge=1)


@dataclass(frozen=True)
class RMScoreConfig(RMEvalConfig):
    out: str = opt("runs/rm-score", "Output directory; scores go to OUT/scores.jsonl.", path=True)
    data: str = opt("", "Rows to score: {prompt, response} (JSONL/JSON/Parquet/save_to_disk).", path=True)
    max_length: int = opt(256, "Max tokens of prompt + response; the prompt is cut from the left.", ge=1)
    batch_size: int = opt(64, "Rows scored per forward per process.", ge=1)

    def validate(self):
        super().validate()
        if not self.data:
            raise UserError("--data is required: a file of {prompt, response} rows to score.")
