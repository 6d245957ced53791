"""The wiring of `align dpo` (stages/dpo.py: DPO, KTO, online DPO) to its preference losses, pinned BY VALUES on
the tiny model: every logged loss, implicit reward and gradient norm of a step is recomputed here by hand, from
unpadded forwards of plain transformers models (the input model loaded from disk, the --ref-model, the policy
after an update) over the RESPONSE tokens only (EOS included, the prompt never), with the formulas written out
below. So the tests see which model is the reference (the frozen start, or --ref-model), which terms carry
gradient (the NLL term of RPO does; the reference and KTO's reference point z0 do not), the signs (chosen up,
rejected down), the lengths |y| of the per-token means, β / γ / α / ε / λ taken from their own options, the
pairs online DPO builds from its judge's scores and the held-out accuracy's rewards.

The stage is built in this process (DPOConfig + DPO / KTO / OnlineDPO with a StageRun, one rank, ZeRO-3 on
CPU as a plain run): its `step(s)` is one optimiser step; `grad_norm` is the engine's norm of the step's
gradient before clipping. The formulas themselves are unit-tested in tests/test_pref_losses.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from align.engine.run import StageRun
from stages.dpo import DPO, KTO, DPOConfig, OnlineDPO
from tests.conftest import applied_lrs, decay_groups, greedy_ids

# prompts of very different lengths, responses of very different lengths (chosen shorter or longer than rejected):
# a length or a sum that counts prompt tokens, or the wrong row's, shows in every number
PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5. #### 5", "rejected": "6"},
    {"prompt": "Tom has 4 apples and eats one of them after lunch. How many apples are left now?", "chosen": "3",
     "rejected": "4 - 1 = 2. #### 2 apples"},
    {"prompt": "Say hi.", "chosen": "hi there, friend", "rejected": "no"},
    {"prompt": "Count to three, please, and then stop counting.", "chosen": "1 2 3",
     "rejected": "one, two, four, five, six"},
    {"prompt": "Name a colour.", "chosen": "blue", "rejected": "a car and a tree"},
    {"prompt": "A box holds 12 eggs. How many eggs are in 3 boxes?", "chosen": "3 * 12 = 36. #### 36",
     "rejected": "15"},
]
KTO_ROWS = [
    {"prompt": "What is 2 + 3?", "completion": "2 + 3 = 5. #### 5", "label": True},
    {"prompt": "Tom has 4 apples and eats one of them after lunch. How many are left?", "completion": "4 - 1 = 2",
     "label": False},
    {"prompt": "Say hi.", "completion": "hi there, friend", "label": True},
    {"prompt": "Count to three, please, and then stop counting.", "completion": "one, two, four, five",
     "label": False},
    {"prompt": "Name a colour.", "completion": "blue", "label": True},
    {"prompt": "A box holds 12 eggs. How many eggs are in 3 boxes?", "completion": "15", "label": False},
]


@pytest.fixture(autouse=True)
def single_process_env(single_process):
    """Every test here builds engines in this process (tests/conftest.py)."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()




