#!/usr/bin/env bash
# A throw-away single-host Slurm cluster for tests: one slurmctld, NODES slurmd processes that
# pretend to be nodes n1..nN (all on this host), and a private munged. Root only; no systemd.
#
#   tests/slurm_cluster.sh up [NODES]     install (apt, if missing), configure, start; wait until idle
#   tests/slurm_cluster.sh down [--wipe]  stop by pidfile: slurmd*, slurmctld, munged (KILL after 10 s)
#   tests/slurm_cluster.sh status         sinfo, or exit 1 if it is not up
#
# Then:  export SLURM_CONF=/run/refitd-slurm/slurm.conf;  srun -N3 hostname;  sbatch -N3 job.sh
#
# Everything lives in TEST_SLURM_DIR (default /run/refitd-slurm): slurm.conf, spool, logs, pidfiles,
# and munged's key and socket. Nothing in /etc is written and no system munged is used, so the
# cluster can sit next to a real Slurm; it listens on ports TEST_SLURM_PORT (default 16817, the
# controller) and the NODES ports after it. Packages: Debian's munge slurmctld slurmd slurm-client,
# installed with --no-install-recommends (~5 s from a warm apt cache), with services kept from
# starting during the install.
#
# Exit status of `up`: 0 up; 2 usage; 3 cannot install (not root, no apt, apt failed); 4 installed
# but munged or Slurm did not come up (see the log tail printed). Running refitd under Slurm:
# README.md, "Running under Slurm".
set -euo pipefail

DIR=${TEST_SLURM_DIR:-/run/refitd-slurm}
PORT=${TEST_SLURM_PORT:-16817}
PACKAGES=(munge slurmctld slurmd slurm-client)
UP_TIMEOUT_S=30
STOP_TIMEOUT_S=10

log() { printf 'slurm_cluster: %s\n' "$*" >&2; }
die() {
    local code=$1
    shift
    log "$*"
    exit "$code"
}

pid_alive() { # PIDFILE -> 0 if it names a live process
    local pid
    [[ -s $1 ]] && pid=$(<"$1") && [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

# ------------------------------------------------------------------------------------------------
# install

have_binaries() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null &&
        command -v munged >/dev/null && command -v munge >/dev/null
}

install_packages() {
    have_binaries && return 0
    [[ $(id -u) -eq 0 ]] || die 3 "not root: cannot install ${PACKAGES[*]}"
    command -v apt-get >/dev/null || die 3 "no apt-get: install ${PACKAGES[*]} by hand"
    # No daemon may start half-configured from a package script: deny service starts while
    # installing (Debian's policy-rc.d convention), unless a policy is already in place.
    local policy=/usr/sbin/policy-rc.d ours=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}")
    local rc=0
    "${apt[@]}" >"$DIR/apt.log" 2>&1 || { apt-get update -q >>"$DIR/apt.log" 2>&1 && "${apt[@]}" >>"$DIR/apt.log" 2>&1; } || rc=$?
    ((ours)) && rm -f "$policy"
    if ((rc)) || ! have_binaries; then
        tail -n 15 "$DIR/apt.log" >&2
        die 3 "apt-get install ${PACKAGES[*]} failed (rc=$rc); full log in $DIR/apt.log"
    fi
}

# ------------------------------------------------------------------------------------------------
# configure

port_in_use() { # PORT -> 0 if something on 127.0.0.1 accepts connections there
    timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null
}

write_config() {
    local nodes=$1 host i last
    host=$(hostname -s)
    last=$((PORT + nodes))
    for ((i = PORT; i <= last; i++)); do
        ! port_in_use "$i" || die 4 "port $i is in use; choose free ones with TEST_SLURM_PORT=<first of $((nodes + 1))>"
    done
    mkdir -p "$DIR/spool" "$DIR/log"
    cat >"$DIR/slurm.conf" <<CONF
# written by tests/slurm_cluster.sh: a throw-away cluster of $nodes emulated nodes on $host
ClusterName=refitdtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$DIR/spool/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
KillWait=10
MailProg=/bin/true
NodeName=n[1-$nodes] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((PORT + 1))-$last] CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

