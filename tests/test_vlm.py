"""Vision-language models (align.vision, docs/vision.md): image rows, their prompt tokens and loss mask, the image
tensors of a batch, the model's forwards and generation with them, and SFT / DPO / GRPO end to end on the tiny
random Qwen2.5-VL (`align model init --preset tiny-vl`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from align import vision
from align.data import IGNORE, collate_pairs, collate_sft, load_rows, model_inputs, preference_examples, sft_examples
from align.errors import UserError
from tests.conftest import run_align

SIZES = {"small.png": (56, 56), "tall.png": (56, 84)}  # (width, height): 4 x 4 and 4 x 6 patches of 14 pixels


def _image(path: Path, size, squares=()) -> str:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size)
    for x, y in squares:
        ImageDraw.Draw(im).rectangle([x, y, x + 9, y + 9], fill=(255, 255, 255))
    im.save(path)
    return path.name


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model directory, its tokenizer with the image processor, its model): the tiny-vl preset saved."""
    from align.models import load_tokenizer, resolve

    out = tmp_path_factory.mktemp("tiny_vl")
    tok = vision.tiny_tokenizer()
    model = vision.tiny_model(tok, seed=0)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    vision.save_processor(tok, out)
    return out, load_tokenizer(resolve(str(out))), model.eval()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A folder with two images of different sizes and SFT / preference / prompt rows that use them."""
    d = tmp_path_factory.mktemp("vlm_data")
    (d / "img").mkdir()
    for name, size in SIZES.items():
        _image(d / "img" / name, size, [(2, 2), (30, 30)])
    sft = [{"prompt": "Count", "images": [f"img/{n}"], "completion": "2", "answer": "2"} for n in SIZES]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft * 4))
    messages = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Count"}, {"type": "image"}]},
                             {"role": "assistant", "content": "2"}], "images": ["img/tall.png"]}
    (d / "messages.jsonl").write_text(json.dumps(messages) + "\n")
    prefs = [{"prompt": "Count", "images": [f"img/{n}"], "chosen": "2", "rejected": "3"} for n in SIZES]
    (d / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefs * 4))
    prompts = [{"prompt": "Count", "images": [f"img/{n}"], "answer": "2"} for n in SIZES]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts * 4))
    return d


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_image_rows_prompt_holds_its_expanded_image_pads_and_the_loss_only_its_completion(vlm, data):
    _, tok, _ = vlm
    rows = load_rows(data / "sft.jsonl", "sft")
    small, = sft_examples(tok, rows[:1], max_length=64)
    tall, = sft_examples(tok, load_rows(data / "messages.jsonl", "sft"), max_length=64)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in vision.VISION_TOKENS[:3])
    user, assistant = tok.convert_tokens_to_ids("<|user|>"), tok.convert_tokens_to_ids("<|assistant|>")
    count, two = _ids(tok, "Count"), _ids(tok, "2")
    # a 56 x 56 image: 4 x 4 patches of 14 pixels, merged 2 x 2 into 4 image tokens, before the text
    prompt = [tok.bos_token_id, user, start, pad, pad, pad, pad, end, *count, assistant]
    assert small["input_ids"] == prompt + two + [tok.eos_token_id]
    assert small["labels"] == [IGNORE] * len(prompt) + two + [tok.eos_token_id]
    image = small["image_prompt"]  # the prompt's images, their pixel values made when a batch is built
    assert image.image_grid_thw.tolist() == [[1, 4, 4]] and image.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    # a messages row with the image part after the text: 56 wide x 84 high is 4 x 6 patches, 6 image tokens
    prompt = [tok.bos_token_id, user, *count, start, *[pad] * 6, end, assistant]
    assert tall["input_ids"] == prompt + two + [tok.eos_token_id]
    assert tall["labels"] == [IGNORE] * len(prompt) + two + [tok.eos_token_id]
    image = tall["image_prompt"]
    assert image.image_grid_thw.tolist() == [[1, 6, 4]] and image.pixel_values.shape == (24, 1176)
    # too long: the text before the image is cut from the left, the image tokens never
    cut = sft_examples(tok, rows[:1], max_length=len(small["input_ids"]) - 2)[0]
    assert cut["input_ids"] == small["input_ids"][2:] and cut["image_prompt"].images == small["image_prompt"].images
    with pytest.raises(UserError, match="an image's tokens are never cut"):
        sft_examples(tok, rows[:1], max_length=len(small["input_ids"]) - 3)


def test_a_batch_concatenates_its_rows_image_patches_and_cuts_into_micro_batches(vlm, data):
    _, tok, _ = vlm
    rows = load_rows(data / "sft.jsonl", "sft")[:2]
    text = {"prompt": "Count", "completion": "2"}
    assert vision.prompt_images(rows[1]["prompt"])[0].endswith("tall.png")
    small, text_ex, tall = sft_examples(tok, [rows[0], text, rows[1]], max_length=64)
    b = collate_sft([small, text_ex, tall], tok.pad_token_id)
    assert b["pixel_values"].shape == (16 + 24, 1176)
    small, tall = small["image_prompt"], tall["image_prompt"]
    assert torch.equal(b["pixel_values"], torch.cat([small.pixel_values, tall.pixel_values]))
    assert b["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]] and b["image_counts"].tolist() == [1, 0, 1]
    assert set(model_inputs(b)) == {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "use_cache"}
    last = vision.select_rows(b, slice(1, 3))  # a micro-batch: its rows' images only
    assert torch.equal(last["pixel_values"], tall.pixel_values) and last["image_grid_thw"].tolist() == [[1, 6, 4]]
    picked = vision.select_rows(b, torch.tensor([2, 0]))  # rows in any order (PPO's shuffled minibatches)
    assert torch.equal(picked["pixel_values"], torch.cat([tall.pixel_values, small.pixel_values]))
    assert vision.forward_images(vision.select_rows(b, slice(1, 2))) == {}  # a text row alone: no image kwargs
    vision._pixels.clear()  # pixel values are made again from the files when no longer cached
    assert torch.equal(small.pixel_values, b["pixel_values"][:16])
    # preference pairs: the chosen rows then the rejected rows, each with its prompt's images
    pairs, _ = preference_examples(tok, load_rows(data / "prefs.jsonl", "preference")[:2], 64)
    p = collate_pairs(pairs, tok.pad_token_id)
    assert p["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]] * 2 and p["pixel_values"].shape == (80, 1176)


def test_a_padded_batch_gives_each_rows_own_log_probs_and_generation(vlm, data):
    """Right padding for the log-probs (no mask: the rollout's batch) and left padding for generate: each row's
    values are those of the row alone, so the images and M-RoPE positions go to the right rows."""
    from align.logprobs import batched_logprobs
    from align.rollout.batch import rollout_batch
    from align.rollout.generation import Completion, Sampling, generate_local

    _, tok, model = vlm
    rows = load_rows(data / "prompts.jsonl", "prompts")[:2]
    from align.data import encode_prompts

    prompts = encode_prompts(tok, [r["prompt"] for r in rows])
    assert [len(p) for p in prompts] == [14, 16] and all(isinstance(p, vision.ImagePrompt) for p in prompts)
    comps = [Completion(p, _ids(tok, "2 3") + [tok.eos_token_id], "", True, None) for p in prompts]
    batch = rollout_batch(comps, tok.pad_token_id, "cpu")
    together = batched_logprobs(model, batch, micro=2)
    assert (together != 0).sum() == 2 * 4  # "2 3" and EOS after each prompt
    assert torch.allclose(together, batched_logprobs(model, batch, micro=1), atol=1e-5)
    for i, c in enumerate(comps):  # each row alone, unpadded
        alone = batched_logprobs(model, rollout_batch([c], tok.pad_token_id, "cpu"), micro=1)[0]
        assert torch.allclose(together[i, : len(alone)], alone, atol=1e-5)
    # the image is seen: another picture of the same size moves the completion's log-probs
    blank = _image(data / "img" / "blank.png", SIZES["small.png"])
    other = vision.ImagePrompt(prompts[0], [str(data / "img" / blank)], prompts[0].image_grid_thw, prompts[0].processor)
    blank = batched_logprobs(model, rollout_batch([Completion(other, comps[0].ids, "", True, None)],
                                                  tok.pad_token_id, "cpu"), micro=1)[0]
    assert (blank - together[0, : len(blank)]).abs().max() > 1e-4
    # and generation sees it: the same keyed samples score otherwise after another picture
    s = Sampling(max_new_tokens=3, temperature=1.0, seed=0)
    seen, blind = (generate_local(model, tok, [p], s, 1, "cpu", fast=False)[0] for p in (prompts[0], other))
    assert max(abs(a - b) for a, b in zip(seen.logps, blind.logps)) > 1e-4
    out = generate_local(model, tok, prompts, Sampling(max_new_tokens=6, temperature=0.0), 2, "cpu", fast=False)
    single = [generate_local(model, tok, [p], Sampling(max_new_tokens=6, temperature=0.0), 1, "cpu", fast=False)[0]
              for p in prompts]
    assert [o.ids for o in out] == [o.ids for o in single]
    never = set(vision.never_sampled(tok))
    assert not any(never & set(o.ids) for o in out)


def test_the_vision_tower_is_frozen_but_its_merger_and_the_lm_train(vlm):
    _, tok, _ = vlm
    model = vision.freeze_tower(vision.tiny_model(tok))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith("model.visual.") and ".merger." not in n for n in trained)
    assert any(n.startswith("model.visual.merger.") for n in trained)
    assert any(n.startswith("model.language_model.") for n in trained)
    everything = vision.freeze_tower(vision.tiny_model(tok), train_vision=True)
    assert all(p.requires_grad for p in everything.parameters())


def test_a_datasets_image_column_is_read_as_images(vlm, data, tmp_path):
    import datasets

    from align.data import encode_prompts

    _, tok, _ = vlm
    ds = datasets.Dataset.from_dict({"prompt": ["Count"], "completion": ["2"],
                                     "images": [[str(data / "img/tall.png")]]})
    ds.cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(str(tmp_path / "ds"))
    row = load_rows(tmp_path / "ds", "sft")[0]
    ids = encode_prompts(tok, [row["prompt"]])[0]
    assert ids.image_grid_thw.tolist() == [[1, 6, 4]] and ids.count(tok.convert_tokens_to_ids(vision.IMAGE_PAD)) == 6


def test_image_rows_are_checked_when_read(data, tmp_path):
    def rows_of(*rows):
        f = tmp_path / "rows.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return f

    ok = {"prompt": "Count", "completion": "2"}
    with pytest.raises(UserError, match=r"rows.jsonl: row 2: image 'gone.png' not found"):
        load_rows(rows_of(ok, {**ok, "images": ["gone.png"]}), "sft")
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(UserError, match=r"row 1: 2 image part\(s\) without a file in the messages, but 1 image"):
        load_rows(rows_of({"prompt": two_parts, "completion": "2",
                           "images": [str(data / "img/small.png")]}), "sft")
    # a part that names its own file (relative to the data file), and a datasets Image value (bytes)
    (tmp_path / "small.png").write_bytes((data / "img/small.png").read_bytes())
    named = [{"role": "user", "content": [{"type": "image", "path": "small.png"}, {"type": "text", "text": "?"}]}]
    row = load_rows(rows_of({"prompt": named, "completion": "2"}), "sft")[0]
    assert vision.prompt_images(row["prompt"]) == [str(tmp_path / "small.png")]
    from align.data import unpaired_examples

    with pytest.raises(UserError, match="--loss kto reads text rows"):  # no silent pairing of text with images
        unpaired_examples(None, load_rows(data / "prefs.jsonl", "preference"), 64)
    raw = {"bytes": (data / "img/small.png").read_bytes(), "path": None}
    row = load_rows(rows_of(ok), "sft")[0]
    assert vision.normalize_row("x", 1, {**row, "images": [raw]})["prompt"][0]["content"][0]["bytes"] == raw["bytes"]


def test_validation_errors_exit_2_naming_the_problem(vlm, data, tmp_path):
    model_dir, _, _ = vlm
    text_only = run_align("sft", "--model", "tiny", "--data", data / "sft.jsonl", "--max-steps", "1",
                          "--out", tmp_path / "a")
    assert text_only.returncode == 2, text_only.stderr
    assert "reads text only" in text_only.stdout + text_only.stderr and "Traceback" not in text_only.stderr
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "images": ["no.png"], "completion": "1"}) + "\n")
    missing = run_align("sft", "--model", model_dir, "--data", tmp_path / "bad.jsonl", "--out", tmp_path / "b")
    assert missing.returncode == 2 and "image 'no.png' not found" in missing.stdout + missing.stderr
    packed = run_align("sft", "--model", model_dir, "--data", data / "sft.jsonl", "--packing", "--out", tmp_path / "c")
    assert packed.returncode == 2 and "cannot be packed" in packed.stdout + packed.stderr
    ppo = run_align("ppo", "--model", model_dir, "--max-steps", "1", "--out", tmp_path / "d")
    assert ppo.returncode == 2 and "align ppo trains text-only models" in ppo.stdout + ppo.stderr
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in "abcd")


def _final(out: Path) -> dict:
    return json.loads((out / "artifact.json").read_text())["metrics"]


def test_sft_dpo_and_grpo_run_on_image_rows(vlm, data, tmp_path):
    model_dir, _, _ = vlm
    sft = run_align("sft", "--model", model_dir, "--data", data / "sft.jsonl", "--eval-data", data / "sft.jsonl",
                    "--max-steps", "2", "--batch-size", "4", "--lr", "1e-3", "--max-new-tokens", "2",
                    "--out", tmp_path / "sft")
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert "vision tower frozen" in sft.stdout and (tmp_path / "sft/model/preprocessor_config.json").is_file()
    m = _final(tmp_path / "sft")
    assert m["steps"] == 2 and 0 < m["train/loss"] < 10 and "eval/pass@1" in m
    dpo = run_align("dpo", "--model", tmp_path / "sft", "--data", data / "prefs.jsonl", "--eval-data", "",
                    "--max-steps", "2", "--batch-size", "4", "--out", tmp_path / "dpo")
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert _final(tmp_path / "dpo")["steps"] == 2
    grpo = run_align("grpo", "--model", tmp_path / "dpo", "--data", data / "prompts.jsonl", "--eval-data",
                     data / "prompts.jsonl", "--eval-samples", "2", "--max-steps", "2", "--prompts-per-step", "2",
                     "--num-generations", "4", "--max-new-tokens", "3", "--beta", "0.04", "--packing",
                     "--out", tmp_path / "grpo")
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    assert "batches with images run padded" in grpo.stdout
    m = _final(tmp_path / "grpo")
    assert m["steps"] == 2 and "eval/pass@1/greedy" in m


def test_count_squares_rows_draw_k_squares_and_answer_k(tmp_path):
    import numpy as np
    from PIL import Image

    from align import tasks

    rows = tasks.make_dataset("count_squares", 12, seed=3)
    assert rows == tasks.make_dataset("count_squares", 12, seed=3)
    assert {r["answer"] for r in rows} <= {"1", "2", "3", "4"} and len({r["answer"] for r in rows}) > 1
    tasks.write_jsonl(rows, tmp_path / "sq.jsonl")
    written = [json.loads(line) for line in (tmp_path / "sq.jsonl").read_text().splitlines()]
    for row, w in zip(rows, written):
        assert w == {"prompt": tasks.COUNT_PROMPT, "images": [w["images"][0]], "completion": row["answer"],
                     "answer": row["answer"]}
        pixels = torch.from_numpy(np.array(Image.open(tmp_path / w["images"][0]).convert("L")))
        white = pixels > 128
        # squares never touch (one per 14-pixel cell): the white pixels are the squares' areas, their count k
        assert white.sum() == sum(side * side for _, _, side in row["squares"])
        assert len(row["squares"]) == int(row["answer"])


def test_the_count_squares_benchmark_runs_its_smoke_version(tmp_path):
    """benchmarks/vlm_count_squares.py --smoke (model init, data make, eval, SFT, GRPO): GRPO's first held-out
    evaluation is SFT's last one (the same model, the same images, greedy)."""
    from benchmarks import vlm_count_squares as bench

    r = bench.run_seed(0, bench.smoke(bench.parser().parse_args(["--smoke"])), tmp_path, run=run_align)
    assert r["problems"] == 16 and r["grpo_start"] == r["sft"]
    assert all(0 <= r[k] <= 1 for k in ("base", "sft", "grpo"))
