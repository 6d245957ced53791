"""Vision-language models (the Qwen2-VL / Qwen2.5-VL family): image rows, their prompt tokens, and the image tensors
a batch carries (docs/vision.md).

A row's images come from an `images` column (file paths relative to the data file, or absolute; `datasets` Image
values) and the `{"type": "image"}` parts of its user messages, in order (a part may name its own file with
"path"). `normalize_row` resolves them once, when the data is read: every image part then names its file, and a
string prompt with images becomes one user message, the images before the text.

A prompt with images is tokenised as the model's processor does (Qwen2_5_VLProcessor): the chat template renders
one <|image_pad|> per image, which becomes grid_t·grid_h·grid_w / merge² pads, the image processor's patches of
that image. The ids travel as an `ImagePrompt` (a list of ids that holds its images' `pixel_values` [patches, C·T·P²]
and `image_grid_thw` [images, 3]); a batch concatenates the patch rows of its rows' images (no padding per row) and
counts each row's images (`image_counts`) so that it can be cut into micro-batches. The model computes its 3-D
M-RoPE positions from input_ids and the grids itself.
"""

from __future__ import annotations

import io
from pathlib import Path

from align.errors import UserError

IMAGE_PAD = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", IMAGE_PAD, "<|vision_end|>", "<|video_pad|>")
VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the model types whose image tokens and M-RoPE this module knows
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
COUNTS = "image_counts"  # [rows]: how many images each row of a batch holds
PROCESSOR_ATTR = "align_image_processor"  # the image processor a VLM's tokenizer carries (load_tokenizer)
SOURCE_KEYS = ("path", "image", "url")  # where an image part names its file (transformers' chat format)


def is_vlm_config(config: dict) -> bool:
    """Whether a config.json dict is a vision-language model this module serves."""
    return config.get("model_type") in VL_TYPES


# ---- rows


def _parts(messages) -> list[dict]:
    """The image parts of a conversation's messages, in order."""
    if not isinstance(messages, list):
        return []
    return [p for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]


def row_has_images(row: dict) -> bool:
    return bool(row.get("images")) or any(_parts(row.get(c)) for c in ("prompt", "messages"))


def _resolve(source, base: Path, where: str):
    """An image value as a loadable source: an absolute path (a relative one is taken from the data file's folder)
    or the bytes of a `datasets` Image value."""
    if isinstance(source, dict):  # a datasets Image feature read without decoding: {"bytes", "path"}
        if source.get("bytes"):
            return bytes(source["bytes"])
        source = source.get("path")
    if not isinstance(source, str) or not source:
        raise UserError(f"{where}: an image must be a file path (or a datasets Image), not {source!r}.")
    path = Path(source) if Path(source).is_absolute() else base / source
    if not path.is_file():
        raise UserError(f"{where}: image {source!r} not found ({path}); image paths are relative to the data file's "
                        "folder, or absolute.")
    return str(path.absolute())


def normalize_row(path, i: int, row: dict) -> dict:
    """`row` with its images resolved (module doc): the `images` column's values fill the image parts that name no
    file, in order; without any such part they are put before the text of the first user message (TRL's
    convention). A count that does not match, a missing file or an image in an assistant message is refused,
    naming the row. Rows without images are returned as they are."""
    if not row_has_images(row):
        return row
    where = f"{path}: row {i}"
    from align.paths import split_spec

    data = Path(split_spec(str(path))[0])
    base = data if data.is_dir() else data.parent
    images = row.get("images") or []
    images = images if isinstance(images, list) else [images]
    given = [_resolve(x, base, where) for x in images]
    key = "messages" if isinstance(row.get("messages"), list) else "prompt"
    value = row.get(key)
    if not isinstance(value, (str, list)):
        raise UserError(f"{where}: images go with a 'prompt' or 'messages' column, which this row lacks.")
    messages = ([{"role": "user", "content": value}] if isinstance(value, str) else
                [dict(m, content=list(m["content"]) if isinstance(m.get("content"), list) else m.get("content"))
                 for m in value])
    if any(_parts([m]) for m in messages if m.get("role") == "assistant"):
        raise UserError(f"{where}: an assistant message holds an image; images belong in the user's messages.")
    parts = _parts(messages)
    open_parts = [p for p in parts if not any(p.get(k) for k in SOURCE_KEYS)]
    if not parts and given:
        user = next((m for m in messages if m.get("role") == "user"), None)
        if user is None:
            raise UserError(f"{where}: {len(given)} image(s) but no user message to put them in.")
        text = user["content"]
        user["content"] = [{"type": "image"} for _ in given] + (
            [{"type": "text", "text": text}] if isinstance(text, str) else list(text))
        open_parts = _parts([user])
    elif len(open_parts) != len(given):
        raise UserError(f"{where}: {len(open_parts)} image part(s) without a file in the messages, but {len(given)} "
                        f"image(s) in the 'images' column; give one image per {{\"type\": \"image\"}} part.")
    for part, src in zip(open_parts, given):
        part.pop("image", None)
        part["path" if isinstance(src, str) else "bytes"] = src
    for part in parts:
        if part not in open_parts and not part.get("bytes"):
            part["path"] = _resolve(next(part[k] for k in SOURCE_KEYS if part.get(k)), base, where)
    out = {k: v for k, v in row.items() if k != "images"}
    out[key] = messages
    return out


