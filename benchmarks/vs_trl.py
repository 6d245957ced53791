"""Shared parts of the side-by-side benchmarks against TRL (`benchmarks.grpo_vs_trl`, `benchmarks.dpo_vs_trl`).

Each run is a fresh subprocess (clean CUDA memory statistics): ours is the real `align <stage>` command, TRL's
is its trainer on the same saved model directory, tokenizer, data, batch sizes, lengths, precision and steps.
TRL is a benchmark-only extra: `pip install .[bench]`.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {
    # SmolLM2-135M's shape (random init: speed does not depend on the weights' values)
    "135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                           max_position_embeddings=2048)),
    # CPU smoke test of the harness itself
    "tiny": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                           max_position_embeddings=512)),
    # Qwen2-0.5B's shape
    "0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=4096, rms_norm_eps=1e-6)),
    # the real configs of the model families people post-train (their config.json values)
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=40960, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                               max_position_embeddings=40960, rms_norm_eps=1e-6,
                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                                  max_position_embeddings=131072, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})),
    "llama3.1-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                                  max_position_embeddings=131072, rms_norm_eps=1e-5,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})),
    # Mistral-7B-v0.1's layout (32k vocabulary, 4,096-token window) at 1.5B: 20 of its layers, a narrower MLP
    "mistral-1.5b": ("mistral", dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16,
                                     num_key_value_heads=8, intermediate_size=7168, vocab_size=32000,
                                     tie_word_embeddings=False, max_position_embeddings=32768, rms_norm_eps=1e-5,
                                     sliding_window=4096,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # mixtures of experts (their config.json values; published total / active parameters in the comments)
    # allenai/OLMoE-1B-7B-0924: 6.9B total, 1.3B active (64 experts, top-8)
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                                  num_key_value_heads=16, intermediate_size=1024, num_experts=64,
                                  num_experts_per_tok=8, norm_topk_prob=False, vocab_size=50304,
                                  tie_word_embeddings=False, max_position_embeddings=4096,
                                  rms_norm_eps=1e-5, router_aux_loss_coef=0.01, clip_qkv=None,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Qwen/Qwen1.5-MoE-A2.7B: 14.3B total, 2.7B active (60 experts, top-4, a shared expert)
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
                                            num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                                            shared_expert_intermediate_size=5632, num_experts=60,
                                            num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=False,
                                            vocab_size=151936, tie_word_embeddings=False,
                                            max_position_embeddings=8192, rms_norm_eps=1e-6,
                                            router_aux_loss_coef=0.001,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active (8 experts, top-2)
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False,
                                     max_position_embeddings=32768, rms_norm_eps=1e-5, router_aux_loss_coef=0.02,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B active (128 experts, top-8)
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                        vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
                                        rms_norm_eps=1e-6, router_aux_loss_coef=0.001,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}

# published (total, active) parameters of the mixture-of-experts configs above
MOE_PUBLISHED = {"olmoe-1b-7b": (6.9e9, 1.3e9), "qwen1.5-moe-a2.7b": (14.3e9, 2.7e9), "mixtral-8x7b": (46.7e9, 12.9e9),
                 "qwen3-30b-a3b": (30.5e9, 3.3e9)}


def config(name: str, **ids):
    from transformers import AutoConfig

    arch, kw = MODELS[name]
    return AutoConfig.for_model(arch, **kw, **ids)


def harness_args(ap, models: str, steps: int) -> None:
    """The options every *_vs_trl harness shares (the hidden ones drive its TRL worker subprocess)."""
    import argparse

    ap.add_argument("--models", default=models)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--only", choices=["both", "ours", "trl"], default="both")
    ap.add_argument("--out", default="")
    ap.add_argument("--ours-extra", default="", help="extra flags for our command, e.g. '--precision bf16-pure'")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)


def out_root(out: str, prefix: str) -> Path:
    import tempfile

    root = Path(out or tempfile.mkdtemp(prefix=prefix))
    root.mkdir(parents=True, exist_ok=True)
    return root


def make_model(name: str, root: Path, ragged_budget: int = 0, prompts: list[str] | None = None,
               in_process: bool = False) -> Path:
    """A random-weight bf16 model of `name`'s config (built on the GPU when there is one: an 8B model in
    seconds) with the project's tokenizer, saved as safetensors. `ragged_budget` > 0: its completions of the
    (templated) `prompts` at temperature 1, cut at that many tokens, end at EOS after half of it on average
    (`ragged`), where a random model otherwise never stops. On a GPU that search runs in a child process
    (unless `in_process`): the fast decoder's compiled code kept the model's weights on the GPU in this process
    after it was closed (16 GiB at 8B, beside the run the harness then launches, which ran out of memory)."""
    out = root / (f"model-{name}" + (f"-ragged{ragged_budget}" if ragged_budget else ""))
    if (out / "config.json").exists():
        return out
    import torch

    if ragged_budget and torch.cuda.is_available() and not in_process:
        code = ("import json, sys; from pathlib import Path; from benchmarks import vs_trl as V; "
                "V.make_model(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), True)")
        subprocess.run([sys.executable, "-c", code, name, str(root), str(ragged_budget), json.dumps(prompts or [])],
                       check=True, cwd=Path(__file__).resolve().parent.parent)
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.paths import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    cfg = config(name, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if ragged_budget:
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts or []]
        ragged(model, tok.eos_token_id, ragged_budget, ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    if torch.cuda.is_available():  # the harness' runs are subprocesses: hand them the GPU this process built on
        torch.cuda.empty_cache()
    return out


def left_padded(prompts: list[list[int]], device):
    """(ids, mask) [B, P] of token-id lists left-padded with 0 (align.data.pad), on `device`."""
    import torch

    from align.data import pad

    return (torch.tensor(pad(prompts, 0, side="left"), device=device),
            torch.tensor(pad([[1] * len(p) for p in prompts], 0, side="left"), device=device))


class CompletionLengths:
    """`lengths(prompts)`: each prompt's completion length (EOS included) sampled at temperature 1 up to `budget`
    tokens from `model` as it is now: on a GPU (or `fast`) by align's fast decoder, as the harness' runs decode
    (one decoder kept across calls, its weights reloaded), else transformers' generate. `close()` frees it."""

    def __init__(self, model, budget: int, eos: int, fast: bool | None = None):
        self.model, self.budget, self.eos = model, budget, eos
        self.dev = next(model.parameters()).device
        self.dec = None
        if self.dev.type == "cuda" if fast is None else fast:  # (fast=True on a CPU: eager, for tests)
            from align.rollout.fast.decoder import FastDecoder

            self.dec = FastDecoder(model, self.dev)

    def __call__(self, prompts: list[list[int]]) -> list[int]:
        import torch

        if self.dec is not None:
            from align.rollout.generation import Sampling

            self.dec.load_weights(self.model)
            out = self.dec.generate(prompts, Sampling(max_new_tokens=self.budget, temperature=1.0), eos=self.eos, pad=0)
        else:
            ids, mask = left_padded(prompts, self.dev)
            out = self.model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=self.budget, eos_token_id=self.eos,
                                      pad_token_id=0)[:, ids.shape[1]:].tolist()
        return [r.index(self.eos) + 1 if self.eos in r else len(r) for r in out]

    def close(self) -> None:
        if self.dec is not None:
            self.dec.release()
            self.dec = None


