"""The SQLite schema of the decision log: one file, five tables, WAL.

``runs``           one row per router start (its config and backends)
``decisions``      one row per routing decision (a retry is a second decision, ``attempt`` 2)
``outcomes``       one row per routed request attempt: how it ended, and its latencies
``config_events``  every policy or knob change and health transition, with before and after
``samples``        periodic per-instance state (backlog, decode load, hit rates, KV, GPU)

Columns are listed here once; the writer and the queries read them from this module.
JSON columns hold JSON text. Times are Unix seconds (``ts``) or milliseconds (``*_ms``).
"""

from __future__ import annotations

import sqlite_utils

#: 2: decisions gained shadows (router/shadow.py) and blocks/blocks_parent (store/chains.py).
#: 3: decisions gained estimate_hit_tokens (the estimate's drift from the KV events).
#: 4: decisions gained estimated_input_tokens (a turn routed before its new text was counted).
#: 5: decisions gained priority (the vLLM priority the router set, router/priority.py).
#: 6: samples gained engine_prefix_queries/engine_prefix_hits (the engine's cumulative counters,
#:    so the log's APC is token-weighted: store/arms.py).
SCHEMA_VERSION = 6

# table -> ordered {column: sqlite type}
TABLES: dict[str, dict[str, type]] = {
    "runs": {
        "run_id": str,
        "started_at": float,
        "ended_at": float,
        "host": str,
        "port": int,
        "policy": str,
        "backends": str,  # JSON list of {name, url, gpu}
        "config": str,  # JSON of the validated router config
        "argv": str,
        "kvtop_version": str,
        "schema_version": int,
    },
    "decisions": {
        "id": int,
        "run_id": str,
        "ts": float,
        "request_id": str,
        "attempt": int,
        "session_id": str,
        "session_source": str,  # header | body_session_id | user | first_block
        "turn": int,
        "policy": str,
        "policy_version": int,
        "instance": str,
        "instance_index": int,
        "reason": str,
        "route_class": str,
        "input_tokens": int,
        "token_source": str,  # tokens | tokenizer | text_approx
        "est_hit_tokens": int,
        "best_hit_tokens": int,
        "best_hit_instance": str,
        "new_prefill_tokens": int,
        "offload": int,  # 1 when the prefill ran on another instance
        "prefill_instance": str,
        "offload_reason": str,
        "migrated_from": str,
        "admission_wait_ms": float,
        "decision_us": float,
        "t_proxy_recv": float,
        "t_prefill_sent": float,
        "t_prefill_done": float,
        "scores": str,  # JSON list: each candidate's score terms
        "index_source": str,  # exact (the instance's KV events) | estimate (the router's model)
        # with index_source exact: the hit the router's own estimate (its LRU model) gave the
        # chosen instance, so |est_hit_tokens - estimate_hit_tokens| is the estimate's drift;
        # NULL when the hit came from the estimate (and in files written before it existed)
        "estimate_hit_tokens": int,
        # a returning turn routed before its new text was tokenized (router/parsing.py): the
        # size the policy saw (the shared prefix counted, the new text estimated); input_tokens
        # is the counted size. NULL when the policy saw the counted size.
        "estimated_input_tokens": int,
        # the vLLM ``priority`` the router set on the request (the ``priority`` feature,
        # router/priority.py); NULL when it set none (feature off, or the client set its own)
        "priority": int,
        "shadows": str,  # JSON list: each shadow policy's pick (router/shadow.py); NULL: none on
        # the prompt's block-hash chain, against its session's previous row (store/chains.py),
        # for what-if replay; first attempts only
        "blocks": str,
        "blocks_parent": str,
    },
    "outcomes": {
        "id": int,
        "run_id": str,
        "ts": float,
        "request_id": str,
        "attempt": int,
        "instance": str,
        "stream": int,
        "status": str,  # ok | error | upstream_error | client_gone | timeout
        "http_status": int,
        "error": str,
        "ttft_ms": float,
        "e2e_ms": float,
        "tpot_ms": float,
        "output_tokens": int,
        "delivered_hit_tokens": int,
        # ttft_ms and e2e_ms count from t_recv, the router's receipt of the request: the
        # admission wait and the offload prefill leg are inside them, and on their own here
        "t_recv": float,
        "t_first_token": float,
        "t_done": float,
        "admission_wait_ms": float,
        "prefill_leg_ms": float,
        # Copied from the attempt's decision when the router writes the outcome, so per-segment
        # questions (kvtop log summary, kvtop report --db) read one table, not a 1M-row join.
        # NULL in files written before they existed: the queries then join the decision.
        "session_id": str,
        "turn": int,
        "policy": str,
        "policy_version": int,
        "route_class": str,
        "input_tokens": int,
        "est_hit_tokens": int,
    },
    "config_events": {
        "id": int,
        "run_id": str,
        "ts": float,
        "kind": str,  # policy | knobs | health | run
        "who": str,
        "policy_version": int,
        "before": str,  # JSON
        "after": str,  # JSON
    },
    "samples": {
        "id": int,
        "run_id": str,
        "ts": float,
        "instance": str,
        "healthy": int,
        "num_requests": int,
        "pending_prefill_tokens": int,
        "decode_requests": int,
        "decode_tokens": int,
        "est_hit_rate": float,
        "engine_hit_rate": float,
        "engine_prefix_queries": float,  # the engine's cumulative prefix-cache counters, in tokens
        "engine_prefix_hits": float,
        "kv_usage": float,
        "gpu_util": float,
        "gpu_mem_used": float,
    },
}

