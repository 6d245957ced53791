"""A plain-PyTorch GRPO loop (no DeepSpeed, no align engine) on align's data, sampler, log-probs and verifier:
the reference `align grpo` is checked against when the tiny model's GRPO gain looks small.

    python -m benchmarks.grpo_plain_cpu MODEL_DIR [--steps 100] [--lr 1e-4]

16 prompts x G 8 at T 1, z-score group advantages, token-mean loss over the response tokens, one update per
rollout (ratio 1: the policy gradient -A * grad log pi), AdamW (0.9, 0.999), clipping 1.0 -- `align grpo`'s
defaults without the dropped-group bookkeeping. Prints the training reward per 25 steps and held-out greedy
pass@1 (200 problems of data/arithmetic/test.jsonl) before and after.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align import data as D
    from align.logprobs import logprobs
    from align.paths import DATA_DIR
    from align.rewards import math_fn
    from align.rollout.batch import rollout_batch
    from align.rollout.generation import Sampling, generate_local

    torch.manual_seed(a.seed)
    random.seed(a.seed)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = D.load_rows(DATA_DIR / "arithmetic/train.jsonl", "prompts")
    ids = D.encode_prompts(tok, [r["prompt"] for r in rows])
    test = D.load_rows(DATA_DIR / "arithmetic/test.jsonl", "verifiable")[:200]
    test_ids = D.encode_prompts(tok, [r["prompt"] for r in test])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0)

    def greedy() -> float:
        model.eval()
        out = generate_local(model, tok, test_ids, Sampling(64, 0.0), 200, "cpu")
        return statistics.mean(math_fn(None, c.text, answer=r["answer"]) for r, c in zip(test, out))

    print(f"step 0: held-out greedy pass@1 {greedy():.3f}", flush=True)
    rewards, t0 = [], time.time()
    for step in range(1, a.steps + 1):
        idx = [i for i in random.sample(range(len(rows)), 16) for _ in range(8)]
        model.eval()
        comps = generate_local(model, tok, [ids[i] for i in idx], Sampling(64, 1.0), 128, "cpu")
        r = torch.tensor([math_fn(None, c.text, answer=rows[i]["answer"]) for i, c in zip(idx, comps)]).view(16, 8)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
        batch = rollout_batch(comps, tok.pad_token_id, "cpu")
        model.train()
        logp, _ = logprobs(model, batch, fused=False)
        mask = batch["response_mask"]
        (-(adv[:, None] * logp * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rewards.append(r.mean().item())
        if step % 25 == 0:
            print(f"steps {step - 24}-{step}: training reward {statistics.mean(rewards[-25:]):.3f} "
                  f"({(time.time() - t0) / step:.2f} s/step)", flush=True)
    print(f"step {a.steps}: held-out greedy pass@1 {greedy():.3f}")


if __name__ == "__main__":
    main()
