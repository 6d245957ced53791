"""The GPU speed guard's comparison (benchmarks/guard.py): which measured figures fail against a baseline."""

from benchmarks.guard import SMALL, compare, median_metrics


def test_a_phase_slower_than_the_tolerance_fails_and_memory_has_its_own():
    base = {"time/generate": 1.40, "time/update": 1.00, "time/reward": 0.002, "peak_gib": 13.87}
    now = {"time/generate": 1.45, "time/update": 1.029, "time/reward": 0.002 + SMALL / 2, "peak_gib": 14.0}
    got = {k: ok for k, _, _, ok in compare(base, now, tolerance=0.03, memory_tolerance=0.01)}
    # 3.6 % slower fails, 2.9 % passes; a 2-ms phase gets SMALL seconds of slack; +0.9 % memory passes
    assert got == {"time/generate": False, "time/update": True, "time/reward": True, "peak_gib": True}
    got = {k: ok for k, _, _, ok in compare(base, {**now, "peak_gib": 14.1}, 0.03, 0.01)}
    assert got["peak_gib"] is False  # +1.7 %
    got = {k: ok for k, _, _, ok in compare(base, {"time/update": 0.9}, 0.03, 0.01)}
    assert got == {"time/generate": False, "time/update": True, "time/reward": False, "peak_gib": False}  # missing


def test_repeated_runs_are_compared_by_each_metrics_median():
    runs = [{"time/step": 2.0, "peak_gib": 13.0}, {"time/step": 2.6, "peak_gib": 13.1},
            {"time/step": 2.1, "peak_gib": 13.0, "time/generate": 1.0}]
    assert median_metrics(runs) == {"peak_gib": 13.0, "time/step": 2.1}  # a metric not in every run is left out
    assert median_metrics(runs[:2]) == {"peak_gib": 13.05, "time/step": 2.3}


def test_every_name_a_benchmark_takes_from_another_exists():
    """The GPU harnesses run only on a GPU: a name one benchmark module reads from another (`from benchmarks import
    vs_trl as V` ... `V.measure_bandwidth()`, `from benchmarks.vs_trl import MODELS`) is checked here, statically,
    so a function lost in an edit fails on the CPU rather than on the lent GPU."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"

    def top_level(mod: str) -> set[str]:
        tree = ast.parse((root / f"{mod}.py").read_text())
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        return names

    missing = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {}  # local name -> benchmarks module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                aliases |= {a.asname or a.name: a.name for a in node.names if (root / f"{a.name}.py").exists()}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                mod = node.module.split(".", 1)[1]
                if (root / f"{mod}.py").exists():
                    missing += [f"{path.name}: {mod}.{a.name}" for a in node.names if a.name not in top_level(mod)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                mod = aliases[node.value.id]
                if node.attr not in top_level(mod):
                    missing.append(f"{path.name}: {mod}.{node.attr}")
    assert missing == []


def test_stage_walls_call_a_stage_slower_only_when_its_whole_spread_moved_up():
    from benchmarks.stage_walls import compare, table

    before = [{"sft": 30.0, "grpo": 17.0}, {"sft": 31.0, "grpo": 18.0}, {"sft": 32.0, "grpo": 17.5}]
    after = [{"sft": 31.5, "grpo": 18.2}, {"sft": 33.0, "grpo": 18.5}, {"sft": 29.0, "grpo": 19.0}]
    rows = {stage: (b, a, slower) for stage, b, a, slower in compare(before, after)}
    assert rows["sft"][2] is False  # 29.0-33.0 overlaps 30.0-32.0
    assert rows["grpo"][2] is True  # 18.2 > 18.0: every after run above every before run
    assert rows["sum"][0] == [47.0, 49.0, 49.5] and rows["sum"][1] == [49.7, 51.5, 48.0]
    assert rows["sum"][2] is False
    text = table(compare(before, after))
    assert "| grpo | 17.5 (17.0-18.0) | 18.5 (18.2-19.0) | 1.057 | **yes** |" in text


def test_the_ragged_harness_model_stops_after_half_its_budget_on_average(shipped_tokenizer):
    """vs_trl.ragged on a tiny random Llama (the harness' mechanism, CPU: transformers' generate): α is searched
    on the decoded rows until they average half the budget, within the tolerance, and the lengths are ragged."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.vs_trl import CompletionLengths, ragged

    tok = shipped_tokenizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True)).eval()
    prompts = [tok(f"What is {i} + {i + 3}?", add_special_tokens=False)["input_ids"] for i in range(8)]
    alpha, mean = ragged(model, tok.eos_token_id, 48, prompts, rows=64)
    assert alpha > 0 and abs(mean - 24) <= 0.06 * 48
    torch.manual_seed(1)
    lengths = CompletionLengths(model, 48, tok.eos_token_id)([prompts[i % 8] for i in range(64)])
    assert abs(sum(lengths) / 64 - 24) <= 0.2 * 48  # a fresh draw of the same rows
    assert len(set(lengths)) > 10 and min(lengths) < 12 and max(lengths) == 48
    # the GPU's path: align's fast decoder (eager here), the weights reloaded between calls
    fast = CompletionLengths(model, 48, tok.eos_token_id, fast=True)
    torch.manual_seed(2)
    by_decoder = fast([prompts[i % 8] for i in range(64)])
    assert abs(sum(by_decoder) / 64 - 24) <= 0.2 * 48 and max(by_decoder) == 48 and min(by_decoder) >= 1
    with torch.no_grad():  # EOS's logit α·(h·μ̂) fifty times higher: every row stops at its first token
        model.get_output_embeddings().weight[tok.eos_token_id] *= 50
    assert set(fast(prompts)) == {1}
    fast.close()


