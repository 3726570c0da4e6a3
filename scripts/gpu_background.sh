#!/usr/bin/env bash
# GPU work longer than one command on a lent host (10 minutes there): scripts/gpu_bench.sh STAGE... started in a
# process session of its own, so that it runs on after the command that started it, and followed by later commands on
# the same host. Such a host is given back once it idles between commands (30 s), the job with it: send the next
# `wait` at once.
# Usage:
#   scripts/gpu_background.sh start STAGE...  start the stages and return (the environment passes through: RACE_ARGS,
#                                             SWEEP_ARGS, ...); refused while an earlier start still runs (an
#                                             ended one's files are moved to BACKGROUND_DIR.previous)
#   scripts/gpu_background.sh wait SECONDS    follow it for at most SECONDS (returning as soon as it ends), print the
#                                             log lines it wrote since the last wait, and copy the files it wrote
#                                             into $OUT so far (background.status holds its exit status once it has
#                                             ended); exits 0 once it has ended, 3 while it runs, 2 if none started
#   scripts/gpu_background.sh stop            stop it and every process it started (SIGTERM, SIGKILL after
#                                             STOP_GRACE_S, default 30)
# Its files under BACKGROUND_DIR (default /tmp/asyncrl-background): pid, log, status, and out/ (the stages' OUT).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH="${GPU_BENCH:-$ROOT/scripts/gpu_bench.sh}"  # what `start` runs; a stand-in in the tests
DIR="${BACKGROUND_DIR:-/tmp/asyncrl-background}"
POLL_S=2  # how often `wait` looks whether the job has ended

running() {
    [ -f "$DIR/pid" ] && [ ! -f "$DIR/status" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null
}

start() {
    if running; then
        echo "gpu_background: a job started earlier still runs (pid $(cat "$DIR/pid")): wait for it or stop it" >&2
        exit 1
    fi
    # the job before (ended) is kept aside, in case a wait never copied its files out
    rm -rf "$DIR.previous" && { [ ! -d "$DIR" ] || mv "$DIR" "$DIR.previous"; } && mkdir -p "$DIR/out"
    # setsid: a session of its own, which the host's end of a command leaves running; its status written when it ends
    setsid bash -c 'cd "$1" && OUT="$2/out" bash "$3" "${@:4}" > "$2/log" 2>&1 < /dev/null; echo $? > "$2/status"' \
        background "$ROOT" "$DIR" "$BENCH" "$@" > /dev/null 2>&1 &
    echo $! > "$DIR/pid"
    echo "gpu_background: started $* (pid $!), log $DIR/log"
}

follow() {
    local seconds="$1" deadline shown
    [ -f "$DIR/pid" ] || { echo "gpu_background: nothing was started (no $DIR/pid)" >&2; exit 2; }
    deadline=$(( $(date +%s) + seconds ))
    while running && [ "$(date +%s)" -lt "$deadline" ]; do sleep "$POLL_S"; done
    shown=$(cat "$DIR/shown" 2>/dev/null || echo 0)  # log bytes printed by earlier waits
    tail -c "+$(( shown + 1 ))" "$DIR/log" 2>/dev/null
    wc -c < "$DIR/log" > "$DIR/shown" 2>/dev/null
    collect
    if running; then
        echo "gpu_background: still running after ${seconds}s"
        exit 3
    fi
    echo "gpu_background: ended with status $(cat "$DIR/status" 2>/dev/null || echo unknown)"
}

collect() {
    # what the stages wrote so far, into this command's OUT (a host sends back only files under it)
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT" && cp -r "$DIR/out/." "$OUT/" 2>/dev/null
    cp "$DIR/status" "$OUT/background.status" 2>/dev/null
    return 0
}

stop() {
    [ -f "$DIR/pid" ] || { echo "gpu_background: nothing was started" >&2; exit 2; }
    local session waited=0
    session=$(cat "$DIR/pid")
    pkill -TERM -s "$session" 2>/dev/null  # every process of its session: the stages' own process groups too
    while pgrep -s "$session" > /dev/null && [ "$waited" -lt "${STOP_GRACE_S:-30}" ]; do sleep 1; waited=$(( waited + 1 )); done
    pkill -KILL -s "$session" 2>/dev/null
    echo "gpu_background: stopped (pid $session)"
}

case "${1:-}" in
    start) shift; [ $# -gt 0 ] || { echo "usage: $0 start STAGE..." >&2; exit 2; }; start "$@" ;;
    wait) [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "usage: $0 wait SECONDS" >&2; exit 2; }; follow "$2" ;;
    stop) stop ;;
    *) echo "usage: $0 start STAGE... | wait SECONDS | stop" >&2; exit 2 ;;
esac
