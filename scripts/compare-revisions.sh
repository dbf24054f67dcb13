#!/usr/bin/env bash
# Builds two revisions of tracer and compares every figure they print on the committed
# recordings (scripts/outputs.sh): a refactor must change none.
#
# usage: scripts/compare-revisions.sh BEFORE [AFTER]     (AFTER: the work tree)
#
# Each revision is checked out in a git worktree under target/compare/ and built there with
# a target folder of its own (kept, so that a second comparison builds only what changed).
# Prints each file that differs with its first lines of difference; exits 1 if any does.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
base=$here/target/compare
mkdir -p "$base"

# The tracer binary of revision $1 (empty: the work tree).
build() {
    local rev=$1 dir
    if [ -z "$rev" ]; then
        dir=$here
    else
        dir=$base/src-$(git -C "$here" rev-parse --short "$rev")
        if [ ! -d "$dir" ]; then
            git -C "$here" worktree add --detach "$dir" "$rev" >/dev/null
        fi
    fi
    (cd "$dir" && cargo build --release -p tracer-cli >&2)
    echo "$dir/target/release/tracer"
}

before=$(build "$1")
after=$(build "${2:-}")
rm -rf "$base/before" "$base/after"
TRACER_SHARED=$here/../shared bash "$here/scripts/outputs.sh" "$before" "$base/before"
TRACER_SHARED=$here/../shared bash "$here/scripts/outputs.sh" "$after" "$base/after"
if diff -rq "$base/before" "$base/after" >/dev/null; then
    echo "every output equal: $(find "$base/before" -type f | wc -l) files"
    exit 0
fi
for f in $(diff -rq "$base/before" "$base/after" | awk '{print $2}'); do
    rel=${f#"$base"/before/}
    echo "== $rel differs"
    diff "$base/before/$rel" "$base/after/$rel" | head -8 || true
done
exit 1
