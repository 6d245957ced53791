"""align.rollout.generation on a ZeRO-3 engine (one process, gloo, CPU): batching, gather modes, EOS, sampling.

runtime.init() starts a single-process torch.distributed group inside the pytest process; that is fine as long
as every in-process user goes through runtime.init() (it is idempotent). The env vars it exports are restored
and the transformers<->DeepSpeed link is cut when this module ends, so later in-process loads are plain again.
"""

import copy
import os

import pytest
import torch

from align import runtime
from align.data import encode_prompts
from align.engine import build
from align.models import load_causal_lm, load_tokenizer, resolve
from align.rollout.generation import Sampling, generate, trim_at_eos

PROMPTS = ["Hi", "What is 1 + 2?", "Sam has 7 coins. He loses 3. How many coins does Sam have now?"]
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")
GREEDY = Sampling(max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    # an earlier test of this process may have initialised the process group and restored these away: runtime.init()
    # then keeps the group and exports nothing, and ZeRO-3's Init reads LOCAL_RANK
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(runtime.free_port()))
    dist = runtime.init()
    ref = resolve(str(tiny_model_dir))
    tok = load_tokenizer(ref)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()  # before the ZeRO-3 link: unsharded reference
    cfg = build.ds_config(zero_stage=3, micro_batch=1, grad_accum=1, world_size=1, dtype=torch.float32)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # shard every tensor, even tiny ones
    model, loader = build.load_partitioned(cfg, lambda dtype: load_causal_lm(ref, tok, dtype), torch.float32)
    eng = build.wrap(model, cfg)
    prompts = encode_prompts(tok, PROMPTS)
    assert len({len(p) for p in prompts}) == 3  # different lengths: batching needs left padding
    yield dict(eng=eng, tok=tok, dist=dist, plain=plain, prompts=prompts)
    del loader
    unset_hf_deepspeed_config()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def gen(setup, prompts=None, s=GREEDY, tok=None, **kw):
    return generate(setup["eng"], tok or setup["tok"], setup["prompts"] if prompts is None else prompts, s,
                    setup["dist"], **kw)


def check_completions(comps, tok, s):
    eos = tok.eos_token_id
    for c in comps:
        assert c.finished == (eos in c.ids)
        if c.finished:
            assert c.ids[-1] == eos and c.ids.count(eos) == 1
        else:
            assert len(c.ids) == s.max_new_tokens
        assert c.text == tok.decode(c.ids, skip_special_tokens=True)


def test_weights_are_sharded(setup):
    eng = setup["eng"]
    assert runtime.is_zero3(eng)
    params = list(eng.module.parameters())
    assert all(p.numel() == 0 for p in params)  # partitioned away outside a forward / gather
    assert sum(p.ds_numel for p in params) == sum(p.numel() for p in setup["plain"].parameters())


def test_batched_left_padding_equals_one_by_one(setup):
    batched = gen(setup, batch_size=8)
    singles = [gen(setup, [p])[0] for p in setup["prompts"]]
    assert [c.prompt_ids for c in batched] == setup["prompts"]
    assert [c.ids for c in batched] == [c.ids for c in singles]
    check_completions(batched, setup["tok"], GREEDY)
    # and both equal plain transformers greedy decoding on the unsharded model, one prompt at a time
    for p, c in zip(setup["prompts"], batched):
        with torch.no_grad():
            ref = setup["plain"].generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                          eos_token_id=2, pad_token_id=0)[0, len(p):].tolist()
        assert c.ids == trim_at_eos(ref, 2, 0)[0]


def test_batch_size_smaller_than_prompts(setup):
    assert [c.ids for c in gen(setup, batch_size=2)] == [c.ids for c in gen(setup, batch_size=3)]


def test_gather_false_equals_gather_true(setup):
    a = gen(setup, gather=True)
    b = gen(setup, gather=False)
    assert [c.ids for c in a] == [c.ids for c in b]
    assert all(p.numel() == 0 for p in setup["eng"].module.parameters())  # re-partitioned afterwards


def test_stops_at_eos(setup):
    """Make the token greedy decoding emits 3rd for prompt 0 the EOS: generation must stop right there."""
    base = gen(setup)
    g0 = base[0].ids
    assert len(g0) == GREEDY.max_new_tokens and not base[0].finished
    target = g0[2]
    tok = copy.deepcopy(setup["tok"])
    tok.eos_token = tok.convert_ids_to_tokens(target)
    assert tok.eos_token_id == target
    stopped = gen(setup, tok=tok)
    assert stopped[0].ids == g0[: g0.index(target) + 1] and stopped[0].finished
    for b, s in zip(base, stopped):  # the other rows: same tokens up to (and including) their first `target`
        assert s.ids == (b.ids[: b.ids.index(target) + 1] if target in b.ids else b.ids)
    check_completions(stopped, tok, GREEDY)


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([5, 6, 2, 0, 0], ([5, 6, 2], True)),  # cut after the first EOS (kept), padding dropped
        ([5, 2, 7, 2], ([5, 2], True)),  # only the first EOS counts
        ([2], ([2], True)),
        ([5, 6, 7], ([5, 6, 7], False)),
        ([], ([], False)),
    ],
)
def test_trim_at_eos(ids, expected):
    assert trim_at_eos(ids, eos_id=2, pad_id=0) == expected