def write_rows(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def hf_model(path):
    """A model as saved on disk, plain transformers, for the hand computations."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def seq_logp(model, prompt_ids: list, resp_ids: list) -> torch.Tensor:
    """log π(y|x) summed over the response tokens only, from one unpadded forward of prompt + response."""
    logits = model(input_ids=torch.tensor([prompt_ids + resp_ids])).logits[0, len(prompt_ids) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(resp_ids)[:, None])[:, 0].sum()


def pair_logps(model, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """([B], [B]) summed response log-probs of chosen and rejected."""
    pc = torch.stack([seq_logp(model, e["prompt_ids"], e["chosen_ids"]) for e in examples])
    pr = torch.stack([seq_logp(model, e["prompt_ids"], e["rejected_ids"]) for e in examples])
    return pc, pr


def lengths(examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """|y_w|, |y_l|: response tokens, EOS included, prompt excluded."""
    return (torch.tensor([float(len(e["chosen_ids"])) for e in examples]),
            torch.tensor([float(len(e["rejected_ids"])) for e in examples]))


def grad_norm(loss: torch.Tensor, model) -> float:
    loss.backward()
    return torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def stage(tmp_path: Path, model_dir, **kw):
    """The DPOConfig (validated) and StageRun of a run on `model_dir`; the caller enters the run and builds the
    class `run` picks (DPO, KTO, OnlineDPO)."""
    cfg = DPOConfig(**{"model": str(model_dir), "out": str(tmp_path / "out"), "pass_data": "", "batch_size": 4,
                       "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 0, "max_steps": 3, **kw})
    cfg.validate()
    return cfg, StageRun(cfg, "dpo")


def step(algo, s: int) -> dict:
    """One optimiser step: its reduced metrics and the engine's gradient norm."""
    m = algo.step(s).reduce("cpu")
    return {**m, "grad_norm": algo.policy.metrics()["grad_norm"]}


def close(got, want, rel=2e-4, abs_=2e-5):
    want = torch.as_tensor(want).detach().item()
    assert got == pytest.approx(want, rel=rel, abs=abs_), (got, want)


def check_pair_metrics(m: dict, loss, rc, rr, pc, pr):
    """The logged metrics of a step: the means over its pairs of the loss and of the loss's own rewards."""
    close(m["loss"], loss.mean())
    close(m["rewards/chosen"], rc.mean())
    close(m["rewards/rejected"], rr.mean())
    close(m["rewards/margins"], (rc - rr).mean())
    assert m["rewards/accuracies"] == pytest.approx((rc > rr).float().mean().item(), abs=1e-6)
    close(m["logps/chosen"], pc.mean())
    close(m["logps/rejected"], pr.mean())


def test_sigmoid_reference_is_the_frozen_start_and_the_steps_are_the_hand_loss(tmp_path, tiny_model_dir):
    """--loss sigmoid, β 0.5, --label-smoothing 0.1, 4 pairs a step in micro-batches of 2. Step 0 (policy =
    reference): loss log 2, rewards 0, the logged log-probs the input model's summed RESPONSE log-probs, and the
    gradient norm that of the cDPO loss by hand (β and ε scale it). After the update: the reference still gives
    the input model's log-probs, the policy does not; on the step's pairs the policy's chosen log-probs rose and
    its rejected ones fell (on average; the margin on every pair). Step 1's loss, rewards, margins and accuracy
    are the hand formula's on the updated policy and the INITIAL model; the held-out accuracy and margin (of the
    first --eval-pairs 5) use the same rewards β(log π − log π_ref)."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    beta, eps = 0.5, 0.1
    heldout = write_rows(tmp_path / "held.jsonl", PAIRS[1:] + PAIRS[:1])  # --eval-data: another file (rotated)
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data=heldout, eval_pairs=5, beta=beta,
                     label_smoothing=eps)
    init = hf_model(tiny_model_dir)
    for p in init.parameters():
        p.requires_grad_(True)

    def cdpo(pc, pr, rc, rr):
        d = beta * ((pc - rc) - (pr - rr))
        return -(1 - eps) * F.logsigmoid(d) - eps * F.logsigmoid(-d), beta * (pc - rc), beta * (pr - rr)

    with run:
        algo = DPO(cfg, run)
        ex = algo.examples
        assert all(e["chosen_ids"][-1] == algo.tok.eos_token_id for e in ex)  # |y| counts EOS
        idx0 = run.indices(len(ex), cfg.batch_size, 0)
        b0 = [ex[i] for i in idx0]
        pc0, pr0 = pair_logps(init, b0)
        m0 = step(algo, 0)
        close(m0["loss"], math.log(2), abs_=1e-6)
        assert m0["rewards/chosen"] == m0["rewards/margins"] == 0.0 and m0["rewards/accuracies"] == 0.0
        close(m0["logps/chosen"], pc0.mean())
        close(m0["logps/rejected"], pr0.mean())
        loss0, _, _ = cdpo(pc0, pr0, pc0.detach(), pr0.detach())  # the reference: no gradient
        close(m0["grad_norm"], grad_norm(loss0.mean(), init), rel=1e-3)
        assert m0["pairs"] == 4

        with torch.no_grad():
            init_c, init_r = pair_logps(init, ex)
            ref_c, ref_r = pair_logps(algo.reference, ex)
            pol_c, pol_r = pair_logps(algo.policy.module, ex)
        torch.testing.assert_close(ref_c, init_c, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ref_r, init_r, rtol=1e-5, atol=1e-4)
        assert (pol_c - init_c).abs().max() > 0.1 and (pol_r - init_r).abs().max() > 0.1
        up, down = (pol_c - init_c)[idx0], (pol_r - init_r)[idx0]  # on the step's pairs
        assert up.mean() > 0.5 and down.mean() < -0.5 and (up - down).min() > 0, (up, down)

        idx1 = run.indices(len(ex), cfg.batch_size, 1)
        loss1, rc1, rr1 = cdpo(pol_c[idx1], pol_r[idx1], init_c[idx1], init_r[idx1])
        m1 = step(algo, 1)
        check_pair_metrics(m1, loss1, rc1, rr1, pol_c[idx1], pol_r[idx1])
        assert 0 < m1["rewards/accuracies"] and m1["rewards/margins"] > 0.5  # non-trivial numbers

        with torch.no_grad():
            pol_c, pol_r = pair_logps(algo.policy.module, ex)
        held = algo.held_out()
    # --eval-pairs 5: the first 5 of --eval-data, i.e. training pairs 1..5
    pol_c, pol_r, init_c, init_r = pol_c[1:6], pol_r[1:6], init_c[1:6], init_r[1:6]
    rc, rr = beta * (pol_c - init_c), beta * (pol_r - init_r)
    assert held["eval/rewards/accuracies"] == pytest.approx((rc > rr).float().mean().item(), abs=1e-6)
    close(held["eval/rewards/margins"], (rc - rr).mean())
    close(held["eval/logps/chosen"], pol_c.mean())


@pytest.mark.parametrize("precompute", [False, True])
def test_ipo_mean_against_the_ref_model_uses_response_lengths(tmp_path, tiny_model_dir, other_model_dir, precompute):
    """--loss ipo-mean, β 0.3, --ref-model another model (live, or --precompute-ref: the same numbers, the reference
    engine freed after its log-probs are taken at step 0): at step 0 the
    loss (Δ̄ − 1/(2β))² with Δ̄ of per-token means (ℓ − ℓ_ref)(y) = (log π − log π_ref)(y) / |y|, |y| the response's
    tokens with EOS, its rewards, log-probs and gradient norm are the hand values from the input model and the
    --ref-model; step 1's, with the policy after the update and the same --ref-model; the held-out accuracy and
    margin use the same per-token-mean rewards."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    beta = 0.3
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data=data, beta=beta, loss="ipo-mean",
                     ref_model=str(other_model_dir), precompute_ref=precompute)
    init, other = hf_model(tiny_model_dir), hf_model(other_model_dir)

    def ipo_mean(pc, pr, rc, rr, n_c, n_r):
        c, r = (pc - rc) / n_c, (pr - rr) / n_r
        return (c - r - 1 / (2 * beta)) ** 2, beta * c, beta * r

    with run:
        algo = DPO(cfg, run)
        ex = algo.examples
        with torch.no_grad():
            ref_c, ref_r = pair_logps(other, ex)
        n_c, n_r = lengths(ex)
        idx0 = run.indices(len(ex), cfg.batch_size, 0)
        pc0, pr0 = pair_logps(init, [ex[i] for i in idx0])
        loss0, rc0, rr0 = ipo_mean(pc0, pr0, ref_c[idx0], ref_r[idx0], n_c[idx0], n_r[idx0])
        m0 = step(algo, 0)
        # --precompute-ref: the reference's log-probs taken once, its engine freed; else it stays, live
        assert (algo.reference is None) == precompute and (algo.ref_train is not None) == precompute
        check_pair_metrics(m0, loss0, rc0, rr0, pc0, pr0)
        close(m0["grad_norm"], grad_norm(loss0.mean(), init), rel=1e-3)

        idx1 = run.indices(len(ex), cfg.batch_size, 1)
        with torch.no_grad():
            pc1, pr1 = pair_logps(algo.policy.module, [ex[i] for i in idx1])
        loss1, rc1, rr1 = ipo_mean(pc1, pr1, ref_c[idx1], ref_r[idx1], n_c[idx1], n_r[idx1])
        check_pair_metrics(step(algo, 1), loss1, rc1, rr1, pc1, pr1)

        with torch.no_grad():
            pol_c, pol_r = pair_logps(algo.policy.module, ex)
        held = algo.held_out()
    _, rc, rr = ipo_mean(pol_c, pol_r, ref_c, ref_r, n_c, n_r)  # the loss's own rewards, as in training
    assert held["eval/rewards/accuracies"] == pytest.approx((rc > rr).float().mean().item(), abs=1e-6)
    close(held["eval/rewards/margins"], (rc - rr).mean())


