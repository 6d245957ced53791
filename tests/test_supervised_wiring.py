"""Wiring of the supervised stages to their formulas, pinned by values computed by hand from the models' own
forwards: the data order every stage draws (StageRun.indices), the reward model's Bradley–Terry step (its scores,
margin, centring term, both heads, the position a scalar head reads, the normalisation it saves), and SFT's
completion-only token-mean loss (micro-batching, packing). The stages are built in-process on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from align import runtime
from align.engine.run import StageRun, step_indices
from tests.conftest import ROOT, eos_prone, greedy_ids, stage_in_process


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""



def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def head(rel: str, n: int, skip: int = 0) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "data" / rel).read_text().splitlines()[skip : skip + n]]


def stage(cls, cfg, name: str):
    """The stage `cls(cfg, run)` built in this process inside its StageRun."""
    return stage_in_process(cfg, name, cls)


def hand_gradient(loss: torch.Tensor, module) -> tuple[dict, float]:
    """∇loss per trained parameter of `module` (at its current weights) and its global norm."""
    names, params = zip(*[(k, p) for k, p in module.named_parameters() if p.requires_grad])
    grads = dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True)))
    grads = {k: g for k, g in grads.items() if g is not None}
    return grads, torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()


def check_update(module, grads: dict, norm: float, engine, step) -> dict:
    """Run `step()` (one optimiser step of `engine`): its gradient norm is the hand loss's, and it moved the
    weights down the hand loss (⟨Δw, ∇loss⟩ < 0)."""
    before = {k: p.detach().clone() for k, p in module.named_parameters() if k in grads}
    out = step()
    assert engine.metrics()["grad_norm"] == pytest.approx(norm, rel=1e-4)
    dot = sum(((p.detach() - before[k]).double() * grads[k].double()).sum() for k, p in module.named_parameters()
              if k in grads)
    assert dot < 0
    return out


# ------------------------------------------------------------------------------------------------- data order


def test_data_order_is_a_new_seeded_permutation_each_epoch_for_any_number_of_ranks(tmp_path):
    """StageRun.indices (the order every stage draws its examples in): consecutive global batches walk epochs,
    each epoch a permutation of all examples (batches cross epoch boundaries), a new order each epoch, drawn from
    the seed (--seed, or an explicit seed: PPO's ptx data) — another seed another order, the same seed the same,
    a pure function of the step (exact resume) — and the ranks' contiguous shares of a step concatenate to the
    global batch of one process, for 1, 2 and 4 ranks."""
    from stages.sft import SFTConfig

    n, size, steps = 10, 4, 15  # 60 indices: 6 epochs, batches 2, 4, 7, ... cross an epoch's end
    cfg = SFTConfig(out=str(tmp_path / "o"), seed=5)
    run = StageRun(cfg, "sft")

    def on(world: int, rank: int):
        run.dist = runtime.Dist(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                                backend="gloo")
        return run

    batches = [on(1, 0).indices(n, size, s) for s in range(steps)]
    assert all(len(b) == size for b in batches)
    flat = [i for b in batches for i in b]
    epochs = [flat[e * n : (e + 1) * n] for e in range(len(flat) // n)]
    assert all(sorted(e) == list(range(n)) for e in epochs), epochs  # each epoch: every example once
    assert len({tuple(e) for e in epochs}) == len(epochs), epochs  # a new order each epoch
    assert epochs[0] != list(range(n))  # shuffled
    # a pure function of (seed, step): the same again, in any order of calls
    assert [on(1, 0).indices(n, size, s) for s in reversed(range(steps))] == batches[::-1]
    assert batches == [step_indices(n, size, s, 5) for s in range(steps)]
    # another seed, another order; the explicit seed wins over --seed
    other = [on(1, 0).indices(n, size, s, seed=6) for s in range(steps)]
    assert other != batches and other[0] != batches[0]
    cfg6 = SFTConfig(out=str(tmp_path / "o6"), seed=6)
    run6 = StageRun(cfg6, "sft")
    run6.dist = run.dist
    assert [run6.indices(n, size, s) for s in range(steps)] == other
    assert [run6.indices(n, size, s, seed=5) for s in range(steps)] == batches
    # any number of ranks: the ranks' contiguous shares are the one-process batch
    for world in (2, 4):
        for s in range(steps):
            shares = [on(world, r).indices(n, size, s) for r in range(world)]
            assert all(len(x) == size // world for x in shares)
            assert [i for x in shares for i in x] == batches[s], (world, s, shares)
    # a larger data set: still a permutation per epoch, epochs differ
    big = [i for s in range(6) for i in on(1, 0).indices(37, 16, s)]  # 96 = 2 epochs + 22
    assert sorted(big[:37]) == sorted(big[37:74]) == list(range(37)) and big[:37] != big[37:74]
    assert len(set(big[74:])) == 22


# ------------------------------------------------------------------------------------------------ reward model


def prefs(tmp_path: Path, n: int, name: str = "pairs.jsonl", skip: int = 0) -> Path:
    """n pairs of data/prefs, every other one with a margin (of both signs)."""
    rows = head("prefs/train.jsonl", n, skip)
    for i, r in enumerate(rows):
        if i % 2:
            r["margin"] = 0.8 if i % 4 == 1 else -0.5
    return write_rows(tmp_path / name, rows)


def rm_config(tmp_path: Path, out: str, data: Path, **kw):
    from stages.rm import RMConfig

    base = dict(model=str(kw.pop("model")), out=str(tmp_path / out), data=str(data), eval_data="", batch_size=4,
                micro_batch_size=2, zero_stage=0, warmup_steps=0, lr=1e-3, seed=3, normalize_samples=5)
    return RMConfig(**{**base, **kw})


def scalar_score(module, ids: list[int]) -> torch.Tensor:
    """The scalar head read at the last token of ONE unpadded sequence: score(h_T)."""
    body = getattr(module, module.base_model_prefix)
    h = body(input_ids=torch.tensor([ids]), use_cache=False).last_hidden_state[0, -1]
    return module.score(h)[0].float()


def likelihood_score(module, prompt: list[int], response: list[int], beta: float) -> torch.Tensor:
    """β · the mean log-prob of the response tokens of ONE unpadded sequence under the LM head."""
    ids = torch.tensor([prompt + response])
    logp = module(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
    lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return beta * lp[len(prompt) - 1 :].mean()


def hand_pairs(algo, examples: list[dict]):
    """(r_w, r_l) of each pair, each sequence scored alone (no padding), by the stage's head."""
    cfg, module = algo.cfg, algo.rm.module
    out = []
    for side in ("chosen_ids", "rejected_ids"):
        if cfg.head == "scalar":
            out.append(torch.stack([scalar_score(module, e["prompt_ids"] + e[side]) for e in examples]))
        else:
            out.append(torch.stack([likelihood_score(module, e["prompt_ids"], e[side], cfg.likelihood_beta)
                                    for e in examples]))
    return out


def check_rm_step(algo, step: int) -> dict:
    """One step of the stage against the hand computation on the pairs of step_indices(step): its logged loss
    −log σ(r_w − r_l − m) + c · (r_w + r_l)² (mean over pairs), rewards, margin and accuracy; the gradient norm of
    its update equals that of the hand loss, and the update goes down it. Returns the step's metrics."""
    cfg = algo.cfg
    batch = [algo.examples[i] for i in step_indices(len(algo.examples), cfg.batch_size, step, cfg.seed)]
    rw, rl = hand_pairs(algo, batch)
    m = torch.tensor([e["margin"] for e in batch])
    assert (m != 0).any()
    loss = (-torch.nn.functional.logsigmoid(rw - rl - m) + cfg.center_coef * (rw + rl) ** 2).mean()
    grads, norm = hand_gradient(loss, algo.rm.module)
    got = check_update(algo.rm.module, grads, norm, algo.rm, lambda: algo.step(step).reduce("cpu"))
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert got["rewards/chosen"] == pytest.approx(rw.mean().item(), rel=1e-5, abs=1e-6)
    assert got["rewards/rejected"] == pytest.approx(rl.mean().item(), rel=1e-5, abs=1e-6)
    # a difference of two scores: fp32 rounding of each (~1e-7 of its size; the likelihood head's are β·log-probs,
    # tens) bounds it, not its own small size
    scale = max(rw.abs().max().item(), rl.abs().max().item(), 1.0)
    assert got["margin"] == pytest.approx((rw - rl).mean().item(), rel=1e-5, abs=1e-6 * scale)
    assert got["accuracy"] == pytest.approx((rw > rl).float().mean().item())
    assert got["pairs"] == cfg.batch_size
    return got


def test_rm_step_is_bradley_terry_of_the_models_own_scores_with_margin_and_centring(tiny_model_dir, tmp_path):
    """The scalar-head stage: chosen and rejected go through ONE padded forward, yet each score equals the value
    head read at the last token of that sequence alone (the last non-pad token, not a pad); the step's loss is
    −log σ(r_w − r_l − m) with the data's margins, plus --center-coef · (r_w + r_l)² (0 leaves it out), averaged
    over the global batch whatever the micro-batching, and the update follows its gradient. Held-out
    accuracy and margin are those of the same scores; the saved offset (no --normalize-scale: scale 1) is the mean
    score of the first --normalize-samples chosen responses."""
    from align.reward_model import HEAD_KEY, OFFSET_KEY, SCALE_KEY
    from stages.rm import RewardModel

    data, held = prefs(tmp_path, 8), prefs(tmp_path, 6, "held.jsonl", skip=100)
    for coef in (0.3, 0.0):
        cfg = rm_config(tmp_path, f"rm{coef}", data, model=tiny_model_dir, center_coef=coef, eval_data=str(held))
        with stage(RewardModel, cfg, "rm") as algo:
            lengths = {len(e["prompt_ids"] + e[s]) for e in algo.examples for s in ("chosen_ids", "rejected_ids")}
            assert len(lengths) > 2  # the micro-batches are padded
            rows = [json.loads(line) for line in data.read_text().splitlines()]
            assert [e["margin"] for e in algo.examples] == [r.get("margin", 0.0) for r in rows]  # the data's own
            for step in (0, 1):
                check_rm_step(algo, step)
            with torch.no_grad():
                rw, rl = hand_pairs(algo, algo.eval_examples)
                got = algo.evaluate(2)
                ref, _ = hand_pairs(algo, algo.examples[: cfg.normalize_samples])
                out = algo.output()  # without --normalize-scale: an offset only
        assert got["eval/accuracy"] == pytest.approx((rw > rl).float().mean().item())
        assert got["eval/margin"] == pytest.approx((rw - rl).mean().item(), rel=1e-4, abs=1e-6)
        assert out.config[OFFSET_KEY] == pytest.approx(ref.mean().item(), abs=1e-5) and out.config[SCALE_KEY] == 1.0
        assert out.kind == "reward" and out.config[HEAD_KEY] == "scalar"


def test_rm_likelihood_head_scores_the_mean_response_log_prob(tiny_model_dir, tmp_path):
    """--head likelihood: the stage's score of a pair's side is β · the mean log-prob of the RESPONSE tokens
    (not the prompt's, not padding) under the model's own LM head, with β from --likelihood-beta; the loss and
    update are the Bradley–Terry ones (with the centring term) of those scores."""
    from stages.rm import RewardModel

    data, held = prefs(tmp_path, 8), prefs(tmp_path, 6, "held.jsonl", skip=100)
    cfg = rm_config(tmp_path, "lik", data, model=tiny_model_dir, head="likelihood", likelihood_beta=3.0,
                    center_coef=0.05, eval_data=str(held))
    with stage(RewardModel, cfg, "rm") as algo:
        from align.data import load_pairs

        want = load_pairs(str(held), "", algo.tok, cfg.max_length, held_out=True)  # --eval-data's pairs, in order
        assert [(e["prompt_ids"], e["chosen_ids"]) for e in algo.eval_examples] == \
            [(e["prompt_ids"], e["chosen_ids"]) for e in want]
        got = check_rm_step(algo, 0)
        assert got["rewards/chosen"] < -1.0  # β · a mean log-prob of a random model: far below 0
        with torch.no_grad():
            rw, rl = hand_pairs(algo, algo.eval_examples)
            ev = algo.evaluate(1)
        out = algo.output()
    assert ev["eval/accuracy"] == pytest.approx((rw > rl).float().mean().item())
    assert ev["eval/margin"] == pytest.approx((rw - rl).mean().item(), rel=1e-4, abs=1e-6)
    # what the artifact's config.json says: the likelihood head with its β (a consumer loads the LM, not a new
    # scalar head)
    from align.reward_model import BETA_KEY, HEAD_KEY

    assert out.config[HEAD_KEY] == "likelihood" and out.config[BETA_KEY] == 3.0


def test_rm_pair_metrics_calibration_buckets_by_hand():
    """pair_metrics of six scored pairs: accuracy over all pairs; each bucket of the Bradley–Terry confidence
    σ(|r_w − r_l|) (0.5-0.6, ..., 0.9-1.0) holds its own pairs, with their count, accuracy and mean confidence;
    an empty bucket is left out; the margin and rewards are in normalised units ((raw − offset) / scale)."""
    from align.reward_model import OFFSET_KEY, SCALE_KEY
    from stages.rm import pair_metrics

    rc = torch.tensor([2.0, 0.1, -1.0, 3.0, 0.5, 0.0])
    rr = torch.tensor([0.0, 0.3, 2.0, 2.9, -0.5, 1.6])  # Δ = 2, −0.2, −3, 0.1, 1, −1.6
    m = pair_metrics(rc, rr, {OFFSET_KEY: 0.5, SCALE_KEY: 2.0})
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = {"0.5-0.6": (2, 0.5, (sig(0.2) + sig(0.1)) / 2), "0.7-0.8": (1, 1.0, sig(1.0)),
            "0.8-0.9": (2, 0.5, (sig(2.0) + sig(1.6)) / 2), "0.9-1.0": (1, 0.0, sig(3.0))}
    for key, (n, acc, conf) in want.items():
        assert m[f"calibration/{key}/n"] == n, key
        assert m[f"calibration/{key}/accuracy"] == pytest.approx(acc), key
        assert m[f"calibration/{key}/confidence"] == pytest.approx(conf, abs=1e-4), key
    assert not any(k.startswith("calibration/0.6-0.7") for k in m)
    assert m["accuracy"] == pytest.approx(0.5) and m["pairs"] == 6
    assert m["margin/mean"] == pytest.approx(((rc - rr) / 2.0).mean().item())
    assert m["rewards/chosen"] == pytest.approx(((rc - 0.5) / 2.0).mean().item())
    assert m["rewards/rejected"] == pytest.approx(((rr - 0.5) / 2.0).mean().item())


def test_rm_normalisation_makes_the_reference_responses_score_zero_mean_unit_std(tiny_model_dir, tmp_path):
    """After training (--normalize-scale, --normalize-samples 5): the saved offset is the mean and the scale the
    std of the raw scores of the chosen responses of the first 5 training pairs; normalization.jsonl and every
    consumer of the saved model (score_ids: PPO, GRPO; `rm score`) read (raw − offset) / scale — in that order,
    tested with an offset far from 0 and a scale far from 1 — so the reference set scores mean 0, std 1."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from align.data import preference_examples
    from align.engine.run import train
    from align.models import load_tokenizer, resolve
    from align.reward_model import OFFSET_KEY, SCALE_KEY, load_reward_model, score_ids
    from stages.rm import RewardModel, RMScoreConfig, run_score

    data = prefs(tmp_path, 8)
    cfg = rm_config(tmp_path, "rm", data, model=tiny_model_dir, normalize_scale=True, max_steps=1)
    cfg.validate()
    try:
        train(cfg, "rm", RewardModel)
    finally:
        unset_hf_deepspeed_config()
    out = Path(cfg.out)
    source = resolve(str(out), expect="reward")
    tok = load_tokenizer(source)
    model = load_reward_model(source, tok, torch.float32).eval()
    config = json.loads((out / "model/config.json").read_text())
    art = json.loads((out / "artifact.json").read_text())
    offset, scale = config[OFFSET_KEY], config[SCALE_KEY]
    assert (art["reward_offset"], art["reward_scale"]) == (offset, scale)

    rows = head("prefs/train.jsonl", 8)
    ex = preference_examples(tok, rows, cfg.max_length)[0]
    with torch.no_grad():
        raw = torch.stack([scalar_score(model, e["prompt_ids"] + e["chosen_ids"]) for e in ex[:5]])
        other = scalar_score(model, ex[6]["prompt_ids"] + ex[6]["rejected_ids"])
    assert offset == pytest.approx(raw.mean().item(), abs=1e-5)
    assert scale == pytest.approx(raw.std().item(), rel=1e-4)
    assert abs(offset) > 0.05 and abs(scale - 1) > 0.5, (offset, scale)  # the order of − and / matters

    ref = [json.loads(line) for line in (out / "normalization.jsonl").read_text().splitlines()]
    assert [r["response_ids"] for r in ref] == [e["chosen_ids"] for e in ex[:5]]
    assert [r["raw"] for r in ref] == pytest.approx(raw.tolist(), abs=1e-5)
    assert [r["reward"] for r in ref] == pytest.approx(((raw - offset) / scale).tolist(), abs=1e-4)

    class Engine(torch.nn.Module):  # score_ids takes an engine: what PPO / GRPO hold (module = the model)
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    seqs = [(e["prompt_ids"], e["chosen_ids"]) for e in ex[:5]] + [(ex[6]["prompt_ids"], ex[6]["rejected_ids"])]
    scored = score_ids(Engine(model), tok, seqs, batch_size=6)  # one padded batch
    want = (torch.cat([raw, other[None]]) - offset) / scale
    torch.testing.assert_close(scored, want, atol=1e-4, rtol=1e-4)
    assert abs(scored[:5].mean().item()) < 1e-4 and scored[:5].std().item() == pytest.approx(1.0, abs=1e-4)

    score_in = write_rows(tmp_path / "score.jsonl", [{"prompt": r["prompt"], "response": r["chosen"]} for r in rows[:5]]
                          + [{"prompt": rows[6]["prompt"], "response": rows[6]["rejected"]}])
    scfg = RMScoreConfig(model=str(out), data=str(score_in), out=str(tmp_path / "scores"), zero_stage=0)
    scfg.validate()
    try:
        run_score(scfg)
    finally:
        unset_hf_deepspeed_config()
    got = [json.loads(line)["reward"] for line in (tmp_path / "scores/scores.jsonl").read_text().splitlines()]
    assert got == pytest.approx(want.tolist(), abs=1e-4)

    # `rm score --columns q=prompt,a=response --max-length 30 --batch-size 4`: renamed columns, prompts cut from
    # the left to fit 30 tokens with the response (+ EOS), every row's normalised score, and the mean / std
    from align.reward_model import encode_scored

    renamed = [{"q": r["prompt"], "a": r["chosen"]} for r in rows[:6]]
    score_in2 = write_rows(tmp_path / "score2.jsonl", renamed)
    whole = prompt_completion(tok, [{"prompt": r["q"], "completion": r["a"]} for r in renamed])
    cut = [(p[max(0, len(p) + len(c) - 30):], c) for p, c in whole]  # the prompt's END kept, the response whole
    assert sum(len(p) < len(w) for (p, _), (w, _) in zip(cut, whole)) >= 2 and all(len(p) + len(r) == 30 for p, r in cut)
    assert encode_scored(tok, [r["q"] for r in renamed], [r["a"] for r in renamed], 30) == cut
    with torch.no_grad():
        want2 = (torch.stack([scalar_score(model, p + r) for p, r in cut]) - offset) / scale
    scfg = RMScoreConfig(model=str(out), data=str(score_in2), out=str(tmp_path / "scores2"), zero_stage=0,
                         columns="q=prompt,a=response", max_length=30, batch_size=4)
    scfg.validate()
    try:
        sm = run_score(scfg)
    finally:
        unset_hf_deepspeed_config()
    got2 = [json.loads(line) for line in (tmp_path / "scores2/scores.jsonl").read_text().splitlines()]
    assert [g["reward"] for g in got2] == pytest.approx(want2.tolist(), abs=1e-4)
    assert sm["rows"] == 6 and sm["reward/mean"] == pytest.approx(want2.mean().item(), abs=1e-4)
    assert sm["reward/std"] == pytest.approx(want2.std().item(), abs=1e-4)

    # `rm eval` (--max-length 40: prompts cut from the left, --batch-size 3: several forwards): its accuracy,
    # rewards and margin are those of the NORMALISED scores of each pair's sides, pairs.jsonl too
    from stages.rm import RMEvalConfig, run_eval

    held_rows = head("prefs/train.jsonl", 7, skip=200)
    held = write_rows(tmp_path / "eval.jsonl", held_rows)
    hx = preference_examples(tok, held_rows, 40)[0]
    assert any(len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) == 40 for e in hx)
    with torch.no_grad():
        nc = (torch.stack([scalar_score(model, e["prompt_ids"] + e["chosen_ids"]) for e in hx]) - offset) / scale
        nr = (torch.stack([scalar_score(model, e["prompt_ids"] + e["rejected_ids"]) for e in hx]) - offset) / scale
    ecfg = RMEvalConfig(model=str(out), data=str(held), out=str(tmp_path / "eval"), zero_stage=0, max_length=40,
                        batch_size=3)
    ecfg.validate()
    try:
        em = run_eval(ecfg)
    finally:
        unset_hf_deepspeed_config()
    assert em["pairs"] == len(hx) == 7
    assert em["accuracy"] == pytest.approx((nc > nr).float().mean().item())
    assert em["rewards/chosen"] == pytest.approx(nc.mean().item(), abs=1e-4)
    assert em["rewards/rejected"] == pytest.approx(nr.mean().item(), abs=1e-4)
    assert em["margin/mean"] == pytest.approx((nc - nr).mean().item(), abs=1e-4)
    assert sum(v for k, v in em.items() if k.endswith("/n")) == 7
    per = [json.loads(line) for line in (tmp_path / "eval/pairs.jsonl").read_text().splitlines()]
    assert [r["reward_chosen"] for r in per] == pytest.approx(nc.tolist(), abs=1e-4)
    assert [r["reward_rejected"] for r in per] == pytest.approx(nr.tolist(), abs=1e-4)
    assert [r["correct"] for r in per] == (nc > nr).tolist()


EOS_PULL = 6.0  # how strongly eos_prone pulls the policy to EOS


def test_rm_normalisation_on_policy_samples_end_in_eos(tiny_model_dir, tmp_path):
    """--columns q=prompt reads the renamed data; --max-length 45 cuts the pairs' prompts from the left (responses
    whole).
    --normalize-on-policy MODEL (a policy made to emit EOS often), --max-new-tokens 6, --normalize-samples 5: the
    reference set is one sample of MODEL per prompt of the first 5 training pairs (those prompts, in order), each
    response at most 6 sampled tokens and ending in exactly one EOS (its own where it finished; appended where the
    budget cut it: the reward model is trained on responses that end in EOS); the saved offset is the mean raw score of exactly those sequences, each scored alone."""
    from align.data import encode_prompts
    from align.models import load_tokenizer, resolve
    from align.reward_model import OFFSET_KEY, SCALE_KEY
    from stages.rm import RewardModel

    data = prefs(tmp_path, 8)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    renamed = write_rows(tmp_path / "renamed.jsonl", [{"q" if k == "prompt" else k: v for k, v in r.items()}
                                                      for r in rows])
    # the policy: the tiny model made to emit EOS often, so that some samples finish and others are cut
    first = encode_prompts(load_tokenizer(resolve(str(tiny_model_dir))), [rows[0]["prompt"]])[0]
    eos_prone(tiny_model_dir, first, EOS_PULL, out=tmp_path / "eos_policy")
    cfg = rm_config(tmp_path, "onpol", renamed, model=tiny_model_dir, normalize_on_policy=str(tmp_path / "eos_policy"),
                    max_new_tokens=6, max_length=45, columns="q=prompt")
    with stage(RewardModel, cfg, "rm") as algo:
        from align.data import encode_completions

        eos, tok = algo.tok.eos_token_id, algo.tok
        cut = 0  # --max-length 45: prompts cut from the LEFT so that prompt + the longer response fits
        for e, r, p in zip(algo.examples, rows, encode_prompts(tok, [r["prompt"] for r in rows])):
            c, j = encode_completions(tok, [r["chosen"], r["rejected"]])
            keep = p[max(0, len(p) + max(len(c), len(j)) - 45):]
            assert (e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) == (keep, c, j)
            cut += len(keep) < len(p)
        assert len(algo.examples) == 8 and cut >= 3
        out = algo.output()
        ref = [json.loads(line) for line in (Path(cfg.out) / "normalization.jsonl").read_text().splitlines()]
        with torch.no_grad():
            raw = torch.stack([scalar_score(algo.rm.module, r["prompt_ids"] + r["response_ids"]) for r in ref])
        assert [r["prompt_ids"] for r in ref] == [e["prompt_ids"] for e in algo.examples[:5]]
    assert all(r["response_ids"][-1] == eos and 2 <= len(r["response_ids"]) <= 7 for r in ref)
    assert all(eos not in r["response_ids"][:-1] for r in ref)
    assert any(len(r["response_ids"]) == 7 for r in ref)  # the budget cut some: their EOS was appended
    assert any(len(r["response_ids"]) <= 6 for r in ref)  # others finished: their own EOS, none appended
    assert [r["raw"] for r in ref] == pytest.approx(raw.tolist(), abs=1e-5)
    assert out.config[OFFSET_KEY] == pytest.approx(raw.mean().item(), abs=1e-5) and out.config[SCALE_KEY] == 1.0


# ---------------------------------------------------------------------------------------------------------- SFT


def sft_config(tmp_path: Path, out: str, data: Path, **kw):
    from stages.sft import SFTConfig

    base = dict(model=str(kw.pop("model")), out=str(tmp_path / out), data=str(data), eval_data="", eval_samples=0,
                batch_size=4, micro_batch_size=2, zero_stage=0, warmup_steps=0, lr=1e-3, seed=3)
    return SFTConfig(**{**base, **kw})


def prompt_completion(tok, rows: list[dict]) -> list[tuple[list, list]]:
    """(prompt ids (chat template), completion ids (+ EOS)) of each row, tokenised here."""
    from align.data import encode_completions, encode_prompts

    return list(zip(encode_prompts(tok, [r["prompt"] for r in rows]),
                    encode_completions(tok, [r["completion"] for r in rows])))


def hand_nll(module, pairs: list[tuple[list, list]]) -> tuple[torch.Tensor, int]:
    """(Σ −log p(completion token | everything before it), number of completion tokens), each sequence alone."""
    total, count = 0.0, 0
    for p, c in pairs:
        ids = torch.tensor([p + c])
        logp = module(input_ids=ids, use_cache=False).logits[0, :-1].float().log_softmax(-1)
        lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
        total = total - lp[len(p) - 1 :].sum()
        count += len(c)
    return total, count


def test_sft_loss_is_the_token_mean_nll_of_completion_tokens_whatever_the_micro_batching(tiny_model_dir, tmp_path):
    """SFT's step on the examples of step_indices(step): the logged loss (and the update's gradient) is the
    token-mean NLL of the COMPLETION tokens of the global batch, computed by hand from the model's logits of each
    sequence alone (prompt and padding carry no loss); the same loss, gradient and weights with one micro-batch
    of 4, two of 2 (gradient accumulation, unequal token counts) and four of 1; held-out eval/loss is the same
    completion NLL."""
    from stages.sft import SFT

    rows = head("arithmetic/train.jsonl", 6)
    held_rows = head("arithmetic/test.jsonl", 3)
    data, held = write_rows(tmp_path / "train.jsonl", rows), write_rows(tmp_path / "held.jsonl", held_rows)
    results = {}
    for micro in (4, 2, 1):
        cfg = sft_config(tmp_path, f"sft{micro}", data, model=tiny_model_dir, micro_batch_size=micro,
                         eval_data=str(held))
        with stage(SFT, cfg, "sft") as algo:
            module, tok = algo.policy.module, algo.tok
            pairs = prompt_completion(tok, rows)
            assert [e["input_ids"] for e in algo.examples] == [p + c for p, c in pairs]
            start = {k: p.detach().clone() for k, p in module.named_parameters()}
            losses = []
            for step in (0, 1):
                idx = step_indices(len(rows), cfg.batch_size, step, cfg.seed)
                nll, n = hand_nll(module, [pairs[i] for i in idx])
                grads, norm = hand_gradient(nll / n, module)
                got = check_update(module, grads, norm, algo.policy, lambda: algo.step(step).reduce("cpu"))
                assert got["loss"] == pytest.approx((nll / n).item(), rel=1e-5)
                assert got["tokens"] == sum(len(pairs[i][0]) + len(pairs[i][1]) for i in idx)
                losses.append((got["loss"], norm))
            with torch.no_grad():
                nll, n = hand_nll(module, prompt_completion(tok, held_rows))
                assert algo.evaluate(2)["eval/loss"] == pytest.approx((nll / n).item(), rel=1e-5)
            end = {k: p.detach().clone() for k, p in module.named_parameters()}
        results[micro] = (losses, start, end)
    (one, w0, w1) = results[4]
    moved = torch.cat([(w1[k] - w0[k]).flatten() for k in w1]).norm()
    for micro in (2, 1):
        losses, _, w = results[micro]
        for (a, ga), (b, gb) in zip(one, losses):
            assert a == pytest.approx(b, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
        assert torch.cat([(w[k] - w1[k]).flatten() for k in w1]).norm() <= 1e-3 * moved


def test_sft_packing_gives_the_loss_of_the_examples_run_separately(tiny_model_dir, tmp_path):
    """--packing: examples share rows of --max-length (two per row here), each with positions restarting at 0 and
    attending only to itself, so a step over every packed row has exactly the token-mean completion NLL (and
    gradient) of the examples each run alone."""
    from stages.sft import SFT

    rows = head("arithmetic/train.jsonl", 8)
    data = write_rows(tmp_path / "train.jsonl", rows)
    cfg = sft_config(tmp_path, "packed", data, model=tiny_model_dir, packing=True, max_length=128, batch_size=4,
                     micro_batch_size=2)
    with stage(SFT, cfg, "sft") as algo:
        module = algo.policy.module
        assert len(algo.examples) == 4 and all(len(r["input_ids"]) <= 128 for r in algo.examples)
        for r in algo.examples:  # two examples per row, the second one's positions start again at 0
            assert r["position_ids"][0] == 0 and r["position_ids"].count(0) == 2
        nll, n = hand_nll(module, prompt_completion(algo.tok, rows))
        grads, norm = hand_gradient(nll / n, module)
        got = check_update(module, grads, norm, algo.policy, lambda: algo.step(0).reduce("cpu"))
    assert got["loss"] == pytest.approx((nll / n).item(), rel=1e-5)


PASS_JUDGE = '''import json

def judge(prompt, completion, **row):
    """Correct when the completion has an even number of characters; logs each call."""
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompt": prompt, "completion": completion}}) + "\\n")
    return float(len(completion) % 2 == 0)
'''


def greedy_text(module, tok, prompt_ids: list, max_new: int) -> str:
    """The model's greedy continuation of ONE prompt by argmax (stops at EOS), decoded."""
    return tok.decode(greedy_ids(module, prompt_ids, max_new, tok.eos_token_id), skip_special_tokens=True)


