"""`align model init`: build the embedded model (a preset) with the shipped tokenizer, as an artifact."""

from __future__ import annotations

import torch

from align.engine.run import StageRun
from align.models import count_parameters, load_causal_lm, load_tokenizer, resolve
from align.paths import TOKENIZER_DIR
from align.runtime import quiet_libraries
from stages.model_init_config import ModelInitConfig  # the options (light: no torch), re-exported


def run(cfg: ModelInitConfig) -> dict:
    quiet_libraries()
    source = resolve(cfg.preset)
    tok = load_tokenizer(source)
    with StageRun(cfg, "model-init") as run:
        run.open({"tokenizer": str(TOKENIZER_DIR)}, distributed=False)
        model = load_causal_lm(source, tok, torch.float32, seed=cfg.seed)
        model.save_pretrained(run.writer.begin_model(), safe_serialization=True)
        tok.save_pretrained(run.writer.model_tmp)
        metrics = {"parameters": count_parameters(model), "vocab_size": len(tok),
                   "layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size}
        return run.complete(metrics, f"model init ({cfg.preset}) → {cfg.out}", extra={"model_kind": "policy"})