def test_simpo_takes_gamma_and_response_lengths_and_loads_no_reference(tmp_path, tiny_model_dir):
    """--loss simpo, β 2, --simpo-gamma 0.7: no reference engine; at step 0 the loss −log σ(β ℓ(y_w) − β ℓ(y_l) − γ)
    with ℓ(y) = log π(y|x) / |y| over the response tokens (EOS included), its rewards β ℓ(y), and the gradient
    norm are the hand values; the held-out accuracy is that of the same rewards."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    beta, gamma = 2.0, 0.7
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data=data, beta=beta, loss="simpo",
                     simpo_gamma=gamma)
    init = hf_model(tiny_model_dir)
    with run:
        algo = DPO(cfg, run)
        assert algo.reference is None
        ex = algo.examples
        n_c, n_r = lengths(ex)
        idx0 = run.indices(len(ex), cfg.batch_size, 0)
        pc0, pr0 = pair_logps(init, [ex[i] for i in idx0])
        l_w, l_l = pc0 / n_c[idx0], pr0 / n_r[idx0]
        loss0 = -F.logsigmoid(beta * l_w - beta * l_l - gamma)
        m0 = step(algo, 0)
        check_pair_metrics(m0, loss0, beta * l_w, beta * l_l, pc0, pr0)
        close(m0["grad_norm"], grad_norm(loss0.mean(), init), rel=1e-3)
        with torch.no_grad():
            pol_c, pol_r = pair_logps(algo.policy.module, ex)
        held = algo.held_out()
    rc, rr = beta * pol_c / n_c, beta * pol_r / n_r
    assert held["eval/rewards/accuracies"] == pytest.approx((rc > rr).float().mean().item(), abs=1e-6)
    assert 0 < held["eval/rewards/accuracies"] < 1  # the lengths decide some pairs
    close(held["eval/rewards/margins"], (rc - rr).mean())


def test_orpo_with_the_rpo_nll_term_carries_its_gradient(tmp_path, tiny_model_dir):
    """--loss orpo, β 0.2, --nll-coef 0.5: at step 0 the loss is ORPO's −ℓ(y_w) − β log σ(log odds(y_w) − log
    odds(y_l)) plus α · (−log π(y_w|x) / |y_w|) per pair; `loss/nll` is the mean of the α term; the gradient norm
    is that of the whole sum (the NLL term carries gradient), the rewards are β ℓ(y)."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    beta, alpha = 0.2, 0.5
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", beta=beta, loss="orpo",
                     nll_coef=alpha)
    init = hf_model(tiny_model_dir)

    def log_odds(ell):
        return ell - torch.log(-torch.expm1(ell))

    with run:
        algo = DPO(cfg, run)
        ex = algo.examples
        n_c, n_r = lengths(ex)
        idx0 = run.indices(len(ex), cfg.batch_size, 0)
        pc0, pr0 = pair_logps(init, [ex[i] for i in idx0])
        l_w, l_l = pc0 / n_c[idx0], pr0 / n_r[idx0]
        nll = -alpha * pc0 / n_c[idx0]
        loss0 = -l_w - beta * F.logsigmoid(log_odds(l_w) - log_odds(l_l)) + nll
        m0 = step(algo, 0)
        check_pair_metrics(m0, loss0, beta * l_w, beta * l_l, pc0, pr0)
        close(m0["loss/nll"], nll.mean())
        close(m0["grad_norm"], grad_norm(loss0.mean(), init), rel=1e-3)


