"""Off-policy GRPO (--max-staleness) in one process: the stage's step at staleness 0 (the queue's synchronous case)
is the synchronous step written out, bit for bit, and a step at staleness 1 is the off-policy step with truncated
importance sampling written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from align.engine.run import StageRun
from align.engine.stats import Stats
from align.rollout.batch import timed
from align.tools.sandbox import isolation
from tests.conftest import parity_reward, small_data


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


def config(tmp_path, model, name: str, **over):
    from stages.grpo import GRPOConfig

    over = {"reward": [parity_reward()], "max_new_tokens": 6, **over}
    cfg = GRPOConfig(model=str(model), out=str(tmp_path / name), eval_data="", data=str(small_data()["arith"]),
                     prompts_per_step=2, num_generations=4, micro_batch_size=8, lr=1e-2, warmup_steps=0,
                     zero_stage=0, **over)
    cfg.validate()
    return cfg


def weights(algo) -> dict:
    return {k: v.detach().clone() for k, v in algo.policy.module.state_dict().items()}


def synchronous_step(algo, step: int) -> Stats:
    """GRPO's synchronous step written out: rollout `step` sampled now from the current weights (a phase of the
    step, timed), then its rewards, advantages and update, and the step's metrics."""
    stats, times = Stats(), {}
    with timed(times, "time/generate"):
        r = algo.local_rollout(step)
    algo.record(r, algo.learn(r, stats, times), stats, times)
    return stats


def steps(cfg, n: int, written_out: bool = False) -> tuple[list[dict], dict, dict]:
    """n steps of a GRPO run built in this process (`written_out`: each step the synchronous step written out, not
    the stage's): (each step's metrics, the weights after them, the stage's resumable state)."""
    from stages.grpo import GRPO

    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        if written_out:
            algo.step = lambda s: synchronous_step(algo, s)
        rows = [run._step(algo, s)[0] for s in range(n)]
        return rows, weights(algo), algo.state_dict()


# multi-turn episodes: an environment answering each turn (ended at common texts) until the third
EPISODES = {"env": f"{Path(__file__).parent / 'fixtures' / 'user_env.py'}:ShortTurns",
            "reward": ["env", parity_reward()], "max_turns": 3, "max_new_tokens": 8}


@pytest.mark.parametrize("kind", ["completions", "episodes"])
def test_the_queue_at_staleness_0_is_the_synchronous_step_bit_for_bit(tiny_model_dir, tmp_path, kind):
    """--max-staleness 0 in one process: the stage's step takes its rollout from the queue, whose LocalSampler
    samples rollout t in step t, right before its update; that is the synchronous step, bit for bit: the same
    metrics (no rollout/staleness nor time/wait: nothing is stale or waited for), the same weights, and a state
    without rollouts (none is kept between steps: a checkpoint holds what it held without the queue). Also with
    multi-turn episodes (--env)."""
    if kind == "episodes" and isolation() is None:
        pytest.skip("this machine cannot isolate a process's network: no user environment runs")
    over = EPISODES if kind == "episodes" else {}
    sync, w_sync, _ = steps(config(tmp_path, tiny_model_dir, "sync", **over), 3, written_out=True)
    queued, w_queued, state = steps(config(tmp_path, tiny_model_dir, "queued", **over), 3)
    if kind == "episodes":
        assert all(r["num_turns/mean"] > 1 for r in sync)  # several turns: the environment's tokens in between
    assert [list(r) for r in queued] == [list(r) for r in sync] and "time/generate" in sync[0]

    def timeless(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and "per_s" not in k} for r in rows]

    assert timeless(queued) == timeless(sync) and sync[0]["loss"] != sync[1]["loss"]
    assert all(torch.equal(w_sync[k], w_queued[k]) for k in w_sync)
    assert state == {"beta": 0.0}


def response_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * batch["response_mask"]


