"""Stochastic rounding to bf16 and the AdamW that uses it (--precision bf16-pure)."""

import pytest
import torch

from align.optim import AdamWSR, stochastic_round_bf16


def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours():
    g = torch.Generator().manual_seed(0)
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    for x in (1.0 + 0.3 * ulp, -(1.0 + 0.3 * ulp), 3.0e-5, -1234.5678):
        xs = torch.full((200_000,), x, dtype=torch.float32)
        r = stochastic_round_bf16(xs, g)
        assert r.dtype == torch.bfloat16
        lo, hi = sorted({v.item() for v in r.unique().float()})
        assert lo <= x <= hi and torch.tensor(lo).bfloat16().float() == lo and torch.tensor(hi).bfloat16().float() == hi
        assert r.float().mean().item() == pytest.approx(x, rel=2e-4)  # E[SR(x)] = x
        p_up = (r.float() == hi).float().mean().item()
        assert p_up == pytest.approx((x - lo) / (hi - lo), abs=0.01)  # two points with mean x
    # round-to-nearest would map 1 + 0.3 ulp to 1.0 every time
    assert torch.tensor(1.0 + 0.3 * ulp).bfloat16().item() == 1.0


def test_values_bf16_holds_exactly_never_move():
    x = torch.tensor([0.0, 1.0, -2.5, 0.15625, 1e-30, 3.0e38]).bfloat16().float()
    for seed in range(5):
        assert torch.equal(stochastic_round_bf16(x, torch.Generator().manual_seed(seed)).float(), x)


