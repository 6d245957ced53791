"""Supervised fine-tuning: next-token loss on completion tokens only.

    loss = (1/N) Σ_{examples} Σ_{t ∈ completion} −log p_θ(y_t | prompt, y_<t)

N = completion tokens in the GLOBAL batch (all ranks, all micro-batches), so 1 process and N processes compute
the same gradient. Held-out: the same loss, and greedy pass@1 when the data carries an `answer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from align import data as D
from align import runtime, tools
from align.artifacts import describe_inputs
from align.console import info
from align.engine.build import Optim
from align.engine.plan import (Data, Device, Family, Model, Plan, Setup, SupervisedPlan, full_logit_bytes, inference_bytes,
                               memory_changes, micro_changes, nproc_changes, trained_model, update_terms)
from align.engine.run import Output, chunks, train
from align.engine.stats import Stats
from align.errors import UserError
from align.models import check_length, count_parameters, load_causal_lm, load_tokenizer, resolve
from align.objectives.tokens import completion_nll
from align.rollout.evaluation import evaluate_policy, fitting_rows, held_out_verifier, verifier_note
from align.rollout.generation import Sampling
from stages.sft_config import SFTConfig  # the options (light: no torch), re-exported


EVAL_ROWS = 64  # the held-out loss runs 64 rows a forward (SFT.evaluate; the memory plan's eval phase)


@dataclass(frozen=True)
class SFTPlan(SupervisedPlan):
    """SFT in the memory plan: the policy trained on rows padded to the data's longest (--max-length when
    packing), with the full logits of its loss; --eval-data's held-out loss is a phase of its own."""

    cfg: SFTConfig
    name: ClassVar[str] = "sft"

    @property
    def held_out(self) -> bool:
        return bool(self.cfg.eval_data or self.cfg.eval_split)

    def phases(self) -> tuple[str, ...]:
        return ("update", "eval") if self.held_out else ("update",)

    def terms(self, plan: Plan, models: dict[str, Model], s: Setup, data: Data) -> None:
        cfg, a = self.cfg, models["policy"].arch
        length = data.sequence(cfg.max_length, cfg.packing)
        plan.add_state(trained_model(cfg, "policy", a), s)
        update_terms(plan, a, self.micro_rows(s.world, data)[0], length, s, "full")
        if self.held_out:  # the held-out loss: EVAL_ROWS rows a forward, their full logits (SFT.evaluate)
            plan.add(f"eval: forward ({EVAL_ROWS} rows x {length} tokens)", inference_bytes(a, EVAL_ROWS, length, s),
                     "eval")
            plan.add(f"eval: logits ({EVAL_ROWS} x {length} x {a.vocab}, fp32 loss)",
                     full_logit_bytes(EVAL_ROWS, length, a.vocab, s), "eval")

    def changes(self, device: Device, data: Data) -> Iterator[Family]:
        """A smaller micro-batch, no held-out loss (its 64-row forwards), LoRA, optimizer offload, more processes."""
        yield micro_changes(self, device, data)
        if self.held_out:
            yield [({"eval_data": ""} if self.cfg.eval_data else {"eval_split": 0.0}, device)]
        yield from memory_changes(self.cfg, device)
        yield nproc_changes(self, device)