def test_rpo_nll_term_on_dpo_against_the_ref_model(tmp_path, tiny_model_dir, other_model_dir):
    """--loss sigmoid, β 0.4, --ref-model another model, --nll-coef 0.3 (RPO): at step 0 each pair's loss is
    −log σ(βΔ) + α · (−log π(y_w|x) / |y_w|), the logged loss, `loss/nll` and the gradient norm are the hand values
    (NLL of the policy's chosen answer, per response token)."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    beta, alpha = 0.4, 0.3
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", beta=beta, nll_coef=alpha,
                     ref_model=str(other_model_dir))
    init, other = hf_model(tiny_model_dir), hf_model(other_model_dir)
    with run:
        algo = DPO(cfg, run)
        ex = algo.examples
        n_c, _ = lengths(ex)
        idx0 = run.indices(len(ex), cfg.batch_size, 0)
        b0 = [ex[i] for i in idx0]
        with torch.no_grad():
            rc, rr = pair_logps(other, b0)
        pc0, pr0 = pair_logps(init, b0)
        nll = -alpha * pc0 / n_c[idx0]
        loss0 = -F.logsigmoid(beta * ((pc0 - rc) - (pr0 - rr))) + nll
        m0 = step(algo, 0)
        check_pair_metrics(m0, loss0, beta * (pc0 - rc), beta * (pr0 - rr), pc0, pr0)
        close(m0["loss/nll"], nll.mean())
        close(m0["grad_norm"], grad_norm(loss0.mean(), init), rel=1e-3)


def test_kto_reference_point_weights_and_held_out(tmp_path, tiny_model_dir, other_model_dir):
    """--loss kto, β 0.5, λ_D 2, λ_U 0.5, --ref-model another model, 4 rows a step in micro-batches of 2 (--seed 1). The
    held-out accuracy at the start is the share of the first --eval-pairs 5 rows whose β(log π − log π_ref) sits
    on their label's side of 0. Step 0: z0 = max(0, the mean of log π − log π_ref over every MISMATCHED row of the
    global batch — each row's completion under the prompt of the global batch's next row, across micro-batches),
    logged as `kl`; each row's loss
    λ_D (1 − σ(β(r − z0))) if desirable, λ_U (1 − σ(β(z0 − r))) if not, with r = log π − log π_ref of its own
    prompt and completion; the logged loss and rewards per kind, and the gradient norm of the mean loss with z0
    and the reference held constant, are the hand values. Step 1 trains on the next seeded global batch (its rows,
    its z0), with the updated policy."""
    data = write_rows(tmp_path / "rows.jsonl", KTO_ROWS)
    beta, w_d, w_u = 0.5, 2.0, 0.5
    heldout = write_rows(tmp_path / "held.jsonl", KTO_ROWS[1:] + KTO_ROWS[:1])  # --eval-data: rotated rows
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data=heldout, eval_pairs=5, beta=beta, loss="kto",
                     desirable_weight=w_d, undesirable_weight=w_u, ref_model=str(other_model_dir), seed=1)
    init, ref = hf_model(tiny_model_dir), hf_model(other_model_dir)

    def logp(model, rows, prompts=None):
        return torch.stack([seq_logp(model, (p or e)["prompt_ids"], e["completion_ids"])
                            for e, p in zip(rows, prompts or [None] * len(rows))])

    with run:
        algo = KTO(cfg, run)
        ex = algo.examples
        label = torch.tensor([e["label"] for e in ex])
        with torch.no_grad():
            r_all = beta * (logp(init, ex[1:6]) - logp(ref, ex[1:6]))  # --eval-pairs 5: the first 5 held-out rows
        label = label[1:6]
        held = algo.held_out()
        assert held["eval/rewards/accuracies"] == pytest.approx(((r_all > 0) == label).float().mean().item(), abs=1e-6)
        close(held["eval/rewards/margins"], r_all[label].mean() - r_all[~label].mean())
        assert 0 < held["eval/rewards/accuracies"] < 1

        idx = run.indices(len(ex), cfg.batch_size, 0)
        rows = [ex[i] for i in idx]
        with torch.no_grad():
            nxt = rows[1:] + rows[:1]  # mismatched: completion k under the global batch's prompt k + 1
            z0 = (logp(init, rows, nxt) - logp(ref, rows, nxt)).mean().clamp(min=0)
            ref_lp = logp(ref, rows)
        assert z0 > 0.1, z0  # the reference point is not floored away here
        r = logp(init, rows) - ref_lp
        good = torch.tensor([e["label"] for e in rows])
        assert 0 < good.sum() < 4
        loss = torch.where(good, w_d * (1 - torch.sigmoid(beta * (r - z0))), w_u * (1 - torch.sigmoid(beta * (z0 - r))))
        m = step(algo, 0)
        close(m["loss"], loss.mean())
        close(m["kl"], z0)
        close(m["rewards/desirable"], (beta * r)[good].mean())
        close(m["rewards/undesirable"], (beta * r)[~good].mean())
        close(m["grad_norm"], grad_norm(loss.mean(), init), rel=1e-3)

        # step 1: the NEXT seeded global batch (not step 0's again), with the policy after step 0's update
        idx1 = run.indices(len(ex), cfg.batch_size, 1)
        assert sorted(idx1) != sorted(idx)
        rows = [ex[i] for i in idx1]
        pol = algo.policy.module
        with torch.no_grad():
            nxt = rows[1:] + rows[:1]
            z1 = (logp(pol, rows, nxt) - logp(ref, rows, nxt)).mean().clamp(min=0)
            r = logp(pol, rows) - logp(ref, rows)
            good = torch.tensor([e["label"] for e in rows])
            loss = torch.where(good, w_d * (1 - torch.sigmoid(beta * (r - z1))),
                               w_u * (1 - torch.sigmoid(beta * (z1 - r))))
        m = step(algo, 1)
        close(m["loss"], loss.mean())
        close(m["kl"], z1)


JUDGE = '''import json

def judge(prompt, completion, **row):
    """The length of the completion; every sample of a row with mode "tie" scores the same."""
    score = 1.0 if row["mode"] == "tie" else float(len(completion))
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompt": prompt, "completion": completion, "score": score}}) + "\\n")
    return score
'''


def test_online_pairs_are_the_judges_best_and_worst_and_ties_weigh_nothing(tmp_path, tiny_model_dir, other_model_dir,
                                                                          monkeypatch):
    """--online, 3 samples of each prompt ranked by a --verifier that logs every score, --ref-model another model,
    --online-every 2: the window of steps 0 and 1 is sampled at once, steps 0 and 1 sample nothing more, at most
    --max-new-tokens each, the K samples of a slot all of its own prompt. Each slot's chosen answer is one of its
    prompt's samples with the judge's highest score,
    the rejected one with the lowest; a slot whose samples all tie weighs 0. The samples are the policy's (their
    log-probs under the policy exceed the reference's). Each step's loss is the mean of −log σ(βΔ) over its
    weighted pairs only (step 1: with the policy after step 0's update), `pairs` their number, `online/reward` the
    mean score of the step's samples, and step 0's gradient norm that of the weighted sum divided by the number of
    pairs of the global batch."""
    log = tmp_path / "scores.jsonl"
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE.format(log=str(log)))
    prompts = [{"prompt": f"Write something about the number {n}.", "answer": str(n), "mode": ("tie", "len")[n % 2]}
               for n in range(8)]
    data = write_rows(tmp_path / "prompts.jsonl", prompts)
    beta = 0.5
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", beta=beta, online=True,
                     online_every=2, online_samples=3, max_new_tokens=16, verifier=f"{judge}:judge",
                     ref_model=str(other_model_dir))
    init, other = hf_model(tiny_model_dir), hf_model(other_model_dir)

    def scored():
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    def dpo(model, pairs):
        with torch.no_grad():
            rc, rr = pair_logps(other, pairs)
        pc, pr = pair_logps(model, pairs)
        return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))), (pc - rc) + (pr - rr)

    import stages.dpo as dpo_module

    sampled = []
    generate = dpo_module.generate_on_rank

    def spy(policy, tok, prompt_ids, *a, **kw):  # the prompts each sample continues, in the judge's order
        out = generate(policy, tok, prompt_ids, *a, **kw)
        sampled.extend(zip(prompt_ids, (c.prompt_ids for c in out)))
        return out

    monkeypatch.setattr(dpo_module, "generate_on_rank", spy)
    with run:
        algo = OnlineDPO(cfg, run)
        log.unlink(missing_ok=True)  # the judge's calls on the first rows before any model was built
        algo.sample_window(0)  # what step 0 does first: the pairs of its --online-every window
        windows = {s: algo.buffer[s] for s in (0, 1)}
        judged = scored()
        assert len(judged) == 2 * 4 * 3
        # sample k of slot j continues slot j's prompt: the K samples of a slot are of one prompt (prompt-major)
        window_idx = [i for s in (0, 1) for i in run.indices(len(algo.rows), cfg.batch_size, s)]
        assert [p for p, _ in sampled] == [algo.prompt_ids[i] for i in window_idx for _ in range(3)]
        assert all(p == q for p, q in sampled)
        # the window's prompts: those of run.indices(s) for each of its steps s, each --online-samples times
        assert [j["prompt"] for j in judged] == [algo.rows[i]["prompt"] for s in (0, 1)
                                                 for i in run.indices(len(algo.rows), cfg.batch_size, s)
                                                 for _ in range(3)]
        for s in (0, 1):
            assert [p["prompt_ids"] for p in windows[s][0]] == [algo.prompt_ids[i] for i in
                                                               run.indices(len(algo.rows), cfg.batch_size, s)]
        kl = 0.0
        for s, (pairs, weights, _) in windows.items():
            assert len(pairs) == 4 and 1 <= weights.sum() <= 3, weights  # ties and pairs in each step
            assert max(len(p[k]) for p in pairs for k in ("chosen_ids", "rejected_ids")) == cfg.max_new_tokens
            for pair, w in zip(pairs, weights.tolist()):
                text = next(r["prompt"] for r, p in zip(algo.rows, algo.prompt_ids) if p == pair["prompt_ids"])
                mine = {j["completion"]: j["score"] for j in judged if j["prompt"] == text}
                top, bottom = max(mine.values()), min(mine.values())
                chosen, rejected = (algo.tok.decode(pair[k], skip_special_tokens=True)
                                    for k in ("chosen_ids", "rejected_ids"))
                assert mine[chosen] == top and mine[rejected] == bottom, (mine, chosen, rejected)
                assert w == float(top > bottom)
            kl += dpo(init, pairs)[1].sum().item()
        # sampled from the policy (the input model), not from the reference: E log π/π_ref = KL(π‖π_ref) > 0
        assert kl > 4, kl  # (+9.5 here; about -12 for samples of the --ref-model)

        pairs, w, _ = windows[0]
        loss, _ = dpo(init, pairs)
        m0 = step(algo, 0)
        close(m0["loss"], (loss * w).sum() / w.sum())
        assert m0["pairs"] == w.sum().item()
        close(m0["online/reward"], sum(j["score"] for j in judged[:12]) / 12)
        close(m0["online/pair_frac"], w.mean())
        close(m0["grad_norm"], grad_norm((loss * w).sum() / w.sum(), init), rel=1e-3)

        pairs, w, _ = windows[1]
        with torch.no_grad():
            loss, _ = dpo(algo.policy.module, pairs)
        m1 = step(algo, 1)
        assert len(scored()) == len(judged)  # step 1's pairs were sampled with step 0's
        close(m1["loss"], (loss * w).sum() / w.sum())
        assert m1["pairs"] == w.sum().item()
        close(m1["online/reward"], sum(j["score"] for j in judged[12:]) / 12)


def test_run_picks_the_variant_from_the_options(monkeypatch):
    """`align dpo` trains DPO for a paired loss, KTO for --loss kto, online DPO
    for --online."""
    import stages.dpo as S

    picked = []
    monkeypatch.setattr(S, "train", lambda cfg, stage, cls: picked.append((stage, cls)))
    for kw in ({}, {"loss": "simpo"}, {"loss": "kto"}, {"online": True}, {"online": True, "loss": "ipo"}):
        S.run(DPOConfig(**kw))
    assert picked == [("dpo", DPO), ("dpo", DPO), ("dpo", KTO), ("dpo", OnlineDPO), ("dpo", OnlineDPO)]


def test_online_samples_at_the_temperature_option(tmp_path, tiny_model_dir):
    """--online --temperature 1e-4 (non-default): the samples of a window are drawn at that temperature, so every
    one of the --online-samples 2 samples of each slot's prompt is the input model's GREEDY continuation (at T 1
    they would differ from it, and from each other); the samples scored by the judge are exactly those, each of
    the step's prompts (the ones of run.indices(step)) once per sample; all tie, so every slot weighs 0 and the
    step logs no pair."""
    log = tmp_path / "scores.jsonl"
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE.format(log=str(log)))
    prompts = [{"prompt": f"Write something about the number {n}.", "answer": str(n), "mode": "len"}
               for n in range(6)]
    data = write_rows(tmp_path / "prompts.jsonl", prompts)
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", online=True, online_samples=2,
                     max_new_tokens=10, verifier=f"{judge}:judge", temperature=1e-4, max_steps=1)
    init = hf_model(tiny_model_dir)
    with run:
        algo = OnlineDPO(cfg, run)
        log.unlink(missing_ok=True)  # the judge's calls on the first rows before any model was built
        eos = algo.tok.eos_token_id
        idx = run.indices(len(algo.rows), cfg.batch_size, 0)
        algo.sample_window(0)
        pairs, weights, reward = algo.buffer[0]
        judged = [json.loads(x) for x in log.read_text().splitlines()]
        assert [j["prompt"] for j in judged] == [algo.rows[i]["prompt"] for i in idx for _ in range(2)]
        for i, pair in zip(idx, pairs):
            assert pair["prompt_ids"] == algo.prompt_ids[i]
            want = greedy_ids(init, algo.prompt_ids[i], cfg.max_new_tokens, eos)
            assert pair["chosen_ids"][: len(want)] == want and pair["rejected_ids"][: len(want)] == want
            text = algo.tok.decode(want, skip_special_tokens=True)
            assert [j["completion"] for j in judged if j["prompt"] == algo.rows[i]["prompt"]] == [text, text]
        assert weights.tolist() == [0.0] * len(idx)
        close(reward, sum(j["score"] for j in judged) / len(judged))


def test_online_pairs_ranked_by_the_reward_model_option(tmp_path, tiny_model_dir, tiny_reward_model_dir):
    """--online --reward-model RM (a scalar RM saved with offset 0.5), 2 samples a prompt at --temperature 1: the
    judge is the RM's NORMALISED score of prompt + sample + EOS (each scored alone, by hand: value head at the last
    token − 0.5), so in each slot the chosen sample scores above the rejected one (or the slot weighs 0 on a tie),
    and `online/reward` logged by the step is the mean of those normalised scores over the step's samples."""
    from transformers import AutoModelForSequenceClassification

    from align.reward_model import encode_scored

    prompts = [{"prompt": f"Tell me about the number {n}.", "answer": str(n)} for n in range(6)]
    data = write_rows(tmp_path / "prompts.jsonl", prompts)
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", online=True, online_samples=2,
                     max_new_tokens=8, reward_model=str(tiny_reward_model_dir), max_steps=1)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, dtype=torch.float32).eval()

    def rm_score(prompt: str, ids: list) -> float:
        text = algo.tok.decode(ids, skip_special_tokens=True)
        (p, r), = encode_scored(algo.tok, [prompt], [text])
        with torch.no_grad():
            return rm(input_ids=torch.tensor([p + r])).logits[0, 0].item() - 0.5

    with run:
        algo = OnlineDPO(cfg, run)
        assert algo.judge is None and algo.rm is not None
        idx = run.indices(len(algo.rows), cfg.batch_size, 0)
        algo.sample_window(0)
        pairs, weights, _ = algo.buffer[0]
        scores = []
        for i, pair, w in zip(idx, pairs, weights.tolist()):
            assert pair["prompt_ids"] == algo.prompt_ids[i]
            sc, sr = (rm_score(algo.rows[i]["prompt"], pair[k]) for k in ("chosen_ids", "rejected_ids"))
            assert w == 1.0 and sc > sr + 1e-4, (sc, sr, w)  # two different samples, the better one chosen
            scores += [sc, sr]
        m = step(algo, 0)
    assert m["pairs"] == 4
    close(m["online/reward"], sum(scores) / len(scores), rel=1e-3, abs_=1e-4)


