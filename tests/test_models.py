"""align.models: presets and save_pretrained dirs of three architectures, sft end-to-end on each, artifacts."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from align.errors import UserError
from align.models import load_causal_lm, load_tokenizer, resolve
from tests.conftest import ROOT, assert_user_error, output, run_align


def sft(model, out, data):
    train, test = data
    return run_align("sft", "--model", model, "--data", train, "--eval-data", test, "--max-steps", 3,
                     "--batch-size", 4, "--eval-every", 0, "--eval-samples", 4, "--max-new-tokens", 4, "--out", out)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_data")
    lines = (ROOT / "data/arithmetic/train.jsonl").read_text().splitlines()
    (d / "train.jsonl").write_text("\n".join(lines[:40]) + "\n")
    (d / "test.jsonl").write_text("\n".join((ROOT / "data/arithmetic/test.jsonl").read_text().splitlines()[:8]) + "\n")
    return d / "train.jsonl", d / "test.jsonl"


@pytest.fixture(scope="module")
def sft_artifact(tiny_model_dir, sft_data, tmp_path_factory) -> Path:
    """ONE short sft run of the tiny preset (saved dir: Llama, tied embeddings) shared by this module."""
    out = tmp_path_factory.mktemp("sft_artifact") / "run"
    proc = sft(tiny_model_dir, out, sft_data)
    assert proc.returncode == 0, output(proc)
    return out


def save_arch(arch: str, root: Path) -> Path:
    """A tiny random model of `arch` with the shipped tokenizer (vocab 512) in a save_pretrained dir."""
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

    tok = load_tokenizer(resolve("tiny"))
    # Qwen2: transformers 5 picks Qwen2Tokenizer from config.json's model_type and appends '<|endoftext|>' as
    # id 512, so give the model a padded vocabulary (as real checkpoints do) that covers it.
    ids = dict(vocab_size=576 if arch == "qwen2" else 512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    if arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, max_position_embeddings=512, **ids)
    else:
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=512, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = root / arch
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def finite_logits(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.tensor([[1, 4, 20, 30, 40, 5]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_architecture_resolves_loads_and_trains(arch, tiny_model_dir, sft_data, tmp_path, request):
    model_dir = tiny_model_dir if arch == "llama" else save_arch(arch, tmp_path)
    ref = resolve(str(model_dir))
    assert ref.model_dir == model_dir and ref.preset is None and ref.artifact is None and ref.kind == "policy"
    tok = load_tokenizer(ref)
    shipped = load_tokenizer(resolve("tiny"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    text = "<|bos|><|user|>Tom has 23 apples. #### 68<|assistant|>"
    assert tok(text, add_special_tokens=False)["input_ids"] == shipped(text, add_special_tokens=False)["input_ids"]
    assert len(tok) == 512 or arch == "qwen2"
    model = load_causal_lm(ref, tok, torch.float32)
    assert model.config.model_type == arch and model.config.vocab_size == (576 if arch == "qwen2" else 512)

    if arch == "llama":
        out = request.getfixturevalue("sft_artifact")
    else:
        out = tmp_path / "out"
        proc = sft(model_dir, out, sft_data)
        assert proc.returncode == 0, output(proc)
    art = json.loads((out / "artifact.json").read_text())
    assert art["status"] == "complete" and art["stage"] == "sft" and art["model_kind"] == "policy"
    assert art["metrics"]["steps"] == 3 and math.isfinite(art["metrics"]["train/loss"])
    assert math.isfinite(art["metrics"]["eval/loss"])
    assert any(k.endswith(".safetensors") for k in art["files"])
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 3
    assert not (out / "model.tmp").exists()
    reloaded = finite_logits(out / "model")  # plain transformers, no align
    assert reloaded.config.model_type == arch
    ref = resolve(str(out))
    assert ref.artifact["status"] == "complete" and ref.model_dir == out / "model"


def test_tied_embeddings_survive_zero3_save(sft_artifact, tiny_model_dir):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_artifact / "model")
    assert model.config.tie_word_embeddings
    emb = model.model.embed_tokens.weight
    assert emb.shape == (512, 128)
    torch.testing.assert_close(model.lm_head.weight, emb, rtol=0, atol=0)
    with safe_open(str(sft_artifact / "model" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert all(f.get_tensor(k).numel() > 0 for k in keys)  # ZeRO-3 would save empty shards if not gathered
        trained = f.get_tensor("model.embed_tokens.weight")
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        initial = f.get_tensor("model.embed_tokens.weight")
    assert trained.abs().sum() > 0 and not torch.equal(trained, initial)  # 3 steps moved the weights


def test_preset_resolves_without_a_directory():
    ref = resolve("tiny")
    assert ref.preset == "tiny" and ref.model_dir is None and ref.tokenizer_dir.name == "tokenizer"
    tok = load_tokenizer(ref)
    m1 = load_causal_lm(ref, tok, torch.float32, seed=0)
    m2 = load_causal_lm(ref, tok, torch.float32, seed=0)
    assert m1.config.tie_word_embeddings and m1.config.vocab_size == 512
    assert torch.equal(m1.model.embed_tokens.weight, m2.model.embed_tokens.weight)  # seeded init


# --------------------------------------------------------------------------------------- resolve errors


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints"))
    return dst


def test_resolve_nonexistent(tmp_path):
    with pytest.raises(UserError, match="no such model directory or artifact") as e:
        resolve(str(tmp_path / "missing"))
    assert "tiny" in str(e.value)  # says which presets exist


def test_resolve_dir_without_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match=r"neither an align artifact \(artifact.json\) nor a model directory"):
        resolve(str(tmp_path))


def test_resolve_config_without_safetensors(tmp_path, tiny_model_dir):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(UserError, match="no .safetensors weights"):
        resolve(str(tmp_path))


def test_a_model_dir_without_tokenizer_files_is_one_line_naming_the_files(tmp_path, tiny_model_dir):
    """A model saved without its tokenizer: transformers says "Couldn't instantiate the backend tokenizer from one
    of: )"; align names the directory and the files it needs, exit 2, before --out is touched."""
    model = tmp_path / "model"
    model.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / f, model / f)
    with pytest.raises(UserError) as e:
        load_tokenizer(resolve(str(model)))
    msg = str(e.value)
    assert msg.startswith(f"{model}: no tokenizer files (expected tokenizer.json") and "\n" not in msg
    assert "tokenizer.save_pretrained" in msg and "backend tokenizer" not in msg
    proc = run_align("eval", str(model), "--data", ROOT / "data/arithmetic/test.jsonl", "--limit", 2,
                     "--out", tmp_path / "out")
    assert_user_error(proc, f"{model}: no tokenizer files")
    assert not (tmp_path / "out").exists()
    (model / "tokenizer.json").write_text("not json")  # a file there, but unreadable: transformers' reason
    with pytest.raises(UserError, match="cannot load a tokenizer"):
        load_tokenizer(resolve(str(model)))


