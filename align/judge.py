"""LLM judges (RLAIF): a causal LM reads a rubric and scores a completion, or says which of two is better.

Pointwise (G-Eval's probability-weighted score, Liu et al. 2023): the judge reads the rubric with `{prompt}` and
`{completion}` filled in, up to where it writes its score; its next-token distribution restricted to the score
labels "0" … "9" (K = 10, each one token) gives

    p_k = softmax(z_label)_k,    score = Σ_k k · p_k / (K − 1)   ∈ [0, 1]

— the expected score, deterministic (no sampling), and graded: a judge torn between 6 and 7 gives 0.72, not a coin
flip between them.

Pairwise (Zheng et al. 2023, "Judging LLM-as-a-judge": judges favour a position): the judge reads both answers and
writes "A" or "B"; P(first better) = p_A / (p_A + p_B) = σ(z_A − z_B) at the verdict, asked in both orders and
averaged,

    P(a ≻ b) = ½ [P_ab(first) + 1 − P_ba(first)]

so a judge that always prefers the first position scores two identical answers 0.5, as it should.

A label must be one token where the rubric ends (checked: `label_ids`); a model with a chat template reads the
rubric as a user message and answers after its generation prompt.
"""

from __future__ import annotations

import torch

from align.errors import UserError

RUBRIC = """Rate the response to the request below on a scale from 0 (useless or wrong) to 9 (fully correct, \
helpful and concise).

Request:
{prompt}

Response:
{completion}

Answer with one digit, the score, and nothing else.
"""

PAIR_RUBRIC = """Which response answers the request below better: more correct, more helpful, more concise?

Request:
{prompt}

Response A:
{a}

Response B:
{b}

Answer with one letter, A or B, and nothing else.
"""

SCORE_LABELS = tuple("0123456789")
BATCH = 16  # texts per forward of the judge (the memory plan counts one such batch: align.engine.plan.judge_terms)
PAIR_LABELS = ("A", "B")


# ---- the estimators: pure functions of the judge's next-token logits


def expected_score(logits_NV: torch.Tensor, label_ids: list[int]) -> torch.Tensor:
    """[N]: Σ_k k · softmax(z[label_ids])_k / (K − 1), the probability-weighted score of K ordered labels in [0, 1]."""
    p_NK = logits_NV[:, label_ids].float().softmax(-1)
    k = torch.arange(len(label_ids), dtype=p_NK.dtype, device=p_NK.device)
    return (p_NK * k).sum(-1) / (len(label_ids) - 1)


def first_preferred(logits_NV: torch.Tensor, first_id: int, second_id: int) -> torch.Tensor:
    """[N]: p(first) / (p(first) + p(second)) = σ(z_first − z_second), the verdict restricted to the two labels."""
    z = logits_NV.float()
    return torch.sigmoid(z[:, first_id] - z[:, second_id])


def both_orders(p_ab: torch.Tensor, p_ba: torch.Tensor) -> torch.Tensor:
    """P(a ≻ b) = ½ [P_ab(first) + 1 − P_ba(first)]: the position bias cancels."""
    return 0.5 * (p_ab + 1.0 - p_ba)


def fill(rubric: str, **fields: str) -> str:
    """The rubric with each `{name}` replaced (str.replace: braces elsewhere in it, or in the texts, stay)."""
    for name, text in fields.items():
        rubric = rubric.replace("{" + name + "}", text)
    return rubric


