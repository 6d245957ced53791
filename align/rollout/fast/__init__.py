"""The fast decoder: rollouts of Llama-family policies from a compiled, CUDA-graph-captured decode step."""
