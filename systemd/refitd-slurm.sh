#!/usr/bin/env bash
# refitd-slurm.sh: one refitd daemon per node of a Slurm allocation, for the length of a command.
#
#   refitd-slurm.sh [LAUNCHER OPTIONS] [REFITD SERVE FLAGS] -- COMMAND [ARGS...]
#   refitd-slurm.sh --on-node -- COMMAND [ARGS...]
#
# Run it inside an allocation (an sbatch script, or salloc). It
#   1. starts `refitd serve` on every node of the job as one step,
#        srun --overlap --ntasks-per-node=1 -N "$SLURM_JOB_NUM_NODES" ... refitd serve --runtime-dir DIR ...
#      each daemon in its own runtime dir BASE/refitd-<jobid>-<node> (so several emulated nodes on
#      one host, or two jobs on one node, never share one), listening on ipc://DIR/control.sock;
#   2. waits, up to --ready-timeout, until every daemon answers `refitd status` on its node (each
#      node's wrapper probes its own daemon and reports READY on the step's stdout; no shared file
#      system is needed), and fails naming the nodes that did not, or the daemon that exited;
#   3. prints one `REFITD_ENDPOINT_<node>=ipc://...` line per node (node names with characters
#      other than [A-Za-z0-9_] have them replaced by _), writes the same lines to --endpoints-file,
#      and exports to COMMAND
#        REFITD_ENDPOINT        this node's daemon (unset when the launcher runs off the allocation)
#        REFITD_ENDPOINTS       every daemon, `node=endpoint,node=endpoint,...`
#        REFITD_ENDPOINTS_FILE  the file of REFITD_ENDPOINT_<node>= lines
#   4. runs COMMAND on this node (in the background, waited for, so that signals are handled at
#      once; on INT or TERM it gets SIGTERM, and SIGKILL after --stop-timeout);
#   5. stops the daemons: `scancel --signal=TERM JOB.STEP` sends SIGTERM to every daemon (not
#      SIGTERM to srun, which srun turns into SIGKILL for its tasks), waits up to --stop-timeout
#      and reports each daemon's exit status. EXIT, INT and TERM are trapped, so a signal to this
#      script stops the daemons cleanly too.
#
# Cancelling: `scancel --batch --signal=TERM JOBID` (and sbatch --signal=B:TERM@120 before the
# time limit) stops the job cleanly when this script is the batch shell (`exec` it). A plain
# `scancel JOBID` signals the daemons and also the srun of the daemon step, which then SIGKILLs
# them: a daemon not done with its shutdown by then leaves its shared-memory segments
# (/dev/shm/refitd-*) behind. (Small daemons won that race in testing; large ones may not.)
#
# COMMAND usually starts the trainer and the engines with srun. Pass --overlap to every such srun
# (the daemon step holds its CPUs), and wrap per-node tasks in `refitd-slurm.sh --on-node --` so
# each one gets its own node's REFITD_ENDPOINT, not the batch node's:
#   srun --overlap -N2 --ntasks-per-node=4 refitd-slurm.sh --on-node -- python train.py
#
# Endpoints are ipc:// sockets, reachable from the same node only: trainer ranks and engines talk
# to the daemon of the node they run on. A tcp:// endpoint for clients on other nodes would need
# authentication (CURVE keys), which this launcher does not set up.
#
# Launcher options (everything else before `--` is passed to `refitd serve`, e.g. --hf-config,
# --world-size, --format, --config; not --runtime-dir or --listen, which the launcher sets; with
# --nodes N, a node's share of an engine spanning N nodes, each daemon also gets --node-rank
# $SLURM_NODEID unless the flags give one):
#   --runtime-base DIR     parent of the per-node runtime dirs, node-local (default /tmp)
#   --refitd PATH          the refitd executable on the nodes (default: refitd on PATH)
#   --ready-timeout SECS   give up when the daemons are not all ready by then (default 300)
#   --stop-timeout SECS    SIGKILL the daemon step when it has not stopped by then (default 60)
#   --endpoints-file PATH  where to write the REFITD_ENDPOINT_<node>= lines (default: a temporary
#                          file, removed at the end)
#   --srun-arg ARG         an extra option for the daemon step's srun (repeatable), e.g.
#                          --srun-arg=--cpus-per-task=8
#
# Exit status: COMMAND's, when every daemon stopped with 0; 1 when COMMAND succeeded but a daemon
# did not exit 0; 2 usage error; 69 the daemons did not all become ready (COMMAND not run);
# 128+N after signal N.
set -euo pipefail

