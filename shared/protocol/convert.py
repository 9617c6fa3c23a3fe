"""Between wire structs and engine types."""

from __future__ import annotations

import msgspec

from shared.model import sampling_params
from shared.model.sampling_params import SamplingParams
from shared.protocol.messages import ConstraintMsg, SamplingMsg, TokenLogprobs


def to_params(msg: SamplingMsg, *, num_resumed: int = 0) -> SamplingParams:
    """Engine parameters for a request that already streamed `num_resumed` tokens (validated: a
    bad value raises ValueError naming it)."""
    fields = msgspec.structs.asdict(msg)
    fields["max_tokens"] = msg.max_tokens - num_resumed
    fields["min_tokens"] = max(0, msg.min_tokens - num_resumed)
    c = msg.constraint
    fields["constraint"] = None if c is None else sampling_params.Constraint(c.kind, c.spec, tuple(c.choices))
    return SamplingParams(**fields)


def to_msg(params: SamplingParams) -> SamplingMsg:
    fields = {f: getattr(params, f) for f in SamplingMsg.__struct_fields__}
    return SamplingMsg(**fields | {"stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids),
                                   "logit_bias": dict(params.logit_bias),
                                   "constraint": None if (c := params.constraint) is None
                                   else ConstraintMsg(kind=c.kind, spec=c.spec, choices=list(c.choices))})


def logprobs_msg(logprobs: list[sampling_params.TokenLogprobs] | None) -> list[TokenLogprobs]:
    return [TokenLogprobs(lp.logprob, lp.top_ids, lp.top_logprobs) for lp in logprobs or []]
