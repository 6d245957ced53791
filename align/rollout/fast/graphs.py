"""The fast decoder's decode step, compiled and captured: on CUDA one graph replay per generated token.

One decode step is three compiled pieces: the step's inputs, ONE transformer layer (the same compiled code for
every layer: its weights and cache are arguments) and the step's end. Compiling one layer instead of the unrolled
model keeps the first step's compile short at any depth; the CUDA graph still holds the whole step, so a token
costs one replay either way. Attention reads the written part of the cache, rounded up to a bucket of slots: one
graph per bucket, one compile for all of them (the attention length is dynamic).
"""

from __future__ import annotations

import os

import torch


class CompiledStep:
    """FastDecoder's decode step (`_step`: the pieces `_step_in`, `_layer_step` of LayerMath and `_step_out`)
    run eagerly, compiled, or as captured CUDA graphs keyed by the sampling settings and the attention length;
    captured graphs hold the addresses of the weights and the cache, so a moved buffer drops them
    (`_drop_graphs`) and the next use re-captures."""

    def _init_graphs(self) -> None:
        self.recaptures = 0  # CUDA graphs re-captured because a buffer came back at another address
        self.recaptured_for: dict[str, int] = {}  # ... by what moved: "weights", "cache"
        self._side = None  # the warm-up stream of every capture
        self.bucket = int(os.environ.get("ALIGN_DECODE_BUCKET", 256)) if self.use_graphs else 1  # see attn_len
        self._graphs: dict = {}
        self._warm: set = set()  # graph keys whose step has been compiled and run
        self._compiled = None

    def _step(self, sampling, eos: int, pad: int, bias: torch.Tensor, fns=None) -> None:
        """Everything one generated token needs, on the device (this is what the CUDA graph holds); `fns`: the
        compiled (step_in, layer_step, step_out), else eager."""
        step_in, layer_step, step_out = fns or (self._step_in, self._layer_step, self._step_out)
        # open cache slot widx for attention: outside the compiled pieces (an in-place write to a view argument
        # with a dynamic length failed AOT functionalization on torch 2.11), inside the CUDA graph all the same
        self.attn_bias.index_fill_(1, self.widx, 0.0)
        x, cos, sin = step_in()
        j = 0  # the MoE layers' count so far: their routes' column
        for L, kc, vc in zip(self.layers, self.k_cache, self.v_cache):
            x = layer_step(L, kc, vc, x, cos, sin, bias)
            if isinstance(x, tuple):  # an MoE layer: (x, the experts the current tokens went to)
                x, idx = x
                if self.record_routes:
                    self._record_routes(j, idx)
                j += 1
        step_out(x, sampling, eos, pad)

    def attn_len(self, w: int) -> int:
        """Cache slots the decode step that writes slot `w` attends to: w + 1 rounded up to a multiple of `bucket`
        (CUDA graphs: one graph per bucket, 256 slots; eager: 1, exactly w + 1), so attention reads the written part
        of the cache, not all of it (at 4K tokens that halves the bytes a decode step reads)."""
        return min(self._shape_key[1], -(-(w + 1) // self.bucket) * self.bucket)

    def _bias(self, n: int) -> torch.Tensor:
        """attn_bias[:, :n], its length dynamic for the compiler (one compile serves every bucket)."""
        b = self.attn_bias[:, :n]
        torch._dynamo.maybe_mark_dynamic(b, 1)
        return b

    def compile_step(self, backend="inductor") -> None:
        """Compile the decode step's three pieces (on CUDA before the first capture; tests: any backend)."""
        self._compiled = tuple(torch.compile(f, fullgraph=True, backend=backend)
                               for f in (self._step_in, self._layer_step, self._step_out))

    def _run_step(self, sampling, eos: int, pad: int, bias: torch.Tensor) -> None:
        if self._compiled is None:
            return self._step(sampling, eos, pad, bias)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # only the attention length is dynamic
            self._step(sampling, eos, pad, bias, self._compiled)

    def _runner(self, sampling, eos: int, pad: int, n: int):
        """A callable doing one `_step` over n cache slots: a CUDA-graph replay on CUDA, eager elsewhere."""
        key = (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p, eos, pad, n, self.record_routes)
        bias = self._bias(n)
        body = lambda: self._run_step(sampling, eos, pad, bias)  # noqa: E731
        if not self.use_graphs:
            return body
        if key not in self._graphs:
            self._graphs[key] = self._capture(key, body)
        return self._graphs[key].replay

    def _capture(self, key: tuple, body) -> torch.cuda.CUDAGraph:
        """`body` captured as a CUDA graph (compiled first if it is not yet): warmed up (compiles) on a side
        stream, then captured; the state it leaves is reset by the next prefill."""
        if self._compiled is None:
            self.compile_step()
        state = (self.cur_tok, self.cur_pos, self.widx, self.sidx, self.finished)
        # ... and the first cache slots it writes: an episode's next turn keeps what the cache holds
        held = (self._kbuf[:, :, :, :2], self._vbuf[:, :, :, :2], self.attn_bias[:, :2])
        saved = [t.clone() for t in state + held]
        if self._side is None:  # ONE side stream for the decoder's life: cuBLAS keeps a workspace (32 MiB on
            self._side = torch.cuda.Stream()  # Hopper) per stream it ran on, so a new stream per capture leaks one
        if not self._graphs:  # one memory pool for the live graphs (run one at a time); a new one once all are
            self._pool = torch.cuda.graph_pool_handle()  # dropped: the allocator frees a pool no graph holds
        s = self._side
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            # a re-capture (an address moved) of a step that ran before needs one warm-up run, not the first's two
            for _ in range(1 if key in self._warm else 2):
                self.widx.zero_(), self.sidx.zero_()
                body()
        torch.cuda.current_stream().wait_stream(s)
        self._warm.add(key)
        self.widx.zero_(), self.sidx.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            body()
        for t, v in zip(state + held, saved):
            t.copy_(v)
        return g

    def _drop_graphs(self, why: str) -> None:
        """The captured graphs hold addresses that moved (`why`: the weights or the cache): re-captured on use."""
        self._graphs = {}
        self.recaptures += 1
        self.recaptured_for[why] = self.recaptured_for.get(why, 0) + 1