def test_a_stale_step_is_the_off_policy_step_with_truncated_importance_weights(tiny_model_dir, tmp_path):
    """Staleness 1: step 1 trains on rollout 1, sampled from θ_0 (before update 0), at θ_1. The loss is
    token-mean of −A · min(π_θ1 / π_θ0, C) over the kept tokens (the clip loss at ratio π_θ/π_old = 1: π_old is the
    trainer's θ_1), its gradient −A · w · ∇log π_θ1; A = r − the group's mean (--advantage mean), r the parity
    reward. Computed here from the rollout's logged sampler log-probs on plain copies of θ_0 and θ_1."""
    from align.models import load_causal_lm, load_tokenizer, resolve
    from align.rollout.batch import rollout_batch
    from stages.grpo import GRPO

    cap = 1.2
    cfg = config(tmp_path, tiny_model_dir, "stale", max_staleness=1, tis_cap=cap, advantage="mean",
                 drop_zero_std_groups=True, loss_agg="token-mean")
    source = resolve(str(tiny_model_dir))
    tok = load_tokenizer(source)
    theta0 = load_causal_lm(source, tok, torch.float32, 0)
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        first, _ = run._step(algo, 0)
        (pending,) = algo.rollouts.queue
        assert (pending.step, pending.version) == (1, 0) and first["rollout/staleness"] == 0
        theta1 = load_causal_lm(source, tok, torch.float32, 0)
        theta1.load_state_dict(weights(algo))
        got, _ = run._step(algo, 1)

    batch = rollout_batch(pending.completions, tok.pad_token_id, "cpu")
    mask = batch["response_mask"]
    with torch.no_grad():  # the sampler's log-probs are θ_0's: the rollout was sampled before update 0
        assert (response_logprobs(theta0, batch, cfg.temperature) - batch["sampler_logp"]).abs().max() < 1e-5
    rewards = torch.tensor([float(len(c.text) % 2) for c in pending.completions]).view(-1, cfg.num_generations)
    adv = rewards - rewards.mean(1, keepdim=True)
    keep = (adv != 0).any(1, keepdim=True).float().expand_as(adv).reshape(-1, 1)
    lp1 = response_logprobs(theta1, batch, cfg.temperature)
    w = torch.exp(lp1.detach() - batch["sampler_logp"]).clamp(max=cap)
    assert (w < cap).any() and (w[mask.bool()] == cap).any() and (w[mask.bool()] != 1).all()  # the weights act
    loss = -(adv.reshape(-1, 1) * w * lp1.exp() / lp1.exp().detach() * mask * keep).sum() / mask.sum()
    loss.backward()
    norm = torch.cat([p.grad.flatten() for p in theta1.parameters() if p.grad is not None]).norm().item()
    assert got["rollout/staleness"] == 1 and got["rollout/stale_logp_abs_diff"] > 1e-3
    assert "rollout/logp_abs_diff" not in got  # RLMonitor's rollout_mismatch judges fresh rollouts only
    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7) and loss.item() != 0
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_the_queued_rollout_is_in_the_stages_checkpoint_state(tiny_model_dir, tmp_path):
    """Staleness 1: after step 0 the queue holds rollout 1 (sampled from θ_0); the stage's state (what a
    checkpoint saves, through JSON) carries it — tokens, texts, EOS flags and the sampler's log-probs — and a stage
    restored from that state trains step 1 on exactly those completions, one step stale, rather than sampling anew."""
    import json

    from stages.grpo import GRPO

    cfg = config(tmp_path, tiny_model_dir, "saved", max_staleness=1)
    with StageRun(cfg, "grpo") as run:
        algo = GRPO(cfg, run)
        run._step(algo, 0)
        (pending,) = algo.rollouts.queue
        state = json.loads(json.dumps(algo.state_dict()))
    cfg2 = config(tmp_path, tiny_model_dir, "restored", max_staleness=1)
    with StageRun(cfg2, "grpo") as run:
        algo = GRPO(cfg2, run)
        algo.load_state_dict(state)
        (restored,) = algo.rollouts.queue
        assert (restored.step, restored.version) == (1, 0)
        assert [(c.prompt_ids, c.ids, c.text, c.finished) for c in restored.completions] == \
            [(c.prompt_ids, c.ids, c.text, c.finished) for c in pending.completions]
        # the sampler's log-probs too: truncated IS after a resume weighs by θ_0's, not by nothing
        assert all(c.logps is not None for c in pending.completions)
        assert [c.logps for c in restored.completions] == [c.logps for c in pending.completions]
        trained = []
        learn = algo.learn
        algo.learn = lambda r, *a: trained.append([c.ids for c in r.completions]) or learn(r, *a)
        got, _ = run._step(algo, 1)
    assert got["rollout/staleness"] == 1 and trained == [[c.ids for c in pending.completions]]


@pytest.mark.parametrize("env, over, cuda, want", [
    ({"WORLD_SIZE": "2"}, {}, True, (1, 1, 2.0)),  # 2 GPUs: 1 decodes, 1 trains, one step off with TIS
    ({"WORLD_SIZE": "8"}, {"max_staleness": 2, "tis_cap": 5.0}, True, (4, 2, 5.0)),  # what the user set is kept
    ({}, {"nproc": 4}, True, (2, 1, 2.0)),  # the launcher's process (--nproc) resolves it as its workers will
    ({"WORLD_SIZE": "2"}, {"nnodes": 2, "node_rank": 0}, True, (0, 0, 0.0)),  # several machines: not measured
    ({"WORLD_SIZE": "2"}, {}, False, (0, 0, 0.0)),  # CPUs: every process samples and trains
    ({"WORLD_SIZE": "1"}, {}, True, (0, 0, 0.0)),  # one GPU
    ({"WORLD_SIZE": "2"}, {"rollout_gpus": 0}, True, (0, 0, 0.0)),  # asked: synchronous
    ({"WORLD_SIZE": "4"}, {"rollout_gpus": 1}, True, (1, 0, 0.0)),  # asked: its own staleness (0)
])
def test_rollout_gpus_auto_resolves_before_the_roles_are_split(monkeypatch, env, over, cuda, want):
    """--rollout-gpus -1 (the default) becomes a number in the config every process resolves (GRPOConfig.automatic,
    before the roles are split, and again in StageRun): half the processes decode on several GPUs of one machine
    (staleness 1, TIS cap 2 where left at 0), else 0."""
    from align.config import build
    from stages.grpo import GRPOConfig

    for k in ("WORLD_SIZE", "ALIGN_GLOBAL_WORLD"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert GRPOConfig(**over).rollout_gpus == -1 or "rollout_gpus" in over  # a config is never rewritten
    built = build(GRPOConfig, None, over)  # validated; its automatic values still left to the run
    assert built.rollout_gpus == over.get("rollout_gpus", -1)
    cfg = built.resolved()
    assert (cfg.rollout_gpus, cfg.max_staleness, cfg.tis_cap) == want
    said = {k: why for k, (_, why) in built.automatic().items() if why}  # what the run's choices line says
    assert ("rollout_gpus" in said) == (want[0] > 0 and "rollout_gpus" not in over)