def test_sft_held_out_pass_at_1_and_max_length(chatty_model_dir, tmp_path):
    """SFT's options beyond the loss: --columns question=prompt reads the renamed data; --max-length 40 cuts prompts from the LEFT (each example's ids are the last
    tokens of prompt + completion that fit; its completion whole, its labels only the completion's) and drops an
    example whose completion alone does not fit; held-out pass@1 runs on the first --eval-samples 2 rows with an
    `answer`, greedy, at most --max-new-tokens 4 tokens, judged by --verifier: the judge sees exactly those
    continuations of the policy, eval/pass@1 is the mean of its verdicts."""
    from align.data import encode_prompts
    from stages.sft import SFT

    log = tmp_path / "verdicts.jsonl"
    judge = tmp_path / "judge.py"
    judge.write_text(PASS_JUDGE.format(log=str(log)))
    rows = head("arithmetic/train.jsonl", 6) + [{"prompt": "hi", "completion": " ".join(["word"] * 60)}]
    held_rows = head("arithmetic/test.jsonl", 4)
    data = write_rows(tmp_path / "train.jsonl", [{"question": r["prompt"], "completion": r["completion"]} for r in rows])
    held = write_rows(tmp_path / "held.jsonl", held_rows)
    cfg = sft_config(tmp_path, "sftpass", data, model=chatty_model_dir, eval_data=str(held), eval_samples=2,
                     max_new_tokens=4, verifier=f"{judge}:judge", max_length=40, columns="question=prompt")
    with stage(SFT, cfg, "sft") as algo:
        log.unlink()  # the judge's calls on the first rows before any model was built
        tok, module = algo.tok, algo.policy.module
        pairs = prompt_completion(tok, rows[:6])
        assert len(algo.examples) == 6  # the long completion's example dropped
        cut = 0
        for e, (p, c) in zip(algo.examples, pairs):
            keep = p[max(0, len(p) + len(c) - 40):]
            cut += len(keep) < len(p)
            assert e["input_ids"] == keep + c and e["labels"] == [-100] * len(keep) + c and e["n_labels"] == len(c)
        assert cut > 0
        m = algo.evaluate(1)
        want = [greedy_text(module, tok, p, 4) for p in encode_prompts(tok, [r["prompt"] for r in held_rows[:2]])]
    judged = [json.loads(x) for x in log.read_text().splitlines()]
    assert [j["prompt"] for j in judged] == [r["prompt"] for r in held_rows[:2]]
    assert [j["completion"] for j in judged] == want and all(w.strip() for w in want)
    assert m["eval/pass@1"] == pytest.approx(sum(len(w) % 2 == 0 for w in want) / 2)