#: Outcome columns copied from the attempt's decision row when the outcome is written.
OUTCOME_DECISION_COLUMNS = ("session_id", "turn", "policy", "policy_version", "route_class",
                            "input_tokens", "est_hit_tokens")

PRIMARY_KEYS = {"runs": "run_id", "decisions": "id", "outcomes": "id", "config_events": "id", "samples": "id"}

#: Columns whose values the writer serializes to JSON text.
JSON_COLUMNS = {"runs": ("backends", "config"), "decisions": ("scores", "shadows"),
                "config_events": ("before", "after")}

INDEXES: list[tuple[str, list[str]]] = [
    ("decisions", ["run_id", "ts"]),
    ("decisions", ["request_id"]),
    ("decisions", ["session_id"]),
    ("decisions", ["instance"]),
    ("decisions", ["reason"]),
    ("decisions", ["policy", "policy_version"]),
    ("outcomes", ["request_id"]),
    ("outcomes", ["run_id", "ts"]),
    # A segment's ok latencies in order: percentiles by walking the index (log summary) or
    # the column loaded already sorted (report --db). The trailing hit columns make it cover
    # the summary's per-segment sums too.
    ("outcomes", ["run_id", "policy", "policy_version", "status", "ttft_ms",
                  "delivered_hit_tokens", "est_hit_tokens"]),
    ("outcomes", ["run_id", "policy", "policy_version", "status", "e2e_ms"]),
    # kvtop report --db: TPOT in order; counts and TTFT in order per route class; requests
    # and delivered hits per instance. Each a covering pass, no sort.
    ("outcomes", ["run_id", "policy", "policy_version", "status", "tpot_ms"]),
    ("outcomes", ["run_id", "policy", "policy_version", "status", "route_class", "ttft_ms"]),
    ("outcomes", ["run_id", "policy", "policy_version", "instance", "status",
                  "delivered_hit_tokens", "input_tokens", "e2e_ms", "tpot_ms"]),
    ("config_events", ["run_id", "ts"]),
    ("samples", ["run_id", "ts"]),
]


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Create missing tables and indexes, and turn on WAL. Safe to call on an existing file."""
    db.enable_wal()
    for name, columns in TABLES.items():
        if not db[name].exists():
            db[name].create(columns, pk=PRIMARY_KEYS[name])
        else:
            # Add columns that a newer kvtop knows of, so old files stay readable.
            existing = set(db[name].columns_dict)
            for col, typ in columns.items():
                if col not in existing:
                    db[name].add_column(col, typ)
    for table, cols in INDEXES:
        db[table].create_index(cols, if_not_exists=True)
