"""Multi-turn decode speed against single-turn, at the same shape, on a GPU (the fast decoder; HF `generate` with
--hf).

    python -m benchmarks.episode_speed [--model qwen2.5-1.5b --episodes 64 --turns 4 --turn-tokens 64 --repeat 3]

A random-weight bf16 model of a real config (`benchmarks.vs_trl.MODELS`), `--episodes` prompts of 30-60 tokens,
sampled at temperature 1. Single-turn: one completion of turns x turn-tokens tokens per prompt. Multi-turn: an
episode per prompt of `--turns` policy turns of `--turn-tokens` tokens each (a random model never stops early, so
every turn runs its budget), an environment answering each turn with an observation of about `--obs-tokens`
tokens (appended as the environment's tokens: the next turn's context). The same policy tokens either way; the
figure is policy tokens per second over the whole rollout (prefills, each turn's re-prefill, the environment's
steps and the host's stop checks included), the median of `--repeat` timed runs after one warm-up (compile,
capture) of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path


class Relay:
    """An environment that answers every turn with the same observation and never ends the episode itself."""

    stops: tuple[str, ...] = ()
    decides_end = True

    def __init__(self, observation: str):
        self.observation = observation

    def reset(self, row):
        return None

    def step(self, turn: str):
        from align.rollout.env import Step

        return Step(observation=self.observation, tool_call=True)


def run(a, root: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.rollout.env import Agent, Limits
    from align.rollout.generation import Sampling, generate_episodes, generate_local, sampling_keys
    from benchmarks import vs_trl as V

    path = V.make_model(a.model, root)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(a.device).eval()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, len(tok), (int(n),), generator=g).tolist()
               for n in torch.randint(30, 60, (a.episodes,), generator=g)]
    rows = [{} for _ in prompts]
    new = a.turns * a.turn_tokens
    text = " tool output: " + " ".join(str(7 * i) for i in range(a.obs_tokens))
    observation = tok.decode(tok(text, add_special_tokens=False)["input_ids"][: a.obs_tokens])
    limits = Limits(max_turns=a.turns, turn_tokens=a.turn_tokens, max_tokens=new,
                    max_env_tokens=a.turns * a.obs_tokens * 2)
    agent = Agent("relay", lambda row: Relay(observation), limits)
    s = Sampling(max_new_tokens=new, temperature=1.0, seed=0)
    fast = False if a.hf else None

    def single():
        out = generate_local(model, tok, prompts, s, batch_size=a.episodes, device=a.device, fast=fast)
        return sum(len(c.ids) for c in out), {}

    def multi():
        keys = sampling_keys(s, range(len(prompts)))
        out = generate_episodes(model, tok, prompts, rows, replace(s, max_new_tokens=a.turn_tokens), agent,
                                a.episodes, a.device, keys, fast=fast)
        return sum(sum(c.policy_mask) for c in out), {
            "turns": statistics.mean(c.episode.turns for c in out),
            "env_tokens": statistics.mean(c.episode.env_tokens for c in out)}

    result = {}
    for name, fn in (("single-turn", single), ("multi-turn", multi)):
        fn()  # warm-up: compile, capture
        times, extra = [], {}
        for _ in range(a.repeat):
            sync()
            t = time.perf_counter()
            tokens, extra = fn()
            sync()
            times.append(time.perf_counter() - t)
        sec = statistics.median(times)
        result[name] = {"seconds": sec, "policy_tokens": tokens, "tokens_per_s": tokens / sec, "runs": times, **extra}
    result["ratio"] = result["multi-turn"]["tokens_per_s"] / result["single-turn"]["tokens_per_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--obs-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="HF generate instead of the fast decoder (both paths)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the harness (HF generate)")
    ap.add_argument("--out", default="", help="folder for the model and episode_speed.json (default: a temp dir)")
    a = ap.parse_args()
    import torch

    from benchmarks import vs_trl as V

    root = V.out_root(a.out, "align-episode-speed-")
    r = run(a, root)
    card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"\n### Multi-turn vs single-turn decode, {a.model} (random weights, bf16), {card}, {a.episodes} rows, "
          f"{a.turns} x {a.turn_tokens} policy tokens, ~{a.obs_tokens} environment tokens a turn, "
          f"{'HF generate' if a.hf or a.device != 'cuda' else 'fast decoder'}; medians of {a.repeat}")
    print("| rollout | seconds | policy tokens | tokens/s | turns | env tokens/episode |\n|---|---|---|---|---|---|")
    for name in ("single-turn", "multi-turn"):
        x = r[name]
        print(f"| {name} | {x['seconds']:.3f} | {x['policy_tokens']} | {x['tokens_per_s']:.0f} | "
              f"{x.get('turns', 1):.2f} | {x.get('env_tokens', 0):.1f} |")
    print(f"multi-turn / single-turn tokens/s: {r['ratio']:.3f}")
    (Path(root) / "episode_speed.json").write_text(json.dumps({"card": card, "args": vars(a), **r}, indent=1))


if __name__ == "__main__":
    main()