class Judge:
    """A causal LM as a judge: `scores` (pointwise) and `preferences` (pairwise, both orders), batched, no grad."""

    def __init__(self, model, tokenizer, rubric: str = RUBRIC, pair_rubric: str = PAIR_RUBRIC,
                 batch_size: int = BATCH, where: str = "the judge"):
        self.model, self.tok, self.batch_size, self.where = model.eval(), tokenizer, batch_size, where
        self.rubric, self.pair_rubric = rubric, pair_rubric
        self.score_ids = self.label_ids(fill(rubric, prompt="x", completion="y"), SCORE_LABELS)
        self.pair_ids = self.label_ids(fill(pair_rubric, prompt="x", a="y", b="z"), PAIR_LABELS)

    def text(self, rubric_filled: str) -> str:
        """What the judge reads: the filled rubric, as a user message where the model has a chat template."""
        if self.tok.chat_template:
            from align.chat import prompt_text

            return prompt_text(self.tok, rubric_filled)
        return rubric_filled

    def label_ids(self, example: str, labels: tuple[str, ...]) -> list[int]:
        """The token of each label where the rubric ends: one token appended to the rubric's own (else a
        UserError: the rubric's end and the label merge, or the label is several tokens)."""
        context = self.tok(self.text(example), add_special_tokens=False)["input_ids"]
        ids = []
        for label in labels:
            both = self.tok(self.text(example) + label, add_special_tokens=False)["input_ids"]
            if both[:-1] != context:
                raise UserError(f"{self.where}: the score label {label!r} is not one token after the rubric's end "
                                f"(the tokenizer writes {both[len(context) - 1:]} there); end the rubric with a "
                                f"space or a newline, or use a judge whose tokenizer has single-digit tokens")
            ids.append(both[-1])
        return ids

    @torch.no_grad()
    def next_token_logits(self, texts: list[str]) -> torch.Tensor:
        """[N, V] fp32: the judge's logits for the token after each text (left-padded batches)."""
        from align.data import pad

        device = next(self.model.parameters()).device
        out = []
        for i in range(0, len(texts), self.batch_size):
            ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts[i : i + self.batch_size]]
            x = torch.tensor(pad(ids, self.tok.pad_token_id or 0, side="left"), device=device)
            mask = torch.tensor(pad([[1] * len(s) for s in ids], 0, side="left"), device=device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out.append(self.model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False,
                                  logits_to_keep=1).logits[:, -1].float())  # (the last position's logits only)
        return torch.cat(out)

    def scores(self, prompts: list[str], completions: list[str]) -> list[float]:
        """The pointwise score in [0, 1] of each completion (`expected_score`)."""
        texts = [self.text(fill(self.rubric, prompt=p, completion=c)) for p, c in zip(prompts, completions)]
        return expected_score(self.next_token_logits(texts), self.score_ids).tolist()

    def preferences(self, prompts: list[str], a: list[str], b: list[str]) -> list[float]:
        """P(a_i ≻ b_i) for each pair, asked in both orders (`both_orders`)."""
        ab = [self.text(fill(self.pair_rubric, prompt=p, a=x, b=y)) for p, x, y in zip(prompts, a, b)]
        ba = [self.text(fill(self.pair_rubric, prompt=p, a=y, b=x)) for p, x, y in zip(prompts, a, b)]
        logits = self.next_token_logits(ab + ba)
        p = first_preferred(logits, *self.pair_ids)
        return both_orders(p[: len(ab)], p[len(ab) :]).tolist()


# ---- --reward judge:MODEL


def as_text(x) -> str:
    """A prompt or completion as the judge reads it: text as it is; chat messages as "role: content" lines (a
    completion of TRL's conversational form, one assistant message, as its content)."""
    if isinstance(x, str):
        return x
    if len(x) == 1 and x[0].get("role") == "assistant":
        return str(x[0].get("content", ""))
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in x)


