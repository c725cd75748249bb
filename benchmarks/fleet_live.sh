#!/bin/bash
# The issue's live scenario on processes: `kvtop sim` (4 instances, h20, speed 10), `kvtop route`
# over two of them with KV events, the bundled agentic trace replayed at speed 10; mid-run
# `kvtop fleet add` the other two, drain i0 (--wait), remove it. Prints the fleet changes, what
# reached i0 after its drain, the sessions' moves, the counters and the client's errors.
# Then re-simulates the recorded run from its log (kvtop simulate --from-db, the fleet changes
# replayed; fitted time scale and --speed 10, the sim's) and prints its closeness check.
# Usage: benchmarks/fleet_live.sh [OUT_DIR]   (ports 18000, 18100-18103, 18200-18207; about 60 s)
# BASELINE=1: no fleet change (STATIC4=1: the router over all four from the start).
set -u
cd "$(dirname "$0")/.."
D=${1:-/tmp/kvtop-fleet-live}; rm -rf "$D"; mkdir -p "$D/state"
B=18100; K=18200
echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
timeout 400 kvtop sim --instances 4 --port-base $B --kv-events-port-base $K --profile h20 --speed 10 \
    --duration 380 > "$D/sim.log" 2>&1 &
SIM=$!
# wait for what was started rather than for a fixed time: on a loaded host the sim took over 4 s
up() { for _ in $(seq 600); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "not up: $1"; return 1; }
for k in 0 1 2 3; do up http://127.0.0.1:$((B+k))/health; done
be() { echo "i$1=http://127.0.0.1:$((B+$1))@kv=tcp://127.0.0.1:$((K+2*$1))@kv-replay=tcp://127.0.0.1:$((K+2*$1+1))"; }
EXTRA=(); [ -n "${STATIC4:-}" ] && EXTRA=(--backend "$(be 2)" --backend "$(be 3)")
timeout 380 kvtop route --backend "$(be 0)" --backend "$(be 1)" "${EXTRA[@]}" --port 18000 --db "$D/kvtop.db" \
    --state-dir "$D/state" > "$D/route.log" 2>&1 &
ROUTE=$!
up http://127.0.0.1:18000/health
timeout 360 kvtop replay kvtop/data/sample_trace.jsonl.gz --target http://127.0.0.1:18000 --speed 10 \
    --out "$D/results.jsonl" --no-progress > "$D/replay.log" 2>&1 &
REPLAY=$!
F="kvtop fleet --state-dir $D/state --router http://127.0.0.1:18000"
sleep 3
if [ -z "${BASELINE:-}" ]; then
    $F add "$(be 2)"; $F add "$(be 3)"
    sleep 2
    $F list
    $F drain i0 --wait 120
    $F remove i0
    $F list
fi
wait $REPLAY
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
curl -s http://127.0.0.1:18000/kvtop/v1/state > "$D/state.json"
kill $ROUTE; wait $ROUTE; kill $SIM; wait $SIM
grep -E "unhealthy|healthy again" "$D/route.log"
python3 - "$D" <<'PY'
import json, sqlite3, sys
from collections import Counter
d = sys.argv[1]
db = sqlite3.connect(f"{d}/kvtop.db")
ev = db.execute("SELECT ts, before, after FROM config_events WHERE kind = 'fleet' ORDER BY ts").fetchall()
for ts, before, after in ev:
    print("config_event fleet", before, "->", after[:80])
res = [json.loads(line) for line in open(f"{d}/results.jsonl")][1:]
print("client requests", len(res), "errors", sum(1 for r in res if r.get("error")),
      Counter(str(r["error"])[:70] for r in res if r.get("error")))
st = json.load(open(f"{d}/state.json"))
print("counters", {k: st["totals"][k] for k in ("num_requests", "pending_prefill_tokens", "decode_requests",
                                                  "decode_tokens", "in_flight")})
drains = [ts for ts, _, after in ev if '"draining"' in after]
if drains:
    t = drains[0]
    print("decisions to i0 after its drain:", db.execute(
        "SELECT count(*) FROM decisions WHERE (instance = 'i0' OR prefill_instance = 'i0') AND ts > ?", (t,)).fetchone()[0])
    print("i0 requests finished after the drain:", db.execute(
        "SELECT count(*), group_concat(DISTINCT o.status) FROM outcomes o JOIN decisions d ON o.request_id = d.request_id "
        "AND o.attempt = d.attempt WHERE d.instance = 'i0' AND o.t_done > ?", (t,)).fetchone())
    before, after = {}, {}
    for s, ts, inst in db.execute("SELECT session_id, ts, instance FROM decisions WHERE attempt = 1 ORDER BY ts"):
        (before if ts <= t else after).setdefault(s, []).append(inst)
    homed = [s for s, seq in before.items() if seq[-1] == "i0"]
    back = [s for s in homed if s in after]

    def moves(seq):
        prev, n = "i0", 0
        for x in seq:
            n, prev = n + (x != prev), x
        return n
    print(f"sessions homed on i0 at the drain: {len(homed)}; came back: {len(back)}; "
          f"instance changes after the drain per returning session: {dict(Counter(moves(after[s]) for s in back))}")
PY
for speed in "" "--speed 10"; do
    echo "re-simulated from the log ${speed:-(time scale fitted)}:"
    kvtop simulate --from-db "$D/kvtop.db" --profile h20 $speed 2>/dev/null | grep -E "^(recorded|sim) |^validation|fleet changes replayed"
done
