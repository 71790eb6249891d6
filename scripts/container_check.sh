#!/usr/bin/env bash
# Build the CPU variant of the Containerfile and check that the server inside answers.
#
# Runs where no image registry can be reached and `podman run` is refused (this project's
# sandbox): the base image is made locally with debootstrap, the build uses
# --isolation=chroot, and the image is started by mounting it and chroot-ing into it.
# Needs root and Debian's podman + debootstrap (installed if missing). Takes 10-20 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${WORK:-/var/tmp/fastrun-container}
base=localhost/debian-bookworm-minbase
image=localhost/fastrun-cpp:cpu
port=${PORT:-18123}
mkdir -p "$work"

command -v podman >/dev/null && command -v debootstrap >/dev/null || {
    apt-get update -qq && apt-get install -y -qq podman debootstrap >/dev/null
}

if ! podman image exists "$base"; then
    echo "== debootstrap bookworm (minbase)"
    rm -rf "$work/rootfs"
    debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >/dev/null
    tar -C "$work/rootfs" -c . | podman import - "$base"
fi

# Behind a TLS-intercepting proxy (as in this sandbox) pip inside the build must trust the
# host's CA bundle: lend it to the build's RUN steps, with a pip.conf pointing at it.
volumes=()
host_ca=/etc/ssl/certs/ca-certificates.crt
if [[ -f $host_ca ]]; then
    printf '[global]\ncert = /etc/ssl/host-ca.crt\n' > "$work/pip.conf"
    volumes=(-v "$host_ca:/etc/ssl/host-ca.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
fi

echo "== podman build (CPU variant)"
podman build --format docker --isolation=chroot "${volumes[@]}" --build-arg VARIANT=cpu --build-arg BASE_BUILD="$base" \
    --build-arg BASE_RUN="$base" -t "$image" -f Containerfile .

echo "== start the image's entrypoint in a chroot"
root=$(podman image mount "$image")
trap 'kill "${server:-0}" 2>/dev/null || true; umount "$root/tmp" 2>/dev/null || true; podman image unmount "$image" >/dev/null || true' EXIT
mount --bind /proc "$root/proc" 2>/dev/null || true
# The mounted image is read-only; the server writes its key store, response store and seal
# secret (all under /tmp here, as a /data volume would hold them) to a scratch folder.
mkdir -p "$work/tmp" && chmod 1777 "$work/tmp"
mount --bind "$work/tmp" "$root/tmp"
chroot --userspec=10001:10001 "$root" env PATH=/opt/fastrun/bin:/usr/bin:/bin HOME=/home/fastrun \
    HF_HOME=/tmp/hf FASTRUN_KEYS_DB=/tmp/keys.sqlite3 \
    fastrun-cpp serve --host 127.0.0.1 --port "$port" --slots 2 --ctx-size 1024 &
server=$!
for _ in $(seq 120); do
    curl -fsS "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    sleep 1
done
echo "== GET /health"
curl -fsS "http://127.0.0.1:$port/health"; echo
echo "== POST /v1/chat/completions"
curl -fsS "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}'
echo
umount "$root/proc" 2>/dev/null || true
echo "== image size: $(podman image inspect "$image" --format '{{.Size}}') bytes"
echo "OK"