start_munged() {
    local m=$DIR/munge
    pid_alive "$m/munged.pid" && return 0
    install -d -o munge -g munge -m 0755 "$m"  # the socket dir must be searchable by all
    if [[ ! -s $m/munge.key ]]; then
        dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
        chown munge:munge "$m/munge.key"
        chmod 0400 "$m/munge.key"
    fi
    runuser -u munge -- munged --socket="$m/munge.socket" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" ||
        die 4 "munged did not start: $(tail -n 5 "$m/munged.log" 2>/dev/null)"
    munge -S "$m/munge.socket" -n | unmunge -S "$m/munge.socket" >/dev/null ||
        die 4 "munge round trip failed: $(tail -n 5 "$m/munged.log" 2>/dev/null)"
}

start_slurm() {
    local nodes=$1 i
    export SLURM_CONF=$DIR/slurm.conf
    pid_alive "$DIR/slurmctld.pid" || slurmctld -f "$SLURM_CONF" || die 4 "slurmctld did not start: $(tail -n 5 "$DIR/log/slurmctld.log")"
    for ((i = 1; i <= nodes; i++)); do
        pid_alive "$DIR/slurmd-n$i.pid" || slurmd -f "$SLURM_CONF" -N "n$i" || die 4 "slurmd -N n$i did not start: $(tail -n 5 "$DIR/log/slurmd-n$i.log")"
    done
    local deadline=$((SECONDS + UP_TIMEOUT_S)) states
    while :; do
        states=$(timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null || true)
        [[ $(grep -c ' idle$' <<<"$states") -eq $nodes ]] && break
        if ((SECONDS >= deadline)); then
            tail -n 5 "$DIR"/log/slurm*.log >&2 || true
            die 4 "nodes not idle after ${UP_TIMEOUT_S} s: ${states:-no answer from slurmctld}"
        fi
        sleep 0.2
    done
}

# ------------------------------------------------------------------------------------------------
# commands

cmd_up() {
    local nodes=${1:-3}
    [[ $nodes =~ ^[1-9][0-9]?$ ]] || die 2 "usage: $0 up [NODES 1-99]"
    [[ $(id -u) -eq 0 ]] || die 3 "not root: the test cluster runs its daemons as root"
    if [[ -f $DIR/up ]] && pid_alive "$DIR/slurmctld.pid"; then
        [[ $(<"$DIR/up") == "$nodes" ]] || die 4 "a cluster of $(<"$DIR/up") nodes is up in $DIR; run '$0 down' first"
        log "already up ($nodes nodes)"
    else
        mkdir -p "$DIR"
        chmod 0755 "$DIR"
        local t0=$SECONDS
        install_packages
        write_config "$nodes"
        start_munged
        start_slurm "$nodes"
        echo "$nodes" >"$DIR/up"
        log "up: $nodes nodes in $((SECONDS - t0)) s"
    fi
    echo "export SLURM_CONF=$DIR/slurm.conf"
}

stop_pidfiles() { # NAME PIDFILE...: TERM them all, wait for all, KILL the rest after STOP_TIMEOUT_S
    local name=$1 f pid pids=() deadline
    shift
    for f in "$@"; do
        pid_alive "$f" && pid=$(<"$f") && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null; do
            if ((SECONDS >= deadline)); then
                log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT_S} s: SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.1
        done
    done
}

cmd_down() {
    local wipe=0
    [[ ${1:-} == --wipe ]] && wipe=1
    if [[ -f $DIR/slurm.conf ]] && pid_alive "$DIR/slurmctld.pid"; then
        SLURM_CONF=$DIR/slurm.conf timeout 10 scancel --quiet --full --user=root 2>/dev/null || true
    fi
    # Order matters: a slurmd whose munged is gone retries munge and ignores SIGTERM for >30 s.
    stop_pidfiles slurmd "$DIR"/slurmd-*.pid
    stop_pidfiles slurmctld "$DIR/slurmctld.pid"
    stop_pidfiles munged "$DIR/munge/munged.pid"
    rm -f "$DIR/up"
    ((wipe)) && rm -rf -- "$DIR"
    if ((wipe)); then log "down; $DIR removed"; else log "down; logs kept in $DIR/log"; fi
}

cmd_status() {
    if [[ ! -f $DIR/up ]] || ! pid_alive "$DIR/slurmctld.pid"; then die 1 "not up ($DIR)"; fi
    SLURM_CONF=$DIR/slurm.conf timeout 5 sinfo -N
}

case ${1:-} in
up) cmd_up "${2:-3}" ;;
down) cmd_down "${2:-}" ;;
status) cmd_status ;;
*) die 2 "usage: $0 up [NODES] | down [--wipe] | status" ;;
esac
