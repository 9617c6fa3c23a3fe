"""Which grammar engine for structured output: llguidance vs outlines-core (vs xgrammar where installed),
on this machine's CPU, this model's vocabulary and the 34 JSON schemas of the structured-output tests.

For each library and schema: does it compile the schema (coverage), how long the compile takes, and
the time to compute the next-token mask at every position of a valid document, which is the cost
paid per decoded token; and whether it accepts the document's tokens (correctness). The documents
are the real model's greedy answers under llguidance's constraint, each validated by `jsonschema`
first, so no library is judged by its own output alone.

    .venv/bin/python benchmarks/bench_grammar_libs.py [--json PATH]

outlines-core and xgrammar are measured where installed (`pip install outlines-core xgrammar`;
neither is a pdserve dependency, and xgrammar pulls transformers and triton).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.config import EngineConfig, SpecConfig  # noqa: E402
from shared.engine.engine import LLMEngine  # noqa: E402
from shared.model.chat_template import render_chat  # noqa: E402
from shared.model.grammar import GrammarCompiler  # noqa: E402
from shared.model.sampling_params import Constraint, SamplingParams  # noqa: E402
from tests.data.json_schemas import SCHEMAS  # noqa: E402


def documents(engine: LLMEngine) -> list[tuple[str, dict, list[int]]]:
    tok = engine.tokenizer
    prompts = [tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": q + " Answer in JSON."}]),
                          add_special_tokens=False) for _, q, _ in SCHEMAS]
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=200,
                                                    constraint=Constraint("json", json.dumps(s)))
                                     for _, _, s in SCHEMAS])
    docs = []
    for (name, _, schema), out in zip(SCHEMAS, outs):
        jsonschema.validate(json.loads(out.text), schema)  # the reference check, independent of any library
        ids = [t for t in out.new_token_ids if t not in tok.stop_token_ids]
        docs.append((name, schema, ids))
    return docs


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        self.compiler = GrammarCompiler(tokenizer, vocab)
        self.compiler.ll_tokenizer  # the vocabulary index, once

    def compile(self, schema: dict):
        return self.compiler.matcher(Constraint("json", json.dumps(schema)))

    def walk(self, matcher, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        for t in ids:
            t0 = time.perf_counter()
            allowed = matcher.allowed()
            times.append(time.perf_counter() - t0)
            if not allowed[t] or not matcher.accept(t):
                return times, False
        return times, True


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int):
        from outlines_core import Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
        self.build_regex = build_regex_from_schema
        pieces: dict[bytes, list[int]] = {}
        eos = min(tokenizer.stop_token_ids)
        for i in range(tokenizer.vocab_size):
            if i not in tokenizer.all_special_ids:
                pieces.setdefault(tokenizer.token_bytes(i), []).append(i)
        self.vocabulary = Vocabulary(eos, pieces)
        self.vocab = vocab

    def compile(self, schema: dict):
        from outlines_core import Guide, Index
        # the separators pdserve writes: ", " and ": " (outlines' regex allows an optional space)
        return Guide(Index(self.build_regex(json.dumps(schema), r"[ ]?"), self.vocabulary))

    def walk(self, guide, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        mask = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)
        for t in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            allowed = ((mask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:self.vocab].bool()
            times.append(time.perf_counter() - t0)
            if not allowed[t]:
                return times, False
            guide.advance(t)
        return times, True


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar as xgr
        self.xgr = xgr
        encoded = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab,
                                 stop_token_ids=sorted(tokenizer.stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(", ", ": "))
        return self.xgr.GrammarMatcher(compiled)

    def walk(self, matcher, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            allowed = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:self.vocab].bool()
            times.append(time.perf_counter() - t0)
            if not allowed[t] or not matcher.accept_token(t):
                return times, False
        return times, True


def measure(lib, docs) -> dict:
    compiled, compile_ms, mask_us, accepted, failures = 0, [], [], 0, []
    for name, schema, ids in docs:
        try:
            t0 = time.perf_counter()
            state = lib.compile(schema)
            compile_ms.append((time.perf_counter() - t0) * 1e3)
        except Exception as exc:  # noqa: BLE001 - an unsupported schema is a result
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        compiled += 1
        times, ok = lib.walk(state, ids)
        mask_us += [t * 1e6 for t in times]
        accepted += ok
        if not ok:
            failures.append(f"{name}: rejected a valid document")
    q = statistics.quantiles(mask_us, n=100) if len(mask_us) > 1 else [0.0] * 99
    return {"library": lib.name, "schemas": len(docs), "compiled": compiled, "accepted": accepted,
            "compile_ms_p50": statistics.median(compile_ms) if compile_ms else None,
            "compile_ms_max": max(compile_ms) if compile_ms else None,
            "mask_us_mean": statistics.fmean(mask_us) if mask_us else None, "mask_us_p99": q[98],
            "tokens": len(mask_us), "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine.from_config(EngineConfig(num_kv_blocks=1024, speculative=SpecConfig(mode="off")))
    docs = documents(engine)
    vocab = engine.model.config.vocab_size
    libs = [Llguidance]
    try:
        import outlines_core  # noqa: F401
        libs.append(OutlinesCore)
    except ImportError:
        print("outlines-core not installed: pip install outlines-core")
    try:
        import xgrammar  # noqa: F401
        libs.append(XGrammar)
    except ImportError:
        print("xgrammar not installed (it pulls transformers and triton): not measured")
    results = []
    for cls in libs:
        t0 = time.perf_counter()
        lib = cls(engine.tokenizer, vocab)
        setup = time.perf_counter() - t0
        r = measure(lib, docs) | {"setup_s": setup}
        results.append(r)
        print(f"{r['library']:14s} setup {setup:5.2f} s  compiled {r['compiled']}/{r['schemas']}  "
              f"accepted {r['accepted']}  compile p50 {r['compile_ms_p50']:.1f} ms max {r['compile_ms_max']:.0f} ms  "
              f"mask {r['mask_us_mean']:.0f} µs mean, {r['mask_us_p99']:.0f} µs p99 over {r['tokens']} tokens")
        for f in r["failures"]:
            print("   ", f)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
