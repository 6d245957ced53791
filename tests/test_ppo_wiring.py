"""PPO's wiring pinned by values: the stage (stages/ppo.py) built in-process on the tiny models, its step, scores,
advantages and update run on fixed rollouts, and every number compared with the same quantity written out by hand
from fresh copies of the models (their own forwards): which model is the reference, which terms carry gradient
(the gradients the update's backward passes give each parameter, read with tensor hooks), which signs, which
tokens count, which options reach which term, and the data order. The formulas themselves (align/objectives) are
unit-tested in tests/test_ppo_rl.py; here: that the stage calls them with the right inputs.

Every stage runs ZeRO-0 in fp32 (the weights are plain tensors: hooks and copies read them) and uncompiled."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from align.engine.stats import Stats
from align.rollout.batch import Rollout
from align.rollout.generation import Completion
from stages.ppo import PPO, PPOConfig
from tests.conftest import applied_lrs, decay_groups, greedy_ids, stage_in_process

BASE = dict(zero_stage=0, compile=False, eval_data="", ptx_coef=0.0, prompts_per_step=4, minibatch_size=4,
            micro_batch_size=2, ppo_epochs=1, max_new_tokens=6, schedule="constant", warmup_steps=0, seed=0)


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_reward_model_dir, tiny_model_dir, shipped_tokenizer):
    """The tiny policy and reward model (tests/conftest.py), another random policy (seed 1: a --ref-model that
    differs from the policy before any update), another sequence classifier (seed 2, offset −0.3: a --value-model
    that differs from the RM), prompts and two ptx texts."""
    from align.models import load_causal_lm, resolve
    from align.paths import DATA_DIR

    from align.reward_model import OFFSET_KEY, load_sequence_classifier

    d = tmp_path_factory.mktemp("ppo_wiring")
    other, value = d / "other", d / "value"
    load_causal_lm(resolve("tiny"), shipped_tokenizer, torch.float32, seed=1).save_pretrained(other)
    shipped_tokenizer.save_pretrained(other)
    v = load_sequence_classifier(resolve("tiny"), shipped_tokenizer, torch.float32, seed=2)
    v.config.pad_token_id = shipped_tokenizer.pad_token_id
    setattr(v.config, OFFSET_KEY, -0.3)
    v.save_pretrained(value)
    shipped_tokenizer.save_pretrained(value)
    rows = [json.loads(line) for line in (DATA_DIR / "arithmetic/train.jsonl").read_text().splitlines()[:16]]
    texts = [{"text": "Sam had 5 apples and ate 2."}, {"text": "Sorted, the numbers 3 1 2 become 1 2 3."}]
    return {"policy": tiny_model_dir, "rm": tiny_reward_model_dir, "other": other, "value": value,
            "prompts": write_jsonl(d / "prompts.jsonl", rows), "text": write_jsonl(d / "text.jsonl", texts)}


def stage(files, tmp_path, name: str = "ppo", **kw):
    """The PPO stage on the tiny policy and RM, BASE's settings overridden by `kw`."""
    cfg = PPOConfig(model=str(files["policy"]), reward_model=str(files["rm"]), data=str(files["prompts"]),
                    ptx_data=str(files["text"]), out=str(tmp_path / name), **{**BASE, **kw})
    return stage_in_process(cfg, "ppo", PPO)


# ---- fixed rollouts and the hand-written quantities

RESPONSES = [([40, 41, 42], True), ([43, 44, 45, 46, 47, 48], False), ([49, 50], True), ([51, 52, 53, 54], False),
             ([55, 56, 57, 58, 59], True), ([60, 61, 62, 63, 64, 65], False), ([66], True), ([67, 68, 69], False)]


def rollout(algo, n: int = 4) -> Rollout:
    """n episodes of the first n prompts: responses of different lengths, with (finished) and without EOS."""
    eos = algo.tok.eos_token_id
    comps = [Completion(algo.prompt_ids[i], ids + [eos] * done, "", done) for i, (ids, done) in enumerate(RESPONSES[:n])]
    return Rollout(algo.rows[:n], comps, 1)


def causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def classifier(path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()


def hand_logp(model, batch, temperature: float = 1.0):
    """(log π(x_{t+1} | x_≤t), entropy of π(· | x_≤t)) at logits / T, on the response tokens only (0 elsewhere)."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float() / temperature
    lp = logits.log_softmax(-1)
    m = batch["response_mask"]
    return lp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * m, -(lp.exp() * lp).sum(-1) * m


def hand_values(rm, batch):
    """The value head at every position (in the RM's normalised units: (raw − offset) / scale), [N, L−1]."""
    from align.reward_model import normalized_reward

    h = getattr(rm, rm.base_model_prefix)(input_ids=batch["input_ids"]).last_hidden_state
    return normalized_reward(rm.score(h)[..., 0][:, :-1].float(), rm.config)


def hand_rm_scores(rm, r: Rollout) -> torch.Tensor:
    """The RM's normalised score of each prompt + response (EOS included), one sequence at a time."""
    from align.reward_model import normalized_reward

    with torch.no_grad():
        raw = torch.stack([rm(input_ids=torch.tensor([c.prompt_ids + c.ids])).logits[0, 0].float() for c in r.completions])
    return normalized_reward(raw, rm.config)


def last_positions(mask):
    return [int(row.nonzero().max()) for row in mask]


def hand_token_rewards(s, kl, mask, beta):
    """r_t = −β·KL_t on the response tokens, + s on each row's last response token."""
    r = -beta * kl * mask
    for i, t in enumerate(last_positions(mask)):
        r[i, t] += s[i]
    return r


def hand_gae(rewards, values, mask, gamma, lam):
    """GAE over each row's response positions (V after the last one is 0); returns = A + V."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        pos = mask[i].nonzero().flatten().tolist()
        a = 0.0
        for j in reversed(range(len(pos))):
            t = pos[j]
            v_next = float(values[i, pos[j + 1]]) if j + 1 < len(pos) else 0.0
            a = float(rewards[i, t]) + gamma * v_next - float(values[i, t]) + gamma * lam * a
            adv[i, t] = a
    return adv, (adv + values.double()) * mask


def hand_whiten(x, mask):
    sel = x[mask.bool()].double()
    return (x.double() - sel.mean()) / torch.sqrt(sel.var() + 1e-8) * mask


def rewards_from_returns(returns, mask):
    """With γ = λ = 1 the returns are the reward-to-go R_t = Σ_{t' ≥ t} r_t', so r_t = R_t − R_{t+1}."""
    nxt = torch.cat([returns[:, 1:], torch.zeros_like(returns[:, :1])], 1)
    return (returns - nxt) * mask


def close(got, want, tol=2e-5):
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


@contextlib.contextmanager
def grads_of(module):
    """{name: the sum of the gradients every backward pass gives this parameter} while the block runs."""
    got, handles = {}, []
    for name, p in module.named_parameters():
        if p.requires_grad:
            def hook(g, name=name):
                got[name] = got.get(name, 0) + g.detach().clone()
            handles.append(p.register_hook(hook))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def assert_same_grads(got: dict, model, loss, what: str):
    """The stage's gradients equal d loss / d θ of the hand-written loss on `model` (a fresh copy)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    want = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    flat_w = torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, (_, p) in zip(want, named)])
    flat_g = torch.cat([(got[n] if n in got else torch.zeros_like(p)).flatten() for n, p in named])
    assert flat_w.norm() > 0, what
    err = ((flat_g - flat_w).norm() / flat_w.norm()).item()
    assert err < 1e-4, f"{what}: the update's gradient is off the hand-written loss's by {err:.3g} (relative)"


def params(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


# ---- the tests


def test_the_reference_is_the_frozen_start_and_the_kl_penalty_scales_with_beta(files, tmp_path):
    """After a PPO step has moved the policy, the stage's reference log-probs (on a fixed rollout) are still the
    initial model's, its π_old the updated policy's (they differ), the per-token KL k1 = log π_old − log π_ref, and
    the per-token rewards read back from the returns (γ = λ = 1: reward-to-go) are −β·KL on every response token
    + the score on the last one, for β = 0.3 and β = 0 alike; the next step's sampled batch has a KL ≠ 0."""
    with stage(files, tmp_path, lr=1e-2, gamma=1.0, lam=1.0, init_kl_coef=0.3, fixed_kl=True) as algo:
        first = algo.step(0).reduce("cpu")
        assert first["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # the first rollout: π_old = π_ref
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        m = batch["response_mask"]
        s = torch.tensor([0.7, -1.2, 0.4, 2.0])
        ro = algo.advantages(batch, s, 0.3)
        ro0 = algo.advantages(batch, s, 0.0)
        with torch.no_grad():
            ref, _ = hand_logp(causal_lm(files["policy"]), batch)
            now, _ = hand_logp(algo.policy.module, batch)
        close(ro["ref_logp"] * m, ref)
        close(ro["old_logp"] * m, now)
        assert ((now - ref).abs().sum() / m.sum()).item() > 1e-2  # the policy moved, the reference did not
        close(ro["kl"], (now - ref) * m)
        for beta, out in ((0.3, ro), (0.0, ro0)):
            close(rewards_from_returns(out["returns"], m), hand_token_rewards(s, (now - ref) * m, m, beta), 1e-4)
        second = algo.step(1).reduce("cpu")
    # k1 on the next sampled batch: not 0 (a reference that is the policy gives exactly 0); its sign is noise
    assert abs(second["objective/kl"]) > 1e-3 and second["kl"] != 0 and second["kl_coef"] == 0.3


def test_advantages_are_whitened_gae_of_the_token_rewards_with_the_chosen_kl_estimator(files, tmp_path):
    """--kl-estimator k3, --ref-model (another random model), --value-model (another classifier), --gamma 0.9,
    --lam 0.8, --temperature 0.7: on a fixed rollout of uneven responses the stage's π_old and π_ref are the models'
    log-probs at logits / T, V_old the --value-model's head at each response position (normalised by its offset), KL_t = k3 = e^r − r − 1 (r = log π_ref − log π_old), the
    advantages GAE(γ, λ) of r_t = −β·KL_t (+ s on the last response token) whitened over the response tokens only,
    the returns GAE + V_old; all 0 on the prompt and the padding."""
    beta, gamma, lam, temp = 0.25, 0.9, 0.8, 0.7
    with stage(files, tmp_path, ref_model=str(files["other"]), value_model=str(files["value"]), kl_estimator="k3",
               gamma=gamma, lam=lam, temperature=temp) as algo:
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        m = batch["response_mask"]
        s = torch.tensor([1.5, -0.5, 0.25, -2.0])
        ro = algo.advantages(batch, s, beta)
    with torch.no_grad():
        old, _ = hand_logp(causal_lm(files["policy"]), batch, temp)
        ref, _ = hand_logp(causal_lm(files["other"]), batch, temp)
        values = hand_values(classifier(files["value"]), batch) * m
    r = (ref - old) * m
    kl = (torch.exp(r) - r - 1) * m
    assert (kl > 0.01).sum() > m.sum() / 2  # the two models differ: the KL term is not a zero
    close(ro["old_logp"] * m, old)
    close(ro["ref_logp"] * m, ref)
    close(ro["old_values"], values)
    close(ro["kl"], kl)
    adv, returns = hand_gae(hand_token_rewards(s, kl, m, beta), values, m, gamma, lam)
    close(ro["returns"], returns, 1e-4)
    close(ro["adv"], hand_whiten(adv, m), 1e-4)


def test_the_update_takes_the_gradients_of_the_clipped_policy_and_value_losses(files, tmp_path):
    """One minibatch, one optimiser step of each network (micro-batches of 2), π_old and V_old shifted so that
    every clip is active somewhere, sampler log-probs beside π_old (--tis-cap 1.2): the gradients the update gives
    the policy are those of the token mean of −min(ρA, clip(ρ, 1 ± ε)A)·min(π_old/π_sampler, 1.2), ρ = π_θ/π_old
    at logits / T, written out on a fresh copy of the policy (none from the value loss, none through π_old or A);
    the value network's are those of c_vf · token mean of ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)
    (none from the policy loss); the logged losses, clip fractions (low, high, value), entropy and approx-KL are
    the hand-written ones; each network's first AdamW step is its own --lr / --vf-lr; V moves toward R."""
    temp, eps, eps_v, c_vf, cap, lr, vf_lr = 0.7, 0.15, 0.05, 0.5, 1.2, 1e-4, 1e-5
    with stage(files, tmp_path, temperature=temp, cliprange=eps, cliprange_value=eps_v, vf_coef=c_vf, tis_cap=cap,
               lr=lr, vf_lr=vf_lr) as algo:
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        m = batch["response_mask"]
        ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
        g = torch.Generator().manual_seed(0)
        shift = (torch.randint(0, 2, m.shape, generator=g) * 2 - 1) * m
        full = {**batch, **ro, "old_logp": ro["old_logp"] + 0.45 * shift,
                "old_values": ro["old_values"] + 0.2 * shift.roll(1, 1)}
        full["sampler_logp"] = full["old_logp"] - 0.3 * shift.roll(2, 1)
        stats = Stats()
        w_pol, w_val = params(algo.policy.module), params(algo.value.module)
        with grads_of(algo.policy.module) as pol_g, grads_of(algo.value.module) as val_g:
            algo.update(0, full, stats)
        step_pol = (params(algo.policy.module) - w_pol).abs().max().item()
        step_val = (params(algo.value.module) - w_val).abs().max().item()
        got = stats.reduce("cpu")
        with torch.no_grad():
            v_after = hand_values(algo.value.module, batch)
    pol, val = causal_lm(files["policy"]), classifier(files["rm"])
    logp, ent = hand_logp(pol, batch, temp)
    adv, old = full["adv"], full["old_logp"]
    ratio = torch.exp(logp - old)
    tis = torch.exp(old - full["sampler_logp"]).clamp(max=cap)
    assert ((tis == cap) & m.bool()).any() and ((tis < 1) & m.bool()).any()
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv) * m
    low, high = ((ratio < 1 - eps) & (adv < 0) & m.bool()), ((ratio > 1 + eps) & (adv > 0) & m.bool())
    assert low.any() and high.any() and (m.bool() & ~low & ~high).any()
    n = m.sum()
    assert_same_grads(pol_g, pol, (pg * tis).sum() / n, "policy")
    values = hand_values(val, batch)
    v_old, ret = full["old_values"], full["returns"]
    clipped_v = v_old + (values - v_old).clamp(-eps_v, eps_v)
    vf = 0.5 * torch.maximum((values - ret) ** 2, (clipped_v - ret) ** 2) * m
    vclip = ((clipped_v - ret) ** 2 > (values - ret) ** 2) & m.bool()
    assert vclip.any() and (m.bool() & ~vclip).any()
    assert_same_grads(val_g, val, c_vf * vf.sum() / n, "value")
    lr_ = logp.detach() - old
    want = {"loss/policy": (pg * tis).sum() / n, "loss/value": vf.sum() / n, "clip_ratio/low": low.sum() / n,
            "clip_ratio/high": high.sum() / n, "clip_ratio": (low | high).sum() / n, "val/clipfrac": vclip.sum() / n,
            "entropy": ent.sum() / n, "policy/approxkl": ((torch.exp(lr_) - lr_ - 1) * m).sum() / n}
    for k, v in want.items():
        assert got[k] == pytest.approx(v.item(), rel=1e-4, abs=1e-6), k
    assert step_pol == pytest.approx(lr, rel=0.05) and step_val == pytest.approx(vf_lr, rel=0.05)
    before = (((values.detach() - ret) ** 2) * m).sum()
    assert (((v_after - ret) ** 2) * m).sum() < before  # the value network moved toward the returns


def test_the_entropy_bonus_raises_the_policy_entropy_and_is_off_at_zero(files, tmp_path):
    """With every advantage 0 the clipped surrogate gives no gradient: --ent-coef 0.05 alone moves the policy,
    along −0.05·∇(token mean of the entropy at logits / T) (hand-written on a fresh copy), and the entropy on those
    tokens rises after the step; --ent-coef 0 leaves the policy's weights and entropy as they were."""
    temp, c_ent = 0.7, 0.05
    entropies = {}
    for coef in (c_ent, 0.0):
        with stage(files, tmp_path, f"ent{coef}", temperature=temp, ent_coef=coef, lr=1e-4) as algo:
            batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
            m = batch["response_mask"]
            ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
            full = {**batch, **ro, "adv": torch.zeros_like(ro["adv"])}
            w0 = params(algo.policy.module)
            stats = Stats()
            with grads_of(algo.policy.module) as pol_g:
                algo.update(0, full, stats)
            with torch.no_grad():
                _, ent = hand_logp(algo.policy.module, batch, temp)
            entropies[coef] = (ent.sum() / m.sum()).item()
            moved = (params(algo.policy.module) - w0).abs().max().item()
        pol = causal_lm(files["policy"])
        _, ent0 = hand_logp(pol, batch, temp)
        if coef:
            assert_same_grads(pol_g, pol, -coef * ent0.sum() / m.sum(), "entropy bonus")
            assert moved > 1e-5
        else:
            assert moved == 0.0 and all((g == 0).all() for g in pol_g.values())
        start = (ent0.sum() / m.sum()).item()
        assert stats.reduce("cpu")["entropy"] == pytest.approx(start, rel=1e-5)
    assert entropies[c_ent] > start + 1e-4, (entropies, start)
    assert entropies[0.0] == pytest.approx(start, rel=1e-6)


def test_the_ptx_term_is_the_lm_loss_of_the_ptx_batch_times_its_coefficient(files, tmp_path):
    """--ptx-coef 0.5 with the two ptx texts as the ptx batch and every advantage 0: the policy's gradient is
    0.5·∇(Σ NLL / tokens) of BOS + text + EOS on a fresh copy of the policy, loss/ptx the mean NLL, and the ptx
    micro-batch belongs to the minibatch's optimiser step (the policy moves by --lr); the value network, which has
    no ptx micro-batch, steps once on the same minibatch all the same (it moves by --vf-lr)."""
    coef = 0.5
    with stage(files, tmp_path, ptx_coef=coef, ptx_batch_size=2, vf_lr=3e-4) as algo:
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
        stats = Stats()
        w0, v0 = params(algo.policy.module), params(algo.value.module)
        with grads_of(algo.policy.module) as pol_g:
            algo.update(0, {**batch, **ro, "adv": torch.zeros_like(ro["adv"])}, stats)
        assert (params(algo.policy.module) - w0).abs().max().item() == pytest.approx(algo.cfg.lr, rel=0.05)
        assert (params(algo.value.module) - v0).abs().max().item() == pytest.approx(3e-4, rel=0.05)
        assert algo.policy.eng.global_steps == algo.value.eng.global_steps == 1
        tok = algo.tok
    texts = [json.loads(x)["text"] for x in files["text"].read_text().splitlines()]
    seqs = [[tok.bos_token_id, *tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id] for t in texts]
    pol = causal_lm(files["policy"])
    nll, count = 0.0, 0
    for s in seqs:  # one text at a time: no padding
        lp = pol(input_ids=torch.tensor([s])).logits[0, :-1].float().log_softmax(-1)
        nll = nll - lp.gather(-1, torch.tensor(s[1:])[:, None]).sum()
        count += len(s) - 1
    assert_same_grads(pol_g, pol, coef * nll / count, "ptx")
    assert stats.reduce("cpu")["loss/ptx"] == pytest.approx((nll / count).item(), rel=1e-5)


def test_the_score_is_the_rm_score_less_the_missing_eos_penalty_clipped_on_both_sides(files, tmp_path):
    """PPO.scores on 8 fixed episodes (4 with EOS), the RM's offset set to the median penalised score (so that the
    scores straddle 0): the proxy is the RM's normalised score of prompt + response; --missing-eos-penalty 0.7
    takes 0.7 from the episodes without EOS only; --reward-clip c (half the smaller extreme: some scores pass c,
    some −c) clips the penalised score to [−c, c]."""
    from align.reward_model import OFFSET_KEY

    p = 0.7
    finished = torch.tensor([float(done) for _, done in RESPONSES])
    rm = classifier(files["rm"])
    with stage(files, tmp_path, "probe", prompts_per_step=8, minibatch_size=8) as algo:
        r = rollout(algo, 8)
        tok = algo.tok
    setattr(rm.config, OFFSET_KEY, 0.0)
    raw = hand_rm_scores(rm, r)
    setattr(rm.config, OFFSET_KEY, (raw - p * (1 - finished)).median().item())
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    files = {**files, "rm": tmp_path / "rm"}
    want = hand_rm_scores(rm, r)
    pen = want - p * (1 - finished)
    assert pen.max() > 0 > pen.min(), pen
    c = 0.5 * min(pen.max().item(), -pen.min().item())
    assert (pen > c).any() and (pen < -c).any() and (pen.abs() < c).any()
    for name, kw, s_want in (("pen", {}, pen), ("clip", {"reward_clip": c}, pen.clamp(-c, c))):
        with stage(files, tmp_path, name, missing_eos_penalty=p, prompts_per_step=8, minibatch_size=8, **kw) as algo:
            proxy, s, _ = algo.scores(rollout(algo, 8))
        close(proxy, want, 1e-5)
        close(s, s_want, 1e-5)


def test_max_approx_kl_stops_the_epoch_loop(files, tmp_path):
    """--ppo-epochs 3 over two minibatches: --max-approx-kl 1e-9 (passed once the first minibatch has moved the
    policy) ends the loop after one epoch (ppo/epochs 1); a bound never reached, or 0 (off), runs all three."""
    epochs = {}
    for bound in (1e-9, 1e3, 0.0):
        with stage(files, tmp_path, f"kl{bound}", ppo_epochs=3, minibatch_size=2, lr=1e-2, max_approx_kl=bound) as algo:
            out = algo.step(0).reduce("cpu")
        epochs[bound] = out["ppo/epochs"]
        assert out["policy/approxkl"] > 1e-9
    assert epochs == {1e-9: 1.0, 1e3: 3.0, 0.0: 3.0}


def test_minibatches_are_a_new_order_each_epoch_and_step_drawn_from_the_seed(files, tmp_path):
    """8 episodes in minibatches of 2 (one forward each), 2 epochs: the episodes each policy forward of the update
    sees make, per epoch, 4 minibatches holding every episode once, each with one episode of each run of 4
    consecutive episodes; their order differs between the epochs of a step and between steps 0 and 1, is the same
    when step 0's update runs again, and differs under another --seed."""
    def orders(algo, step, full):
        seen = []

        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if torch.is_grad_enabled():  # the update's forwards (π_old, V_old and the RM run without gradients)
                seen.append(frozenset(int(i) for i in (ids[:, None] == full["input_ids"][None]).all(-1).nonzero()[:, 1]))
        h = algo.policy.module.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            algo.update(step, full, Stats())
        finally:
            h.remove()
        assert len(seen) == 8 and all(len(x) == 2 for x in seen)  # 2 epochs × 4 minibatches
        return [seen[e * 4:(e + 1) * 4] for e in range(2)]

    got = {}
    for seed in (0, 1):
        with stage(files, tmp_path, f"seed{seed}", seed=seed, prompts_per_step=8, minibatch_size=2, ppo_epochs=2) as algo:
            batch = rollout(algo, 8).batch(algo.tok.pad_token_id, "cpu")
            ro = algo.advantages(batch, torch.linspace(-1, 1, 8), 0.1)
            full = {**batch, **ro}
            got[seed] = [orders(algo, 0, full)] + ([orders(algo, 1, full), orders(algo, 0, full)] if seed == 0 else [])
    for steps in got.values():
        for epochs in steps:
            for mbs in epochs:
                assert sorted(i for mb in mbs for i in mb) == list(range(8))  # each episode once per epoch
                assert all(sorted(i // 4 for i in mb) == [0, 1] for mb in mbs)  # one of each run of 4
            assert epochs[0] != epochs[1]  # a new order each epoch
    assert got[0][0] != got[0][1] and got[0][0] == got[0][2]  # a new order each step, the same for the same step
    # each run of 4 draws its own order: the minibatches are not fixed strides (episode i with i + 4) everywhere
    assert any(max(mb) - min(mb) != 4 for steps in got.values() for epochs in steps for mbs in epochs for mb in mbs)
    assert got[0][0] != got[1][0]  # another seed, another order


def test_the_step_wires_beta_the_score_and_the_reference_into_the_rewards(files, tmp_path):
    """Steps with --ref-model (KL > 0 from the start) at --temperature 0.7, --init-kl-coef 0.3 (not the default
    0.2). --fixed-kl keeps β = 0.3. The adaptive controller with the target set 10% under the first step's KL
    (known from the fixed run: the same rollout) gives β₁ = 0.3·(1 + 0.1·4/10) (n = 4 episodes, horizon 10); in step 1 the per-token rewards the update gets
    (read back from its returns, γ = λ = 1) are −β₁·(log π_old − log π_ref) + s on the last token, with π_old the
    policy entering step 1 and π_ref the --ref-model (both at logits / T), s the RM's score of the sampled
    response less --missing-eos-penalty where it has no EOS; the step's metrics are those of that batch (KL per
    episode and per token, scores, RLHF reward s − β·KL, explained variance of V_old); the sampler drew at the
    trainer's temperature; β is the checkpointed state and a restored β is the next step's."""
    from align.reward_model import normalized_reward

    temp, p = 0.7, 0.25
    common = dict(ref_model=str(files["other"]), init_kl_coef=0.3, kl_horizon=10.0, gamma=1.0, lam=1.0, lr=1e-2,
                  missing_eos_penalty=p, temperature=temp)
    with stage(files, tmp_path, "fixed", fixed_kl=True, **common) as algo:
        f0, f1 = algo.step(0).reduce("cpu"), algo.step(1).reduce("cpu")
        assert algo.state_dict() == {"kl_coef": 0.3}
    assert f0["kl_coef"] == f1["kl_coef"] == 0.3 and f0["objective/kl"] > 0.1
    kl0 = f0["objective/kl"]
    target = kl0 / 1.1
    rm, ref_model = classifier(files["rm"]), causal_lm(files["other"])
    seen = {}
    with stage(files, tmp_path, "adaptive", target_kl=target, **common) as algo:
        update = algo.update

        def spy(step, batch, stats):
            with torch.no_grad():
                seen[step] = {"batch": {k: v.clone() for k, v in batch.items()},
                              "old": hand_logp(algo.policy.module, batch, temp)[0],
                              "ref": hand_logp(ref_model, batch, temp)[0],
                              "values": hand_values(algo.value.module, batch) * batch["response_mask"]}
            return update(step, batch, stats)
        algo.update = spy
        a0, a1 = algo.step(0).reduce("cpu"), algo.step(1).reduce("cpu")
        state = algo.state_dict()
        algo.load_state_dict({"kl_coef": 0.05})
        a2 = algo.step(2).reduce("cpu")
        eos = algo.tok.eos_token_id
    assert a0["objective/kl"] == pytest.approx(kl0, rel=1e-6)
    beta1 = 0.3 * (1 + 0.1 * 4 / 10)
    assert a0["kl_coef"] == 0.3 and a1["kl_coef"] == pytest.approx(beta1, rel=1e-6)
    e1 = min(max(a1["objective/kl"] / target - 1, -0.2), 0.2)
    assert state == {"kl_coef": pytest.approx(beta1 * (1 + e1 * 4 / 10), rel=1e-6)} and a2["kl_coef"] == 0.05
    for row in (a0, a1):
        assert row["rollout/logp_abs_diff"] < 1e-4  # the decoder sampled at T: its log-probs are the trainer's
    b = seen[1]["batch"]
    m = b["response_mask"]
    kl = (seen[1]["old"] - seen[1]["ref"]) * m
    ids = b["input_ids"]
    proxy, finished = [], []
    for i, t in enumerate(last_positions(m)):
        seq = ids[i, : t + 2]  # prompt + response, up to the last response token
        with torch.no_grad():
            proxy.append(normalized_reward(rm(input_ids=seq[None]).logits[0, 0].float(), rm.config))
        finished.append(float(seq[-1] == eos))
    proxy, finished = torch.stack(proxy), torch.tensor(finished)
    s = proxy - p * (1 - finished)
    returns = b["returns"]
    close(rewards_from_returns(returns, m), hand_token_rewards(s, kl, m, beta1), 1e-4)
    n = len(s)
    want = {"objective/kl": kl.sum() / n, "kl": kl.sum() / m.sum(), "reward": proxy.mean(), "objective/scores": s.mean(),
            "objective/rlhf_reward": s.mean() - beta1 * kl.sum() / n}
    sel = m.bool()
    want["val/explained_variance"] = 1 - (returns - seen[1]["values"])[sel].double().var() / returns[sel].double().var()
    for k, v in want.items():
        assert a1[k] == pytest.approx(v.item(), rel=1e-4, abs=1e-6), k


# ---- audit 2: options at non-default values, the whole step, per-element values


def test_the_gold_term_is_centred_on_the_other_episodes_mean_gold_per_episode(files, tmp_path, shipped_tokenizer):
    """--gold-reward-coef 0.5 (verifier math on the prompts' `answer`) with --missing-eos-penalty 0.3, 8 fixed
    episodes of which 3 give the right answer: the gold each episode gets is the verifier's 1/0, and each episode's
    score is the RM's normalised score + 0.5·(g_i − (Σg − g_i)/(n − 1)) − 0.3·[no EOS], episode by episode (a
    batch-mean baseline, a gold term on the wrong episodes or without its coefficient give other values); the
    step's record logs reward = mean RM score, gold_reward = mean gold (3/8), kl = Σ KL / response tokens.
    --max-prompt-length L (the 11th shortest prompt's length) keeps exactly the prompts of at most L tokens, in
    file order."""
    from align import data as D

    c, p, n = 0.5, 0.3, 8
    right = [0, 3, 5]
    rows = [json.loads(x) for x in files["prompts"].read_text().splitlines()]
    lengths = [len(x) for x in D.encode_prompts(shipped_tokenizer, [r["prompt"] for r in rows])]
    limit = sorted(lengths)[10]
    assert max(lengths) > limit
    kept = [r for r, k in zip(rows, lengths) if k <= limit]
    with stage(files, tmp_path, "gold", gold_reward_coef=c, missing_eos_penalty=p, prompts_per_step=n,
               minibatch_size=n, max_prompt_length=limit) as algo:
        assert [r["prompt"] for r in algo.rows] == [r["prompt"] for r in kept] and algo.dropped == len(rows) - len(kept)
        r = rollout(algo, n)
        for i, comp in enumerate(r.completions):
            comp.text = r.sample_rows[i]["completion"] if i in right else "1 + 1 = 12345. #### 12345"
        proxy, s, gold = algo.scores(r)
        batch = r.batch(algo.tok.pad_token_id, "cpu")
        ro = algo.advantages(batch, s, 0.1)
        stats = Stats()
        algo.record(r, proxy, gold, batch, ro, stats)
        logged = stats.reduce("cpu")
    g = torch.tensor([float(i in right) for i in range(n)])
    finished = torch.tensor([float(done) for _, done in RESPONSES[:n]])
    want_proxy = hand_rm_scores(classifier(files["rm"]), r)
    close(gold, g)
    close(proxy, want_proxy, 1e-5)
    loo = (g.sum() - g) / (n - 1)
    close(s, want_proxy + c * (g - loo) - p * (1 - finished), 1e-5)
    m = batch["response_mask"]
    want = {"reward": want_proxy.mean(), "gold_reward": g.mean(), "kl": ro["kl"].sum() / m.sum()}
    for k, v in want.items():
        assert logged[k] == pytest.approx(v.item(), rel=1e-5, abs=1e-7), k


def test_the_step_samples_the_seeded_prompts_of_each_step_with_the_samplers_options(files, tmp_path):
    """Driving step() with --seed 3 over 16 prompts, 4 per step: the rollout the update of step s receives holds,
    row by row, the prompts step_indices(16, 4, s, 3) names (step 0's and step 1's differ), each followed by a
    response of at most --max-new-tokens 5 tokens; with --top-k 1, and again with --top-p 1e-4 (top-k off), every
    response token is the argmax of the policy entering that step (at the sampler's temperature 0.8: argmax
    unchanged) up to and including EOS; each episode is scored with its own prompt's row."""
    from align.engine.run import step_indices

    seen, scored = {}, {}
    for top_k, top_p in ((1, 1.0), (0, 1e-4)):  # each alone keeps only the most likely token
        with stage(files, tmp_path, f"prompts{top_k}", seed=3, top_k=top_k, top_p=top_p, temperature=0.8,
                   max_new_tokens=5) as algo:
            update, scores = algo.update, algo.scores

            def spy(step, batch, stats):
                with torch.no_grad():
                    logits = algo.policy.module(input_ids=batch["input_ids"]).logits[:, :-1]
                seen[top_k, step] = ({k: v.clone() for k, v in batch.items()}, logits.argmax(-1))
                return update(step, batch, stats)

            def spy_scores(r):  # the rows the verifier and the RM see with each episode
                scored.setdefault(top_k, []).append([(row["prompt"], c.prompt_ids) for row, c in
                                                     zip(r.sample_rows, r.completions)])
                return scores(r)
            algo.update, algo.scores = spy, spy_scores
            algo.step(0)
            algo.step(1)
            prompt_ids, rows = algo.prompt_ids, algo.rows
    order = {s: step_indices(16, 4, s, 3) for s in (0, 1)}
    assert order[0] != order[1]
    for k in scored:  # each episode scored with its own prompt's row
        assert scored[k] == [[(rows[i]["prompt"], prompt_ids[i]) for i in order[s]] for s in (0, 1)]
    for (_, s), (batch, greedy) in seen.items():
        ids, m = batch["input_ids"], batch["response_mask"]
        assert ids.shape[0] == 4
        for row, i in enumerate(order[s]):
            pos = m[row].nonzero().flatten()
            start = int(pos.min())
            assert ids[row, : start + 1].tolist() == prompt_ids[i], (s, row)
            assert 1 <= len(pos) <= 5
            assert (ids[row, pos + 1] == greedy[row, pos]).all(), (s, row)  # top-k 1: the argmax token


def test_each_update_takes_the_next_seeded_ptx_batch_cut_at_ptx_max_length(files, tmp_path):
    """6 ptx texts, --ptx-batch-size 3, --ptx-max-length 8, 2 epochs of 2 minibatches (4 optimiser steps a PPO
    step): the ptx forward of the policy's u-th optimiser step of PPO step s (u counted over the step's epochs)
    holds the 3 texts step_indices(6, 3, 4·s + u, seed + 1) names, each BOS + text + EOS cut to 8 tokens; so the
    epochs of a step and the steps see new ptx batches."""
    from align.engine.run import step_indices

    texts = [{"text": f"{w} is the word that starts this text, and the numbers 1 2 3 follow it."}
             for w in ("Red", "Blue", "Green", "Seven", "Nine", "Sam")]
    ptx = write_jsonl(tmp_path / "ptx6.jsonl", texts)
    got = []
    with stage({**files, "text": ptx}, tmp_path, "ptx6", ptx_coef=0.3, ptx_batch_size=3, ptx_max_length=8,
               ppo_epochs=2, minibatch_size=2, seed=5) as algo:
        tok = algo.tok
        want_seqs = [([tok.bos_token_id] + tok(t["text"], add_special_tokens=False)["input_ids"]
                      + [tok.eos_token_id])[:8] for t in texts]
        assert all(len(tok(t["text"], add_special_tokens=False)["input_ids"]) > 8 for t in texts)
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
        full = {**batch, **ro}

        def pre(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if torch.is_grad_enabled() and ids.shape[1] != full["input_ids"].shape[1] or not any(
                    (ids[:, None, :] == full["input_ids"][None]).all(-1).any(-1)):
                got.append([row.tolist() for row in ids])
        h = algo.policy.module.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            algo.update(0, full, Stats())
            algo.update(1, full, Stats())
        finally:
            h.remove()
    assert len(got) == 8  # 2 steps × 2 epochs × 2 minibatches
    for k, rows in enumerate(got):
        assert len(rows) == 3 and sorted(rows) == sorted(want_seqs[i] for i in step_indices(6, 3, k, 6)), k
    assert got[0] != got[2] and got[1] != got[3]


def test_max_approx_kl_compares_the_epochs_token_mean(files, tmp_path):
    """--ppo-epochs 3 over two minibatches at --lr 1e-2: the epochs' approx-KL(π_old‖π_θ) = e^{log π_θ − log π_old}
    − (log π_θ − log π_old) − 1 summed over the response tokens the update's policy forwards see, read from those
    forwards (at logits / T, T = 0.7); a bound between epoch 0's token mean and its sum runs exactly the epochs up
    to the first one whose TOKEN MEAN passes it (not its sum: that would stop after epoch 0); ppo/epochs says so.
    That epoch's OWN mean: a bound over epoch 0's mean and epochs 0-1's pooled mean, under epoch 1's, stops after
    epoch 1 (a running mean over the epochs so far would not)."""
    temp = 0.7

    copy = causal_lm(files["policy"])

    def run(name, bound):
        per_epoch = []
        with stage(files, tmp_path, name, ppo_epochs=3, minibatch_size=2, lr=1e-2, temperature=temp,
                   max_approx_kl=bound) as algo:
            batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
            ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
            full = {**batch, **ro}

            def pre(module, args, kwargs):
                ids = kwargs.get("input_ids", args[0] if args else None)
                if torch.is_grad_enabled():  # the update's forwards; this one, under no_grad, is not
                    rows = (ids[:, None] == full["input_ids"][None]).all(-1).nonzero()[:, 1]
                    with torch.no_grad():
                        copy.load_state_dict(module.state_dict())  # the weights this forward runs with
                        logp, _ = hand_logp(copy, {"input_ids": ids, "response_mask": full["response_mask"][rows]},
                                            temp)
                    m = full["response_mask"][rows]
                    d = (logp - full["old_logp"][rows]) * m
                    per_epoch.append(torch.stack([((d.exp() - d - 1) * m).sum(), m.sum()]).double())
            h = algo.policy.module.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                epochs = algo.update(0, full, Stats())
            finally:
                h.remove()
        assert len(per_epoch) == 2 * epochs  # one forward per minibatch (micro-batch 2)
        sums = [per_epoch[2 * e] + per_epoch[2 * e + 1] for e in range(epochs)]
        return epochs, [(float(t), float(t / k)) for t, k in sums]

    epochs, kl = run("akl_off", 0.0)
    assert epochs == 3
    total0, mean0 = kl[0]
    assert total0 > 0
    later = [mn for _, mn in kl[1:] if mn > mean0]
    bound = min([total0 / 2] + later) if later else total0 / 2
    bound = (mean0 + bound) / 2  # over epoch 0's token mean, under its sum
    assert mean0 < bound < total0
    want = next((e + 1 for e, (_, mn) in enumerate(kl) if mn > bound), 3)
    got, kl_b = run("akl_on", bound)
    assert got == want and got > 1
    # epoch 1's OWN token mean is compared, not one pooled over epochs 0 and 1 (a running mean over the epochs)
    (total1, mean1), tok0, tok1 = kl[1], total0 / mean0, kl[1][0] / kl[1][1]
    pooled = (total0 + total1) / (tok0 + tok1)
    bound1 = (pooled + mean1) / 2
    assert mean0 < pooled < bound1 < mean1, kl
    got1, _ = run("akl_own", bound1)
    assert got1 == 2
    for (t, _), (tb, _) in zip(kl, kl_b):
        assert tb == pytest.approx(t, rel=1e-5)


def test_evaluate_scores_the_greedy_held_out_answers_with_the_reward_model(files, tmp_path, chatty_model_dir):
    """--eval-data (held-out problems with answers) --eval-samples 3 at --temperature 1.5: evaluate(0) answers its 3 first
    problems greedily (the same answers on a second call: no sampling at T), logs eval/problems 3, eval/pass@1/greedy
    the verified fraction of the saved answers, eval/reward the mean of the RM's normalised scores of prompt +
    greedy answer (a fresh copy of the RM, one pair at a time), equal to the saved rm_score of each, and
    eval/kl 0 at step 0 and, later, the latest step's KL per episode (objective/kl, what RLMonitor's held-out hacking
    rule reads); the reward model, not the value network (--value-model: another classifier), scores. The answers
    are the policy's own greedy decode (a policy whose greedy answers are visible text, decoded here by argmax
    token by token), not samples at --temperature."""
    from align.data import encode_prompts
    from align.paths import DATA_DIR
    from align.reward_model import encode_scored, normalized_reward

    held_rows = [json.loads(x) for x in (DATA_DIR / "arithmetic/test.jsonl").read_text().splitlines()[:4]]
    held = write_jsonl(tmp_path / "held.jsonl", held_rows)  # not the training prompts
    with stage({**files, "policy": chatty_model_dir}, tmp_path, "eval", eval_data=str(held), eval_samples=3,
               temperature=1.5, max_new_tokens=5, value_model=str(files["value"])) as algo:
        got = algo.evaluate(0)
        recs = [json.loads(x) for x in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
        again = algo.evaluate(0)
        recs2 = [json.loads(x) for x in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
        rm_tok, rows = algo.rm_tok, algo.rows
        # after training steps: the KL per episode of the latest batch (objective/kl), not the per-token kl
        history = algo.run.monitor.history
        history["objective/kl"], history["kl"] = [0.4, 2.5], [0.01, 0.03]
        later = algo.evaluate(2)
    assert len(recs) == 3 and [r["greedy"] for r in recs] == [r["greedy"] for r in recs2] and got == again
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in held_rows[:3]]  # --eval-data's first 3, in order
    policy, eos = causal_lm(chatty_model_dir), rm_tok.eos_token_id
    want_text = [rm_tok.decode(greedy_ids(policy, p, 5, eos), skip_special_tokens=True)
                 for p in encode_prompts(rm_tok, [r["prompt"] for r in recs])]
    assert [r["greedy"] for r in recs] == want_text and all(want_text)
    train = [json.loads(x) for x in files["prompts"].read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in train]  # the training prompts: --data's
    rm = classifier(files["rm"])
    pairs = encode_scored(rm_tok, [r["prompt"] for r in recs], [r["greedy"] for r in recs])
    with torch.no_grad():
        raw = torch.stack([rm(input_ids=torch.tensor([list(pr) + list(rs)])).logits[0, 0].float() for pr, rs in pairs])
    want = normalized_reward(raw, rm.config)
    close(torch.tensor([r["rm_score"] for r in recs]), want, 1e-5)
    assert got["eval/problems"] == 3.0 and got["eval/kl"] == 0.0 and later["eval/kl"] == 2.5
    assert got["eval/reward"] == pytest.approx(want.mean().item(), rel=1e-5, abs=1e-7)
    assert got["eval/pass@1/greedy"] == pytest.approx(sum(r["greedy_correct"] for r in recs) / 3)


def test_ptx_from_sft_data_is_the_lm_loss_of_the_completions_only(files, tmp_path):
    """--ptx-data in SFT form ({prompt, completion}: the 16 prompts' file), --ptx-batch-size 2, --ptx-coef 0.5,
    every advantage 0: the policy's gradient is 0.5·∇(Σ NLL of the completion tokens given the chat-templated prompt
    / completion tokens) over the two rows step_indices(16, 2, 0, seed + 1) names, on a fresh copy of the policy
    (no loss on the prompt's tokens), and loss/ptx is that mean NLL."""
    from align import data as D
    from align.engine.run import step_indices

    coef = 0.5
    with stage({**files, "text": files["prompts"]}, tmp_path, "ptxsft", ptx_coef=coef, ptx_batch_size=2) as algo:
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        ro = algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)
        stats = Stats()
        with grads_of(algo.policy.module) as pol_g:
            algo.update(0, {**batch, **ro, "adv": torch.zeros_like(ro["adv"])}, stats)
        tok = algo.tok
    rows = [json.loads(x) for x in files["prompts"].read_text().splitlines()]
    pick = [rows[i] for i in step_indices(len(rows), 2, 0, algo.cfg.seed + 1)]
    pol = causal_lm(files["policy"])
    nll, count = 0.0, 0
    for row in pick:
        p = D.encode_prompts(tok, [row["prompt"]])[0]
        c = D.encode_completions(tok, [row["completion"]])[0]
        lp = pol(input_ids=torch.tensor([p + c])).logits[0, :-1].float().log_softmax(-1)
        nll = nll - lp[len(p) - 1:].gather(-1, torch.tensor(c)[:, None]).sum()
        count += len(c)
    assert_same_grads(pol_g, pol, coef * nll / count, "ptx (sft data)")
    assert stats.reduce("cpu")["loss/ptx"] == pytest.approx((nll / count).item(), rel=1e-5)


def test_each_step_samples_with_new_keys_drawn_from_the_seed(files, tmp_path):
    """8 copies of ONE prompt, 4 a step, at --temperature 1 with the update skipped (the policy stays the start):
    the responses step 0 and step 1 sample for the same prompt differ (the sampler's keys change with the step,
    not only with the slot), and step 1 under another --seed samples other responses (the keys come from the
    seed)."""
    row = json.loads(files["prompts"].read_text().splitlines()[0])
    same = write_jsonl(tmp_path / "same.jsonl", [row] * 8)
    got = {}
    for seed, steps in ((3, (0, 1)), (4, (1,))):
        with stage({**files, "prompts": same}, tmp_path, f"keys{seed}", seed=seed, temperature=1.0,
                   max_new_tokens=6) as algo:
            def spy(step, batch, stats, seed=seed):
                m = batch["response_mask"]
                got[seed, step] = [batch["input_ids"][i, 1:][m[i].bool()].tolist() for i in range(len(m))]
                return 1
            algo.update = spy
            for s in steps:
                algo.step(s)
    for k, v in got.items():
        assert len(v) == 4 and len({tuple(x) for x in v}) > 1, k  # the slots of a step: their own keys
    assert got[3, 0] != got[3, 1]
    assert got[3, 1] != got[4, 1]


def test_a_reward_model_with_another_tokenizer_scores_the_decoded_texts_in_its_own_encoding(files, tmp_path):
    """A reward model whose tokenizer renders prompts with another chat template (same vocabulary): the step's
    scores are the RM's normalised scores of prompt + response TEXT encoded by the RM's own tokenizer (its
    template, response + EOS), one pair at a time on a fresh copy; the policy's token ids would give others."""
    import shutil

    from transformers import AutoTokenizer

    from align.reward_model import encode_scored, normalized_reward

    rm_dir = tmp_path / "rm_other_template"
    shutil.copytree(files["rm"], rm_dir)
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    rm_tok.chat_template = "Judge this. " + rm_tok.chat_template
    rm_tok.save_pretrained(rm_dir)
    with stage({**files, "rm": rm_dir}, tmp_path, value_model=str(files["value"])) as algo:
        assert not algo.rm_same_tok
        r = rollout(algo)
        for c in r.completions:
            c.text = algo.tok.decode(c.ids, skip_special_tokens=True)
        proxy, _, _ = algo.scores(r)
        prompts, tok = r.prompts, algo.tok
    pairs = encode_scored(AutoTokenizer.from_pretrained(rm_dir), prompts, [c.text for c in r.completions])
    assert [p for p, _ in pairs] != [c.prompt_ids for c in r.completions]  # the RM's encoding is its own
    assert pairs != encode_scored(tok, prompts, [c.text for c in r.completions])
    rm = classifier(rm_dir)
    with torch.no_grad():
        raw = torch.stack([rm(input_ids=torch.tensor([list(p) + list(x)])).logits[0, 0].float() for p, x in pairs])
    close(proxy, normalized_reward(raw, rm.config), 1e-5)


def test_the_lr_schedule_runs_over_the_optimiser_steps_with_warmup_and_the_stages_betas(files, tmp_path):
    """--schedule linear --warmup-steps 2 --max-steps 2 with 2 PPO epochs of one minibatch: 4 optimiser steps of
    each network in all; the learning rate each step applies is lr·f(u) for u = 0..3, f the warmup (u + 1) / 2,
    then the linear decay to 10 % over the optimiser steps (not the PPO steps): 0.5, 1, 1, 0.55 (--vf-lr for
    the value network); AdamW runs with PPO's β = (0.9, 0.999) and --weight-decay 0.05 on each network's
    matrices, none on its 1-D parameters (norms, biases). --on-alarm's β raise: ×3 of a β above 0; from 0, the
    default 0.1."""
    lr, vf_lr = 2e-4, 5e-4
    with stage(files, tmp_path, schedule="linear", warmup_steps=2, max_steps=2, ppo_epochs=2, lr=lr,
               vf_lr=vf_lr, weight_decay=0.05) as algo:
        batch = rollout(algo).batch(algo.tok.pad_token_id, "cpu")
        full = {**batch, **algo.advantages(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.1)}
        with applied_lrs(algo.policy.eng.optimizer, algo.value.eng.optimizer) as (policy_lrs, value_lrs):
            algo.update(0, full, Stats())
            algo.update(1, full, Stats())
        betas = {net.eng.optimizer.param_groups[0]["betas"] for net in (algo.policy, algo.value)}
        decay = [decay_groups(net.eng.optimizer) for net in (algo.policy, algo.value)]
        history = algo.run.monitor.history  # final_metrics: the first and last windows of the run's series
        history["reward"], history["gold_reward"] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 6
        history["objective/kl"] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
        final = algo.final_metrics({"eval/reward": 0.5}, {"eval/reward": 0.1})
        algo.kl_ctl.value = 0.0
        algo.raise_kl(3.0)
        from_zero = algo.kl_ctl.value
        algo.raise_kl(3.0)
        raised = algo.kl_ctl.value
    f = [0.5, 1.0, 1.0, 0.55]
    assert policy_lrs == pytest.approx([lr * x for x in f])
    assert value_lrs == pytest.approx([vf_lr * x for x in f])
    assert betas == {(0.9, 0.999)}
    assert decay == [{(0.05, "matrices", (0.9, 0.999)), (0.0, "1-d", (0.9, 0.999))}] * 2  # matrices decayed only
    assert from_zero == pytest.approx(0.1) and raised == pytest.approx(0.3)
    assert final["reward/first3"] == pytest.approx(1.0) and final["reward/last3"] == pytest.approx(4.0)
    assert final["objective/kl/last3"] == pytest.approx(0.5) and final["start/reward"] == 0.1
    assert final["eval/reward"] == 0.5


def test_a_resume_restores_the_stages_state_and_keeps_the_start_evaluation(files, tmp_path):
    """Two steps (a checkpoint after each, a held-out evaluation at the start), then --resume to three: the resumed
    stage enters its first step with the adaptive β the first run had entering that step (the stage's own state,
    restored from the checkpoint), evaluates at step 3 only (not `the start` again at the resumed weights), and
    keeps the first run's start evaluation."""
    base = dict(max_steps=2, save_every=1, eval_data=str(files["prompts"]), eval_samples=2, max_new_tokens=4,
                target_kl=0.01)

    def spy(algo, seen):
        evaluate, step_ = algo.evaluate, algo.step
        algo.evaluate = lambda s: seen["evaluated"].append(s) or evaluate(s)
        algo.step = lambda s: seen["beta"].append((s, algo.kl_ctl.value)) or step_(s)

    first, resumed = {"evaluated": [], "beta": []}, {"evaluated": [], "beta": []}
    with stage(files, tmp_path, "resumed", **base) as algo:
        spy(algo, first)
        algo.run.fit(algo)
        start = dict(algo.run.start_eval)
    with stage(files, tmp_path, "resumed", **{**base, "max_steps": 3, "resume": True}) as algo:
        spy(algo, resumed)
        algo.run.fit(algo)
        again = dict(algo.run.start_eval)
    s0, beta = resumed["beta"][0]
    assert s0 >= 1 and beta == pytest.approx(dict(first["beta"])[s0]) and beta != pytest.approx(first["beta"][0][1])
    assert first["evaluated"][0] == 0 and 0 not in resumed["evaluated"] and resumed["evaluated"][-1] == 3
    assert start and again == start


# ---- multi-turn episodes (--tools)

# (policy turn, tool answer) pairs then the last turn: 1 on the policy's tokens, 0 on the tool's
EPISODES = [([40, 41], [70, 71, 72], [42, 43]), ([44], [73], [45, 46, 47]), ([48, 49, 50], [], []),
            ([51], [74, 75], [52])]


def episode_rollout(algo) -> Rollout:
    """Four episodes: three with a tool's answer between two policy turns (the last turn ends at EOS), one of a
    single turn."""
    from align.rollout.completion import EpisodeInfo

    eos, comps = algo.tok.eos_token_id, []
    for i, (first, tool, last) in enumerate(EPISODES):
        ids = first + tool + last + [eos]
        mask = [1] * len(first) + [0] * len(tool) + [1] * (len(last) + 1)
        info = EpisodeInfo("", 2 if tool else 1, int(bool(tool)), 0, "eos", len(tool), 0.0)
        comps.append(Completion(algo.prompt_ids[i], ids, "", True, None, mask, info))
    return Rollout(algo.rows[:4], comps, 1)


def test_ppo_over_episodes_scores_values_and_advantages_at_the_policys_tokens_only(files, tmp_path):
    """--tools: an episode's tool answers are no time steps of the policy. The response mask is the policy mask;
    π_old, π_ref, the KL penalty, V_old, the advantages and the returns are 0 at the tool's tokens; the score sits
    on the last policy token; GAE runs over the policy's tokens only, across the tool's gap (the hand GAE over
    each row's policy positions, γ 0.9, λ 0.8); the update's gradient from the tool's tokens is 0 (their
    log-probs changed, the update's gradient does not). A real step samples episodes and logs their metrics."""
    with stage(files, tmp_path, tools="calculator", value_model=str(files["value"]), gamma=0.9, lam=0.8) as algo:
        r = episode_rollout(algo)
        batch = r.batch(algo.tok.pad_token_id, "cpu")
        m = batch["response_mask"]
        for i, c in enumerate(r.completions):
            start = len(c.prompt_ids) - 1
            assert m[i, start:start + len(c.ids)].tolist() == c.policy_mask and m[i].sum() == sum(c.policy_mask)
        tool = torch.zeros_like(m)
        for i, c in enumerate(r.completions):
            start = len(c.prompt_ids) - 1
            tool[i, start:start + len(c.ids)] = 1 - torch.tensor(c.policy_mask)
        assert tool.sum() == 6
        s = torch.tensor([1.5, -0.5, 0.25, -2.0])
        ro = algo.advantages(batch, s, 0.2)
        for k in ("old_logp", "ref_logp", "kl", "old_values", "adv", "returns"):
            assert (ro[k] * tool).abs().sum() == 0, k
        with torch.no_grad():
            old, _ = hand_logp(causal_lm(files["policy"]), batch)
            values = hand_values(classifier(files["value"]), batch) * m
        close(ro["old_logp"] * m, old)
        adv, returns = hand_gae(hand_token_rewards(s, ro["kl"], m, 0.2), values, m, 0.9, 0.8)
        close(ro["returns"], returns, 1e-4)
        close(ro["adv"], hand_whiten(adv, m), 1e-4)
        # the first turn's advantages see the score after the gap: without it they would change
        gapless = hand_gae(hand_token_rewards(torch.zeros(4), ro["kl"], m, 0.2), values, m, 0.9, 0.8)[0]
        first = [len(c.prompt_ids) - 1 for c in r.completions[:2]]
        assert all(abs(float(adv[i, t] - gapless[i, t])) > 1e-3 for i, t in enumerate(first))
        # the tool's tokens give the policy no gradient: the same update with their old log-probs moved
        full = {**batch, **ro}
        moved = {**full, "old_logp": full["old_logp"] + 0.7 * tool}
        grads, w0 = [], {k: v.clone() for k, v in algo.policy.module.state_dict().items()}
        for b in (full, moved):
            algo.policy.module.load_state_dict(w0)  # (the minibatch's optimiser step moved the weights)
            with grads_of(algo.policy.module) as g:
                algo.minibatch(b, Stats())
            grads.append(torch.cat([g[n].flatten() for n in sorted(g)]))
        torch.testing.assert_close(grads[0], grads[1])
        got = algo.step(0).reduce("cpu")
    assert {"tools/call_frequency", "num_turns/mean", "episodes/stop/eos", "episodes/policy_token_frac"} <= set(got)


def test_the_gold_verifier_grades_an_episodes_last_turn_and_the_rm_its_transcript(files, tmp_path):
    """--tools: the built-in gold verifier reads the policy's last turn (its answer), not the transcript, where the
    tool's answer may hold the right number; the reward model scores the whole transcript."""
    from align.rollout.completion import EpisodeInfo

    with stage(files, tmp_path, tools="calculator") as algo:
        answers = [str(row["answer"]) for row in algo.rows[:4]]
        comps = []
        for i, a in enumerate(answers):
            final = f"The answer is {a}." if i % 2 else "I cannot say."  # right on odd rows only
            text = f"<calc>{a}</calc><out>{a}</out>{final}"
            ids = algo.tok(text, add_special_tokens=False)["input_ids"] + [algo.tok.eos_token_id]
            mask = [1] * len(ids)
            info = EpisodeInfo(final, 2, 1, 0, "eos", 0, 0.0)
            comps.append(Completion(algo.prompt_ids[i], ids, text, True, None, mask, info))
        r = Rollout(algo.rows[:4], comps, 1)
        proxy, _, gold = algo.scores(r)
        assert gold.tolist() == [0.0, 1.0, 0.0, 1.0]
        close(proxy, hand_rm_scores(classifier(files["rm"]), r))
