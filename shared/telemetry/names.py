"""Prometheus metric names: a contract (DESIGN.md), defined once. The gateway's /metrics exports
them all, the workers' and the kvstore's labelled by service and instance."""

TTFT = "pdserve_time_to_first_token_seconds"
ITL = "pdserve_inter_token_latency_seconds"
E2E = "pdserve_e2e_request_latency_seconds"
KV_TRANSFER = "pdserve_kv_transfer_seconds"
KV_BLOCKS_IN_USE = "pdserve_kv_blocks_in_use"
PREFIX_QUERIES = "pdserve_prefix_cache_queries_total"
PREFIX_HITS = "pdserve_prefix_cache_hits_total"
REQUESTS_RUNNING = "pdserve_requests_running"
REQUESTS_WAITING = "pdserve_requests_waiting"
REQUESTS_TOTAL = "pdserve_requests_total"
# speculative decoding (vLLM's names, with pdserve's prefix)
SPEC_DRAFTS = "pdserve_spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "pdserve_spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "pdserve_spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "pdserve_spec_decode_num_accepted_tokens_per_pos_total"

CONTRACT_NAMES = (TTFT, ITL, E2E, KV_TRANSFER, KV_BLOCKS_IN_USE, PREFIX_QUERIES, PREFIX_HITS, REQUESTS_RUNNING,
                  REQUESTS_WAITING)