def test_sampling_without_a_seed_follows_torchs_rng(setup):
    s = Sampling(max_new_tokens=8, temperature=1.5)
    torch.manual_seed(5)
    a = [c.ids for c in gen(setup, s=s)]
    torch.manual_seed(5)
    b = [c.ids for c in gen(setup, s=s)]
    torch.manual_seed(6)
    c = [c.ids for c in gen(setup, s=s)]
    assert a == b
    assert a != c  # really sampling: another seed, other tokens
    assert a != [c.ids for c in gen(setup)]


def test_top_k_1_sampling_equals_greedy(setup):
    torch.manual_seed(7)
    sampled = gen(setup, s=Sampling(max_new_tokens=8, temperature=1.0, top_k=1))
    assert [c.ids for c in sampled] == [c.ids for c in gen(setup)]


SAMPLED = Sampling(max_new_tokens=8, temperature=1.5, seed=11)


def test_a_prompts_samples_do_not_depend_on_the_batch_layout(setup):
    """With a sampling seed, prompt i's samples depend on (seed, i) alone: the same for any batch size, gather mode
    and company of other prompts (the prompt keeps its index), and on the fast decoder too (the same keyed race on
    the same logits)."""
    prompts = [p for p in setup["prompts"] for _ in range(4)]  # 4 samples of each prompt, as pass@k draws them
    ref = [c.ids for c in gen(setup, prompts, SAMPLED, batch_size=64)]
    assert len({tuple(x) for x in ref[:4]}) > 1  # really sampling: a prompt's 4 samples differ
    for bs in (1, 5):
        assert [c.ids for c in gen(setup, prompts, SAMPLED, batch_size=bs)] == ref, bs
    assert [c.ids for c in gen(setup, prompts, SAMPLED, batch_size=5, gather=False)] == ref
    from align.rollout.generation import generate_local

    with runtime.gathered_for_generation(setup["eng"], True) as module:
        alone = generate_local(module, setup["tok"], prompts[5:7], SAMPLED, 64, "cpu", indices=[5, 6])
        fast = generate_local(module, setup["tok"], prompts, SAMPLED, 3, "cpu", fast=True)
    assert [c.ids for c in alone] == ref[5:7]
    assert [c.ids for c in fast] == ref
    assert [c.ids for c in gen(setup, prompts, Sampling(max_new_tokens=8, temperature=1.5, seed=12))] != ref


def test_keyed_sampling_follows_the_distribution():
    """The race with keyed noise samples softmax(z): over 20,000 keys at one position, and over 20,000 positions
    of one key; after top-k / top-p filtering only kept tokens are drawn."""
    from align.rollout.sampling import choose, filter_logits, prompt_keys

    z = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = z.softmax(-1)[0]
    keys = torch.tensor(prompt_keys(3, range(20000)))
    for draws in (choose(z.expand(20000, 5), keys, 7),
                  torch.stack([choose(z, keys[:1], t) for t in range(20000)]).flatten()):
        freq = torch.bincount(draws, minlength=5).float() / 20000
        assert (freq - p).abs().max() < 0.015, freq
    kept = choose(filter_logits(z.expand(20000, 5).clone(), top_k=2, top_p=1.0), keys, 0)
    assert set(kept.tolist()) == {0, 1}


def test_sampling_draws_from_the_whole_distribution(setup):
    """Temperature 1, no top-k / top-p: the log-probability of the sampled tokens averages minus the entropy of
    the distributions they were drawn from. (HF `generate` given top_k=None keeps its default top 50: -5.8 against
    -6.2 on this model, which is what the HF path sampled before.)"""
    from align.rollout.generation import generate_local

    model, tok, p = setup["plain"], setup["tok"], setup["prompts"][2]
    out = generate_local(model, tok, [p] * 300, Sampling(max_new_tokens=4, temperature=1.0, seed=3), 300, "cpu",
                         fast=False)
    logp_chosen, neg_entropy = [], []
    with torch.no_grad():
        for c in out:
            logp = model(torch.tensor([p + c.ids])).logits[0, len(p) - 1 : -1].float().log_softmax(-1)
            logp_chosen += logp.gather(1, torch.tensor(c.ids)[:, None]).flatten().tolist()
            neg_entropy += (logp.exp() * logp).sum(-1).tolist()
    n = len(logp_chosen)
    assert abs(sum(logp_chosen) / n - sum(neg_entropy) / n) < 0.15, (sum(logp_chosen) / n, sum(neg_entropy) / n)