def test_near_flip_counts_tokens_whose_kth_and_next_router_logits_tie_relative_to_their_spread():
    import torch

    from benchmarks.decoder_families import near_flip

    # tie: top-2 against 3rd 0.01 apart, under 0.01 x the logits' std (1.731, by hand); clear: 2.0 apart
    tie, clear = [3.0, 2.0, 1.99, -1.0], [3.0, 2.0, 0.0, -1.0]
    assert abs(torch.tensor(tie).std().item() - 1.731) < 1e-3
    assert near_flip(torch.tensor([tie, clear]), k=2) == 0.5
    assert near_flip(torch.tensor([tie, clear]), k=1) == 0.0  # 1.0 apart
    assert near_flip(8 * torch.tensor([tie, clear]), k=2) == 0.5  # a scaled router flips as many routes
    assert near_flip(torch.tensor([[3.0, 2.0, 1.98, -1.0]]), k=2) == 0.0  # 0.02 apart: above 0.0173


def test_the_ragged_harness_trains_at_a_rate_that_keeps_its_lengths():
    """--ragged: both sides step at 1e-8 (5e-5 on the noise reward undid the ragged lengths within two steps),
    the other shapes at 5e-5; the command carries it."""
    import argparse
    from pathlib import Path

    from benchmarks.grpo_vs_trl import lr, ours_command, shape_args

    from benchmarks.vs_trl import harness_args

    ap = argparse.ArgumentParser()
    harness_args(ap, models="135m", steps=4)
    shape_args(ap)
    ragged, plain = ap.parse_args(["--ragged"]), ap.parse_args([])
    assert lr(ragged) == 1e-8 and lr(plain) == 5e-5
    for a, want in ((ragged, 1e-8), (plain, 5e-5)):
        a.data_file = ""
        cmd = ours_command(Path("m"), a, 1, Path("o"), 8)
        assert float(cmd[cmd.index("--lr") + 1]) == want


def test_the_teacher_forced_gap_replays_the_decoders_routes():
    """decoder_families.teacher_forced_gap on a tiny Mixtral (CPU, fp32): the fast decoder's greedy tokens lie at
    the HF forward's best logit (gap 0) with its own routes or the decoder's replayed; replaying other experts
    (every route moved to the next expert) moves the logits, so the gap is no longer 0."""
    import torch
    from transformers import AutoModelForCausalLM

    from align.rollout.fast.decoder import FastDecoder
    from align.rollout.generation import Sampling
    from benchmarks.decoder_families import config, left_padded_routes, teacher_forced_gap

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config("tiny-mixtral", bos_token_id=1, eos_token_id=2, pad_token_id=0),
                                         dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 7, 12)]
    dec = FastDecoder(m, torch.device("cpu"))
    dec.load_weights(m)
    tokens = dec.generate(prompts, Sampling(max_new_tokens=8, temperature=0.0), eos=-1, pad=0, routes=True)
    routes = dec.last_routes
    L = max(map(len, prompts))
    mask = torch.tensor([[0] * (L - len(p)) + [1] * (len(p) + 8) for p in prompts])
    R = left_padded_routes(prompts, routes, L + 8)
    assert [int((R[i, :, 0, 0] == -1).sum()) for i in range(4)] == [L - len(p) + 1 for p in prompts]  # pad, last
    assert (R[:, :, :, 0] >= 0).sum() > 0 and R.shape[-1] == 2
    assert teacher_forced_gap(m, prompts, tokens, L, mask)[1] < 1e-4
    assert teacher_forced_gap(m, prompts, tokens, L, mask, R)[1] < 1e-4
    moved = torch.where(R >= 0, (R + 1) % 4, R)
    assert teacher_forced_gap(m, prompts, tokens, L, mask, moved)[0] > 1e-3
