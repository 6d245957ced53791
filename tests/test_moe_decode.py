"""The fast decoder on mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) and routing replay, on CPU (fp32,
eager), with tiny random models of each family: greedy tokens equal HF `generate`'s, logits and sampled log-probs
the HF forward's; the recorded routes are the experts HF's router picks for each token; replaying them in the
trainer's forward closes the log-prob gap of tokens whose routes flipped, keeps the router's gradient, and survives
gradient checkpointing's recompute and packing; a GRPO run with --routing-replay logs the mismatch metric."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from align.engine.stats import Stats
from align.errors import UserError
from align.logprobs import logprobs
from align.rollout.batch import rollout_batch
from align.rollout.completion import Completion
from align.rollout.fast import moe
from align.rollout.fast.decoder import FastDecoder
from align.rollout.fast.support import describe, unsupported_reason
from align.rollout.generation import Sampling, generate_local
from align.routing_replay import check, moe_blocks, replayed_gate_weights, routing_replay

EOS, PAD = 2, 0
PROMPTS = [[1, 5, 9, 11], [1, 7], [1, 30, 31, 32, 33, 34, 35], [1, 40, 41]]
BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
            max_position_embeddings=256, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1, num_experts_per_tok=2,
            tie_word_embeddings=False)
FAMILIES = {
    # a dense layer between two MoE layers (mlp_only_layers), Qwen3's own head_dim, per-head q/k norm
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, head_dim=24,
                      mlp_only_layers=[1]),
    # q/k norm over the whole projection, q/k/v clipped, gate weights not renormalised
    "olmoe": dict(num_experts=8, intermediate_size=32, norm_topk_prob=False, clip_qkv=3.0),
    "mixtral": dict(num_local_experts=4, intermediate_size=32, sliding_window=None),
    # a sigmoid-gated shared expert beside the routed ones, q/k/v biases, a dense middle layer (mlp_only_layers),
    # gate weights as they are; then renormalised, with 4 experts and every second layer sparse (decoder_sparse_step)
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen2_moe-norm": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=2),
}
MOE_LAYERS = {"qwen3_moe": [0, 2], "qwen2_moe": [0, 2], "qwen2_moe-norm": [1]}  # 3 layers; the others: all


def model_type(kind: str) -> str:
    """The transformers model type of a FAMILIES key ("qwen2_moe-norm": qwen2_moe)."""
    return kind.split("-")[0]


class Tok:
    eos_token_id, pad_token_id, bos_token_id = EOS, PAD, 1

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def make(kind: str, layers: int = 3):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type(kind), **{**BASE, "num_hidden_layers": layers}, **FAMILIES[kind])
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # bigger weights: sharper, more varied greedy continuations and routes
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
            else:  # norm weights away from 1
                p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.fixture(params=["shared", "copy"])
def weights(request, monkeypatch):
    if request.param == "copy":
        monkeypatch.setenv("ALIGN_FAST_DECODER_COPY", "1")
    return request.param


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_matches_hf_generate(kind, weights):
    m = make(kind)
    assert unsupported_reason(m, length=7 + 12) is None
    assert "experts, top-2" in describe(m)
    s = Sampling(max_new_tokens=12, temperature=0.0)
    plain = generate_local(m, Tok(), PROMPTS, s, batch_size=4, device="cpu", fast=False)
    fast = generate_local(m, Tok(), PROMPTS, s, batch_size=4, device="cpu", fast=True)
    assert [c.ids for c in fast] == [c.ids for c in plain]
    assert len({tuple(c.ids) for c in plain}) > 1
    dec = m._align_fast_decoder
    assert dec.shares_weights == (weights == "shared") and dec.moe_layers == MOE_LAYERS.get(kind, [0, 1, 2])
    if weights == "shared":  # the experts' 3-D tensors (and a shared expert's matrices) read in place
        i = dec.moe_layers[0]
        block = m.model.layers[i].mlp
        assert dec.layers[i]["egu"].data_ptr() == block.experts.gate_up_proj.data_ptr()
        if hasattr(block, "shared_expert"):
            assert dec.layers[i]["se_u"].data_ptr() == block.shared_expert.up_proj.weight.data_ptr()
    # the other expert kernel (gathered weights and a batched matmul instead of torch._grouped_mm): the same tokens
    assert dec.grouped
    dec.grouped = False
    dec.load_weights(m)  # (a copy's storage is given back after each rollout)
    assert [r[: len(c.ids)] for r, c in zip(dec.generate(PROMPTS, s, EOS, PAD), plain)] == [c.ids for c in plain]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_prefill_logits_equal_the_hf_forward(kind):
    m = make(kind)
    P = 7
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in PROMPTS])
    mask = (ids != PAD).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        dec = FastDecoder(m, "cpu")
        dec.load_weights(m)
        dec._alloc(len(PROMPTS), 32)
        got = dec._prefill(ids, mask)
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_fp8_rollouts_keep_the_experts_and_the_shared_expert_in_the_compute_dtype():
    """An FP8 decoder of a Qwen2-MoE model: attention and the dense layer's MLP in E4M3; an MoE layer's router,
    routed experts, shared expert (gate/up fused) and its gate copied exactly in the compute dtype (fp32 here); its
    logits near the exact decoder's (rounded, but close)."""
    from align.rollout.fast import fp8

    m = make("qwen2_moe")
    exact, dec = FastDecoder(m, "cpu"), FastDecoder(m, "cpu", precision="fp8")
    for d in (exact, dec):
        d.load_weights(m)
    moe_L, dense_L, block = dec.layers[0], dec.layers[1], m.model.layers[0].mlp
    assert [dense_L[k].dtype for k in ("qkv", "o", "gu", "down")] == [fp8.E4M3] * 4 and moe_L["qkv"].dtype == fp8.E4M3
    se = block.shared_expert
    kept = {"router": block.gate.weight, "egu": block.experts.gate_up_proj, "edown": block.experts.down_proj,
            "se_gu": torch.cat([se.gate_proj.weight, se.up_proj.weight]), "se_down": se.down_proj.weight,
            "se_gate": block.shared_expert_gate.weight}
    for k, w in kept.items():
        assert moe_L[k].dtype == torch.float32 and torch.equal(moe_L[k], w), k
    P = 7
    ids = torch.tensor([[PAD] * (P - len(p)) + p for p in PROMPTS])
    with torch.no_grad():
        for d in (exact, dec):
            d._alloc(len(PROMPTS), 32)
        want, got = exact._prefill(ids, (ids != PAD).long()), dec._prefill(ids, (ids != PAD).long())
    assert 1e-4 < ((got - want).norm() / want.norm()).item() < 0.2  # 0.078 (E4M3 rounding, some routes flip)


