#!/usr/bin/env bash
# Builds the tokenonce OCI image from Debian packages alone (no registry): the release binary,
# the shared libraries it needs taken from Debian's .debs (libc6, libgcc-s1, libssl3), Debian's
# CA bundle and a passwd entry for uid 10001, assembled with buildah from scratch into two
# layers (base, binary), stored as $TAG and written to an oci-archive. Then inspects it and runs
# the binary from the image's own files (chroot). Idempotent; installs buildah on first use.
#
#   bash tests/image/build.sh          # image localhost/tokenonce:dev, ~/.cache/tokenonce-image/tokenonce.oci.tar
#
# TOKENONCE_BIN=path     use this binary instead of `cargo build --release` (no build; CI
#                        passes tier 1's dev build: a release build is ~17 min cold here)
# TOKENONCE_IMAGE_DEBUG  CARGO_PROFILE_RELEASE_DEBUG of that build (default 0: no debug info)
# TOKENONCE_IMAGE_TAG    image name (default localhost/tokenonce:dev)
# TOKENONCE_IMAGE_DIR    work and output folder (default ~/.cache/tokenonce-image)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${TOKENONCE_IMAGE_DIR:-$HOME/.cache/tokenonce-image}
TAG=${TOKENONCE_IMAGE_TAG:-localhost/tokenonce:dev}
BASE_TAG="${TAG%:*}-base:${TAG##*:}"
PKGS=(libc6 libgcc-s1 libssl3 ca-certificates)
UID_GID=10001
say() { echo "[image] $*"; }
die() { echo "[image] error: $*" >&2; exit 1; }
T0=$SECONDS

# Tools: buildah assembles; readelf (binutils) lists the libraries the binary needs.
missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v readelf >/dev/null 2>&1 || missing+=(binutils)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The binary: a release build without debug info unless told otherwise (smaller, builds faster).
if [ -n "${TOKENONCE_BIN:-}" ]; then
  BIN=$TOKENONCE_BIN
else
  t=$SECONDS
  (cd "$ROOT" && CARGO_PROFILE_RELEASE_DEBUG=${TOKENONCE_IMAGE_DEBUG:-0} cargo build --release --locked --bin tokenonce) \
    >"$OUT.cargo-build.log" 2>&1 || { tail -n 30 "$OUT.cargo-build.log" >&2; die "cargo build --release failed"; }
  BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/tokenonce
  say "cargo build --release (debug=${TOKENONCE_IMAGE_DEBUG:-0}): $((SECONDS - t)) s"
fi
[ -x "$BIN" ] || die "no binary at $BIN"