class SFT:
    progress = ("loss", "lr", "eval/loss", "eval/pass@1")

    def __init__(self, cfg: SFTConfig, run):
        cfg = run.cfg  # as the run resolved it: --lr, --warmup-steps left to it made concrete
        self.cfg, self.run = cfg, run
        source = resolve(cfg.model)
        check_length(source, cfg.max_length)
        rows, split = D.split_off(D.load_rows(cfg.data, "sft", cfg.columns), cfg.eval_split, cfg.data)
        eval_rows = D.load_rows(cfg.eval_data, "sft", cfg.columns, held_out=True) if cfg.eval_data else split
        if cfg.assistant_only_loss and D.data_kind(rows) != "messages":
            raise UserError(f"{cfg.data}: --assistant-only-loss trains every assistant turn of {{messages}} "
                            f"conversations; this is {D.data_kind(rows)} data, whose loss is already on "
                            f"{'every token' if D.data_kind(rows) == 'text' else 'the completion'}: drop the flag.")
        if cfg.tools and D.data_kind(rows) != "prompt-completion":
            raise UserError(f"{cfg.data}: --tools reads {{prompt, completion}} rows whose completions hold the tool "
                            f"calls and answers; this is {D.data_kind(rows)} data.")
        self.tok = load_tokenizer(source, cfg.trust_remote_code, cfg.chat_template)
        examples = D.sft_examples(self.tok, rows, cfg.max_length, cfg.assistant_only_loss, cfg.tools)
        if not examples:
            raise UserError(f"{cfg.data}: no example fits --max-length {cfg.max_length}; raise it.")
        self.examples = D.pack_examples(examples, cfg.max_length) if cfg.packing else examples
        self.eval_examples = D.sft_examples(self.tok, eval_rows, cfg.max_length, cfg.assistant_only_loss, cfg.tools)
        self.agent = tools.agent(cfg.tools, cfg.max_new_tokens, cfg.max_turns, cfg.max_tool_tokens, cfg.tool_timeout,
                                 tokenizer=self.tok)
        self.verifiable = fitting_rows([r for r in eval_rows if "answer" in r and "prompt" in r][: cfg.eval_samples],
                                       self.tok, source, cfg.max_new_tokens + (cfg.max_tool_tokens if cfg.tools else 0),
                                       cfg.eval_data or cfg.data)
        self.verifier = held_out_verifier(cfg.verifier, self.verifiable, self.tok, cfg.eval_data or cfg.data)
        run.choose_verifier(self.verifier)
        dist = run.open(describe_inputs(source, cfg.data, cfg.eval_data), SFTPlan(cfg), lora=(source,),
                        sequence_tokens=D.longest_row(self.examples), notes=verifier_note(self.verifier))
        self.micro, accum = run.layout.micro, run.layout.accum
        if len(examples) < len(rows):
            info(f"[yellow]dropped {len(rows) - len(examples)} examples whose completion exceeds --max-length[/]")
        self.policy = run.train("policy", lambda dtype: load_causal_lm(source, self.tok, dtype, cfg.seed, cfg.trust_remote_code),
                                Optim(cfg.lr, cfg.max_steps, cfg.warmup_steps, cfg.schedule, cfg.weight_decay),
                                micro=self.micro, accum=accum)
        self.n_params = count_parameters(self.policy.module)
        packed = f" in {len(self.examples)} packed rows" if cfg.packing else ""
        info(f"sft: {self.n_params / 1e6:.2f}M parameters, {len(examples)} examples{packed}, {dist.world_size} "
             f"process(es), ZeRO-{run.layout.zero_stage}, {run.layout.precision}, micro batch {self.micro} x accum "
             f"{accum}, "
             f"device {dist.device.type}")

    def step(self, step: int) -> Stats:
        device = self.run.dist.device
        batch = [self.examples[i] for i in self.run.indices(len(self.examples), self.cfg.batch_size, step)]
        n_global = runtime.all_reduce_sum(torch.tensor(float(sum(e["n_labels"] for e in batch)), device=device))
        stats = Stats()
        for mb in chunks(batch, self.micro):
            b = D.to_device(D.collate_sft(mb, self.tok.pad_token_id), device)
            nll, n = completion_nll(self.policy(**D.model_inputs(b)).logits, b["labels"])
            self.policy.backward(nll / n_global)
            stats.mean("loss", nll, n)
            stats.sum("tokens", (b["input_ids"] != self.tok.pad_token_id).sum())
        return stats

    @torch.no_grad()
    def evaluate(self, step: int) -> dict:
        metrics, dist = {}, self.run.dist
        if self.eval_examples:
            head = self.eval_examples[: 256 * dist.world_size]
            mine = runtime.shard(head[: len(head) // dist.world_size * dist.world_size], dist) or head[:1]
            stats = Stats()
            for mb in chunks(mine, EVAL_ROWS):
                b = D.to_device(D.collate_sft(mb, self.tok.pad_token_id), dist.device)
                stats.mean("eval/loss", *completion_nll(self.policy(**D.model_inputs(b)).logits, b["labels"]))
            metrics.update(stats.reduce(dist.device))
        if self.verifiable:
            m, _ = evaluate_policy(self.policy.eng, self.tok, self.verifiable, dist, verifier=self.verifier,
                                   sampling=Sampling(max_new_tokens=self.cfg.max_new_tokens, temperature=0.0),
                                   agent=self.agent)
            metrics["eval/pass@1"], metrics["eval/pass@1_stderr"] = m["pass@1/greedy"], m["pass@1/greedy_stderr"]
        return metrics

    def final_metrics(self, last: dict, start: dict) -> dict:
        return {"train/loss": last["loss"], **{k: v for k, v in last.items() if k.startswith("eval/")},
                "parameters": self.n_params}

    def close(self, failed: bool = False) -> None:
        if self.agent:  # your tools' sandbox (--tools FILE.py:fn)
            self.agent.close()

    def output(self) -> Output:
        return Output(self.policy.eng, self.tok, extra={"zero_partition": runtime.partition_stats(self.policy.eng)})


def run(cfg: SFTConfig) -> dict:
    return train(cfg, "sft", SFT)