def test_router_and_experts_by_hand():
    """route: softmax then top-k, renormalised where the family does; replayed_gate_weights: the same
    normalisation at given experts; both expert kernels against a loop over (token, expert)."""
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0]]))  # p = 1/6, 2/6, 3/6
    idx, w = moe.route(logits, 2, renorm=False, fp32_weights=False)
    assert idx.tolist() == [[2, 1]] and w[0].tolist() == pytest.approx([0.5, 1 / 3])
    _, w = moe.route(logits, 2, renorm=True, fp32_weights=False)
    assert w[0].tolist() == pytest.approx([0.6, 0.4])
    chosen = torch.tensor([[0, 2]])
    assert replayed_gate_weights(logits, chosen, False, False)[0].tolist() == pytest.approx([1 / 6, 0.5])
    assert replayed_gate_weights(logits, chosen, True, False)[0].tolist() == pytest.approx([0.25, 0.75])
    assert replayed_gate_weights(logits.bfloat16(), chosen, True, True).dtype == torch.float32  # Mixtral's fp32
    g = torch.Generator().manual_seed(0)
    x, gu, down = torch.randn(5, 16, generator=g), torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    idx, w = torch.randn(5, 4, generator=g).topk(2, -1).indices, torch.rand(5, 2, generator=g)
    want = torch.zeros(5, 16)
    for n in range(5):
        for k in range(2):
            gate, up = (gu[idx[n, k]] @ x[n]).chunk(2)
            want[n] += w[n, k] * (down[idx[n, k]] @ (torch.nn.functional.silu(gate) * up))
    for fn in (moe.experts_gathered, moe.experts_grouped):
        assert (fn(x, gu, down, idx, w) - want).abs().max() < 1e-4 * want.abs().max()


def routed(m, kind="mixtral", n=8, new=10):
    """A sampled rollout of `m` with its routes recorded, as a batch."""
    s = Sampling(max_new_tokens=new, temperature=1.0, seed=3, routes=True)
    out = generate_local(m, Tok(), (PROMPTS * 4)[:n], s, n, "cpu", fast=True)
    return out, rollout_batch(out, PAD, "cpu")


