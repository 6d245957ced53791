"""`align export`: a LoRA DPO run's model, merged, loads in plain transformers and decodes greedily what the run's
own evaluation path decoded; its model card carries the lineage; DIR is refused when not empty, written whole."""

from __future__ import annotations

import json

import pytest

from tests.conftest import assert_user_error, output, run_align, small_data

DPO = ["--lora-r", "4", "--max-steps", "2", "--batch-size", "8", "--lr", "5e-2", "--warmup-steps", "1",
       "--eval-every", "0", "--eval-samples", "0", "--eval-data", ""]


def ok(proc):
    assert proc.returncode == 0, output(proc)[-3000:]
    return proc


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model_dir):
    """A tiny LoRA DPO run that keeps the adapter alone (--no-merge: export merges it with peft), and the greedy
    completions the run's own eval path (`align eval`) decodes with it."""
    tmp = tmp_path_factory.mktemp("export")
    out, ev = tmp / "dpo", tmp / "eval"
    ok(run_align("dpo", "--model", tiny_model_dir, "--no-merge", *DPO, "--data", small_data()["prefs"], "--out", out))
    ok(run_align("eval", out, "--data", small_data()["arith_test"], "--limit", "6", "--k", "1",
                 "--max-new-tokens", "8", "--out", ev))
    return out, [json.loads(x) for x in (ev / "samples.jsonl").read_text().splitlines()]


def test_export_loads_in_plain_transformers_and_decodes_as_the_run(dpo_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.data import encode_prompts

    run, samples = dpo_run
    dest = tmp_path / "hf"
    ok(run_align("export", run, "--to", dest))
    assert not (run / "model" / "model.safetensors").exists()  # the run kept the adapter alone
    assert (dest / "model.safetensors").is_file() and not (dest / "adapter").exists()
    model = AutoModelForCausalLM.from_pretrained(dest).eval()
    tok = AutoTokenizer.from_pretrained(dest)
    assert not any(k.startswith("align_") for k in model.config.to_dict())
    texts = []
    for ids in encode_prompts(tok, [s["prompt"] for s in samples]):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        texts.append(tok.decode(gen[0, len(ids):], skip_special_tokens=True))
    assert texts == [s["greedy"] for s in samples]
    assert len(set(texts)) > 1  # not one degenerate completion everywhere

    card = (dest / "README.md").read_text()
    art = json.loads((run / "artifact.json").read_text())
    assert "library_name: transformers" in card and "### 1. dpo (complete)" in card
    for path, digest in art["inputs"]["data"].items():
        assert f"`{path}` sha256 `{digest}`" in card
    key, value = next((k, v) for k, v in art["metrics"].items() if isinstance(v, float))
    assert f"| {key} | {value:.4g} |" in card
    assert "RLMonitor events:" in card


def test_export_refuses_a_non_empty_dir_and_writes_whole(dpo_run, tmp_path):
    run, _ = dpo_run
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    assert_user_error(run_align("export", run, "--to", dest), "--to", "not empty", "--overwrite")
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    ok(run_align("export", run, "--to", dest, "--overwrite"))
    assert not (dest / "keep.txt").exists() and (dest / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary directory left beside it
    assert_user_error(run_align("export", tmp_path / "nothing", "--to", tmp_path / "x"), "no such model")
