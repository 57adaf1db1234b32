#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests: one slurmctld and one slurmd per "node".
#
#   scripts/slurm_cluster.sh up   DIR [NUM_NODES=2] [BASE_PORT=16817]   # prints `export SLURM_CONF=...`
#   scripts/slurm_cluster.sh down DIR
#
# Nodes are named ${NODE_PREFIX:-node}1..N; BASE_PORT is slurmctld's, node i listens on BASE_PORT + i.
# Two clusters at once need distinct prefixes and ports (slurmd's cgroups are named after the node).
#
# Needs root and Debian's `slurmctld slurmd slurm-client munge` (installed here if missing).
# How it stays private to DIR (recipe in DESIGN.md, "Testing on these machines"):
# - its own munged (fresh key, socket under DIR; slurm finds it through AuthInfo=socket=...);
# - every slurmd runs in its own UTS namespace with hostname nodeN, on the shared host network, with
#   NodeAddr=127.0.0.1 and its own Port=; node names go into /etc/hosts first (else lookups leave
#   the machine) and NoInAddrAny keeps every daemon on loopback;
# - ProctrackType=proctrack/cgroup, because linuxproc lets daemonized children escape a cancelled job;
# - Gres=gpu:2 per node backed by character-device files, so jobs see CUDA_VISIBLE_DEVICES.
# Clients (sbatch, squeue, scontrol) find the cluster through SLURM_CONF=DIR/slurm.conf.
set -euo pipefail

cmd=${1:?usage: slurm_cluster.sh up|down DIR [NUM_NODES] [BASE_PORT]}
dir=${2:?usage: slurm_cluster.sh up|down DIR [NUM_NODES] [BASE_PORT]}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

stop_pidfile() {  # stop the daemon whose pid is in $1 and wait (up to 5 s) for it to go
  local pidfile=$1 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

if [ "$cmd" = down ]; then
  # Cancel what is still queued or running (a failed test may leave a job), so no job process outlives
  # the cluster; then wait (up to 15 s) for slurmd to clean the jobs up.
  if [ -f "$dir/slurm.conf" ] && [ -f "$dir/run/slurmctld.pid" ]; then
    export SLURM_CONF="$dir/slurm.conf"
    scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 30); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  # slurmd ignores SIGTERM while it retries to register with a controller: stop slurmds first.
  for pidfile in "$dir"/run/slurmd-*.pid; do [ -e "$pidfile" ] && stop_pidfile "$pidfile"; done
  stop_pidfile "$dir/run/slurmctld.pid"
  stop_pidfile "$dir/run/munged.pid"
  exit 0
fi
[ "$cmd" = up ] || { echo "slurm_cluster.sh: unknown command $cmd (use up or down)" >&2; exit 2; }

num_nodes=${3:-2}
base_port=${4:-16817}

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$dir"/{run,log,state,spool,dev}
nodes=()
for i in $(seq 1 "$num_nodes"); do nodes+=("${NODE_PREFIX:-node}$i"); done

# Node names must resolve locally: slurmctld and slurmd look them up.
for n in "${nodes[@]}"; do
  grep -qE "^127\.0\.0\.1[[:space:]].*\b$n\b" /etc/hosts || echo "127.0.0.1 $n" >>/etc/hosts
done

# --- munge: a private daemon and key.
[ -f "$dir/munge.key" ] || mungekey -c -k "$dir/munge.key" 2>/dev/null || dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 2>/dev/null
chmod 600 "$dir/munge.key"
munged --force --key-file="$dir/munge.key" --socket="$dir/run/munge.socket" \
  --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/state/munged.seed"

# --- fake GPUs: character devices (slurm only checks the files exist; jobs get CUDA_VISIBLE_DEVICES).
for n in "${nodes[@]}"; do
  for g in 0 1; do
    [ -e "$dir/dev/$n-gpu$g" ] || mknod "$dir/dev/$n-gpu$g" c 1 3  # same major/minor as /dev/null
  done
done

ctld_port=$base_port
{
  echo "ClusterName=prime-local"
  echo "SlurmctldHost=localhost(127.0.0.1)"
  echo "SlurmctldPort=$ctld_port"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  echo "AuthInfo=socket=$dir/run/munge.socket"
  echo "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny"
  echo "StateSaveLocation=$dir/state"
  echo "SlurmdSpoolDir=$dir/spool/%n"
  echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
  echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
  echo "SlurmctldLogFile=$dir/log/slurmctld.log"
  echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
  echo "ProctrackType=proctrack/cgroup"
  echo "TaskPlugin=task/none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core"
  echo "GresTypes=gpu"
  echo "SchedulerType=sched/builtin"
  echo "SchedulerParameters=batch_sched_delay=0"
  echo "MpiDefault=none"
  echo "ReturnToService=2"
  echo "JobCompType=jobcomp/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "MinJobAge=600"
  echo "KillWait=5"
  echo "SlurmctldTimeout=30"
  echo "SlurmdTimeout=30"
  echo "InactiveLimit=0"
  echo "SlurmctldDebug=info"
  echo "SlurmdDebug=info"
  i=0
  for n in "${nodes[@]}"; do
    i=$((i + 1))
    echo "NodeName=$n NodeAddr=127.0.0.1 NodeHostname=$n Port=$((base_port + i)) CPUs=2 RealMemory=2000 Gres=gpu:2 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} >"$dir/slurm.conf"

{
  for n in "${nodes[@]}"; do echo "NodeName=$n Name=gpu File=$dir/dev/$n-gpu[0-1]"; done
} >"$dir/gres.conf"

cat >"$dir/cgroup.conf" <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
for n in "${nodes[@]}"; do
  mkdir -p "$dir/spool/$n"
  # Own UTS namespace: `hostname` inside a job on this node says nodeN, as on a real cluster.
  unshare --uts sh -c "hostname $n && exec slurmd -f '$SLURM_CONF' -N $n"
done

# Ready when every node is idle (about a second here).
for _ in $(seq 100); do
  idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
  [ "$idle" -ge "$num_nodes" ] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "slurm_cluster.sh: nodes did not become idle within 20 s; see $dir/log/" >&2
sinfo -N >&2 || true
exit 1