def load(model: str, rubric: str = RUBRIC, pair_rubric: str = PAIR_RUBRIC, where: str = "") -> Judge:
    """A Judge of `model` (an artifact, a model directory or a preset) on this process's device (bf16 on a GPU),
    frozen. Never partitioned: loaded with transformers' ZeRO-3 link of a live training engine set aside."""
    from transformers.integrations import deepspeed as hf_ds

    from align.models import load_causal_lm, load_tokenizer, resolve

    source = resolve(model, expect=None)
    tok = load_tokenizer(source)
    cuda = torch.cuda.is_available()
    link = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None  # (a live link would make from_pretrained shard the judge)
    try:
        judge = load_causal_lm(source, tok, torch.bfloat16 if cuda else torch.float32, seed=0)
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = link
    judge = judge.to(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu").requires_grad_(False)
    return Judge(judge, tok, rubric, pair_rubric, where=where or f"judge {model}")


def reward(model: str, rubric: str = RUBRIC):
    """--reward judge:MODEL: a batched reward function (TRL's form) giving each completion the judge's pointwise
    score in [0, 1]; the judge is loaded on the first call (the reward probe's, before the policy is built) and kept.
    Its `judge()` is the Judge itself (a stage scores its held-out answers with it)."""
    state: dict = {}

    def get() -> Judge:
        if "judge" not in state:
            state["judge"] = load(model, rubric, where=f"--reward judge:{model}")
        return state["judge"]

    def judge(prompts, completions, **columns):
        return get().scores([as_text(p) for p in prompts], [as_text(c) for c in completions])

    judge.batched = True
    judge.judge = get
    return judge


# ---- the judge in the training stages: grpo --reward judge:MODEL, ppo --judge, dpo --online --judge

LEARNED = ("judge", "reward_model")  # the parts of a GRPO reward that a learned model gives: what a policy can game


def watched(fns: list, parts: list[dict], reward_model: bool = False) -> dict[str, list[float]]:
    """What RLMonitor's reward_hacking compares in a GRPO step whose reward holds both a learned scorer (a judge
    among `fns`, or a --reward-model: `reward_model`) and a verifier (any other reward function of `fns`: math,
    exact, a function of yours): {"proxy_reward": the mean of the learned scorers' values of each sample they
    scored, "gold_reward": the mean of the verifiers' values of each sample they scored}, `parts` holding each
    sample's {name: value}; {} without both (decided by the options alone: every process logs the same keys). A
    verifier weighted 0 (`--reward math:0`) is a gold reward logged only, as PPO's --gold-reward is with
    --gold-reward-coef 0."""
    gold = [f.name for f in fns if f.fn is not None and f.name not in LEARNED]
    proxy = ["judge"] * any(f.name == "judge" for f in fns) + ["reward_model"] * reward_model
    if not gold or not proxy:
        return {}
    out: dict[str, list[float]] = {"proxy_reward": [], "gold_reward": []}
    for p in parts:
        for key, names in (("proxy_reward", proxy), ("gold_reward", gold)):
            values = [p[n] for n in names if n in p]
            if values:
                out[key].append(sum(values) / len(values))
    return out


def judged_records(judge: Judge, records: list[dict]) -> tuple[list[dict], float]:
    """Held-out records (rollout.evaluation's) with the judge's pointwise score of each greedy answer as "judge",
    and the mean of those scores (the proxy RLMonitor's reward_hacking_heldout sets beside the verified pass
    rate)."""
    s = judge.scores([as_text(r["prompt"]) for r in records], [r["greedy"] for r in records])
    return [{**r, "judge": v} for r, v in zip(records, s)], sum(s) / max(len(s), 1)


def judge_model(specs: list[str]) -> str:
    """The model of the first judge:MODEL[:WEIGHT] among --reward specs ('' : none), as parse_rewards reads it
    (align.rewards imports this module: the spec is split here)."""
    import re

    for spec in specs:
        parts = spec.split(":")
        if len(parts) > 1 and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", parts[-1]):
            parts.pop()
        if parts[0] == "judge" and len(parts) == 2:
            return parts[1]
    return ""


def the_judge(fns: list) -> Judge | None:
    """The Judge of the first judge:MODEL among reward functions (rewards.parse_rewards'), loaded; None if none."""
    fn = next((f.fn for f in fns if f.name == "judge" and f.fn is not None), None)
    return fn.judge() if fn is not None else None


def rank_samples(judge: Judge, prompts: list[str], texts: list[str], k: int) -> torch.Tensor:
    """[n] the judge's score of each of n = P·K samples (K = k a prompt, prompt-major) for ranking them: K = 2
    pairwise, each sample's P(it ≻ the other) asked in both orders (`Judge.preferences`: a position bias cancels),
    so a pair's two scores sum to 1; K > 2 pointwise, each sample's expected score (`Judge.scores`)."""
    if k != 2:
        return torch.tensor(judge.scores(prompts, texts))
    p = torch.tensor(judge.preferences(prompts[::2], texts[::2], texts[1::2]))
    return torch.stack([p, 1.0 - p], 1).flatten()