PASS_JUDGE = '''import json

def judge(prompt, completion, **row):
    """Correct when the completion has an even number of characters; logs each call."""
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompt": prompt, "completion": completion}}) + "\\n")
    return float(len(completion) % 2 == 0)
'''


def test_pass_at_1_on_the_first_eval_samples_greedy_with_the_verifier(tmp_path, chatty_model_dir):
    """--max-length 32 cuts the pairs' prompts from the left (the responses whole). --pass-data (5 rows),
    --eval-samples 3, --max-new-tokens 5, --verifier a logging judge: evaluate(0) checks the
    GREEDY continuations (at most 5 tokens) of the input model on the first 3 problems, once each, with that judge;
    eval/pass@1/greedy is the mean of its verdicts, eval/problems 3; final_metrics reports the start's as
    pass@1/reference."""
    log = tmp_path / "verdicts.jsonl"
    judge = tmp_path / "judge.py"
    judge.write_text(PASS_JUDGE.format(log=str(log)))
    rows = [{"prompt": f"What is {n} + {n + 2}?", "answer": str(2 * n + 2)} for n in range(5)]
    pass_data = write_rows(tmp_path / "pass.jsonl", rows)
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    cfg, run = stage(tmp_path, chatty_model_dir, data=data, eval_data="", pass_data=pass_data, eval_samples=3,
                     max_new_tokens=5, verifier=f"{judge}:judge", max_length=32)
    init = hf_model(chatty_model_dir)
    with run:
        algo = DPO(cfg, run)
        log.unlink(missing_ok=True)  # the judge's calls on the first rows before any model was built
        from align.data import encode_completions, encode_prompts

        cut = 0  # --max-length 32: each pair's prompt loses tokens from the LEFT so prompt + the longer response fits
        for e, r, p in zip(algo.examples, PAIRS, encode_prompts(algo.tok, [r["prompt"] for r in PAIRS])):
            c, j = encode_completions(algo.tok, [r["chosen"], r["rejected"]])
            keep = p[max(0, len(p) + max(len(c), len(j)) - 32):]
            assert (e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) == (keep, c, j)
            cut += len(keep) < len(p)
        assert len(algo.examples) == len(PAIRS) and cut >= 2
        m = algo.evaluate(0)
        eos = algo.tok.eos_token_id
        want = [algo.tok.decode(greedy_ids(init, p, 5, eos), skip_special_tokens=True)
                for p in encode_prompts(algo.tok, [r["prompt"] for r in rows[:3]])]
    judged = [json.loads(x) for x in log.read_text().splitlines()]
    assert [j["prompt"] for j in judged] == [r["prompt"] for r in rows[:3]]
    assert [j["completion"] for j in judged] == want and all(w.strip() for w in want)
    assert m["eval/problems"] == 3.0
    close(m["eval/pass@1/greedy"], sum(len(w) % 2 == 0 for w in want) / 3)
    assert algo.final_metrics({k: 0.0 for k in algo.train_keys}, m)["pass@1/reference"] == m["eval/pass@1/greedy"]