def test_resolve_incomplete_artifact(sft_artifact, tmp_path):
    art_dir = copy_artifact(sft_artifact, tmp_path / "a")
    rec = json.loads((art_dir / "artifact.json").read_text())
    rec["status"] = "running"
    (art_dir / "artifact.json").write_text(json.dumps(rec))
    with pytest.raises(UserError, match=r"artifact is incomplete \(status 'running'\)"):
        resolve(str(art_dir))


def test_resolve_tampered_artifact(sft_artifact, tmp_path):
    art_dir = copy_artifact(sft_artifact, tmp_path / "a")
    resolve(str(art_dir))  # the intact copy is fine
    f = art_dir / "model" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0x01  # one bit of one weight
    f.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="sha256 does not match artifact.json") as e:
        resolve(str(art_dir))
    assert "model.safetensors" in str(e.value)


def test_resolve_artifact_missing_file(sft_artifact, tmp_path):
    art_dir = copy_artifact(sft_artifact, tmp_path / "a")
    (art_dir / "model" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="artifact file model/tokenizer.json is missing"):
        resolve(str(art_dir))


def test_resolve_artifact_json_corrupt(sft_artifact, tmp_path):
    art_dir = copy_artifact(sft_artifact, tmp_path / "a")
    (art_dir / "artifact.json").write_text('{\n  "status": "complete",\n  oops\n}\n')
    with pytest.raises(UserError, match=r"artifact.json:3: artifact.json is not valid JSON"):
        resolve(str(art_dir))


def test_resolve_wrong_kind(sft_artifact):
    with pytest.raises(UserError, match="this is a policy model, but a reward model"):
        resolve(str(sft_artifact), expect="reward")


def test_model_init_unknown_preset(tmp_path):
    proc = run_align("model", "init", "--preset", "huge", "--out", tmp_path / "m")
    assert_user_error(proc, "--preset must be one of tiny, small, tiny-vl, got 'huge'.")
    assert not (tmp_path / "m").exists()