PROG="refitd-slurm"
EXIT_USAGE=2
EXIT_UNAVAILABLE=69 # EX_UNAVAILABLE from sysexits.h
POLL_S=0.2

RUNTIME_BASE=/tmp
REFITD=refitd
READY_TIMEOUT_S=300
STOP_TIMEOUT_S=60
ENDPOINTS_FILE=
SRUN_ARGS=()
SERVE_ARGS=()
COMMAND=()

# state, for the EXIT trap
WORKDIR=
DAEMON_PID=
DAEMON_OUT=
NODES=()
CMD_PID=
CMD_RC=
REAPED=
SIGNALLED=

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    local code=$1
    shift
    log "$*"
    exit "$code"
}

# ------------------------------------------------------------------------------------------------
# on every node: the daemon step's task

# Runs `refitd serve` on this node and reports on stdout, one line each: `REFITD-START <node>
# <jobid.stepid>` at once, `REFITD-READY <node> <endpoint>` once the daemon answers STATUS,
# `REFITD-STOPPING <node> <signal>` when the step is signalled, `REFITD-EXIT <node> <status>` when
# the daemon is gone. The daemon's own output goes to stderr (srun labels it with the task index). It never signals the daemon
# itself: Slurm signals every process of the step, and a second SIGTERM would make refitd skip its
# clean shutdown. Shipped to the nodes with `declare -f`, so the script need not be on them.
refitd_node_daemon() { # BASE REFITD [SERVE ARGS...]
    set -u
    local base=$1 refitd=$2
    shift 2
    local node=${SLURMD_NODENAME:-$(hostname -s)}
    local dir="$base/refitd-${SLURM_JOB_ID}-$node" created=0 pid rc exit_file
    local endpoint="ipc://$dir/control.sock"
    [[ -e $dir ]] || created=1
    echo "REFITD-START $node ${SLURM_JOB_ID}.${SLURM_STEP_ID}"
    trap 'echo "REFITD-STOPPING $node TERM"' TERM
    trap 'echo "REFITD-STOPPING $node INT"' INT
    # a node's share (--nodes N): each daemon is told its node, unless the arguments say it already
    local arg share=0
    for arg in "$@"; do
        case $arg in
        --nodes | --nodes=*) share=1 ;;
        --node-rank | --node-rank=*) share=0 && break ;;
        esac
    done
    ((share)) && set -- "$@" --node-rank "${SLURM_NODEID:?SLURM_NODEID is not set}"
    # A subshell runs the daemon and writes down its exit status: Slurm signals every process of the
    # step, this shell included, and a `wait` that a trapped signal cuts short returns 128+signal,
    # not the status of a daemon that exited at that very moment (it would read as 143 after a clean
    # stop). The subshell's trap only defers a signal until the daemon, its foreground command, is
    # done; the daemon itself starts with the default dispositions.
    exit_file=$(mktemp "${TMPDIR:-/tmp}/refitd-exit-${SLURM_JOB_ID}-$node.XXXXXX") || return 1
    (
        trap : TERM INT
        "$refitd" serve --runtime-dir "$dir" "$@" </dev/null 1>&2
        echo "$?" >"$exit_file"
    ) &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        if [[ -S $dir/control.sock ]] &&
            "$refitd" status --listen "$endpoint" --timeout 2 >/dev/null 2>&1; then
            echo "REFITD-READY $node $endpoint"
            break
        fi
        sleep 0.2
    done
    while kill -0 "$pid" 2>/dev/null; do # a trapped signal cuts `wait` short: wait again until it is gone
        wait "$pid"
    done
    rc=$(cat -- "$exit_file" 2>/dev/null)
    rm -f -- "$exit_file"
    [[ $rc =~ ^[0-9]+$ ]] || rc=unknown # the subshell was killed (SIGKILL) before it could say
    echo "REFITD-EXIT $node $rc"
    ((created)) && rm -rf -- "$dir"
    [[ $rc != unknown ]] && return "$rc"
    return 1
}

