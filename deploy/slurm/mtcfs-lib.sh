# Shared by mtcfs-prolog and mtcfs-epilog (sourced): the configuration and this job's names.
# slurmd runs both as root with an environment of its own making, not its own environment
# (22.05: SLURM_JOB_ID, SLURM_NODELIST, SLURMD_NODENAME, SLURM_CONF, SLURM_JOB_USER, ...;
# no PATH, so it is set here; no job name, so it is asked of slurmctld).
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
conf=${MTCFS_SLURM_CONF:-}
if [ -z "$conf" ]; then
  if [ -f "$here/mtcfs-slurm.conf" ]; then conf=$here/mtcfs-slurm.conf; else conf=/etc/mtcfs/slurm.conf; fi
fi
MTCFS=mtcfs COORD= OPTIONS= MOUNT_ROOT=/mnt/ckpt STORE_ROOT=/dev/shm/mtcfs PORT=7470
MOUNT_TIMEOUT=120s LOG=
# shellcheck disable=SC1090
source "$conf" || { echo "mtcfs-slurm: cannot read $conf" >&2; exit 1; }

node=${SLURMD_NODENAME:?SLURMD_NODENAME is not set (not run by slurmd?)}
jobid=${SLURM_JOB_ID:?SLURM_JOB_ID is not set (not run by slurmd?)}

say() {
  local line
  line="$(date -u +%FT%TZ) $(basename "$0") job $jobid node $node: $*"
  echo "$line" >&2
  if [ -n "$LOG" ]; then echo "$line" >> "${LOG//%n/$node}"; fi
}

# The job's name (the Prolog's environment has none in Slurm 22.05): from slurmctld. The
# Epilog does not ask again: it reads the mount point the Prolog recorded in state_dir.
job_name() {
  local name
  name=${SLURM_JOB_NAME:-}
  if [ -z "$name" ]; then
    name=$(scontrol show job "$jobid" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobName=//p')
  fi
  # a name a path and an etcd key can hold: anything else becomes '_'
  printf '%s' "${name:-job$jobid}" | tr -c 'A-Za-z0-9._-' '_'
}

store_root=${STORE_ROOT//%n/$node}
mount_root=${MOUNT_ROOT//%n/$node}
state_dir=$store_root/.slurm-jobs   # job id -> mount point, written by the Prolog
