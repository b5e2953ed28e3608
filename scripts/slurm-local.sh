#!/usr/bin/env bash
# A real SLURM cluster of one host, for tests/test_slurm.py (the guide's array recipe):
# munged, slurmctld and slurmd from Debian's `munge` and `slurm-wlm`, one node, one partition.
#
#   scripts/slurm-local.sh [start]   as root: configure, start what is not running, and wait
#                                    until `sinfo` shows the node idle (idempotent)
#   scripts/slurm-local.sh stop      stop the daemons this script started
#
# The config goes to /etc/slurm/slurm.conf, where sbatch and sinfo look, and is only ever
# (re)written when it is absent or one this script wrote: a host's own cluster config is
# never replaced. State, logs and pid files live under $STCAST_SLURM_DIR (/var/tmp/stcast-slurm).
# No cgroups: processes are tracked through /proc (proctrack/linuxproc) and tasks are not
# bound (task/none), so this runs in containers and sandboxes too.
set -euo pipefail

state=${STCAST_SLURM_DIR:-/var/tmp/stcast-slurm}
conf=/etc/slurm/slurm.conf
marker="# Written by stcast scripts/slurm-local.sh: a one-host test cluster."
node=$(hostname -s)
wait_s=${STCAST_SLURM_WAIT:-90}

die() { echo "slurm-local: $*" >&2; exit 1; }

# Stop the daemon whose pid file is $1 (only a pid file this script's config names).
stop_pidfile() {
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$1"
}

is_running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "${1:-start}" = stop ]; then
    stop_pidfile "$state/slurmd.pid"
    stop_pidfile "$state/slurmctld.pid"
    [ -f "$state/munged.started" ] && stop_pidfile /run/munge/munged.pid && rm -f "$state/munged.started"
    echo "slurm-local: stopped"
    exit 0
fi
[ "${1:-start}" = start ] || die "usage: $0 [start|stop]"

[ "$(id -u)" = 0 ] || die "must run as root (it writes $conf and starts daemons)"
for cmd in munged munge slurmctld slurmd sinfo sbatch; do
    command -v "$cmd" >/dev/null || die "no $cmd: apt-get install -y slurm-wlm munge"
done
id munge >/dev/null 2>&1 || die "no munge user: install Debian's munge package"

# --- munge: the key, then the daemon (as its own user, as the package runs it) --------------
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    # 1024 random bits, as `mungekey --create` writes them.
    (umask 077 && head -c 128 /dev/urandom >/etc/munge/munge.key)
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
mkdir -p "$state"
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged
    touch "$state/munged.started"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ------------------------------------------------------------------------------
# The node as slurmd sees it (CPUs, RealMemory in MB): a node configured larger than it is
# would be drained.
hw=$(slurmd -C | head -1)
cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
if [ -z "$cpus" ] || [ -z "$mem" ]; then die "slurmd -C gave no CPUs or RealMemory: $hw"; fi
new=$(cat <<EOF
$marker
ClusterName=stcast
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
ReturnToService=2
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
)
mkdir -p "$state/ctld" "$state/d" /etc/slurm
if [ -f "$conf" ] && ! grep -qxF "$marker" "$conf"; then
    die "$conf exists and was not written by this script: leaving it (and this host's cluster) alone"
fi
if [ "$(cat "$conf" 2>/dev/null)" != "$new" ]; then
    # A changed config (another host name, memory): restart what runs under the old one.
    stop_pidfile "$state/slurmd.pid"
    stop_pidfile "$state/slurmctld.pid"
    printf '%s\n' "$new" >"$conf.tmp"
    mv "$conf.tmp" "$conf"
fi

# --- the daemons (each forks into the background itself) -------------------------------------
is_running "$state/slurmctld.pid" || slurmctld
is_running "$state/slurmd.pid" || slurmd

# --- wait until the node takes jobs ----------------------------------------------------------
for _ in $(seq "$wait_s"); do
    st=$(sinfo -h -N -n "$node" -o %T 2>/dev/null || true)
    case "$st" in
        idle | mixed | allocated) echo "slurm-local: node $node $st (CPUs=$cpus RealMemory=$mem)"; exit 0 ;;
        drained* | draining*) die "node $node $st: $(sinfo -h -R -o %E)" ;;
    esac
    sleep 1
done
die "node $node not idle after ${wait_s}s (sinfo: ${st:-no answer}); see $state/slurmctld.log and $state/slurmd.log"
