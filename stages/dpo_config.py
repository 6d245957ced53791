"""`align dpo`'s options (stages/dpo.py runs them): a module of its own, light (no torch), so `align dpo --help`
and a config's checks are instant."""

from __future__ import annotations

from dataclasses import dataclass

from align import objectives
from align.config import (ByModel, SupervisedConfig, check_judge, defaults, held_out_opt, opt, read_rubric,
                          verifier_opt)
from align.errors import UserError
from align.paths import DATA_DIR


# the lr of a pretrained model: TRL DPOConfig's
@dataclass(frozen=True)
@defaults(out="runs/dpo", max_steps=300, lr=ByModel(1e-4, pretrained=1e-6))
class DPOConfig(SupervisedConfig):
    ref_model: str = opt("", "Frozen reference model (default: the input --model).", path=True)
    data: str = opt(str(DATA_DIR / "prefs/train.jsonl"), "Preference pairs: {prompt, chosen, rejected} (or "
                    "{chosen, rejected}, implicit prompt); --loss kto: also {prompt, completion, label}.", path=True)
    eval_data: str = held_out_opt(str(DATA_DIR / "prefs/test.jsonl"), "Held-out pairs for implicit-reward accuracy "
                                                                      "('' : none).")
    pass_data: str = held_out_opt(str(DATA_DIR / "arithmetic/test.jsonl"), "Verifiable data for greedy pass@1 of "
                                  "policy and input model ('' : skip).", split=False, label="pass@1")
    beta: float = opt(0.1, "β: strength of the implicit KL to the reference.", gt=0)
    loss: str = opt("sigmoid", "Preference loss:", choices=objectives.Choices("preference", "unpaired_preference"))
    simpo_gamma: float = opt(0.5, "γ of --loss simpo: the target reward margin.", ge=0)
    desirable_weight: float = opt(1.0, "λ_D of --loss kto (raise it when desirable rows are fewer).", gt=0)
    undesirable_weight: float = opt(1.0, "λ_U of --loss kto.", gt=0)
    label_smoothing: float = opt(0.0, "ε of conservative DPO (--loss sigmoid).", ge=0, lt=0.5)
    nll_coef: float = opt(0.0, "α of RPO's NLL term: α · the chosen answer's per-token NLL added to each pair's loss "
                               "(0: off).", ge=0)
    precompute_ref: bool = opt(False, "Compute reference log-probs once before training and free the reference model.")
    packing: bool = opt(False, "Padding-free forwards: each micro-batch's chosen and rejected rows packed (a GPU: one "
                               "row, varlen flash attention; else fewer rows, block-diagonal attention); the same "
                               "log-probs.",
                        group="hardware")
    eval_pairs: int = opt(0, "Held-out pairs to evaluate (0: all).", ge=0)
    eval_samples: int = opt(200, "Problems of --pass-data for greedy pass@1 (0: skip).", ge=0)
    verifier: str = verifier_opt()
    max_new_tokens: int = opt(48, "Generation budget for pass@1 (and, with --online, for the sampled pairs).", ge=1)
    online: bool = opt(False, "Online DPO: pairs sampled from the current policy on the prompts of --data ({prompt, "
                              "answer} rows) and ranked by --verifier, by --reward-model or by --judge.")
    online_every: int = opt(1, "With --online: sample new pairs every N steps (each sampling fills the next N "
                               "steps' batches).", ge=1)
    online_samples: int = opt(4, "With --online: samples per prompt; chosen = the best, rejected = the worst.",
                                ge=2)
    temperature: float = opt(1.0, "With --online: sampling temperature.", gt=0)
    reward_model: str = opt("", "With --online: an `align rm train` artifact that ranks the samples (default: the "
                                "--verifier).", path=True)
    judge: str = opt("", "With --online: an LLM judge (a causal LM: an artifact, a model directory, a preset) that "
                         "ranks the samples: 2 --online-samples pairwise, asked in both orders (A/B), more pointwise "
                         "by its expected score 0-9 (default: the --verifier).", path=True)
    judge_rubric: str = opt("", "With --judge: its rubric, a text file: for 2 --online-samples with {prompt}, {a} and "
                                "{b}, ending where the judge writes A or B; for more with {prompt} and {completion}, "
                                "ending where it writes a digit 0-9 (default: align.judge's).", path=True,
                            user_file=True)

    @property
    def unpaired(self) -> bool:
        return self.loss in objectives.Choices("unpaired_preference")

    @property
    def objective(self) -> objectives.Entry:
        return objectives.get("unpaired_preference" if self.unpaired else "preference", self.loss)

    @property
    def reference_free(self) -> bool:
        return not self.objective.needs_reference

    def validate(self):
        super().validate()
        if self.unpaired and self.precompute_ref:
            raise UserError(f"--loss {self.loss} compares each row with mismatched ones of its batch: drop "
                            "--precompute-ref.")
        if self.reference_free and (self.precompute_ref or self.ref_model):
            raise UserError(f"--loss {self.loss} uses no reference model: drop --precompute-ref / --ref-model.")
        if self.label_smoothing and not self.objective.label_smoothing:
            smoothed = objectives.Choices("preference", label_smoothing=True)
            raise UserError(f"--label-smoothing applies to --loss {' / '.join(smoothed)} only.")
        if self.online and self.eval_split:
            raise UserError("--eval-split holds out pairs of --data, and --online reads prompts there: drop it.")
        if self.online:
            if self.unpaired or self.precompute_ref:
                raise UserError(f"--online samples new pairs as it trains: drop --loss {self.loss} / --precompute-ref.")
        elif self.reward_model or self.judge:
            flag = "--reward-model" if self.reward_model else "--judge"
            raise UserError(f"{flag} ranks sampled pairs: it needs --online.", option=flag[2:].replace("-", "_"))
        if self.reward_model and self.judge:
            raise UserError("--reward-model and --judge both rank the samples: give one.", option="judge")
        check_judge(self.judge, self.judge_rubric)
        self.rubric()

    @property
    def pairwise(self) -> bool:
        """--judge with 2 --online-samples: the judge compares the two (both orders), not one at a time."""
        return self.online_samples == 2

    def rubric(self) -> str:
        """--judge-rubric's text ("" when not given), with the fields its form needs (`pairwise`)."""
        if self.pairwise:
            return read_rubric(self.judge_rubric, ("{a}", "{b}"), "with 2 --online-samples the judge compares two "
                                                                 "answers: write {prompt}, {a} and {b} where it reads them")
        return read_rubric(self.judge_rubric, ("{completion}",), f"with {self.online_samples} --online-samples the "
                                                                  "judge scores each answer: write {prompt} and "
                                                                  "{completion} where it reads them")