def own_routes(m, batch) -> torch.Tensor:
    """The experts HF's own routers pick for every token of the batch, [N, L, MoE layers, k]."""
    got = []
    hooks = [block.gate.register_forward_hook(lambda mod, a, o: got.append(o[2])) for _, block in moe_blocks(m)]
    with torch.no_grad():
        m(input_ids=batch["input_ids"])
    for h in hooks:
        h.remove()
    return torch.stack([g.view(*batch["input_ids"].shape, -1) for g in got], 2)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_recorded_routes_are_the_routers_and_replay_matches_the_sampler(kind):
    """The decoder's routes of every prompt and response token are the experts HF's router picks for it in the
    trainer's forward (-1 on padding, and on the last token of a row cut at the token limit, which no decode step
    read); with them replayed the
    trainer's log-probs equal the sampler's (as they do without: the same weights route alike)."""
    m = make(kind, layers=2)
    out, batch = routed(m, kind)
    rec = batch["routed_experts"]
    assert rec.dtype == torch.int8 and rec.shape[2:] == (len(moe_blocks(m)), 2)
    own = own_routes(m, batch)
    for i, c in enumerate(out):
        n = len(c.prompt_ids) + len(c.ids)
        assert (rec[i, n:] == -1).all() and (rec[i, : n - 1] >= 0).all()
        # the last token: read by a decode step only when the row ended (EOS) before the others
        m_ = n if (rec[i, n - 1] >= 0).all() else n - 1
        assert m_ == n or len(c.ids) == 10
        assert torch.equal(rec[i, :m_].long().sort(-1).values, own[i, :m_].sort(-1).values)
    mask = batch["response_mask"].bool()
    with torch.no_grad(), routing_replay(m):
        lp, _ = logprobs(m, batch, temperature=1.0)
    assert (lp - batch["sampler_logp"])[mask].abs().max() < 1e-4
    assert lp[mask].abs().min() > 1e-3


def perturbed_router(m, scale: float = 0.02) -> None:
    """The routers' weights moved a little, as a policy update moves them: some tokens' top-k flips."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, block in moe_blocks(m):
            block.gate.weight.mul_(1 + scale * torch.randn(block.gate.weight.shape, generator=g))


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_replay_closes_the_gap_of_flipped_routes(kind):
    """The decoder sampled with routers that differ slightly from the trainer's. Tokens after a route flip (a
    token's log-prob depends on the routes of every position before it) are far off the sampler's log-probs
    without replay and as close as the unflipped tokens with it (the gate weights still move with the router:
    that part of the gap is the policy's, not the routes')."""
    m = make(kind, layers=2)
    _, batch = routed(m, kind, n=16)
    perturbed_router(m)
    rec, own = batch["routed_experts"].long(), own_routes(m, batch)
    flipped = ((rec >= 0).all(-1) & (rec.sort(-1).values != own.sort(-1).values).any(-1)).any(-1)  # [N, L]
    after_flip = flipped.long().cumsum(1)[:, :-1] > 0
    mask = batch["response_mask"].bool()
    hit, rest = mask & after_flip, mask & ~after_flip
    assert hit.sum() >= 5 and rest.sum() >= 5  # flips happened, and not everywhere
    stats = Stats()
    with torch.no_grad():
        plain, _ = logprobs(m, batch, temperature=1.0)
        with routing_replay(m, stats=stats):
            replayed, _ = logprobs(m, batch, temperature=1.0)
    # rollout/route_flip_frac: the replayed (token, layer) routes the trainer's router would have chosen otherwise
    have = (rec >= 0).all(-1)
    differ = (rec.sort(-1).values != own.sort(-1).values).any(-1) & have
    assert stats.reduce("cpu")["rollout/route_flip_frac"] == pytest.approx(differ.sum().item() / have.sum().item())
    assert 0 < differ.sum() < have.sum()
    gap, gap_r = (plain - batch["sampler_logp"]).abs(), (replayed - batch["sampler_logp"]).abs()
    assert gap[hit].max() > 10 * gap_r[hit].max()
    assert gap_r[hit].max() < 2 * gap[rest].max()  # replayed: no worse than the tokens whose routes never flipped
    assert torch.equal(gap_r[rest], gap[rest])  # nothing else changes


def test_replay_keeps_the_router_gradient_through_checkpointing_and_packing():
    """Under replay the router still gets gradient (the gate weights are its softmax at the replayed experts);
    gradient checkpointing's recompute routes the same way (the gradients equal those without checkpointing,
    and differ from the trainer's own routing's); a packed forward replays each sequence's routes."""
    m = make("qwen3_moe", layers=3)
    _, batch = routed(m, n=8)
    perturbed_router(m, 0.05)
    mask = batch["response_mask"]

    def grads(ckpt: bool, replay: bool):
        m.zero_grad()
        m.train()
        if ckpt:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with routing_replay(m, replay):
            lp, _ = logprobs(m, batch, temperature=1.0)
            (lp * mask).sum().backward()
        if ckpt:
            m.gradient_checkpointing_disable()
        m.eval()
        return torch.cat([b.gate.weight.grad.flatten() for _, b in moe_blocks(m)]), lp.detach()

    want, lp = grads(False, True)
    got, lp_ckpt = grads(True, True)
    own, lp_own = grads(True, False)
    assert want.abs().max() > 1e-3
    assert (got - want).abs().max() < 1e-5 * want.abs().max() and torch.equal(lp_ckpt, lp)
    assert (own - want).abs().max() > 1e-2 * want.abs().max() and not torch.equal(lp_own, lp)
    from align.logprobs import packing
    from align.varlen import enable

    assert enable(m, force=True)  # packed into one row, varlen attention (per segment on a CPU), as on a GPU
    assert packing(batch, min_saving=0.1, varlen=True) is not None  # the rows differ in length: they are packed
    with torch.no_grad(), routing_replay(m):
        packed, _ = logprobs(m, batch, temperature=1.0, pack=True)
    assert (packed - lp)[mask.bool()].abs().max() < 1e-5