def test_optimiser_options_and_columns_reach_the_step(tmp_path, tiny_model_dir):
    """--lr 2e-3 --weight-decay 0.5 (non-default), --warmup-steps 0, ZeRO-0, and --columns renaming the data's
    q/good/bad to prompt/chosen/rejected: the pairs are the renamed rows'. The first AdamW step from the same start
    with --weight-decay 0.5 and with 0 differs by exactly −lr·wd·w0 on every matrix and not at all on a 1-D (norm)
    weight (decoupled decay, matrices only), and without decay no weight moves by more than lr, the largest
    moves by lr (Adam's first step is lr · g/(|g| + eps))."""
    from align.data import encode_completions

    renamed = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIRS]
    data = write_rows(tmp_path / "renamed.jsonl", renamed)
    lr, wd = 2e-3, 0.5
    after = {}
    for decay in (wd, 0.0):
        cfg, run = stage(tmp_path / str(decay), tiny_model_dir, data=data, eval_data="",
                         columns="q=prompt,good=chosen,bad=rejected", lr=lr, weight_decay=decay, zero_stage=0)
        with run:
            algo = DPO(cfg, run)
            assert [e["chosen_ids"] for e in algo.examples] == encode_completions(algo.tok, [r["chosen"] for r in PAIRS])
            assert [e["rejected_ids"] for e in algo.examples] == encode_completions(algo.tok,
                                                                                    [r["rejected"] for r in PAIRS])
            params = dict(algo.policy.module.named_parameters())
            w0 = {k: p.detach().clone() for k, p in params.items()}
            step(algo, 0)
            after[decay] = {k: p.detach().clone() for k, p in params.items()}
    dims = set()
    for k, w in w0.items():
        want = -lr * wd * w if w.dim() >= 2 else torch.zeros_like(w)
        torch.testing.assert_close(after[wd][k] - after[0.0][k], want, atol=2e-8, rtol=1e-3, msg=k)
        dims.add(min(w.dim(), 2))
    assert dims == {1, 2}
    moves = torch.cat([(after[0.0][k] - w0[k]).abs().flatten() for k in w0])
    assert moves.max().item() == pytest.approx(lr, rel=1e-4)


