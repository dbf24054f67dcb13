#!/usr/bin/env bash
# Every figure a tracer binary prints on the committed recordings, one file per command and
# recording, so that two revisions' can be compared (scripts/compare-revisions.sh).
#
# usage: scripts/outputs.sh TRACER OUT_DIR
#
# The recordings: ../shared/snapshots (real PyTorch memory snapshots, imported), the H200
# recordings (tests/data/gpu-h200) and a traced incident demo (tests/data/demo-incident.db.gz).
# Output that names the database's temporary path or the time of writing is normalized.
set -euo pipefail

tracer=$(realpath "$1")
out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
shared=${TRACER_SHARED:-$here/../shared}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Each recording as a database of its own, named by what it holds.
dbs=()
for gz in "$here"/tests/data/gpu-h200/trace-*.db.gz "$here"/tests/data/demo-incident.db.gz; do
    name=$(basename "$gz" .db.gz)
    gzip -dc "$gz" >"$work/$name.db"
    dbs+=("$name")
done
for snap in "$shared"/snapshots/*.pickle; do
    name=snapshot-$(basename "$snap" .pickle)
    "$tracer" import --snapshot "$snap" --db "$work/$name.db" >/dev/null 2>&1
    dbs+=("$name")
done

normalize() {
    sed -e "s#$work#DB_DIR#g" -e "s#$tracer#TRACER#g" -e 's#"generated_[a-z_]*": *[0-9"][^,}]*#"generated": X#g'
}

run() {
    local name=$1 what=$2
    shift 2
    { "$tracer" "$@" 2>&1 || echo "exit $?"; } | normalize >"$out/$name.$what"
}

mcp_session() {
    local db=$1
    {
        echo '{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2024-11-05","capabilities":{},"clientInfo":{"name":"outputs","version":"1"}}}'
        echo '{"jsonrpc":"2.0","method":"notifications/initialized"}'
        local id=1
        for tool in sessions explain layout whatif op_stats stacks; do
            echo "{\"jsonrpc\":\"2.0\",\"id\":$id,\"method\":\"tools/call\",\"params\":{\"name\":\"$tool\",\"arguments\":{}}}"
            id=$((id + 1))
        done
    } | "$tracer" mcp --db "$db" 2>/dev/null |
        # Answers come as each tool finishes: in the order asked.
        python3 -c 'import json, sys; print("".join(sorted(sys.stdin, key=lambda l: json.loads(l).get("id", -1))), end="")'
}

for name in "${dbs[@]}"; do
    db=$work/$name.db
    run "$name" explain.txt explain --db "$db"
    run "$name" explain.json explain --db "$db" --json
    run "$name" layout.json layout --db "$db" --json
    run "$name" layout-oom.json layout --db "$db" --json --at oom
    run "$name" whatif.json whatif --db "$db" --json
    run "$name" stacks.txt stacks --db "$db"
    mcp_session "$db" | normalize >"$out/$name.mcp.jsonl"
    "$tracer" report --db "$db" -o "$work/$name.html" >/dev/null 2>&1 || true
    normalize <"$work/$name.html" >"$out/$name.report.html" 2>/dev/null || true
    "$tracer" export --format perfetto --db "$db" -o "$work/$name.pftrace" >/dev/null 2>&1 || true
    sha256sum <"$work/$name.pftrace" >"$out/$name.perfetto.sha256" 2>/dev/null || true
    "$tracer" export --format pytorch-snapshot --db "$db" -o "$work/$name.pickle" 2>"$out/$name.snapshot.stderr" >/dev/null || true
    normalize <"$out/$name.snapshot.stderr" >"$out/$name.snapshot.txt" && rm "$out/$name.snapshot.stderr"
    sha256sum <"$work/$name.pickle" >"$out/$name.snapshot.sha256" 2>/dev/null || true
done
echo "outputs of ${#dbs[@]} recordings in $out" >&2