def test_replay_context_and_routes_round_trip():
    """routing_replay leaves the blocks as they were; inside it, a forward without routes routes itself; the
    reference model (no replay installed) is never given routes; --routing-replay on a dense policy is a
    UserError; a Completion's routes survive its JSON form (queued rollouts, decoder answers)."""
    m = make("olmoe", layers=2)
    out, batch = routed(m, n=4, new=4)
    ids = batch["input_ids"]
    with torch.no_grad():
        want = m(input_ids=ids).logits
        with routing_replay(m):
            assert torch.equal(m(input_ids=ids).logits, want)
            with routing_replay(m):  # re-entrant: the inner one does nothing
                pass
            assert "forward" in vars(moe_blocks(m)[0][1])
    assert all(not {"forward", "_align_replay", "_align_routes"} & set(vars(b)) for _, b in moe_blocks(m))
    from align.routing_replay import forward_kwargs

    assert forward_kwargs(m, batch) == {}  # not installed: the model routes itself
    from tests.test_fast_generate import make as make_dense

    with pytest.raises(UserError, match="--routing-replay"):
        check(make_dense("llama", True), True)
    assert check(m, True) and not check(make_dense("llama", True), False)
    c = out[0]
    back = Completion.from_json(json.loads(json.dumps(c.to_json())))
    assert torch.equal(back.routes, c.routes) and back.routes.dtype == c.routes.dtype and back.ids == c.ids


def test_grpo_with_routing_replay_logs_the_mismatch(tmp_path):
    """A GRPO run on a tiny Qwen3-MoE policy with --routing-replay (the fast decoder records routes, the update
    replays them, gradient checkpointing on): the decoder's and the trainer's log-probs agree to fp32 rounding,
    and the update replayed the routes (rollout/route_flip_frac logged: none flipped, the same weights in fp32)."""
    from align.models import load_tokenizer, resolve
    from tests.conftest import parity_reward, run_command, small_data

    from transformers import AutoConfig, AutoModelForCausalLM

    tok = load_tokenizer(resolve("tiny"))
    cfg = AutoConfig.for_model("qwen3_moe", **{**BASE, "vocab_size": len(tok), "num_hidden_layers": 2,
                                               "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                                               "bos_token_id": tok.bos_token_id}, **FAMILIES["qwen3_moe"])
    torch.manual_seed(0)
    model_dir = tmp_path / "moe"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    out = tmp_path / "g"
    import os

    env = {**os.environ, "COLUMNS": "500"}
    proc = run_command([sys.executable, "-m", "align", "grpo", "--model", str(model_dir), "--out", str(out),
                        "--max-steps", "2", "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens",
                        "6", "--eval-data", "", "--warmup-steps", "0", "--reward", parity_reward(), "--data",
                        str(small_data()["arith"]), "--routing-replay", "--gradient-checkpointing"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rollouts: fast decoder (qwen3_moe" in proc.stdout + proc.stderr  # it records routes (on a CPU too)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["rollout/logp_abs_diff"] for r in rows if "rollout/logp_abs_diff" in r]
    assert len(diffs) == 2 and max(diffs) < 1e-5
    assert [r["rollout/route_flip_frac"] for r in rows if "rollout/route_flip_frac" in r] == [0.0, 0.0]
