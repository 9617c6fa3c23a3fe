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

# cost accounting (services/gateway/cost.py): per request, summed at the gateway
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
GENERATION_TOKENS = "pdserve_generation_tokens_total"
PREFILL_SECONDS = "pdserve_prefill_seconds_total"
DECODE_SECONDS = "pdserve_decode_seconds_total"
PREFILL_CORE_SECONDS = "pdserve_prefill_core_seconds_total"  # × each step's threads (GPU: 1); priced
DECODE_CORE_SECONDS = "pdserve_decode_core_seconds_total"
KV_TRANSFER_BYTES = "pdserve_kv_transfer_bytes_total"
COST = "pdserve_cost_total"  # {phase="prefill"|"decode"|"kv_transfer", currency}
ROUTER_JOBS = "pdserve_router_jobs_total"  # {pool, worker, reason}: where the router sent each job, and why
ROUTER_CACHED_TOKENS = "pdserve_router_expected_cached_tokens_total"  # prompt tokens it expected cached there
MIGRATIONS = "pdserve_migrations_total"  # requests resubmitted after their worker died or hung
ENGINE_BUSY = "pdserve_engine_busy_seconds_total"  # per worker: step time, all of it charged to requests
ENGINE_BUSY_CORE = "pdserve_engine_busy_core_seconds_total"
# OpenTelemetry GenAI server metrics, in Prometheus form (dots → underscores, unit suffix)
GENAI_TTFT = "gen_ai_server_time_to_first_token_seconds"
GENAI_TPOT = "gen_ai_server_time_per_output_token_seconds"
GENAI_DURATION = "gen_ai_server_request_duration_seconds"
# the GenAI semantic conventions' advised bucket boundaries
GENAI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GENAI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GENAI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

CONTRACT_NAMES = (TTFT, ITL, E2E, KV_TRANSFER, KV_BLOCKS_IN_USE, PREFIX_QUERIES, PREFIX_HITS, REQUESTS_RUNNING,
                  REQUESTS_WAITING)