def test_adamw_sr_is_torch_adamw_on_fp32_parameters():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    groups = lambda m: [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}]
    oa = torch.optim.AdamW(groups(a), lr=1e-2, betas=(0.9, 0.95))
    ob = AdamWSR(groups(b), lr=1e-2, betas=(0.9, 0.95))
    for step in range(6):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    assert set(ob.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_updates_below_a_bf16_ulp_survive_with_stochastic_rounding_only():
    """A weight of 1.0 (bf16 ulp 2^-7 ≈ 0.0078) with a constant gradient: Adam's step is ≈ lr = 1e-4, so 300
    steps should move it by ≈ −0.03. Round-to-nearest AdamW (torch's, on bf16) never moves it; AdamWSR does, by
    the right amount up to rounding noise, and keeps its moments in bf16 (8 bytes per parameter in all)."""
    torch.manual_seed(0)
    w_rn = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    w_sr = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    o_rn = torch.optim.AdamW([w_rn], lr=1e-4, weight_decay=0.0)
    o_sr = AdamWSR([w_sr], lr=1e-4, weight_decay=0.0)
    for _ in range(300):
        for w, o in ((w_rn, o_rn), (w_sr, o_sr)):
            w.grad = torch.ones_like(w)
            o.step()
    assert torch.all(w_rn == 1.0)
    assert w_sr.float().mean().item() == pytest.approx(1.0 - 300 * 1e-4, abs=1e-3)
    assert {t.dtype for t in o_sr.state[w_sr].values() if t.ndim} == {torch.bfloat16}


def test_chunked_update_equals_one_chunk(monkeypatch):
    """The multi-tensor update runs over chunks of parameters, a tensor larger than a chunk in slices (bounding
    its fp32 temporaries): the chunking must not change the arithmetic (fp32 parameters, no rounding: exact)."""
    import align.optim as O

    def run(chunk):
        monkeypatch.setattr(O, "CHUNK", chunk)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        o = O.AdamWSR(m.parameters(), lr=1e-2)
        for step in range(3):
            o.zero_grad()
            m(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            o.step()
        return [p.detach().clone() for p in m.parameters()]

    for a, b in zip(run(1 << 22), run(20)):  # 20 elements: the 128- and 64-element weights go in slices
        assert torch.equal(a, b)


def test_a_tensor_larger_than_a_chunk_is_stepped_in_slices_with_bounded_temporaries(monkeypatch):
    """The fp32 temporaries of a step scale with the chunk, not with the largest tensor (an embedding of 136M
    elements made the update's peak): the largest tensor the update allocates is one chunk."""
    import align.optim as O

    monkeypatch.setattr(O, "CHUNK", 64)
    w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    w.grad = torch.full_like(w, 0.5)
    seen = []
    real_cat = torch.cat

    def cat(ts, *a, **k):
        out = real_cat(ts, *a, **k)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(torch, "cat", cat)
    o = O.AdamWSR([w], lr=1e-2, weight_decay=0.0)
    o.step()
    assert seen and max(seen) <= 64 and sum(seen) == 1000  # every element rounded once, a chunk at a time
    assert torch.all(w < 1.0) and o.state[w]["step"].item() == 1


def _eager_fused(monkeypatch):
    """The one-kernel path with its function run eagerly (the GPU compiles it; the arithmetic is the same)."""
    import align.optim as O

    monkeypatch.setattr(O, "_fused", O.adamw_sr_tensor)


def test_fused_tensor_update_equals_the_multi_tensor_path_on_fp32(monkeypatch):
    """The GPU's one-kernel-per-tensor AdamW (`adamw_sr_tensor`, its hyperparameters in a device tensor) and the
    CPU's chunked foreach path are the same update: fp32 weights match over steps with a changing learning rate
    and weight decay in one group, none in the other."""
    _eager_fused(monkeypatch)

    def run(fused):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        o = AdamWSR([{"params": [m[0].weight, m[1].weight], "weight_decay": 0.1},
                     {"params": [m[0].bias, m[1].bias], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), fused=fused)
        for step in range(5):
            for g in o.param_groups:
                g["lr"] = 1e-2 / (step + 1)
            o.zero_grad()
            m(torch.randn(5, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            o.step()
        return [p.detach().clone() for p in m.parameters()], o

    (a, _), (b, ob) = run(False), run(True)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    assert set(ob.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_fused_update_rounds_stochastically_onto_bf16(monkeypatch):
    """On bf16 weights the one-kernel path keeps sub-ulp updates in expectation (the 300-step test above) and its
    moments in bf16; a non-contiguous weight is stepped in place too."""
    _eager_fused(monkeypatch)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    t = torch.nn.Parameter(torch.ones(64, 32, dtype=torch.bfloat16).t())  # non-contiguous
    o = AdamWSR([w, t], lr=1e-4, weight_decay=0.0, fused=True)
    for _ in range(300):
        w.grad, t.grad = torch.ones_like(w), torch.ones_like(t)
        o.step()
    assert w.float().mean().item() == pytest.approx(1.0 - 300 * 1e-4, abs=1e-3)
    assert t.float().mean().item() == pytest.approx(1.0 - 300 * 1e-4, abs=2e-3)
    assert {x.dtype for x in o.state[w].values() if x.ndim} == {torch.bfloat16}


def test_compiled_tensor_update_is_one_graph_for_every_size():
    """torch.compile of `adamw_sr_tensor` with dynamic sizes: tensors of other sizes and another learning rate
    reuse the first graph (no recompile per parameter shape or step), and it computes what the eager function
    does (fp32: no rounding)."""
    from align.optim import adamw_sr_tensor

    import torch._dynamo.testing

    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    f = torch.compile(adamw_sr_tensor, dynamic=True, fullgraph=True, backend=counts)
    for n, lr in ((100, 1e-2), (37, 5e-3), (1000, 1e-3)):
        gen = torch.Generator().manual_seed(n)
        p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
        v = v.abs()
        hp = torch.tensor([lr, 0.9, 0.95, 1e-8, 0.1, 0.19, 0.0975])
        want = [x.clone() for x in (p, m, v)]
        adamw_sr_tensor(*want[:1], g, *want[1:], hp)
        f(p, g, m, v, hp)
        for x, y in zip((p, m, v), want):
            torch.testing.assert_close(x, y)
    assert counts.frame_count == 1
    w, g = torch.ones(300, dtype=torch.bfloat16), torch.ones(300, dtype=torch.bfloat16)
    f(w, g, torch.zeros_like(w), torch.zeros_like(w), hp)  # bf16: the stochastic rounding compiles too
    assert w.dtype == torch.bfloat16 and set(w.float().tolist()) == {1.0, 1.0 - 2**-8}  # the two neighbours