# ------------------------------------------------------------------------------------------------
# on the launching node

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit "$EXIT_USAGE"
}

parse_args() {
    local arg
    while (($#)); do
        arg=$1
        case $arg in
        --) shift && COMMAND=("$@") && break ;;
        -h | --help) usage ;;
        --runtime-base=* | --refitd=* | --ready-timeout=* | --stop-timeout=* | --endpoints-file=* | --srun-arg=*)
            set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
            continue
            ;;
        --runtime-base | --refitd | --ready-timeout | --stop-timeout | --endpoints-file | --srun-arg)
            (($# >= 2)) || die "$EXIT_USAGE" "$arg needs a value"
            case $arg in
            --runtime-base) RUNTIME_BASE=$2 ;;
            --refitd) REFITD=$2 ;;
            --ready-timeout) READY_TIMEOUT_S=$2 ;;
            --stop-timeout) STOP_TIMEOUT_S=$2 ;;
            --endpoints-file) ENDPOINTS_FILE=$2 ;;
            --srun-arg) SRUN_ARGS+=("$2") ;;
            esac
            shift
            ;;
        --runtime-dir | --runtime-dir=* | --listen | --listen=* | --endpoint | --endpoint=*)
            die "$EXIT_USAGE" "$arg: the launcher sets each node's runtime dir and endpoint; use --runtime-base DIR"
            ;;
        *) SERVE_ARGS+=("$arg") ;;
        esac
        shift
    done
    ((${#COMMAND[@]})) || die "$EXIT_USAGE" "no command: refitd-slurm.sh [OPTIONS] -- COMMAND [ARGS...] (--help)"
    [[ $READY_TIMEOUT_S =~ ^[1-9][0-9]*$ ]] || die "$EXIT_USAGE" "--ready-timeout $READY_TIMEOUT_S: give whole seconds > 0"
    [[ $STOP_TIMEOUT_S =~ ^[1-9][0-9]*$ ]] || die "$EXIT_USAGE" "--stop-timeout $STOP_TIMEOUT_S: give whole seconds > 0"
    [[ $RUNTIME_BASE == /* ]] || die "$EXIT_USAGE" "--runtime-base $RUNTIME_BASE: give an absolute path"
}

# Lines `KIND NODE VALUE` that the daemon tasks reported so far (srun --label puts "N: " first).
reports() { grep -oE "REFITD-$1 [^ ]+ [^ ]+\$" "$DAEMON_OUT" 2>/dev/null | cut -d' ' -f2- || true; }
count() { reports "$1" | cut -d' ' -f1 | sort -u | wc -l; } # nodes that reported KIND

start_daemons() {
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#NODES[@]} == SLURM_JOB_NUM_NODES)) ||
        die "$EXIT_UNAVAILABLE" "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST names ${#NODES[@]} nodes, SLURM_JOB_NUM_NODES says $SLURM_JOB_NUM_NODES"
    log "starting refitd on ${#NODES[@]} node(s): ${NODES[*]} (runtime dirs $RUNTIME_BASE/refitd-$SLURM_JOB_ID-<node>)"
    DAEMON_OUT=$WORKDIR/daemons.out
    # The daemons must not see the variables this launcher exports (refitd refuses unknown REFITD_*).
    env -u REFITD_ENDPOINT -u REFITD_ENDPOINTS -u REFITD_ENDPOINTS_FILE \
        srun --overlap --nodes="${#NODES[@]}" --ntasks="${#NODES[@]}" --ntasks-per-node=1 \
        --kill-on-bad-exit=0 --input=none --label --job-name="refitd-$SLURM_JOB_ID" "${SRUN_ARGS[@]}" \
        bash -c "$(declare -f refitd_node_daemon)"'; refitd_node_daemon "$@"' refitd-node \
        "$RUNTIME_BASE" "$REFITD" "${SERVE_ARGS[@]}" >"$DAEMON_OUT" </dev/null &
    DAEMON_PID=$!
}

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT_S)) exited ready missing
    while (($(count READY) < ${#NODES[@]})); do
        exited=$(reports EXIT)
        if [[ -n $exited ]]; then
            die "$EXIT_UNAVAILABLE" "refitd exited during start-up, on node (status): $(tr '\n' ' ' <<<"$exited")- its log is above, lines labelled with the node's index"
        fi
        kill -0 "$DAEMON_PID" 2>/dev/null ||
            die "$EXIT_UNAVAILABLE" "the daemon step (srun) ended before every daemon was ready; see its errors above"
        if ((SECONDS >= deadline)); then
            ready=$(reports READY | cut -d' ' -f1 | sort)
            missing=$(comm -23 <(printf '%s\n' "${NODES[@]}" | sort) <(printf '%s\n' "$ready") | tr '\n' ' ')
            die "$EXIT_UNAVAILABLE" "not ready after ${READY_TIMEOUT_S} s on: ${missing}(raise --ready-timeout, or see the daemon logs above)"
        fi
        sleep "$POLL_S"
    done
    log "all ${#NODES[@]} daemons ready in $((SECONDS - deadline + READY_TIMEOUT_S)) s"
}

publish_endpoints() {
    local file=${ENDPOINTS_FILE:-$WORKDIR/endpoints.env} node endpoint all=() here=${SLURMD_NODENAME:-}
    local lines=()
    while read -r node endpoint; do
        lines+=("REFITD_ENDPOINT_${node//[^A-Za-z0-9_]/_}=$endpoint")
        all+=("$node=$endpoint")
        [[ $node == "$here" ]] && export REFITD_ENDPOINT=$endpoint
    done < <(reports READY | sort)
    printf '%s\n' "${lines[@]}" >"$file.tmp"
    mv -f -- "$file.tmp" "$file"
    printf '%s\n' "${lines[@]}"
    REFITD_ENDPOINTS=$(
        IFS=,
        echo "${all[*]}"
    )
    export REFITD_ENDPOINTS REFITD_ENDPOINTS_FILE=$file
    [[ -n ${REFITD_ENDPOINT:-} ]] ||
        log "this host (${here:-not a node of the job}) runs no daemon: REFITD_ENDPOINT is not set; use REFITD_ENDPOINTS or --on-node"
}

# The daemon step's id, as its tasks reported it (step ids are not predictable), else from squeue.
daemon_step() {
    local step
    step=$(reports START | awk 'NR == 1 {print $2}')
    [[ -n $step ]] || step=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null |
        awk -v n="refitd-$SLURM_JOB_ID" '$2 == n {print $1; exit}')
    echo "$step"
}

# SIGTERM to every process of the daemon step, unless Slurm is already stopping it (the tasks say
# so): a second SIGTERM makes refitd exit at once instead of cleanly.
stop_daemons() {
    [[ -n $DAEMON_PID ]] || return 0
    local deadline rc=0 node status failed=0 step
    step=$(daemon_step)
    if kill -0 "$DAEMON_PID" 2>/dev/null && (($(count STOPPING) < ${#NODES[@]})); then
        if [[ -n $step ]]; then
            log "stopping the daemons: scancel --signal=TERM $step"
            scancel --signal=TERM "$step" || log "scancel --signal=TERM $step failed"
        else
            log "the daemon step has no id yet: SIGTERM to srun (which SIGKILLs the daemons)"
            kill -TERM "$DAEMON_PID" 2>/dev/null || true
        fi
    fi
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while kill -0 "$DAEMON_PID" 2>/dev/null && ((SECONDS < deadline)); do
        sleep 0.1
    done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then
        log "the daemon step is still running after ${STOP_TIMEOUT_S} s: cancelling it (SIGKILL)"
        [[ -n $step ]] && scancel "$step" 2>/dev/null
        kill -KILL "$DAEMON_PID" 2>/dev/null || true
    fi
    wait "$DAEMON_PID" 2>/dev/null || rc=$?
    DAEMON_PID=
    for node in "${NODES[@]}"; do
        status=$(reports EXIT | awk -v n="$node" '$1 == n {print $2}')
        if [[ $status == 0 ]]; then
            log "refitd on $node exited 0"
        else
            log "refitd on $node: ${status:+exit status $status}${status:-no exit reported (killed?)}"
            failed=1
        fi
    done
    log "daemon step $step (srun) exited with $rc"
    return "$failed"
}

# COMMAND runs in the background, so that a signal to this script is handled at once (a trap waits
# for a foreground command); stdin is passed on explicitly, as bash would give it /dev/null.
run_command() {
    log "running: ${COMMAND[*]}"
    "${COMMAND[@]}" <&0 &
    CMD_PID=$!
    reap "$CMD_PID"
    CMD_RC=$REAPED CMD_PID=
    log "command exited with $CMD_RC"
}

reap() { # PID: wait for our child PID to end (a trapped signal cuts `wait` short); status in REAPED
    while :; do
        REAPED=0
        wait "$1" || REAPED=$?
        kill -0 "$1" 2>/dev/null || break
    done
}

# On INT or TERM: SIGTERM to COMMAND (if it runs), wait up to --stop-timeout, then stop the daemons.
stop_command() {
    [[ -n $CMD_PID ]] && kill -0 "$CMD_PID" 2>/dev/null || return 0
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    log "SIGTERM to the command (pid $CMD_PID)"
    kill -TERM "$CMD_PID" 2>/dev/null || true
    while kill -0 "$CMD_PID" 2>/dev/null && ((SECONDS < deadline)); do
        sleep 0.1
    done
    if kill -0 "$CMD_PID" 2>/dev/null; then
        log "the command ignored SIGTERM for ${STOP_TIMEOUT_S} s: SIGKILL"
        kill -KILL "$CMD_PID" 2>/dev/null || true
    fi
    reap "$CMD_PID"
    CMD_PID=
    log "command exited with $REAPED"
}

on_signal() {
    SIGNALLED=$1
    log "got SIG$1: stopping"
    exit $((128 + $(kill -l "$1")))
}

on_exit() {
    local rc=$? daemons=0
    set +e
    trap '' INT TERM
    stop_command
    stop_daemons || daemons=1
    [[ -n $WORKDIR ]] && rm -rf -- "$WORKDIR"
    if [[ -n $CMD_RC && -z $SIGNALLED ]]; then
        rc=$CMD_RC
        ((rc == 0 && daemons)) && rc=1
    fi
    exit "$rc"
}

on_node() {
    shift # --on-node
    [[ ${1:-} == -- ]] && shift
    (($#)) || die "$EXIT_USAGE" "usage: refitd-slurm.sh --on-node -- COMMAND [ARGS...]"
    local node=${SLURMD_NODENAME:-$(hostname -s)} entry
    local -a entries
    IFS=, read -r -a entries <<<"${REFITD_ENDPOINTS:-}"
    for entry in "${entries[@]}"; do
        if [[ ${entry%%=*} == "$node" ]]; then
            export REFITD_ENDPOINT=${entry#*=}
            exec "$@"
        fi
    done
    die "$EXIT_UNAVAILABLE" "no refitd daemon for node $node in REFITD_ENDPOINTS='${REFITD_ENDPOINTS:-}' (run under refitd-slurm.sh, on a node of its job)"
}

main() {
    [[ ${1:-} == --on-node ]] && on_node "$@"
    parse_args "$@"
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NUM_NODES:-} && -n ${SLURM_JOB_NODELIST:-} ]] ||
        die "$EXIT_USAGE" "not inside a Slurm allocation (no SLURM_JOB_ID): run it from an sbatch script or under salloc"
    command -v srun >/dev/null || die "$EXIT_UNAVAILABLE" "srun is not on PATH"
    unset REFITD_ENDPOINT REFITD_ENDPOINTS REFITD_ENDPOINTS_FILE # outputs of this script, never inputs
    WORKDIR=$(mktemp -d "${TMPDIR:-/tmp}/$PROG-$SLURM_JOB_ID.XXXXXX")
    trap on_exit EXIT
    trap 'on_signal INT' INT
    trap 'on_signal TERM' TERM
    start_daemons
    wait_ready
    publish_endpoints
    run_command
}

main "$@"
