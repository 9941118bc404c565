#!/bin/sh
# Installs the SLURM daemons and client that tests/slurm_cluster.py starts as a throw-away local
# cluster. Idempotent and quick when they are present. Where it cannot install (not root, no apt-get)
# it says why and exits 0: those tests then skip, or fail under CI=true, with the same reason.
set -eu

PACKAGES="slurmctld slurmd slurm-client"
BINARIES="slurmctld slurmd sbatch squeue sinfo scontrol scancel"

missing=""
for binary in $BINARIES; do
    command -v "$binary" >/dev/null 2>&1 || missing="$missing $binary"
done
if [ -z "$missing" ]; then
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "install_slurm: not root, so not installing $PACKAGES (missing:$missing); SLURM tests will skip" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: no apt-get, so not installing $PACKAGES (missing:$missing); SLURM tests will skip" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet (or stale ones without these packages): refresh only
# then, since an update costs seconds to minutes.
for package in $PACKAGES; do
    if ! apt-cache policy "$package" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        echo "install_slurm: no apt candidate for $package; running apt-get update" >&2
        apt-get update -q || echo "install_slurm: apt-get update failed" >&2
        break
    fi
done
echo "install_slurm: installing $PACKAGES (missing:$missing)" >&2
# A failed install (no network, no such package) leaves the tests to report it: they skip with the
# reason, or fail under CI=true; the rest of the suite still runs.
if ! apt-get install -y -q --no-install-recommends $PACKAGES; then
    echo "install_slurm: apt-get install $PACKAGES failed; SLURM tests will skip (or fail under CI=true)" >&2
fi