# Debian's packages, as apt has them now: downloaded once per version (cached), unpacked into a
# staging tree.
mkdir -p "$OUT/debs"
candidates() { apt-cache show --no-all-versions "${PKGS[@]}" 2>/dev/null | sed -n 's/^Package: //p; s/^Version: //p' | paste - -; }
list=$(candidates)
[ "$(echo "$list" | grep -c .)" = ${#PKGS[@]} ] || { apt-get update -qq >/dev/null; list=$(candidates); }
# The first existing path of a glob's matches, or nothing.
first() { [ -e "$1" ] && echo "$1"; }
deb_of() { first "$OUT/debs/${1}_${2//:/%3a}_"*.deb; }
fetch=() versions=()
while read -r pkg ver; do
  [ -n "$(deb_of "$pkg" "$ver")" ] || fetch+=("$pkg=$ver")
  versions+=("$pkg=$ver")
done <<<"$list"
[ ${#versions[@]} = ${#PKGS[@]} ] || die "apt knows only: ${versions[*]} (wanted ${PKGS[*]})"
if [ ${#fetch[@]} -gt 0 ]; then
  (cd "$OUT/debs" && apt-get download -qq "${fetch[@]}" 2>/dev/null) || die "apt-get download ${fetch[*]} failed"
fi
rm -rf "$OUT/debroot" "$OUT/rootfs"
mkdir -p "$OUT/debroot"
for pv in "${versions[@]}"; do
  pkg=${pv%%=*} ver=${pv#*=}
  dpkg-deb -x "$(deb_of "$pkg" "$ver")" "$OUT/debroot"
done

# The root: the binary's shared libraries (followed through their own NEEDED entries), the ELF
# interpreter, the CA bundle, passwd/group, a copy of the default config, /tmp.
R=$OUT/rootfs
MA=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -dumpmachine)
mkdir -p "$R/usr/lib/$MA" "$R/usr/local/bin" "$R/etc/ssl/certs" "$R/etc/tokenonce" "$R/usr/lib/ssl" \
  "$R/var/lib/dpkg/status.d" "$R/tmp"
chmod 1777 "$R/tmp"
ln -s usr/lib "$R/lib"
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
queue=("$BIN") seen=" "
while [ ${#queue[@]} -gt 0 ]; do
  elf=${queue[0]} queue=("${queue[@]:1}")
  for so in $(needed "$elf"); do
    case "$seen" in *" $so "*) continue ;; esac
    seen+="$so "
    src=$(find "$OUT/debroot" -name "$so" \( -type f -o -type l \) | head -n 1)
    [ -n "$src" ] || die "$so (needed by $(basename "$elf")) is in none of: ${PKGS[*]}"
    cp -L "$src" "$R/usr/lib/$MA/$so"
    queue+=("$R/usr/lib/$MA/$so")
  done
done
interp=$(readelf -l "$BIN" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')
if [ ! -e "$R$interp" ]; then
  mkdir -p "$R$(dirname "$interp")"
  cp -L "$(find "$OUT/debroot" -name "$(basename "$interp")" | head -n 1)" "$R$interp"
fi
# What update-ca-certificates would write, and the OpenSSL paths Debian's openssl package links.
cat "$OUT/debroot"/usr/share/ca-certificates/mozilla/*.crt >"$R/etc/ssl/certs/ca-certificates.crt"
ln -s /etc/ssl/certs/ca-certificates.crt "$R/usr/lib/ssl/cert.pem"
ln -s /etc/ssl/certs "$R/usr/lib/ssl/certs"
# Licences of what is shipped, and the package records scanners read (distroless' layout).
for pv in "${versions[@]}"; do
  pkg=${pv%%=*} ver=${pv#*=}
  mkdir -p "$R/usr/share/doc/$pkg"
  doc=$OUT/debroot/usr/share/doc/$pkg
  if [ -L "$doc" ]; then
    # A doc folder linked to its source package's (libgcc-s1 -> gcc-12-base): that one has it.
    src_pkg=$(basename "$(readlink "$doc")")
    first "$OUT/debs/${src_pkg}_"*.deb >/dev/null || (cd "$OUT/debs" && apt-get download -qq "$src_pkg" 2>/dev/null)
    dpkg-deb -x "$(first "$OUT/debs/${src_pkg}_"*.deb)" "$OUT/debroot"
  fi
  cp "$doc/copyright" "$R/usr/share/doc/$pkg/"
  dpkg-deb -f "$(deb_of "$pkg" "$ver")" >"$R/var/lib/dpkg/status.d/$pkg"
done
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\ntokenonce:x:%s:%s:tokenonce:/nonexistent:/usr/sbin/nologin\n' \
  "$UID_GID" "$UID_GID" >"$R/etc/passwd"
printf 'root:x:0:\ntokenonce:x:%s:\n' "$UID_GID" >"$R/etc/group"
printf 'passwd: files\ngroup: files\nhosts: files dns\n' >"$R/etc/nsswitch.conf"
cp "$ROOT/conf/default.toml" "$R/etc/tokenonce/tokenonce.toml"
# Debug info never ships: a given binary (CI passes tier 1's dev build) is copied without it.
mkdir -p "$OUT/bin" && objcopy --strip-debug "$BIN" "$OUT/bin/tokenonce"

# Two layers, base then binary, with the commit's time on files and image: the same inputs give
# the same image id, so a rerun leaves no dangling image behind.
EPOCH=$(git -C "$ROOT" log -1 --format=%ct 2>/dev/null || echo 0)
REV=$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n 1)
ids_of_tags() { for t in "$TAG" "$BASE_TAG"; do buildah images -q "$t" 2>/dev/null || true; done; }
old_ids=$(ids_of_tags)
buildah rm tokenonce-image-base tokenonce-image >/dev/null 2>&1 || true
c=$(buildah from --name tokenonce-image-base scratch)
buildah copy --quiet "$c" "$R" / >/dev/null
buildah commit --quiet --rm --format oci --timestamp "$EPOCH" "$c" "$BASE_TAG" >/dev/null
c=$(buildah from --name tokenonce-image "$BASE_TAG")
buildah copy --quiet --chmod 0755 "$c" "$OUT/bin/tokenonce" /usr/local/bin/tokenonce >/dev/null
buildah config --entrypoint '["/usr/local/bin/tokenonce"]' --cmd '' --user "$UID_GID:$UID_GID" \
  --port 8000/tcp --port 9000/tcp --workingdir / --env PATH=/usr/local/bin:/usr/bin --stop-signal SIGTERM \
  --label org.opencontainers.image.title=tokenonce \
  --label "org.opencontainers.image.description=A P/D sidecar reverse proxy for vLLM that tokenizes each prompt once" \
  --label "org.opencontainers.image.version=$VERSION" --label "org.opencontainers.image.revision=$REV" \
  --label org.opencontainers.image.licenses=Apache-2.0 \
  --label "io.tokenonce.debian-packages=${versions[*]}" "$c"
buildah commit --quiet --rm --format oci --timestamp "$EPOCH" "$c" "$TAG" >/dev/null
for id in $old_ids; do
  ids_of_tags | grep -q "^${id:0:12}" || buildah rmi "$id" >/dev/null 2>&1 || true
done
rm -f "$OUT/tokenonce.oci.tar"
buildah push --quiet "$TAG" "oci-archive:$OUT/tokenonce.oci.tar:$TAG" >/dev/null

# Inspect: what a runtime will do with it, and fail on anything unexpected.
fmt='{{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.User}} {{len .OCIv1.RootFS.DiffIDs}}'
read -r entry user layers <<<"$(buildah inspect --type image --format "$fmt" "$TAG")"
# shellcheck disable=SC2016  # a Go template, not a shell expansion
ports=$(buildah inspect --type image --format '{{range $p, $_ := .OCIv1.Config.ExposedPorts}}{{$p}} {{end}}' "$TAG")
[ "$entry" = '[/usr/local/bin/tokenonce]' ] || die "entrypoint is $entry"
[ "$user" = "$UID_GID:$UID_GID" ] || die "user is $user"
[ "$layers" = 2 ] || die "$layers layers, expected 2 (base, binary)"
[ "$ports" = "8000/tcp 9000/tcp " ] || die "exposed ports are: $ports"
say "$TAG: entrypoint $entry, user $user, ports $ports, $layers layers; packages ${versions[*]}"
say "sizes: root without binary $(du -sk "$R" | cut -f1) KiB, binary $(($(stat -c %s "$OUT/bin/tokenonce") / 1024)) KiB," \
  "oci-archive $(($(stat -c %s "$OUT/tokenonce.oci.tar") / 1024)) KiB ($OUT/tokenonce.oci.tar)"

# The binary runs from the image's own files, as uid 10001, with no container runtime.
c=$(buildah from --name tokenonce-image-check "$TAG")
trap 'buildah umount "$c" >/dev/null 2>&1; buildah rm "$c" >/dev/null 2>&1' EXIT
mnt=$(buildah mount "$c")
chroot --userspec="$UID_GID:$UID_GID" "$mnt" /usr/local/bin/tokenonce check /etc/tokenonce/tokenonce.toml \
  || die "tokenonce check inside the image root failed"
chroot --userspec="$UID_GID:$UID_GID" "$mnt" /usr/local/bin/tokenonce print-default | cmp -s - "$ROOT/conf/default.toml" \
  || die "print-default inside the image differs from conf/default.toml"
say "chroot into the image: tokenonce check and print-default ok as uid $UID_GID; built in $((SECONDS - T0)) s"
