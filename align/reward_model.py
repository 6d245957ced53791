"""Reward models: loading, raw scoring and THE normalisation every consumer (rm score, PPO, GRPO) applies.

A reward model is a `save_pretrained` model whose config names its head (`align_reward_head`):
  * scalar (the default): an AutoModelForSequenceClassification (num_labels=1); the score is read at the last
    non-padding token (transformers does it; the config carries `pad_token_id`), InstructGPT's reward model;
  * likelihood: an AutoModelForCausalLM; the score is β · the mean log-probability of the response tokens under
    its own LM head (`align_reward_beta`; objectives.reward.likelihood_reward). A small model that cannot learn a scalar
    verdict at its last token often already ranks answers by their likelihood.
Both are trained with the same Bradley–Terry loss, and carry align's normalisation
    normalised = (raw − align_reward_offset) / align_reward_scale
fitted after `align rm train` so that the reference responses score 0 on average (InstructGPT).
"""

from __future__ import annotations

import torch

from align.errors import UserError
from align.objectives.reward import likelihood_reward
from align.models import LOAD_ERRORS, REWARD_HEAD_KEY, REWARD_HEADS

OFFSET_KEY = "align_reward_offset"
SCALE_KEY = "align_reward_scale"
HEAD_KEY = REWARD_HEAD_KEY
BETA_KEY = "align_reward_beta"
HEADS = REWARD_HEADS


def _getter(config):
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


def head_of(config) -> tuple[str, float]:
    """(head, β) named by a reward model's config (a model config or a dict); no key: a scalar head."""
    get = _getter(config)
    return get(HEAD_KEY, None) or "scalar", float(get(BETA_KEY, None) or 1.0)


def normalized_reward(raw, config) -> torch.Tensor | float:
    """(raw − offset) / scale with the offset and scale stored in a model config (or an artifact/config dict)."""
    get = _getter(config)
    offset = get(OFFSET_KEY, None)
    if offset is None:
        offset = get("reward_offset", 0.0)
    scale = get(SCALE_KEY, None)
    if scale is None:
        scale = get("reward_scale", 1.0)
    return (raw - float(offset)) / float(scale)


def require_trained(source, spec: str, flag: str = "--reward-model"):
    """`source` (a resolved --reward-model) unless it is a preset: an untrained model is no reward model."""
    if source.preset:
        raise UserError(f"{flag} {spec}: a preset is an untrained model, not a reward model; pass an "
                        "`align rm train` artifact.")
    return source


def load_reward_model(source, tokenizer, dtype, seed: int = 0, trust_remote_code: bool = False,
                      head: str | None = None, beta: float = 1.0):
    """A reward model. To train one, name its `head`: `scalar` puts a new value head on `source`'s body,
    `likelihood` takes the causal LM itself (its config marked with the head and β). To use one (head None):
    the head its config names."""
    new = head is not None
    if not new:
        head = head_of(source.config)[0]
    if head == "scalar":
        return load_sequence_classifier(source, tokenizer, dtype, seed, trust_remote_code)
    from align.models import load_causal_lm

    model = load_causal_lm(source, tokenizer, dtype, seed, trust_remote_code)
    if new:  # trained with this β, whatever the source's config said
        setattr(model.config, HEAD_KEY, "likelihood")
        setattr(model.config, BETA_KEY, float(beta))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def load_sequence_classifier(source, tokenizer, dtype, seed: int = 0, trust_remote_code: bool = False):
    """A scalar-head model: from a scalar reward model (its head), or from a causal LM / preset / likelihood
    reward model (body weights, new head; e.g. PPO's value network). pad_token_id is set in the config so the
    reward is read at the last non-padding token."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from align.models import preset_config, with_saved_adapter

    if source.base is not None:  # a LoRA adapter saved alone: its base's body (and head), then the adapter
        return with_saved_adapter(load_sequence_classifier(source.base, tokenizer, dtype, seed,
                                                           trust_remote_code), source)
    torch.manual_seed(seed)  # the new score head
    if source.preset:
        cfg = preset_config(source.preset, tokenizer)
        cfg.num_labels = 1
        return AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
    try:
        cfg = AutoConfig.from_pretrained(source.model_dir, num_labels=1, trust_remote_code=trust_remote_code)
        cfg.pad_token_id = tokenizer.pad_token_id
        setattr(cfg, HEAD_KEY, "scalar")  # a body taken from a likelihood reward model gets a scalar head
        model = AutoModelForSequenceClassification.from_pretrained(
            source.model_dir, config=cfg, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code)
    except LOAD_ERRORS as e:
        raise UserError(f"{source.model_dir}: cannot load as a sequence classifier ({str(e).splitlines()[0]}).") from None
    return model


def raw_rewards(model, batch: dict) -> torch.Tensor:
    """Raw reward per row of a right-padded batch (input_ids, attention_mask; a likelihood head also needs
    `labels`: the response tokens, −100 elsewhere): [B] in fp32."""
    head, beta = head_of(getattr(model, "module", model).config)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    if head == "likelihood":
        return likelihood_reward(out.logits, batch["labels"], beta).float()
    return out.logits[:, 0].float()


def encode_scored(tokenizer, prompts: list, responses: list[str], max_length: int = 0) -> list[tuple[list, list]]:
    """(prompt (chat template), response + EOS) token ids, exactly as the reward model was trained; the prompt
    loses tokens from the left when `max_length` is set."""
    from align.data import encode_completions, encode_prompts

    out = []
    for p, r in zip(encode_prompts(tokenizer, prompts), encode_completions(tokenizer, responses)):
        if max_length and len(p) + len(r) > max_length:
            p = p[max(0, len(p) + len(r) - max_length):]
        out.append((p, r))
    return out


@torch.no_grad()
def score_ids(eng, tokenizer, seqs: list[tuple[list, list]], batch_size: int = 64, normalize: bool = True) -> torch.Tensor:
    """Rewards of (prompt ids, response ids) pairs on this rank. Under ZeRO-3 with several ranks every rank must
    make the same number of calls (equal-length lists): each forward gathers parameters collectively."""
    from align.data import pad

    device = next(eng.module.parameters()).device
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        ids = [p + r for p, r in chunk]
        batch = {"input_ids": torch.tensor(pad(ids, tokenizer.pad_token_id), device=device),
                 "attention_mask": torch.tensor(pad([[1] * len(s) for s in ids], 0), device=device),
                 "labels": torch.tensor(pad([[-100] * len(p) + r for p, r in chunk], -100), device=device)}
        out.append(raw_rewards(eng, batch).cpu())
    raw = torch.cat(out) if out else torch.zeros(0)
    return normalized_reward(raw, eng.module.config) if normalize else raw


def score(eng, tokenizer, prompts: list, responses: list[str], batch_size: int = 64, max_length: int = 0) -> torch.Tensor:
    """Normalised rewards [N] of prompt/response pairs (rendered as in training). Same collective rule as
    `score_ids`."""
    return score_ids(eng, tokenizer, encode_scored(tokenizer, prompts, responses, max_length), batch_size)
