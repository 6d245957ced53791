"""`align model init`: build the embedded model (a preset) with the shipped tokenizer, as an artifact."""

from __future__ import annotations

import torch

from align import vision
from align.engine.run import StageRun
from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
from align.paths import TOKENIZER_DIR
from align.runtime import quiet_libraries
from stages.model_init_config import ModelInitConfig  # the options (light: no torch), re-exported


def run(cfg: ModelInitConfig) -> dict:
    quiet_libraries()
    if cfg.preset == "tiny-vl":  # a vision-language model: the shipped tokenizer with the vision tokens
        tok = vision.tiny_tokenizer()
        build = lambda: vision.tiny_model(tok, cfg.seed)  # noqa: E731
    else:
        source = resolve(cfg.preset)
        tok = load_tokenizer(source)
        build = lambda: load_causal_lm(source, tok, torch.float32, seed=cfg.seed)  # noqa: E731
    with StageRun(cfg, "model-init") as run:
        run.open({"tokenizer": str(TOKENIZER_DIR)}, distributed=False)
        model = build()
        model.save_pretrained(run.writer.begin_model(), safe_serialization=True)
        tok.save_pretrained(run.writer.model_tmp)
        vision.save_processor(tok, run.writer.model_tmp)
        text = model.config.get_text_config()
        metrics = {"parameters": count_parameters(model), "vocab_size": len(tok),
                   "layers": text.num_hidden_layers, "hidden_size": text.hidden_size}
        return run.complete(metrics, f"model init ({cfg.preset}) → {cfg.out}", extra={"model_kind": "policy"})