@__import__("torch").no_grad()
def ragged(model, eos: int, budget: int, prompts: list[list[int]], mean_fraction: float = 0.5, rows: int = 64,
           tolerance: float = 0.06, tries: int = 10) -> tuple[float, float]:
    """Make a random-weight model's completions of `prompts` (token ids, repeated to `rows` rows as the harness'
    G samples of each) stop after `mean_fraction` of `budget` tokens on average: the EOS row of the output matrix
    becomes α·μ̂, μ̂ the mean direction of the final hidden states h on the model's own samples (EOS masked while
    it samples), so EOS's logit α·(h·μ̂) is positive at every position; α is then searched on log α (doubling or
    halving until the goal is bracketed, then regula falsi) by decoding the rows and measuring their mean length
    until it is within `tolerance`·budget of the goal.
    Measured, not modelled: a random model's hidden states persist along a sample (its prompt steers the whole
    completion), so its rows stop at rates of their own that no one rate describes (a pooled per-token rate along
    one coordinate of h gave Qwen2.5-0.5B's shape 237 of 256 tokens, 25 of 32 rows never stopping, where 128 was
    asked; a per-row model along μ̂, 174). Returns (α, the last measured mean length)."""
    import torch

    dev = next(model.parameters()).device
    w = model.get_output_embeddings().weight
    w[eos] = 0  # no EOS while it samples (its logit 0 among ~10⁵ others)
    prompts = prompts or [[1] * 8]
    sample = prompts[:16]
    ids, mask = left_padded(sample, dev)
    P, T = ids.shape[1], min(budget, 64)
    seqs = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=T, min_new_tokens=T, eos_token_id=None, pad_token_id=0)
    mask = torch.cat([mask, torch.ones(len(sample), T, dtype=mask.dtype, device=dev)], 1)
    h = model(input_ids=seqs, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              output_hidden_states=True).hidden_states[-1][:, P - 1 : -1].float()
    mu = h.flatten(0, 1).mean(0)
    u = mu / mu.norm()
    # a start: the α at which EOS's mean probability over these positions is 1 / (goal length)
    others = torch.logsumexp((h @ w.float().T).index_fill(-1, torch.tensor([eos], device=dev), float("-inf")), -1)
    proj, goal = h @ u, mean_fraction * budget
    lo, hi = 0.0, 4 * float(others.max()) / max(float(proj.min()), 1e-3)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if torch.sigmoid(mid * proj - others).mean().item() < 1 / goal else (lo, mid)
    alpha = (lo + hi) / 2
    rows_ = [prompts[i % len(prompts)] for i in range(rows)]
    lengths = CompletionLengths(model, budget, eos)
    lo = hi = None  # the bracket, (log α, mean length): lo's completions longer than the goal, hi's shorter
    mean = float("nan")
    for _ in range(tries):
        w[eos] = (alpha * u).to(w.dtype)
        mean = sum(lengths(rows_)) / rows
        print(f"ragged: α {alpha:.4g}: completions average {mean:.0f} of {budget} tokens", flush=True)
        if abs(mean - goal) <= tolerance * budget:
            break
        if mean > goal:
            lo = (math.log(alpha), mean)
        else:
            hi = (math.log(alpha), mean)
        if lo is None or hi is None:  # no bracket yet: a factor of 2 the right way
            alpha = alpha * 2 if hi is None else alpha / 2
        else:  # regula falsi on log α (each decode of a 4K budget at 8B takes ~40 s: few tries)
            t = (lo[1] - goal) / (lo[1] - hi[1])
            alpha = math.exp(lo[0] + min(max(t, 0.1), 0.9) * (hi[0] - lo[0]))
    lengths.close()
    return alpha, mean


