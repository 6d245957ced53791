"""GPU check: the fast decoder re-captures its graphs once every graph was dropped (what a buffer that comes back
at another address after `release` causes), in a fresh graph memory pool: capturing into the pool of graphs that
were all destroyed trips the caching allocator's `use_count > 0` assert (seen in a GRPO run on torch 2.11).

    python -m benchmarks.recapture_check
"""
import torch
from transformers import AutoModelForCausalLM

from align.rollout.fast.decoder import FastDecoder
from align.rollout.generation import Sampling
from benchmarks import vs_trl as V

with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(V.config("tiny", bos_token_id=1, eos_token_id=2, pad_token_id=0),
                                         dtype=torch.bfloat16).eval()
dec = FastDecoder(m, "cuda")
s = Sampling(max_new_tokens=40, temperature=1.0)
p = [[1, 5, 6, 7]] * 8
dec.load_weights(m)
a = dec.generate(p, s, -1, 0, keys=list(range(8)))
dec.release()
dec.load_weights(m)
dec._graphs = {}  # as when a buffer moved: every graph dropped, re-captured by the next rollout
b = dec.generate(p, s, -1, 0, keys=list(range(8)))
x = torch.randint(0, 10, (4,), device="cuda")  # RNG outside capture still works
print("re-captured:", bool(dec._graphs), "same samples:", a == b, "RNG outside capture:", x.shape)
