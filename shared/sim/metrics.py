"""What the simulator measures, in `pdserve bench`'s terms (services/bench/metrics.py).

Per request it keeps a few numbers (arrival, first and last token, tokens out), never a list of
token times: inter-token latencies go into a log-spaced histogram per request kind (bins 0.5%
wide, so a percentile read from it is within 0.3% of the exact one), which keeps an hour of a
thousand workers' traffic in a few megabytes.

    TTFT   first token − arrival (+ the profile's per-request overhead outside the engines)
    TPOT   (E2EL − TTFT) / (output tokens − 1)
    ITL    gap between consecutive events of one request (its first decode gap includes the KV move);
           with speculative decoding an event carries the profile's `tokens_per_event` tokens on
           average, so each token gap g of a sequence stepping on enters the histogram as an event
           gap g·τ of weight 1/τ; a gap in which it waited w before a step s (its first decode gap:
           the KV move) is one event, w + s·τ
    E2EL   last token − arrival (+ the same overhead)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
HIST_LO_S = 1e-6
BINS_PER_E = 200  # bins per factor e: width 0.5%
HIST_BINS = int(math.log(1e4 / HIST_LO_S) * BINS_PER_E) + 1
ITL_SPAN_SAMPLES = 8  # a decode span's step times enter the histogram as this many weighted points


class ItlHistogram:
    __slots__ = ("counts", "n", "total", "lo", "hi")

    def __init__(self):
        self.counts = [0.0] * HIST_BINS
        self.n, self.total, self.lo, self.hi = 0.0, 0.0, math.inf, 0.0

    def add(self, x: float, weight: float = 1.0) -> None:
        i = int(math.log(max(x, HIST_LO_S) / HIST_LO_S) * BINS_PER_E)
        self.counts[min(i, HIST_BINS - 1)] += weight
        self.n += weight
        self.total += x * weight
        if x < self.lo:
            self.lo = x
        if x > self.hi:
            self.hi = x

    def merge(self, other: ItlHistogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.n += other.n
        self.total += other.total
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

    def percentile(self, q: float) -> float:
        target = self.n * q / 100.0
        acc = 0.0
        for i, c in enumerate(self.counts):
            if c and acc + c >= target:
                frac = (target - acc) / c
                x = HIST_LO_S * math.exp((i + frac) / BINS_PER_E)
                return min(max(x, self.lo), self.hi)
            acc += c
        return self.hi

    def spread(self, shape: tuple[float, ...]) -> ItlHistogram:
        """This distribution with each gap g replaced by g·q for every q in `shape`, equally weighted
        (a convolution in log space: a factor is a shift by a whole number of bins)."""
        if tuple(shape) == (1.0,) or self.n <= 0:
            return self
        counts = np.asarray(self.counts)
        out = np.zeros_like(counts)
        for q in shape:
            shift = int(round(math.log(q) * BINS_PER_E))
            src = counts[max(0, -shift):HIST_BINS - max(0, shift)]
            out[max(0, shift):max(0, shift) + src.size] += src
            # (mass shifted past either end piles up in the end bin)
            if shift > 0:
                out[-1] += counts[HIST_BINS - shift:].sum()
            elif shift < 0:
                out[0] += counts[:-shift].sum()
        h = ItlHistogram()
        h.counts = list(out / len(shape))
        h.n = self.n
        h.total = self.total * sum(shape) / len(shape)
        h.lo, h.hi = self.lo * min(shape), self.hi * max(shape)
        return h

    def summary_ms(self) -> dict[str, float] | None:
        if self.n <= 0:
            return None
        out = {"n": int(round(self.n)), "mean": 1e3 * self.total / self.n, "min": 1e3 * self.lo}
        out |= {f"p{q}": 1e3 * self.percentile(q) for q in PERCENTILES}
        out["max"] = 1e3 * self.hi
        return out


class Recorder:
    """Per-request times and the ITL histograms; the engines call `token` and `span_tokens`."""

    def __init__(self, kinds: list[str], itl_from_s: float | None = None, tokens_per_event: float = 1.0,
                 itl_shape: tuple[float, ...] = (1.0,)):
        self.kinds = kinds
        self.tau = tokens_per_event
        self.itl_shape = tuple(itl_shape)
        self.itl_from_s = -math.inf if itl_from_s is None else itl_from_s
        self.hists = [ItlHistogram() for _ in kinds]
        self.arrival: list[float] = []
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.kind: list[int] = []
        self.first_s: list[float] = []
        self.last_s: list[float] = []
        self.finish_s: list[float] = []
        self.tokens: list[int] = []

    def new_request(self, arrival: float, prompt: int, output: int, kind: int) -> int:
        self.arrival.append(arrival)
        self.prompt.append(prompt)
        self.output.append(output)
        self.kind.append(kind)
        self.first_s.append(-1.0)
        self.last_s.append(-1.0)
        self.finish_s.append(-1.0)
        self.tokens.append(0)
        return len(self.arrival) - 1

    def token(self, seq, t: float, step_start: float, step_tau: float | None = None, tokens: int = 1) -> None:
        """`seq` got a token at `t` from a step begun at `step_start`: a slice of an event (a decode
        step: its gap × τ, weight 1/τ), or, from a step that computed a prompt's chunk too
        (`step_tau` given), a whole event of `tokens` tokens, its gap the whole step."""
        rid = seq.rid
        last = self.last_s[rid]
        if last < 0:
            self.first_s[rid] = t
        elif t >= self.itl_from_s:
            scale, weight = (self.tau, 1.0 / self.tau) if step_tau is None else (1.0, 1.0)
            if last < step_start:  # it waited for this step (its KV moved, a batch to join): one event
                self.hists[seq.kind].add(step_start - last + (t - step_start) * scale)
            else:
                self.hists[seq.kind].add((t - last) * scale, weight)
        self.last_s[rid] = t
        self.tokens[rid] += tokens

    def decode_span(self, engine, span, end: float) -> list:
        """A decode span of `span.steps` steps ended at `end`: every running sequence got one token a
        step. One pass over the batch (this is the simulator's inner loop): tokens, times, blocks;
        the gaps go to the histograms, step 0's per sequence only when it did not start with the span."""
        k, start, first = span.steps, span.start, span.first_step_s * span.slow
        first_end = start + first
        last_s, tokens, hists, bs, tau = self.last_s, self.tokens, self.hists, engine.bs, self.tau
        counting_first = first_end >= self.itl_from_s
        per_kind = [0] * len(hists)
        cont_kind = [0] * len(hists)  # sequences whose previous token ended as the span began
        grown, done = 0, []
        for seq in engine.running:
            rid, kind = seq.rid, seq.kind
            last = last_s[rid]
            per_kind[kind] += 1
            if last < 0:  # its prompt's last token, all the rest cached: the span's first step samples
                self.first_s[rid] = first_end  # its first token (no gap before it)
            elif last == start:
                cont_kind[kind] += 1
            elif counting_first:  # it waited for the span (joined it): one event, the wait and a step
                hists[kind].add(start - last + first * tau)
            last_s[rid] = end
            tokens[rid] += k
            seq.num_tokens += k
            seq.remaining -= k
            computed = seq.computed = seq.computed + k
            need = (computed + bs - 1) // bs - seq.blocks
            if need > 0:
                seq.blocks += need
                grown += need
            if seq.remaining == 0:
                done.append(seq)
        engine._take(grown)
        if counting_first:
            for kind, n in enumerate(cont_kind):
                if n:
                    hists[kind].add(first * tau, n / tau)
        if k > 1:
            c = engine.profile.decode.per_ctx_token_s * span.batch * span.slow
            points = range(1, k) if k - 1 <= ITL_SPAN_SAMPLES else \
                [1 + round((k - 2) * j / (ITL_SPAN_SAMPLES - 1)) for j in range(ITL_SPAN_SAMPLES)]
            share = (k - 1) / len(points)
            for j in points:
                if start + engine._span_time(span, j + 1) >= self.itl_from_s:
                    gap = first + c * j
                    for kind, n in enumerate(per_kind):
                        if n:
                            hists[kind].add(gap * tau, n * share / tau)
        return done

    def finish(self, rid: int, t: float) -> None:
        self.finish_s[rid] = t

    # ------------------------------------------------------------------------------- summary

    def summarize(self, duration_s: float, overhead_s: float = 0.0, slo_ttft_ms: float | None = None,
                  slo_tpot_ms: float | None = None, since_s: float = -math.inf) -> dict[str, Any]:
        """The requests that arrived from `since_s` on (all of them, as a rule), over `duration_s`."""
        counted = np.array(self.arrival) >= since_s
        summary = self._summary(np.nonzero(counted)[0], self._merged(range(len(self.kinds))), duration_s,
                                overhead_s, slo_ttft_ms, slo_tpot_ms)
        kinds = sorted(set(self.kind))
        if len(kinds) > 1:
            kind_arr = np.array(self.kind)
            summary["by_kind"] = {self.kinds[k]: self._summary(np.nonzero(counted & (kind_arr == k))[0],
                                                               self.hists[k], duration_s, overhead_s, slo_ttft_ms,
                                                               slo_tpot_ms)
                                  for k in kinds}
        return summary

    def by_window(self, window_s: float, overhead_s: float, slo_ttft_ms: float,
                  slo_tpot_ms: float) -> list[list[float]]:
        """[window start s, requests, % meeting TTFT, % meeting TPOT, % meeting both] per `window_s` of
        arrivals: where in a run the misses are (a scaled fleet: as the load turns, say). A request
        that did not finish meets neither."""
        arrival, first, finish = (np.array(x) for x in (self.arrival, self.first_s, self.finish_s))
        out = np.array(self.output)
        done = finish >= 0
        ttft_ok = done & ((first - arrival + overhead_s) * 1e3 <= slo_ttft_ms)
        tpot = np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), 0.0)
        tpot_ok = done & (tpot * 1e3 <= slo_tpot_ms)
        which = np.floor(arrival / window_s).astype(int)
        n = np.bincount(which)
        met = [np.bincount(which, weights=ok) for ok in (ttft_ok, tpot_ok, ttft_ok & tpot_ok)]
        return [[float(w * window_s), int(n[w]), *(round(100.0 * float(m[w]) / n[w], 3) for m in met)]
                for w in np.nonzero(n)[0]]

    def _merged(self, kinds) -> ItlHistogram:
        h = ItlHistogram()
        for k in kinds:
            h.merge(self.hists[k])
        return h

    def _summary(self, idx: np.ndarray, hist: ItlHistogram, duration_s: float, overhead_s: float,
                 slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
        arrival = np.array(self.arrival)[idx]
        first, finish = np.array(self.first_s)[idx], np.array(self.finish_s)[idx]
        out_tok, in_tok = np.array(self.output)[idx], np.array(self.prompt)[idx]
        done = finish >= 0
        ttft = (first - arrival + overhead_s)[done]
        e2el = (finish - arrival + overhead_s)[done]
        multi = done & (out_tok > 1)
        tpot = (finish - first)[multi] / (out_tok[multi] - 1)
        duration = max(duration_s, 1e-9)
        n_done = int(done.sum())
        outs, ins = int(out_tok[done].sum()), int(in_tok[done].sum())
        s: dict[str, Any] = {
            "sent": len(idx), "completed": n_done, "failed": len(idx) - n_done, "failures": {},
            "duration_s": duration_s, "total_input_tokens": ins, "total_output_tokens": outs,
            "output_tokens_of_failed": 0, "request_throughput": n_done / duration,
            "output_throughput": outs / duration, "total_token_throughput": (ins + outs) / duration,
            "ttft_ms": _distribution(ttft), "tpot_ms": _distribution(tpot), "itl_ms": hist.spread(self.itl_shape).summary_ms(),
            "e2el_ms": _distribution(e2el), "goodput": None,
        }
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            ok = np.ones(n_done, dtype=bool)
            if slo_ttft_ms is not None:
                ok &= ttft * 1e3 <= slo_ttft_ms
            if slo_tpot_ms is not None:
                tp = np.zeros(n_done)
                tp[(out_tok[done] > 1)] = tpot
                ok &= tp * 1e3 <= slo_tpot_ms
            s["slo_attainment"] = {
                "ttft_pct": 100.0 * float((ttft * 1e3 <= slo_ttft_ms).mean()) if slo_ttft_ms is not None and n_done else None,
                "tpot_pct": 100.0 * float((tpot * 1e3 <= slo_tpot_ms).sum() + (n_done - tpot.size)) / n_done
                if slo_tpot_ms is not None and n_done else None}
            good = int(ok.sum())
            s["goodput"] = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "good": good,
                            "request_goodput": good / duration,
                            "attainment_pct": 100.0 * good / len(idx) if len(idx) else None}
        return s


def _distribution(values_s: np.ndarray) -> dict[str, float] | None:
    if values_s.size == 0:
        return None
    ms = values_s * 1e3
    out = {"n": int(ms.size), "mean": float(ms.mean()), "min": float(ms.min())}
    out |= {f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}
    out["max"] = float(ms.max())
    return out