PARITY = "def parity(prompt, completion, **row):\n    return float(len(completion) % 2 == 0)\n"


@pytest.mark.parametrize("use_evaluate", [False, True])
def test_held_out_pass_at_k_groups_each_problems_own_samples(chatty_model_dir, tmp_path, use_evaluate):
    """align.rollout.evaluation.evaluate_policy with 3 problems and --samples 4 (k = 1, 2, 4; 8 dropped: k > n): problem i's
    saved samples are exactly the 4 the sampler gives ITS prompt (sampling keys i·4 … i·4 + 3, generated here
    alone, not sliced from the stage's batch), its n_correct is the verifier's count over them, and each pass@k is
    the mean over problems of the unbiased 1 − C(n−c, k) / C(n, k) of those counts (through align.passk and
    through the shipped `evaluate` metric); greedy pass@1 is the mean of the greedy verdicts."""
    from math import comb

    from align.data import encode_prompts
    from align.rewards import verifier_fn
    from align.rollout.evaluation import evaluate_policy
    from align.rollout.generation import Sampling, generate_local
    from stages.sft import SFT

    judge = tmp_path / "parity.py"
    judge.write_text(PARITY)
    rows = head("arithmetic/test.jsonl", 3)
    data = write_rows(tmp_path / "train.jsonl", head("arithmetic/train.jsonl", 2))
    cfg = sft_config(tmp_path, "passk", data, model=chatty_model_dir)
    s, n = Sampling(max_new_tokens=5, temperature=1.0, seed=11), 4
    with stage(SFT, cfg, "sft") as algo:
        tok, module = algo.tok, algo.policy.module
        m, recs = evaluate_policy(algo.policy.eng, tok, rows, algo.run.dist, ks=(1, 2, 4, 8), samples=n, sampling=s,
                                  verifier=f"{judge}:parity", batch_size=5, use_evaluate=use_evaluate)
        prompts = encode_prompts(tok, [r["prompt"] for r in rows])
        own = [[c.text for c in generate_local(module, tok, [p] * n, s, n, "cpu", indices=range(i * n, (i + 1) * n))]
               for i, p in enumerate(prompts)]
        greedy = [greedy_text(module, tok, p, 5) for p in prompts]
    check = verifier_fn(f"{judge}:parity")
    assert [r["samples"] for r in recs] == own
    assert len({tuple(o) for o in own}) == 3  # the problems' samples differ: a wrong grouping shows
    cs = [sum(int(check(r["prompt"], t) == 1.0) for t in o) for r, o in zip(rows, own)]
    assert [r["n_correct"] for r in recs] == cs and 0 < sum(cs) < 3 * n
    assert len(set(cs)) > 1 or any(0 < c < n for c in cs)
    for k in (1, 2, 4):
        want = sum(1 - comb(n - c, k) / comb(n, k) for c in cs) / 3
        assert m[f"pass@{k}"] == pytest.approx(want, abs=1e-9)
    assert "pass@8" not in m and m["problems"] == 3
    assert [r["greedy"] for r in recs] == greedy
    assert m["pass@1/greedy"] == pytest.approx(sum(len(g) % 2 == 0 for g in greedy) / 3)


