#!/usr/bin/env bash
# Build pipeinfer's OCI image from Debian's and PyPI's packages only: no base image is pulled from a registry.
#
#   launch/image/build.sh [TAG]          (default TAG: localhost/pipeinfer:<version>; needs root, podman, debootstrap)
#
# 1. A Debian bookworm root file system (debootstrap --variant=minbase, from the Debian mirror apt uses here) is
#    imported as localhost/pipeinfer-debian:bookworm-<hash of its package list>; built once, then reused.
# 2. launch/image/Containerfile builds llama.cpp once for every x86-64 CPU (ggml's CPU variants, chosen at run
#    time on each host) and installs pipeinfer with its pinned dependencies from PyPI into /opt/pipeinfer.
# podman caches each step, so a rebuild after a change to pipeinfer's code takes seconds.
# Environment: DEBIAN_MIRROR (default: the first deb.debian.org-style URI in apt's sources), PODMAN (default podman),
# IMAGE_ARCHIVE=FILE also writes the image as a docker-archive (for `apptainer build pipeinfer.sif docker-archive://FILE`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PODMAN=${PODMAN:-podman}
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
TAG=${1:-localhost/pipeinfer:$VERSION}

PACKAGES="python3,python3-venv,ca-certificates,libgomp1,openssh-client,procps"
MIRROR=${DEBIAN_MIRROR:-$(grep -hoE '^(URIs:|deb) +http[^ ]*debian/?' /etc/apt/sources.list.d/* /etc/apt/sources.list \
                          2>/dev/null | awk '{print $2}' | head -1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE=localhost/pipeinfer-debian:bookworm-$(echo "$PACKAGES" | sha256sum | cut -c1-12)

if ! "$PODMAN" image exists "$BASE"; then
    command -v debootstrap >/dev/null || { echo "build.sh: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
    root=$(mktemp -d /var/tmp/pipeinfer-rootfs.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    echo "[image] debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
        || { tail -5 "$root.log" >&2; echo "build.sh: debootstrap failed (log: $root.log)" >&2; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --numeric-owner -c . | "$PODMAN" import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -f "$root.log"
fi

# The build reaches PyPI the way pip does on this machine: its configuration, certificate bundle and local wheel
# folders (PIP_*, /etc/pip.conf, find-links / file:// indexes) are lent to the build steps, not kept in the image.
volumes=()
pipenv=()
for v in $(env | grep -oE '^PIP_[A-Z_]+' || true); do pipenv+=(--build-arg "$v=${!v}"); done
[[ -f /etc/pip.conf ]] && volumes+=(-v /etc/pip.conf:/etc/pip.conf:ro)
for d in $( { cat /etc/pip.conf 2>/dev/null; echo "${PIP_FIND_LINKS:-}"; echo "${PIP_CERT:-}"; } \
            | grep -oE '(file://)?/[^ ]+' | sed 's|^file://||' | sort -u); do
    [[ -e $d ]] && volumes+=(-v "$d:$d:ro")
done

# the build context: what a checkout installs, nothing else (no .git, results or caches)
context=$(mktemp -d /var/tmp/pipeinfer-context.XXXXXX)
trap 'rm -rf "$context"' EXIT
git ls-files -z pyproject.toml README.md pipeinfer prompts launch | xargs -0 cp --parents -t "$context"
LLAMA=$(python3 -c 'import tomllib; print(next(d.split("==")[1] for d in tomllib.load(open("pyproject.toml", "rb"))
                    ["project"]["dependencies"] if d.startswith("llama-cpp-python==")))')

old=$("$PODMAN" image inspect "$TAG" --format '{{.Id}}' 2>/dev/null || true)
start=$(date +%s)
"$PODMAN" build --network host "${volumes[@]}" "${pipenv[@]}" --build-arg BASE="$BASE" \
    --build-arg LLAMA_CPP_PYTHON="$LLAMA" -f launch/image/Containerfile -t "$TAG" "$context"
echo "[image] $TAG built in $(( $(date +%s) - start )) s ($("$PODMAN" image inspect "$TAG" --format '{{.Size}}' \
    | awk '{printf "%.0f MB", $1 / 1e6}'))"
# the image this tag named before, if the build replaced it (and no container uses it)
if [[ -n $old && $old != $("$PODMAN" image inspect "$TAG" --format '{{.Id}}') ]]; then
    "$PODMAN" rmi "$old" >/dev/null 2>&1 || true
fi
if [[ -n ${IMAGE_ARCHIVE:-} ]]; then
    rm -f "$IMAGE_ARCHIVE"
    "$PODMAN" save --format docker-archive -o "$IMAGE_ARCHIVE" "$TAG"
    echo "[image] wrote $IMAGE_ARCHIVE"
fi
