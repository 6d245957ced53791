"""The fast decoder's static KV cache and the decode state of one (batch rows, capacity) shape, allocated once
for that shape and handed back to the allocator between rollouts (the update needs the memory)."""

from __future__ import annotations

import torch


class KVCache:
    """FastDecoder's cache: every layer's K in one buffer and V in another (`k_cache[i]`, `v_cache[i]`: views),
    the attention bias over the slots, and the decode state the compiled step updates in place (current token
    and position per row, the slot and output column written next, EOS flags, sampling keys, the output tokens
    and their log-probs). A buffer that comes back elsewhere after `release` drops the captured graphs
    (CompiledStep._drop_graphs)."""

    def _alloc(self, B: int, cap: int) -> None:
        if self._shape_key == (B, cap):
            return
        d = self.device
        # one spare slot, never attended to: no slice [:, :n] of the cache or the bias is contiguous, so one
        # compile serves every attention length n (a contiguous slice takes other code paths: a recompile)
        # every layer's K one buffer, every layer's V another (a layer's k and v never share a storage: the compiled
        # layer writes both): two pieces for `release` to give back and the next rollout to take again, which the
        # allocator returns at their old addresses far more often than 2 x layers pieces (a moved one costs a
        # re-capture of every graph)
        self._kbuf = torch.zeros(self.n_layers, B, self.n_kv, cap + 1, self.head_dim, device=d, dtype=self.dtype)
        self._vbuf = torch.zeros_like(self._kbuf)
        self.k_cache, self.v_cache = list(self._kbuf.unbind(0)), list(self._vbuf.unbind(0))
        self.attn_bias = torch.zeros(B, cap + 1, device=d, dtype=torch.float32)
        self.cur_tok = torch.zeros(B, dtype=torch.long, device=d)
        self.cur_pos = torch.zeros(B, dtype=torch.long, device=d)
        self.widx = torch.zeros(1, dtype=torch.long, device=d)  # cache slot the next token is written to
        self.sidx = torch.zeros(1, dtype=torch.long, device=d)  # column of `out` the next token goes to
        self.finished = torch.zeros(B, dtype=torch.bool, device=d)
        self.keys = torch.zeros(B, dtype=torch.long, device=d)  # each row's sampling key (align.rollout.sampling)
        # each row's position of its first new token for its keyed noise (an episode's tokens so far; else 0)
        self.key_offset = torch.zeros(B, dtype=torch.long, device=d)
        self.out = None
        self.out_logp = None
        self.last_logps = None  # the last `generate`'s sampling log-probs per row (None when greedy)
        self._out_len = 0
        if d.type == "cuda":
            for t in self.k_cache + self.v_cache + [self.attn_bias]:
                torch._dynamo.mark_static_address(t)  # unguarded: a new address re-records, never recompiles
        self._shape_key = (B, cap)
        self._graphs, self._warm = {}, set()
        self._released = False
        self._held = None  # per row: (the tokens its cache holds, their slots), see `_extension`
        self._next_slot = 0  # the first slot no row has written

    def _big(self) -> list[torch.Tensor]:
        return [self._kbuf, self._vbuf]

    def _release_cache(self) -> None:
        """The cache's storage back to the allocator (its tensors stay: no recompile); `_restore` takes it again."""
        if self._shape_key is None or self._released:
            return
        self._ptrs = [t.data_ptr() for t in self._big()]
        for t in self._big():
            t.untyped_storage().resize_(0)
        self._released = True
        self._held = None

    def _restore(self) -> None:
        if not self._released:
            return
        for t in self._big():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.zero_()  # masked cache slots are multiplied by 0: they must not hold NaN/inf garbage
        if [t.data_ptr() for t in self._big()] != self._ptrs and self._graphs:
            self._drop_graphs("cache")
        self._released = False

    def _remember(self, prompts: list[list[int] | None], rows: list[list[int]], slots: list, top: int,
                  steps: int) -> None:
        """After a generate: what each row's cache holds, its context then the generated tokens the decode steps
        wrote (all but the last: `steps` - 1 of them, at slots top, top + 1, ...), with their slots."""
        new = list(range(top, top + steps - 1))
        self._held = [None if p is None else (p + row[: steps - 1], sl + new)
                      for p, row, sl in zip(prompts, rows, slots)]
        self._next_slot = top + steps - 1

    def _extension(self, prompts: list[list[int] | None], new: int, pad: int):
        """The plan to prefill only what each row's context adds to what its cache holds (`_held`): for each
        row, the longest common prefix of the two stays in place (open), its other slots are closed, and the
        rest of the context (at least its last token: the next token's logits) goes in one left-padded block
        after the last slot written, at its positions in the context. (ids, mask, positions [B, m], the block's
        first slot, the open slots before it [B, start], each row's slots); None when there is nothing held for
        these rows or no room for the block and `new` tokens (then everything is prefilled again)."""
        held, start = getattr(self, "_held", None), getattr(self, "_next_slot", 0)
        if held is None or len(held) < len(prompts) or self._released:
            return None
        keep, todo = [], []
        for p, h in zip(prompts, held):
            if p is None:  # an ended episode's row: nothing to prefill
                keep.append(0), todo.append([])
                continue
            if h is None:  # a row the cache holds nothing of: everything is prefilled again
                return None
            k = next((i for i, (a, b) in enumerate(zip(p, h[0])) if a != b), min(len(p), len(h[0])))
            k = min(k, len(p) - 1)
            keep.append(k), todo.append(p[k:])
        m = max(map(len, todo))
        B, cap = self._shape_key
        if m == 0 or start + m + new > cap:
            return None
        self._outputs(B, new, pad)
        ids = torch.full((B, m), pad, dtype=torch.long)
        mask = torch.zeros(B, m, dtype=torch.long)
        pos = torch.zeros(B, m, dtype=torch.long)
        open_before = torch.zeros(B, start, dtype=torch.bool)
        slots = []
        for r, (k, t) in enumerate(zip(keep, todo)):
            kept = held[r][1][:k] if k else []
            open_before[r, kept] = True
            ids[r, m - len(t):] = torch.tensor(t, dtype=torch.long)
            mask[r, m - len(t):] = 1
            pos[r, m - len(t):] = torch.arange(k, k + len(t))
            slots.append(None if prompts[r] is None else kept + list(range(start + m - len(t), start + m)))
        d = self.device
        return ids.to(d), mask.to(d), pos.to(d), start, open_before, slots

    def kv_cache_bytes(self, rows: int, length: int) -> int:
        return 2 * self.n_layers * rows * self.n_kv * length * self.head_dim * torch.finfo(self.dtype).bits // 8