def test_sft_grad_clip_and_eval_every_reach_the_run(tiny_model_dir, tmp_path):
    """--grad-clip 1e-12: the update's gradient is clipped to that norm before AdamW, whose step of a gradient far
    below its ε moves no weight by more than 1e-4·lr (at the default clip 1.0 the same step moves them by ~lr);
    the logged grad_norm is the norm before clipping. --eval-every 1 over --max-steps 3: the held-out evaluation
    runs after steps 1 and 2 and at the end (3), each logged as eval/loss."""
    from stages.sft import SFT

    rows, held_rows = head("arithmetic/train.jsonl", 6), head("arithmetic/test.jsonl", 2)
    data, held = write_rows(tmp_path / "train.jsonl", rows), write_rows(tmp_path / "held.jsonl", held_rows)
    moved = {}
    for clip in (1e-12, 1.0):
        cfg = sft_config(tmp_path, f"clip{clip}", data, model=tiny_model_dir, grad_clip=clip)
        with stage(SFT, cfg, "sft") as algo:
            w0 = torch.cat([p.detach().flatten().clone() for p in algo.policy.module.parameters()])
            algo.step(0)
            norm = algo.policy.metrics()["grad_norm"]
            w1 = torch.cat([p.detach().flatten() for p in algo.policy.module.parameters()])
            moved[clip] = ((w1 - w0).abs().max().item(), norm)
    lr = sft_config(tmp_path, "x", data, model=tiny_model_dir).lr
    assert moved[1e-12][0] < 1e-4 * lr and moved[1.0][0] > 0.5 * lr
    assert moved[1e-12][1] == pytest.approx(moved[1.0][1], rel=1e-5) and moved[1.0][1] > 1e-3  # before clipping
    cfg = sft_config(tmp_path, "every", data, model=tiny_model_dir, eval_data=str(held), eval_every=1, max_steps=3)
    evaluated = []
    with stage(SFT, cfg, "sft") as algo:
        evaluate = algo.evaluate
        algo.evaluate = lambda s: evaluated.append(s) or evaluate(s)
        algo.run.fit(algo)
    logged = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert evaluated == [1, 2, 3]
    assert sorted(r["step"] for r in logged if "eval/loss" in r) == [1, 2, 3]


