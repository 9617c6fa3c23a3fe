"""The batched sampler (the parameters are in shared/model/sampling_params.py).

Each row's logits are first processed as vLLM does: `logit_bias` is added, then the repetition
penalty (prompt and output tokens: a positive logit divided by it, a negative one multiplied), then
the frequency penalty (minus penalty × count in the output) and the presence penalty (minus penalty
for each token in the output). Log-probabilities are those of the processed logits divided by the
temperature (1 when greedy), before top-k, top-p and min-p. Then: greedy (argmax) when temperature
is 0; otherwise temperature → top-k → top-p → min-p → a draw. A seeded request
draws output token i from a generator seeded with (seed, i), so its tokens are reproducible whatever
it is batched with, and wherever token i is sampled: a prefill worker samples token 0 and a decode
worker the rest, or a migrated request resumes on another worker, and the stream is the same.
"""

from __future__ import annotations

import torch

from shared.model.sampling_params import History, SamplingParams, TokenLogprobs


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator for output token `position` of a request seeded with `seed`."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
           histories: list[History | None] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [B, V] fp32, one row per sequence (processed in place); positions: each row's output
    index; histories: each row's tokens so far (needed where its params are penalized)
    → (token ids, log-probabilities where asked for)."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        if histories is None or any(histories[i] is None for i in penalized):
            raise ValueError("penalized rows need their histories")
        apply_penalties(logits, [params[i] for i in penalized], [histories[i] for i in penalized], penalized)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        out[greedy_rows] = logits[greedy_rows].argmax(dim=-1).cpu()
    for i, p in enumerate(params):  # random rows: each may have its own generator, so one at a time
        if p.greedy:
            continue
        probs = _probs(logits[i], p)
        g = None if p.seed is None else position_generator(p.seed, positions[i])
        out[i] = torch.multinomial(probs, 1, generator=g).item()
    tokens = out.tolist()
    return tokens, token_logprobs(logits, params, tokens)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
                    rows: list[int]) -> None:
    """Bias and penalties of `rows` of logits, in place, all rows at once (see the module doc)."""
    V = logits.shape[-1]
    n = len(rows)
    sub = logits[rows]
    counts = torch.zeros(n, V, dtype=torch.float32)
    seen = torch.zeros(n, V, dtype=torch.bool)
    for j, h in enumerate(histories):
        if h.output:
            counts[j].scatter_add_(0, torch.tensor(h.output, dtype=torch.int64), torch.ones(len(h.output)))
        if h.prompt:
            seen[j, torch.tensor(h.prompt, dtype=torch.int64)] = True
    seen |= counts > 0
    col = lambda values: torch.tensor(values, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    bias_rows = [j for j, p in enumerate(params) if p.logit_bias]
    for j in bias_rows:
        ids = torch.tensor(list(params[j].logit_bias), dtype=torch.int64)
        sub[j].index_add_(0, ids, torch.tensor(list(params[j].logit_bias.values()), dtype=torch.float32))
    rep = col([p.repetition_penalty for p in params])
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub -= col([p.frequency_penalty for p in params]) * counts
    sub -= col([p.presence_penalty for p in params]) * (counts > 0)
    logits[rows] = sub


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprobs | None]:
    """Log-probabilities of the processed logits over the temperature (1 when greedy), where asked."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in (params[i] for i in rows)]).unsqueeze(1)
    lp = torch.log_softmax(logits[rows] / temps, dim=-1)
    k = max(params[i].logprobs for i in rows)
    top = lp.topk(k, dim=-1) if k else None
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows]).unsqueeze(1)).squeeze(1).tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs
        ids = top.indices[j, :n].tolist() if n else []
        vals = top.values[j, :n].tolist() if n else []
        out[i] = TokenLogprobs(chosen[j], ids, vals)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits: [n, V], row j the model's prediction of targets[j] → each target's log-probability
    and the k most likely tokens' (of the raw logits: no penalty or temperature, as vLLM's prompt
    log-probabilities)."""
    if not targets:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
    if not k:
        return [TokenLogprobs(c, [], []) for c in chosen]
    top = lp.topk(k, dim=-1)
    return [TokenLogprobs(c, ids, vals) for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


def _probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """row: [V] logits → [V] probabilities after temperature, top-k and top-p."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (cum - sorted_logits.softmax(-1)) >= p.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = row.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs
