"""The batched sampler (the parameters are in shared/model/sampling_params.py).

Each row's logits are first processed as vLLM does: `logit_bias` is added, then the repetition
penalty (prompt and output tokens: a positive logit divided by it, a negative one multiplied), then
the frequency penalty (minus penalty × count in the output) and the presence penalty (minus penalty
for each token in the output). Log-probabilities are those of the processed logits divided by the
temperature (1 when greedy), before top-k, top-p and min-p. Then: greedy (argmax) when temperature
is 0; otherwise temperature → top-k → top-p → min-p → a draw. A draw inverts the distribution
function at one uniform number (torch's `multinomial` and `exponential_` cost ~1.1 ms a row of
49,152 here; this costs 0.04–0.25 ms a row), and every row of a batch is drawn at once. A seeded request
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
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        _put(tokens, greedy, _rows(logits, greedy).argmax(dim=-1).tolist())
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        _put(tokens, drawn, draw(_rows(logits, drawn), [params[i] for i in drawn], [positions[i] for i in drawn]))
    return tokens, token_logprobs(logits, params, tokens)


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without the copy when that is every row."""
    return x if len(rows) == x.shape[0] else x[rows]


def _put(tokens: list[int], rows: list[int], picked: list[int]) -> None:
    for i, t in zip(rows, picked):
        tokens[i] = t


# candidates a top-p row first looks among (the most likely tokens); it looks among 8x as many
# while they hold less than top_p of the probability, and at last among all of them
TOP_P_CANDIDATES = 64
# the whole-vocabulary draw walks the distribution in blocks: a block's mass, then the token in it
CDF_BLOCK = 256


def draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token for each row of logits [n, V] (not changed): temperature, then top-k, top-p, min-p,
    then a draw by the inverse of the distribution function at one uniform number a row (a seeded
    row's from `position_generator`, so the token is a function of the row, its parameters, seed
    and position alone, whatever shares the batch). All rows at once: top-k and top-p look only
    among the most likely tokens (`topk`, never a sort of the whole vocabulary); a row with neither
    draws from the whole vocabulary in blocks of CDF_BLOCK."""
    n, V = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
    x = logits / temps
    u = torch.rand(n, dtype=torch.float64)
    for i, p in enumerate(params):
        if p.seed is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=position_generator(p.seed, positions[i]))
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    narrows = [bool(k) or p.top_p < 1.0 for k, p in zip(top_k, params)]
    narrowed = [i for i in range(n) if narrows[i]]
    full = [i for i in range(n) if not narrows[i]]
    tokens = [0] * n
    if narrowed:
        _put(tokens, narrowed, _draw_among_candidates(_rows(x, narrowed), [top_k[i] for i in narrowed],
                                                      [params[i] for i in narrowed], u[narrowed]))
    if full:
        probs = _rows(x, full).softmax(-1)
        min_p = torch.tensor([params[i].min_p for i in full], dtype=torch.float32).unsqueeze(1)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        _put(tokens, full, _inverse_cdf_blocked(probs, u[full]))
    return tokens


def _draw_among_candidates(x: torch.Tensor, top_k: list[int], params: list[SamplingParams],
                           u: torch.Tensor) -> list[int]:
    """Rows with top-k and/or top-p: the kept tokens are among the C most likely, so only those are
    sorted (by `topk`). top-p sees the probabilities after top-k (renormalized among the k kept), and
    drops a token when the mass before it already reaches top_p (the first token always stays)."""
    n, V = x.shape
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
    k = torch.tensor(top_k, dtype=torch.int64).unsqueeze(1)  # 0: no top-k
    C = min(V, max(max(top_k), TOP_P_CANDIDATES if any(not kk for kk in top_k) else 0))
    norm = x.logsumexp(-1, keepdim=True)  # the whole row's normalizer (rows without top-k)
    while True:
        vals, ids = x.topk(C, dim=-1)  # sorted, most likely first
        rank = torch.arange(C).unsqueeze(0)
        in_k = (k == 0) | (rank < k)
        logp = torch.where(k > 0, vals.masked_fill(~in_k, float("-inf")).log_softmax(-1), vals - norm)
        p = logp.exp()
        cum = p.cumsum(-1)
        keep = in_k & ((cum - p) < top_p)
        # a row without top-k whose C candidates hold less than top_p may keep tokens past them
        short = (k.squeeze(1) == 0) & (cum[:, -1] < top_p.squeeze(1))
        if C == V or not bool(short.any()):
            break
        C = min(V, C * 8)
    probs = p.masked_fill(~keep, 0.0)
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)  # the first candidate is the most likely
    picked = _inverse_cdf(probs, u)
    return ids.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [n, m] ≥ 0 (not normalized; each row some mass), u [n] in [0, 1) → for each row the index
    j with cdf[j-1] ≤ u·total < cdf[j], in float64: never an index of zero probability."""
    cdf = probs.double().cumsum(-1)
    return _search(cdf, u * cdf[:, -1], probs)


def _search(cdf: torch.Tensor, target: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    if not bool((cdf[:, -1] > 0).all()):  # NaN logits, or every token masked
        raise ValueError("a row to sample has no token of positive probability (NaN or all -inf logits)")
    j = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    # rounding can put the target at the very end: then the row's last index of nonzero probability
    last = torch.where(probs > 0, torch.arange(probs.shape[1]), -1).amax(-1)
    return torch.minimum(j, last)


def _inverse_cdf_blocked(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """`_inverse_cdf` over a whole vocabulary without a [n, V] float64 cumsum: the block of CDF_BLOCK
    tokens by the blocks' masses, then the token within it by the fraction of its mass left."""
    n, V = probs.shape
    blocks = -(-V // CDF_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - V)).view(n, blocks, CDF_BLOCK)
    mass = padded.sum(-1).double()  # [n, blocks]
    cdf = mass.cumsum(-1)
    target = u * cdf[:, -1]
    b = _search(cdf, target, mass)
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    left = ((target - before) / mass.gather(1, b.unsqueeze(1)).squeeze(1)).clamp(0.0, 1.0 - 1e-12)
    return (b * CDF_BLOCK + _inverse_cdf(padded[torch.arange(n), b], left)).tolist()


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