def prompt_images(prompt) -> list:
    """The image sources (paths or bytes) of a normalised prompt, in order."""
    return [p.get("bytes") or p.get("path") for p in _parts(prompt)]


def printable(prompt):
    """A prompt as a JSON record can hold it (eval_samples.jsonl): an image given as bytes (a datasets Image)
    named by its size instead."""
    if not any(p.get("bytes") for p in _parts(prompt)):
        return prompt
    return [dict(m, content=[{"type": "image", "bytes": f"<{len(p['bytes'])} bytes>"} if p.get("bytes") else p
                             for p in m["content"]]) if isinstance(m.get("content"), list) else m for m in prompt]


def load_image(source):
    """An RGB PIL image from a path or bytes; a UserError when PIL cannot read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        name = "image bytes" if isinstance(source, bytes) else source
        raise UserError(f"{name}: not an image PIL can read ({e}).") from None


# ---- tokens


class ImagePrompt(list):
    """A prompt's token ids, its image pads expanded, with its images: their sources, `image_grid_thw` [images, 3]
    and `pixel_values` [patches, C·T·P²], made by `processor` when asked for (a dataset's images are not held in
    memory as tensors: a batch's are made when it is built, the last PIXEL_CACHE sets kept). Concatenating it with
    a list gives a plain list (the images are attached again by whoever builds the batch: `example_images`,
    `collate_images`)."""

    def __init__(self, ids, images, image_grid_thw, processor):
        super().__init__(ids)
        self.images, self.image_grid_thw, self.processor = tuple(images), image_grid_thw, processor

    @property
    def pixel_values(self):
        return pixels(self.processor, self.images)


PIXEL_CACHE = 512  # the image sets whose pixel_values are kept (a GRPO group's G rows share their prompt's)
_pixels: dict = {}


def pixels(processor, images: tuple):
    """pixel_values [patches, C·T·P²] of `images` (sources) under `processor`, the last PIXEL_CACHE sets kept."""
    key = (id(processor), images)
    if key not in _pixels:
        _keep(key, processor(images=[load_image(s) for s in images], return_tensors="pt")["pixel_values"])
    return _pixels[key]


def _keep(key, pixel_values) -> None:
    if len(_pixels) >= PIXEL_CACHE:
        _pixels.pop(next(iter(_pixels)))
    _pixels[key] = pixel_values


def image_processor(tokenizer):
    """The image processor a VLM's tokenizer carries (None: a text-only model)."""
    return getattr(tokenizer, PROCESSOR_ATTR, None)


def pad_counts(grid_thw, merge: int) -> list[int]:
    """The <|image_pad|> tokens each image becomes: t·h·w patches / merge² (the merger joins merge × merge patches
    into one token; Qwen2-VL, Wang et al. 2024)."""
    return [int(t * h * w) // (merge * merge) for t, h, w in grid_thw.tolist()]


def encode_image_prompt(tokenizer, text: str, images: list) -> ImagePrompt:
    """The ids of a rendered prompt `text` holding one <|image_pad|> per image of `images` (sources), each expanded
    to its image's pad count, with the images' tensors."""
    proc = image_processor(tokenizer)
    if proc is None:
        raise UserError(f"{tokenizer.name_or_path}: a prompt holds images, but this model reads text only (no "
                        "image processor); use a vision-language model (Qwen2-VL / Qwen2.5-VL) or rows without "
                        "images.")
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(images):
        raise UserError(f"{tokenizer.name_or_path}: its chat template renders {len(pieces) - 1} {IMAGE_PAD} for a "
                        f"prompt with {len(images)} image(s); use the model's own (vision) chat template.")
    enc = proc(images=[load_image(s) for s in images], return_tensors="pt")
    grid = enc["image_grid_thw"]
    text = pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(pad_counts(grid, proc.merge_size), pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    _keep((id(proc), tuple(images)), enc["pixel_values"])
    return ImagePrompt(ids, images, grid, proc)


def cut_left(prompt: list[int], cut: int, tokenizer=None) -> list[int]:
    """prompt[cut:] (a prompt cut from the left to fit --max-length); an ImagePrompt keeps its images, and one
    whose cut would reach its first image token is refused (its image tokens must all stay)."""
    if cut <= 0:
        return prompt
    if not isinstance(prompt, ImagePrompt):
        return prompt[cut:]
    start = tokenizer.convert_tokens_to_ids(VISION_TOKENS[0]) if tokenizer is not None else None
    first = next((j for j, t in enumerate(prompt) if t == start), 0)
    if cut > first:
        raise UserError(f"a prompt with images has {len(prompt)} tokens (its image tokens included) and does not fit "
                        "--max-length; raise --max-length (an image's tokens are never cut).")
    return ImagePrompt(list.__getitem__(prompt, slice(cut, None)), prompt.images, prompt.image_grid_thw,
                       prompt.processor)


# ---- batches


def _of(item):
    """(pixel_values, image_grid_thw) of an ImagePrompt or an example dict, else None."""
    if isinstance(item, ImagePrompt):
        return item.pixel_values, item.image_grid_thw
    if isinstance(item, dict) and "image_prompt" in item:
        return _of(item["image_prompt"])
    return None


def example_images(prompt) -> dict:
    """What an example keeps of its prompt's images (the ImagePrompt, whose tensors `collate_images` makes), {}
    for a text prompt."""
    return {"image_prompt": prompt} if isinstance(prompt, ImagePrompt) else {}


def collate_images(items: list, device=None) -> dict:
    """The image tensors of a batch of rows (ImagePrompts or example dicts, one per row, in row order):
    pixel_values [Σ patches, D] (every row's images' patch rows, concatenated: no padding per row),
    image_grid_thw [Σ images, 3] and image_counts [rows]; {} when no row has an image."""
    import torch

    imgs = [_of(x) for x in items]
    if not any(imgs):
        return {}
    pv = torch.cat([i[0] for i in imgs if i])
    grid = torch.cat([i[1] for i in imgs if i])
    counts = torch.tensor([len(i[1]) if i else 0 for i in imgs])
    out = {"pixel_values": pv, "image_grid_thw": grid, COUNTS: counts}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def forward_images(batch: dict) -> dict:
    """The image kwargs of a model forward: pixel_values and image_grid_thw where the batch has images."""
    grid = batch.get("image_grid_thw")
    return {k: batch[k] for k in IMAGE_KEYS} if grid is not None and len(grid) else {}


def batch_images(batch: dict) -> dict:
    """The image entries of a batch (to carry into a batch built from it)."""
    return {k: batch[k] for k in (*IMAGE_KEYS, COUNTS) if k in batch}


def select_rows(batch: dict, idx) -> dict:
    """Rows `idx` (a slice or a tensor / list of row indices) of a batch, its images with them."""
    import torch

    out = {k: v[idx] for k, v in batch.items() if k not in IMAGE_KEYS}
    if COUNTS not in batch:
        return out
    counts = batch[COUNTS].tolist()
    rows = range(len(counts))[idx] if isinstance(idx, slice) else torch.as_tensor(idx).flatten().tolist()
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    patches = batch["image_grid_thw"].prod(-1).tolist()
    start = [0]
    for p in patches:
        start.append(start[-1] + p)
    imgs = [j for r in rows for j in range(first[r], first[r + 1])]
    pv = batch["pixel_values"]
    out["image_grid_thw"] = batch["image_grid_thw"][imgs]
    out["pixel_values"] = (torch.cat([pv[start[j]: start[j + 1]] for j in imgs]) if imgs else pv[:0])
    return out


def never_sampled(tokenizer) -> list[int] | None:
    """A VLM's vision tokens, which a response must never hold (a sampled <|image_pad|> would be read as an image
    token with no image behind it): suppressed in generation. None for a text-only model."""
    if image_processor(tokenizer) is None:
        return None
    return [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS]


def generate_images(prompts: list, device) -> dict:
    """The image kwargs of `generate` for a chunk of prompts (ImagePrompts among them), {} for text prompts."""
    return forward_images(collate_images(prompts, device))


# ---- models


def freeze_tower(model, train_vision: bool = False):
    """The vision tower frozen (its patch embedding and blocks: `model.visual`, but its merger — the projector
    into the LM — trained), unless `train_vision`; a model without one is returned untouched. Returns the
    model."""
    visual = getattr(getattr(model, "model", model), "visual", None)
    if visual is None or train_vision:
        return model
    frozen = [p for name, p in visual.named_parameters() if not name.startswith("merger.")]
    for p in frozen:
        p.requires_grad_(False)
    from align.console import info

    n = sum(getattr(p, "ds_numel", p.numel()) for p in frozen)
    info(f"vision tower frozen ({n / 1e6:.3f}M parameters; its merger and the language model train; "
         "--train-vision trains it too)", once=True)
    return model


def with_tower(load, train_vision: bool):
    """A loader `load(dtype) -> model` whose model has its vision tower frozen or trained (`freeze_tower`)."""
    return lambda dtype: freeze_tower(load(dtype), train_vision)


def refuse(model: str, stage: str) -> None:
    """A UserError when `model` (a --model value: a directory or an artifact) is a vision-language model and
    `stage` trains text-only models (ppo, rm: their value and reward heads read text). Reads config.json only;
    anything else (a preset, a hub id, what cannot be read) is left to the stage."""
    import json

    path = Path(model)
    config = path / "model" / "config.json" if (path / "artifact.json").is_file() else path / "config.json"
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(values, dict) and is_vlm_config(values):
        raise UserError(f"--model {model}: a vision-language model; align {stage} trains text-only models (sft, dpo "
                        "and grpo train vision-language ones: docs/vision.md).", option="model")


def attach_processor(tokenizer, model_dir: Path):
    """The tokenizer of a VLM directory with its image processor (preprocessor_config.json; the PIL backend when
    torchvision is missing) attached, so that every place that tokenises a prompt can process its images."""
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"{model_dir}: a vision-language model without a readable image processor "
                        f"(preprocessor_config.json: {str(e).splitlines()[0]}).") from None
    object.__setattr__(tokenizer, PROCESSOR_ATTR, proc)
    return tokenizer


def save_processor(tokenizer, out_dir) -> None:
    """A VLM's image processor saved beside its tokenizer (preprocessor_config.json)."""
    proc = image_processor(tokenizer)
    if proc is not None:
        proc.save_pretrained(out_dir)


# ---- the tiny preset (`align model init --preset tiny-vl`)

# the shipped tokenizer's template (data/tokenizer) with content parts: an image part is the vision tokens around
# one <|image_pad|>, which encode_image_prompt expands
TINY_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}<|system|>{% elif message['role']"
    " == 'user' %}<|user|>{% elif message['role'] == 'assistant' %}<|assistant|>{% else %}{{ raise_exception('unknown "
    "role ' + message['role'] + '; use system, user or assistant') }}{% endif %}{% if message['role'] == 'assistant' "
    "%}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% elif message['content'] is string "
    "%}{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

# a random Qwen2.5-VL small enough for CPU tests: a 1-block vision tower (hidden 32) and its merger into a 2-layer
# LM (hidden 64); the M-RoPE sections split the LM's 16 rotary pairs as (temporal, height, width)
TINY_TEXT = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=56)


def tiny_tokenizer():
    """The shipped tokenizer with the vision tokens, the template above and the default Qwen2-VL image processor
    (PIL backend: no torchvision needed) attached."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from align.paths import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = TINY_TEMPLATE
    object.__setattr__(tok, PROCESSOR_ATTR, Qwen2VLImageProcessorPil())
    return tok


def tiny_model(tokenizer, seed: int = 0):
    """A random tiny Qwen2.5-VL (TINY_TEXT, TINY_VISION) for `tokenizer` (tiny_tokenizer)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in
           zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"), VISION_TOKENS)}
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = Qwen2_5_VLConfig(text_config={**TINY_TEXT, "vocab_size": len(tokenizer), "tie_word_embeddings": True,
                                           **special},
                              vision_config=TINY_VISION, tie_word_embeddings=True, **ids, **special)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)
