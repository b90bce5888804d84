"""Test harness for servelab.models: a minimal paged model runner and the HF oracle.

``PagedRunner`` plays the part of the pipeline's model runner with none of
its policy: it hands out *random, non-contiguous* block ids, keeps each
sequence's block table and computed-token count, and runs one forward per
step for whatever mix of prefill chunks and decode tokens it is given.
"""

from __future__ import annotations

import torch

from servelab.models import allocate_kv_caches, prepare_inputs

ARCHS = ("llama", "qwen2", "mistral")
ATOL = 2e-5  # float32 logits, servelab vs transformers (observed <= 5e-6 on CPU)


class PagedRunner:
    """Drive ``model`` over a paged cache of ``num_blocks`` blocks of ``block_size``."""

    def __init__(self, model, block_size: int, num_blocks: int = 256, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.caches = allocate_kv_caches(model, num_blocks, block_size)
        gen = torch.Generator().manual_seed(seed)
        # Block 0 is the null block: never handed out, as in BlockPool.
        self.free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables: dict[object, list[int]] = {}
        self.computed: dict[object, int] = {}

    @torch.no_grad()
    def step(self, work: dict[object, list[int]]) -> dict[object, torch.Tensor]:
        """Compute ``work[seq]`` (new tokens per sequence) in ONE forward; returns
        float32 logits ``[len(tokens), vocab]`` per sequence, for every new token."""
        seqs = list(work)
        for s in seqs:
            table = self.tables.setdefault(s, [])
            done = self.computed.setdefault(s, 0)
            need = -(-(done + len(work[s])) // self.block_size)
            while len(table) < need:
                table.append(self.free.pop())
        ids, pos, meta = prepare_inputs(
            [work[s] for s in seqs], [self.computed[s] for s in seqs],
            [self.tables[s] for s in seqs], self.block_size,
        )
        logits = self.model.compute_logits(self.model(ids, pos, self.caches, meta))
        starts = meta.query_start_loc.tolist()
        out = {}
        for i, s in enumerate(seqs):
            out[s] = logits[starts[i]:starts[i + 1]]
            self.computed[s] += len(work[s])
        return out


def run_schedule(model, sequences, prompt_lens, budget, block_size, seed=0):
    """Feed ``sequences`` through the paged cache; prompts go in chunks of at most
    ``budget`` tokens per step, the remainder one token per step. Returns the
    logits of every position of every sequence and whether any step mixed a
    prefill chunk with a decode."""
    runner = PagedRunner(model, block_size, seed=seed)
    done = [0] * len(sequences)
    rows = [[] for _ in sequences]
    steps, mixed = 0, False
    while any(d < len(s) for d, s in zip(done, sequences)):
        left, work, kinds = budget, {}, set()
        for i, seq in enumerate(sequences):
            if done[i] >= len(seq) or left == 0:
                continue
            take = min(prompt_lens[i] - done[i], left) if done[i] < prompt_lens[i] else 1
            kinds.add("prefill" if done[i] < prompt_lens[i] else "decode")
            work[i] = seq[done[i]:done[i] + take]
            left -= take
        for i, logits in runner.step(work).items():
            rows[i].append(logits)
            done[i] += len(work[i])
        steps += 1
        mixed |= kinds == {"prefill", "decode"}
    return [torch.cat(r) for r in rows], steps, mixed


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, block_size: int = 4,
                    eos_token_ids: tuple[int, ...] = (), seed: int = 0) -> list[list[int]]:
    """Greedy decoding of all prompts together: one batched prefill, then batched decodes."""
    runner = PagedRunner(model, block_size, seed=seed)
    outputs: list[list[int]] = [[] for _ in prompts]
    work = {i: list(p) for i, p in enumerate(prompts)}
    while work:
        logits = runner.step(work)
        next_work = {}
        for i, rows in logits.items():
            token = int(rows[-1].argmax())
            outputs[i].append(token)
            if token not in eos_token_ids and len(outputs[i]) < max_new_tokens:
                next_work[i] = [token]
        work = next_work
    return outputs


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[len, vocab]`` for one unpadded sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def load_hf(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    return model.eval()


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random token ids (BOS first), avoiding the special ids 0..2 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab_size, (n - 1,), generator=gen).tolist() for n in lengths]


def error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Elementwise float32 bound of a K-term dot product (+ bias): gamma_(K+1) * (|x| @ |w|^T + |b|)."""
    k = x.shape[-1] + 1
    unit = 2.0 ** -24
    gamma = k * unit / (1 - k * unit)
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return gamma * magnitude + 1e-30