def n_params(name: str) -> int:
    """Exact parameter count of `name`'s config (built on the meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config(name))
    return sum(p.numel() for p in m.parameters())


def flop_params(name: str) -> int:
    """The N of MFU's 6·N: every parameter of a dense model; a mixture of experts' active ones (the top-k experts
    a token runs through, embedding and head counted, as the published "active" numbers do: align.engine.plan)."""
    from align.engine import plan as P

    a = P.arch({"model_type": MODELS[name][0], **MODELS[name][1]})
    return P.n_params(a, active=True) if a.moe else n_params(name)


def kv_bytes_per_token(name: str, elem: int = 2) -> int:
    _, kw = MODELS[name]
    d = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    return 2 * kw["num_hidden_layers"] * kw["num_key_value_heads"] * d * elem


def measure_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (the decode roofline's ceiling)."""
    import torch

    x = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2 * 2**30 / statistics.median(ts)


def roofline(name: str, rows: int, prompt_len: float, new_tokens: int, gen_seconds: float, bw: float) -> dict:
    """Bytes one decode step must read (bf16 weights once + the batch's KV cache at its mean length) over the
    measured bandwidth: the floor per decode step; achieved = generation time / tokens per row."""
    w = n_params(name) * 2
    kv = rows * (prompt_len + new_tokens / 2) * kv_bytes_per_token(name)
    floor = (w + kv) / bw
    achieved = gen_seconds / new_tokens
    return {"floor_ms": floor * 1e3, "achieved_ms": achieved * 1e3, "fraction": floor / achieved,
            "bytes_per_step_mb": (w + kv) / 1e6}


def run(cmd: list[str], log: Path, env: dict | None = None, timeout: float | None = None, gpus: int = 1) -> bool:
    """Run one benchmark subprocess; one-GPU runs see GPU 0 only (TRL's Trainer would use DataParallel).
    `timeout`: BENCH_TIMEOUT seconds, else 420."""
    import os

    timeout = timeout or float(os.environ.get("BENCH_TIMEOUT", 420))
    t = time.time()
    from align.runtime import launch_env

    e = {**launch_env(gpus), "PYTHONUNBUFFERED": "1", **(env or {})}
    if gpus == 1:
        e["CUDA_VISIBLE_DEVICES"] = e.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, timeout=timeout)
            ok = p.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    print(f"  [{'ok' if ok else 'FAILED'}] {time.time() - t:6.1f} s  {' '.join(cmd[-12:])[:160]}  (log {log})",
          flush=True)
    if not ok:
        print("".join(open(log).readlines()[-25:]), flush=True)
    return ok


def torchrun(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    from align.runtime import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


def median_rows(rows: list[dict], keys: list[str]) -> dict:
    rows = rows[1:] if len(rows) > 1 else rows  # the first step includes compile / warm-up
    return {k: statistics.median(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)}


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


class StepTimer:
    """TRL side: wraps trainer methods to accumulate CUDA-synchronised time per phase; a callback records them
    per optimizer step."""

    def __init__(self, trainer, phases: dict[str, str], nograd_only: set[str] = frozenset()):
        import torch
        from transformers import TrainerCallback

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        self.acc = {k: 0.0 for k in phases.values()}
        self.rows: list[dict] = []
        timer = self

        for meth, key in phases.items():
            orig = getattr(trainer, meth)

            def wrapped(*a, _orig=orig, _key=key, **kw):
                if _key in nograd_only and torch.is_grad_enabled():
                    return _orig(*a, **kw)
                sync()
                t = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    sync()
                    timer.acc[_key] += time.perf_counter() - t

            setattr(trainer, meth, wrapped)

        class CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                sync()
                timer.t0 = time.perf_counter()
                timer.acc = {k: 0.0 for k in timer.acc}

            def on_step_end(self, args, state, control, **kw):
                sync()
                timer.rows.append({"time/step": time.perf_counter() - timer.t0, **timer.acc})

        trainer.add_callback(CB())


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1))
