"""The fast decoder against the HF forward on real configs of each family it takes, on a GPU, in bf16.

    python -m benchmarks.decoder_families [--models qwen2.5-1.5b,qwen3-1.7b,llama3.2-1b,mistral-1.5b]

For each random-weight model (built on the GPU from the real config in `benchmarks.vs_trl.MODELS`): 16
left-padded prompts of 40-200 tokens; the last position's logits of (a) the HF forward in fp32 (the reference),
(b) the HF forward in bf16, (c) our decoder's prefill in bf16. Relative error ||x - ref|| / ||ref|| of (b) and (c):
ours passes when it is within 1.5x HF's own bf16 error (random weights give near-flat logits, so both errors are
several percent). Then 64 greedy tokens from each path
(bf16): the share of rows whose first 16 tokens agree, and ms per generated token of our CUDA-graph decoder
against HF `generate` (64 rows); and, teacher-forced through the HF forward, how far below its best logit each
token our CUDA-graph decoder chose lies (in logit standard deviations: near 0 for bf16 near-ties; a wrong mask or
cache shows as large gaps). Passes also need the largest gap under 0.5.
"""

from __future__ import annotations

import argparse
import time


def check(name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from align.rollout.fast.decoder import FastDecoder
    from align.rollout.fast.support import unsupported_reason
    from align.rollout.generation import Sampling
    from benchmarks import vs_trl as V

    cfg = V.config(name, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    why = unsupported_reason(m, length=264)
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(40, 200, (16,), generator=g).tolist()
    P = max(lens)
    ids = torch.zeros(16, P, dtype=torch.long)
    mask = torch.zeros(16, P, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, P - n:] = torch.randint(3, min(cfg.vocab_size, 30000), (n,), generator=g)
        mask[i, P - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        m.to(torch.bfloat16)
        hf = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        dec = FastDecoder(m, "cuda")
        dec.load_weights(m)
        dec._alloc(16, P + 64)
        ours = dec._prefill(ids, mask)
    rel = lambda x: float((x - ref).norm() / ref.norm())  # noqa: E731
    r = {"model": name, "type": cfg.model_type, "fast path": why or "yes", "hf_bf16_err": rel(hf), "ours_err": rel(ours)}
    # greedy agreement and decode speed, 64 rows
    prompts = [ids[i % 16, P - lens[i % 16]:].tolist() for i in range(64)]
    s = Sampling(max_new_tokens=64, temperature=0.0)
    dec = FastDecoder(m, "cuda")
    dec.load_weights(m)
    dec.generate(prompts, s, eos=-1, pad=0)  # compile + capture (eos -1: every row runs 64 tokens)
    torch.cuda.synchronize()
    t = time.perf_counter()
    fast = dec.generate(prompts, s, eos=-1, pad=0)
    torch.cuda.synchronize()
    r["ours_ms_per_token"] = (time.perf_counter() - t) / 64 * 1e3
    L = max(len(p) for p in prompts)
    hid = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device="cuda")
    hmask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=2)
    with torch.no_grad():
        m.generate(input_ids=hid, attention_mask=hmask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = m.generate(input_ids=hid, attention_mask=hmask, **kw)[:, L:].tolist()
        torch.cuda.synchronize()
    r["hf_ms_per_token"] = (time.perf_counter() - t) / 64 * 1e3
    r["greedy_rows_equal_16"] = sum(a[:16] == b[:16] for a, b in zip(fast, out)) / 64
    # teacher-forced: how far below the HF forward's best logit is the token our CUDA-graph decoder chose, at every
    # generated position (in units of the logits' std; bf16 near-ties give small gaps, a wrong mask or cache large)
    seq = torch.tensor([[0] * (L - len(p)) + p + f for p, f in zip(prompts, fast)], device="cuda")
    smask = torch.cat([hmask, torch.ones(64, 64, dtype=hmask.dtype, device="cuda")], 1)
    with torch.no_grad():
        lg = m(input_ids=seq, attention_mask=smask, position_ids=(smask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    lg = lg[:, L - 1 : L + 63]  # the logits that chose each of the 64 generated tokens
    chosen = lg.gather(-1, seq[:, L : L + 64, None])[..., 0]
    gap = (lg.max(-1).values - chosen) / lg.std(-1)
    r["gap_mean"], r["gap_max"] = float(gap.mean()), float(gap.max())
    r["pass"] = why is None and r["ours_err"] <= max(1.5 * r["hf_bf16_err"], 1e-3) and r["gap_max"] < 0.5
    del m, dec
    torch.cuda.empty_cache()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2.5-1.5b,qwen3-1.7b,llama3.2-1b,mistral-1.5b")
    a = ap.parse_args()
    import torch

    rows = [check(n) for n in a.models.split(",")]
    print(f"\n### Fast decoder vs HF forward, bf16, {torch.cuda.get_device_name()}, random weights of real configs")
    print("| model | type | fast path | HF bf16 rel. err | ours rel. err | greedy rows equal (16 tok) | decode gap mean / max "
          "(std) | ours ms/token | HF generate ms/token | pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['type']} | {r['fast path']} | {r['hf_bf16_err']:.2e} | {r['ours_err']:.2e} | "
              f"{r['greedy_rows_equal_16']:.2f} | {r['gap_mean']:.3f} / {r['gap_max']:.3f} | {r['ours_ms_per_token']:.2f} | {r['hf_ms_per_token']:.2f} | "
              f"{'yes' if r['pass'] else 'NO'} |")


if __name__ == "__main__":
    main()