def test_sft_held_out_loss_is_the_token_mean_over_every_chunk(tiny_model_dir, tmp_path):
    """70 held-out examples (scored 64 at a time: two chunks of unequal size and token count): eval/loss is the
    token-mean completion NLL over all 70 (Σ NLL / Σ completion tokens), not a mean of the chunks' means."""
    from stages.sft import SFT

    rows, held_rows = head("arithmetic/train.jsonl", 4), head("arithmetic/test.jsonl", 70)
    data, held = write_rows(tmp_path / "train.jsonl", rows), write_rows(tmp_path / "held.jsonl", held_rows)
    cfg = sft_config(tmp_path, "held70", data, model=tiny_model_dir, eval_data=str(held))
    with stage(SFT, cfg, "sft") as algo, torch.no_grad():
        pairs = prompt_completion(algo.tok, held_rows)
        total, n = hand_nll(algo.policy.module, pairs)
        (a, na), (b, nb) = hand_nll(algo.policy.module, pairs[:64]), hand_nll(algo.policy.module, pairs[64:])
        got = algo.evaluate(0)["eval/loss"]
    assert got == pytest.approx((total / n).item(), rel=1e-5)
    assert abs((a / na + b / nb).item() / 2 - got) > 1e-4  # the chunks' mean would differ
