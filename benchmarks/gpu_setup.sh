#!/usr/bin/env bash
# On a lent GPU machine: the wheels carried in .whl (deepspeed, pydantic, datasets, evaluate, trl, ...) into
# /tmp/site. Source it: `. benchmarks/gpu_setup.sh` (exports PYTHONPATH with the repo first).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | grep -v -i -E "warn|already" | tail -3
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, deepspeed, datasets, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())" 2>&1 | tail -2