def test_online_sampling_keys_change_with_the_step_not_with_the_window(tmp_path, tiny_model_dir):
    """--online on 8 copies of ONE prompt, 2 samples each at T 1, --online-every 2: the window of steps 0 and 1,
    sampled at once, gives step 1's slots other samples than step 0's (the keys count the step); and a run with
    --online-every 1 sampling steps 0 and 1 one at a time (the policy still the start) draws exactly the window's
    samples (the keys are the seed's and the step's, not the RNG's: they do not depend on how steps are grouped
    into windows); a run entering the window at step 1 (a resume) samples step 1 alone, as the window did (with
    --max-steps 4 a full window from there would reach step 2); a slot's samples differ."""
    log = tmp_path / "scores.jsonl"
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE.format(log=str(log)))
    data = write_rows(tmp_path / "prompts.jsonl", [{"prompt": "Write something about the number 7.", "answer": "7",
                                                    "mode": "len"}] * 8)
    got, buffered = {}, {}
    for every, starts in ((2, (0,)), (1, (0, 1)), (2, (1,))):
        if log.exists():
            log.unlink()
        cfg, run = stage(tmp_path / f"every{every}{starts}", tiny_model_dir, data=data, eval_data="", online=True,
                         online_every=every, online_samples=2, max_new_tokens=8, verifier=f"{judge}:judge",
                         temperature=1.0, max_steps=4, seed=2)
        with run:
            algo = OnlineDPO(cfg, run)
            log.unlink(missing_ok=True)  # the judge's calls on the first rows before any model was built
            for s0 in starts:
                algo.sample_window(s0)
            judged = [json.loads(x)["completion"] for x in log.read_text().splitlines()]
            buffered[every, starts] = sorted(algo.buffer)
        got[every, starts] = [judged[i: i + 8] for i in range(0, len(judged), 8)]  # 4 slots x 2 samples a step
    window, alone, mid = got[2, (0,)], got[1, (0, 1)], got[2, (1,)]
    assert len(window) == 2 and len(alone) == 2 and buffered[2, (0,)] == [0, 1]
    assert window[0] != window[1]
    # step by step, the same samples as the window (sampling step 0 first draws nothing the keys depend on)
    assert alone == window
    # a window entered at step 1 (a resume inside it) samples only up to its end: step 1, as the window did
    assert buffered[2, (1,)] == [1] and mid == [window[1]]
    assert len(set(window[0])) > 1
    assert any(window[0][2 * j] != window[0][2 * j + 1] for j in range(4))  # a slot's samples: keys of their own


def test_the_lr_schedule_warmup_weight_decay_and_betas_reach_the_optimiser(tmp_path, tiny_model_dir):
    """--schedule linear --warmup-steps 2 --max-steps 4 --weight-decay 0.1: the learning rate each optimiser step
    applies is lr·(0.5, 1, 1, 0.55) (warmup (u + 1) / 2, then the linear decay to 10 %); AdamW decays the matrices
    by 0.1 and no 1-D parameter (norms, biases), with β = (0.9, 0.95)."""
    data = write_rows(tmp_path / "pairs.jsonl", PAIRS)
    lr = 2e-4
    cfg, run = stage(tmp_path, tiny_model_dir, data=data, eval_data="", schedule="linear", warmup_steps=2,
                     max_steps=4, weight_decay=0.1, lr=lr, zero_stage=0)
    with run:
        algo = DPO(cfg, run)
        opt = algo.policy.eng.optimizer
        with applied_lrs(opt) as (applied,):
            for s in range(4):
                algo.step(s)
        groups = decay_groups(opt)
    assert applied == pytest.approx([lr * f for f in (0.5, 1.0, 1.0, 0.55)])
    assert groups == {(0.1, "matrices", (0.9, 0.95)), (0.0, "1-d", (0.9, 0.95))}
