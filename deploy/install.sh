#!/usr/bin/env bash
# Installs the Ouroboros fleet on a host managed by systemd, or upgrades it.
# Safe to run twice: every step checks before it acts, and a second run with the
# same source changes nothing.
#
#   sudo deploy/install.sh                                   # a sandbox host (worker)
#   sudo deploy/install.sh --components worker,reconciler,web --start
#   deploy/install.sh --root /tmp/scratch ...                # into a scratch root
#
# What it does, in order:
#   1. system packages the host lacks (bubblewrap emacs-nox git python3-venv
#      dbus-user-session openssh-client libseccomp2), live hosts only;
#   2. the system account `ouroboros` (home /var/lib/ouroboros, no login shell);
#   3. the release: a virtualenv under /opt/ouroboros/releases/<version>-<hash>
#      holding this source (or --wheel), built once per source; the symlink
#      /opt/ouroboros/current moves to it; instrument.env beside it names the
#      commit (the installed package is not a git checkout). Its dependencies
#      are installed once per dependency set, in a virtualenv under
#      /opt/ouroboros/dependencies/<hash> that no unit runs: a release starts
#      as a hard-linked copy of it, so an upgrade that keeps the dependencies
#      installs only the project's own wheel;
#   4. /etc/ouroboros/ouroboros.env from deploy/ouroboros.env, only if absent;
#   5. the units: the worker as a user unit of `ouroboros` (and its per-release
#      template for drains, and a doctor), the reconciler and the web UI as
#      system units, the user manager's controller delegation, and
#      LoadCredential= drop-ins for the files present in /etc/ouroboros/credentials;
#   6. lingering for `ouroboros` (its user manager runs from boot), and the
#      requested components enabled; with --start, (re)started;
#   7. an ssh key for the worker's git access (printed, to authorize it on the
#      git server).
#
# --root DIR (or DESTDIR) installs into DIR instead of / and touches nothing
# outside it: no package manager, no running systemd, no host user database. The
# root must hold etc/passwd, etc/group, etc/shadow and etc/gshadow. Paths inside
# the installed files are the final ones (/opt/ouroboros/..., not DIR/opt/...).
set -euo pipefail

readonly account=ouroboros
readonly home=/var/lib/ouroboros
readonly prefix=/opt/ouroboros
readonly etc=/etc/ouroboros
readonly provider_keys=(ANTHROPIC_API_KEY OPENAI_API_KEY OPENAI_COMPATIBLE_API_KEY)
readonly packages=(bubblewrap emacs-nox git python3-venv dbus-user-session openssh-client libseccomp2)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source_dir=$(dirname "$here")
root=${DESTDIR:-/}
components=worker
python=/usr/bin/python3
wheel=""
commit=""
pip_args=()
use_apt=1
start=0
doctor=0

usage() {
  cat <<'USAGE'
usage: deploy/install.sh [options]
  --root DIR               install into DIR (also: DESTDIR=DIR); for tests and images
  --components LIST        comma-separated: worker, reconciler, web [worker]
  --source DIR             the project checkout to install [this script's ../]
  --wheel FILE             install this built wheel instead of building the source
  --python PATH            interpreter for the virtualenv [/usr/bin/python3]
  --pip-arg ARG            extra argument for pip install (repeatable), e.g.
                           --pip-arg=--no-index --pip-arg=--find-links=/srv/wheels
  --instrument-commit SHA  commit of the source, when it is not a clean git checkout
  --no-apt                 do not install missing system packages
  --start                  (re)start the enabled units now (live hosts only)
  --doctor                 only run `schedule-lineage doctor` as the worker would
USAGE
}

die() {
  printf 'install.sh: %s\n' "$*" >&2
  exit 2
}
say() { printf 'install.sh: %s\n' "$*"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=${2:?--root needs a directory}; shift 2 ;;
    --root=*) root=${1#*=}; shift ;;
    --components) components=${2:?}; shift 2 ;;
    --components=*) components=${1#*=}; shift ;;
    --source) source_dir=${2:?}; shift 2 ;;
    --source=*) source_dir=${1#*=}; shift ;;
    --wheel) wheel=${2:?}; shift 2 ;;
    --wheel=*) wheel=${1#*=}; shift ;;
    --python) python=${2:?}; shift 2 ;;
    --python=*) python=${1#*=}; shift ;;
    --pip-arg) pip_args+=("${2:?}"); shift 2 ;;
    --pip-arg=*) pip_args+=("${1#*=}"); shift ;;
    --instrument-commit) commit=${2:?}; shift 2 ;;
    --instrument-commit=*) commit=${1#*=}; shift ;;
    --no-apt) use_apt=0; shift ;;
    --start) start=1; shift ;;
    --doctor) doctor=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "run as root (it creates an account and files owned by it)"
root=$(cd "$root" 2>/dev/null && pwd) || die "--root: no such directory"
[ "$root" = / ] && root=""
live=0
[ -z "$root" ] && live=1
# systemd is the manager of this machine (not just installed): units can be
# reloaded and started now.
systemd_running=0
[ "$live" -eq 1 ] && [ -d /run/systemd/system ] && systemd_running=1

# systemctl --user for the account, through its user manager's private socket:
# needs neither a login session nor systemd-container (`systemctl -M user@`).
user_systemctl() {
  runuser -u "$account" -- env XDG_RUNTIME_DIR="/run/user/$uid" systemctl --user "$@"
}

if [ "$doctor" -eq 1 ]; then
  [ "$systemd_running" -eq 1 ] || die "--doctor needs a live host running systemd"
  uid=$(id -u "$account" 2>/dev/null) || die "no account $account: install first"
  systemctl start "user@$uid.service"
  user_systemctl daemon-reload
  since=$(date +%s)
  status=0
  user_systemctl start ouroboros-doctor.service || status=$?
  journalctl --no-pager -o cat "_SYSTEMD_USER_UNIT=ouroboros-doctor.service" --since "@$since"
  exit "$status"
fi

want() { case ",$components," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
for c in ${components//,/ }; do
  case "$c" in worker | reconciler | web) ;; *) die "unknown component: $c" ;; esac
done
[ -f "$source_dir/pyproject.toml" ] || die "$source_dir is not the project checkout"
[ -z "$wheel" ] || [ -f "$wheel" ] || die "--wheel: $wheel does not exist"
if [ -n "$commit" ] && ! [[ "$commit" =~ ^([0-9a-f]{40}|[0-9a-f]{64})$ ]]; then
  die "--instrument-commit must be 40 or 64 lowercase hex digits"
fi

R() { printf '%s%s' "$root" "$1"; } # a final path, inside the install root

# --- 1. system packages -------------------------------------------------------
if [ "$live" -eq 1 ] && [ "$use_apt" -eq 1 ] && command -v apt-get >/dev/null; then
  missing=()
  for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# --- 2. the account -----------------------------------------------------------
for f in passwd group shadow gshadow; do
  [ -f "$(R /etc/$f)" ] || die "$(R /etc/$f) is missing: --root must be a root filesystem"
done
if ! grep -q "^$account:" "$(R /etc/passwd)"; then
  say "creating system account $account"
  useradd_root=()
  [ "$live" -eq 1 ] || useradd_root=(--prefix "$root")
  useradd "${useradd_root[@]}" --system --user-group --home-dir "$home" --create-home \
    --shell /usr/sbin/nologin --comment "Ouroboros fleet" "$account"
fi
uid=$(awk -F: -v u="$account" '$1 == u { print $3 }' "$(R /etc/passwd)")
gid=$(awk -F: -v u="$account" '$1 == u { print $4 }' "$(R /etc/passwd)")
if [ -z "$uid" ] || [ -z "$gid" ]; then
  die "cannot read the uid and gid of $account"
fi

# System directories are created if absent and otherwise left alone; the
# fleet's own get their modes and owners enforced on every run.
mkdir -p "$(R /opt)" "$(R /etc/systemd/system)" "$(R /var/lib/systemd/linger)"
install -d -m 0755 "$(R $prefix)" "$(R $prefix/releases)" "$(R $prefix/libexec)"
# The worker units' ExecStart= wrapper: not part of a release (the instrument
# never depends on it), so it is replaced in place.
install -m 0755 "$here/systemd/cgroup-delegate.sh" "$(R $prefix/libexec/cgroup-delegate)"
# The account reads its configuration and credentials; only root writes them.
install -d -m 0750 -o 0 -g "$gid" "$(R $etc)" "$(R $etc/credentials)"
install -d -m 0750 -o "$uid" -g "$gid" "$(R $home)"

# --- 3. the release -------------------------------------------------------------
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$source_dir/pyproject.toml" | head -n 1)
[ -n "$version" ] || die "no version in $source_dir/pyproject.toml"
if [ -n "$wheel" ]; then
  digest=$(sha256sum "$wheel" | cut -c1-12)
else
  # The bytes that make the instrument: the same source gives the same release.
  digest=$(cd "$source_dir" &&
    find pyproject.toml organism.el worker scheduler sandbox_scripts -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12)
fi
release="$version-$digest"
release_dir="$prefix/releases/$release"
venv="$release_dir/venv"

# Rewrites the absolute path $2 to $3 in the scripts and configuration of the
# virtualenv at $1 (the only files of a virtualenv that name where it lives).
# sed -i writes a new file: a hard link into another virtualenv is left alone.
relocate() {
  local pattern
  pattern=$(printf '%s' "$2" | sed 's/[][\.*^$|]/\\&/g')
  grep -rlF "$2" "$1/bin" "$1/pyvenv.cfg" 2>/dev/null |
    while read -r f; do sed -i "s|$pattern|$3|g" "$f"; done
}

if [ ! -f "$(R "$release_dir/.complete")" ]; then
  say "building release $release"
  rm -rf "$(R "$release_dir")"
  install -d -m 0755 "$(R "$release_dir")"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  if [ -z "$wheel" ]; then
    # Build from a copy: setuptools writes build/ and *.egg-info into the tree it
    # builds, and the checkout is not ours to write.
    parts=(pyproject.toml organism.el worker scheduler sandbox_scripts)
    for f in "$source_dir"/README* "$source_dir"/LICENSE*; do
      [ -f "$f" ] && parts+=("${f##*/}")
    done
    tar -C "$source_dir" --exclude=__pycache__ --exclude='*.pyc' -cf - "${parts[@]}" |
      tar -C "$work" -xf -
    mkdir "$work/wheels"
    "$python" -m venv "$work/builder"
    "$work/builder/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
      "${pip_args[@]}" -w "$work/wheels" "$work" >/dev/null
    wheel_file=$(ls "$work"/wheels/*.whl)
  else
    wheel_file=$wheel
  fi
  # The dependency set: the wheel's own requirements (not its extras), the
  # interpreter and the pip arguments. The same set gives the same virtualenv.
  "$python" - "$wheel_file" >"$work/requirements.txt" <<'PY' || die "--wheel: cannot read the requirements of $wheel_file"
import sys
import zipfile
from email.parser import HeaderParser

with zipfile.ZipFile(sys.argv[1]) as wheel:
    (name,) = [n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
    metadata = HeaderParser().parsestr(wheel.read(name).decode())
print("\n".join(sorted(r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r)))
PY
  dependencies="$prefix/dependencies/$({
    "$python" -c 'import sys; print(sys.version)'
    cat "$work/requirements.txt"
    printf '%s\n' "${pip_args[@]}"
  } | sha256sum | cut -c1-12)"
  if [ ! -f "$(R "$dependencies/.complete")" ]; then
    say "installing the dependencies in $dependencies"
    rm -rf "$(R "$dependencies")"
    install -d -m 0755 "$(R "$prefix/dependencies")" "$(R "$dependencies")"
    "$python" -m venv "$(R "$dependencies/venv")"
    # No bytecode in the release: every process keeps it in its own account's private,
    # checked cache (worker/__init__.py), and without it a release directory is a pure
    # function of its inputs.
    "$(R "$dependencies/venv")/bin/python" -m pip install -q --disable-pip-version-check \
      --no-compile "${pip_args[@]}" -r "$work/requirements.txt"
    if [ -n "$root" ]; then
      relocate "$(R "$dependencies/venv")" "$root$prefix" "$prefix"
    fi
    touch "$(R "$dependencies/.complete")"
  fi
  cp -al "$(R "$dependencies/venv")" "$(R "$venv")"
  relocate "$(R "$venv")" "$dependencies/venv" "$venv"
  "$(R "$venv")/bin/python" -m pip install -q --disable-pip-version-check --no-compile \
    "${pip_args[@]}" "$wheel_file"
  if [ -n "$root" ]; then
    # The venv was made at DIR/opt/...; it will run at /opt/...
    relocate "$(R "$venv")" "$root$prefix" "$prefix"
  fi
  touch "$(R "$release_dir/.complete")"
fi

# The commit of this release, for lineage provenance (the installed package is
# not a git checkout). A dirty checkout gets none: better a refusal at
# `schedule-lineage init` than a lineage naming code it did not run.
if [ -z "$commit" ] && [ -z "$wheel" ] && git -C "$source_dir" rev-parse --verify --quiet HEAD >/dev/null; then
  if [ -z "$(git -C "$source_dir" status --porcelain --untracked-files=no)" ]; then
    commit=$(git -C "$source_dir" rev-parse HEAD)
  else
    say "warning: $source_dir has uncommitted changes; no instrument commit recorded"
  fi
fi
{
  echo "# Written by deploy/install.sh for release $release."
  if [ -n "$commit" ]; then
    echo "OUROBOROS_INSTRUMENT_COMMIT=$commit"
  else
    echo "# Commit unknown: pass --instrument-commit, or set OUROBOROS_INSTRUMENT_COMMIT."
  fi
} >"$(R "$release_dir/instrument.env")"
chmod 0644 "$(R "$release_dir/instrument.env")"

# A relative link, valid inside and outside a scratch root.
if [ "$(readlink "$(R $prefix/current)" 2>/dev/null || true)" != "releases/$release" ]; then
  ln -sfn "releases/$release" "$(R $prefix/current)"
  say "current release: $release"
fi

# --- 4. configuration -------------------------------------------------------------
if [ ! -e "$(R $etc/ouroboros.env)" ]; then
  install -m 0640 -o 0 -g "$gid" "$here/ouroboros.env" "$(R $etc/ouroboros.env)"
  say "installed $etc/ouroboros.env: edit it (broker, repository, store)"
fi

# --- 5. units -----------------------------------------------------------------------
user_units="$home/.config/systemd/user"
install -d -m 0755 -o "$uid" -g "$gid" "$(R $home/.config)" "$(R $home/.config/systemd)" \
  "$(R "$user_units")" "$(R "$user_units/ouroboros-worker.service.d")" \
  "$(R "$user_units/ouroboros-worker@.service.d")" "$(R "$user_units/ouroboros-doctor.service.d")"
for unit in ouroboros-worker.service ouroboros-worker@.service ouroboros-doctor.service \
  ouroboros-repack.service ouroboros-repack.timer; do
  install -m 0644 -o "$uid" -g "$gid" "$here/systemd/$unit" "$(R "$user_units/$unit")"
done
install -d -m 0755 "$(R "/etc/systemd/system/user@$uid.service.d")" \
  "$(R /etc/systemd/system/ouroboros-reconciler.service.d)" \
  "$(R /etc/systemd/system/ouroboros-web.service.d)"
for unit in ouroboros-reconciler.service ouroboros-web.service; do
  install -m 0644 "$here/systemd/$unit" "$(R "/etc/systemd/system/$unit")"
done
install -m 0644 "$here/systemd/user-delegate.conf" \
  "$(R "/etc/systemd/system/user@$uid.service.d/ouroboros-delegate.conf")"

# LoadCredential= lines for the credential files that exist: systemd refuses to
# start a unit whose credential source is missing, and a key that is absent must
# simply mean "not configured". S3 credentials (AWS shared-credentials format):
# s3-writer.ini for the worker and reconciler, s3-reader.ini for the web UI.
credentials_dropin() { # s3 credentials file, include provider keys (0/1)
  local var
  echo "# Generated by deploy/install.sh from the files in $etc/credentials;"
  echo "# re-run it after adding or removing one."
  echo "[Service]"
  if [ "$2" -eq 1 ]; then
    for var in "${provider_keys[@]}"; do
      if [ -f "$(R "$etc/credentials/$var")" ]; then
        echo "LoadCredential=$var:$etc/credentials/$var"
      fi
    done
  fi
  if [ -f "$(R "$etc/credentials/$1")" ]; then
    echo "LoadCredential=aws-credentials:$etc/credentials/$1"
    echo "Environment=AWS_SHARED_CREDENTIALS_FILE=%d/aws-credentials"
  fi
}
for dir in ouroboros-worker.service.d ouroboros-worker@.service.d ouroboros-doctor.service.d; do
  credentials_dropin s3-writer.ini 1 >"$(R "$user_units/$dir/50-credentials.conf")"
  chown "$uid:$gid" "$(R "$user_units/$dir/50-credentials.conf")"
  chmod 0644 "$(R "$user_units/$dir/50-credentials.conf")"
done
credentials_dropin s3-writer.ini 0 \
  >"$(R /etc/systemd/system/ouroboros-reconciler.service.d/50-credentials.conf)"
credentials_dropin s3-reader.ini 0 \
  >"$(R /etc/systemd/system/ouroboros-web.service.d/50-credentials.conf)"
chmod 0644 "$(R /etc/systemd/system/ouroboros-reconciler.service.d/50-credentials.conf)" \
  "$(R /etc/systemd/system/ouroboros-web.service.d/50-credentials.conf)"

# --- 6. lingering and enablement --------------------------------------------------
# Lingering is a flag file; loginctl also starts the user manager at once, which
# only a live host with logind can do.
if [ "$systemd_running" -eq 1 ] && command -v loginctl >/dev/null; then
  loginctl enable-linger "$account"
else
  : >"$(R "/var/lib/systemd/linger/$account")"
  chmod 0644 "$(R "/var/lib/systemd/linger/$account")"
fi

# Enabling is a symlink in the target's .wants directory: made directly, so that
# it works offline and in a scratch root alike, exactly as systemctl would.
if want worker; then
  install -d -m 0755 -o "$uid" -g "$gid" "$(R "$user_units/default.target.wants")"
  ln -sfn ../ouroboros-worker.service "$(R "$user_units/default.target.wants/ouroboros-worker.service")"
  chown -h "$uid:$gid" "$(R "$user_units/default.target.wants/ouroboros-worker.service")"
  install -d -m 0755 -o "$uid" -g "$gid" "$(R "$user_units/timers.target.wants")"
  ln -sfn ../ouroboros-repack.timer "$(R "$user_units/timers.target.wants/ouroboros-repack.timer")"
  chown -h "$uid:$gid" "$(R "$user_units/timers.target.wants/ouroboros-repack.timer")"
fi
for c in reconciler web; do
  if want "$c"; then
    mkdir -p "$(R /etc/systemd/system/multi-user.target.wants)"
    ln -sfn "/etc/systemd/system/ouroboros-$c.service" \
      "$(R "/etc/systemd/system/multi-user.target.wants/ouroboros-$c.service")"
  fi
done

# --- 7. the worker's ssh key (git over ssh) -----------------------------------------
if want worker && command -v ssh-keygen >/dev/null; then
  install -d -m 0700 -o "$uid" -g "$gid" "$(R $home/.ssh)"
  if [ ! -f "$(R $home/.ssh/id_ed25519)" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "$account@$(hostname)" -f "$(R $home/.ssh/id_ed25519)"
    chown "$uid:$gid" "$(R $home/.ssh/id_ed25519)" "$(R $home/.ssh/id_ed25519.pub)"
  fi
fi

# --- live host: reload, start ----------------------------------------------------
if [ "$systemd_running" -eq 1 ]; then
  systemctl daemon-reload
  if [ "$start" -eq 1 ]; then
    systemctl start "user@$uid.service"
    if want worker; then
      user_systemctl daemon-reload
      user_systemctl restart ouroboros-worker.service
    fi
    for c in reconciler web; do
      if want "$c"; then systemctl restart "ouroboros-$c.service"; fi
    done
  fi
elif [ "$start" -eq 1 ]; then
  say "--start ignored: systemd is not running here"
fi

say "release $release installed under $(R $prefix) for: $components"
if [ "$live" -eq 1 ]; then
  cat <<NEXT
Next steps:
  1. edit $etc/ouroboros.env (broker, shared repository, observation store);
  2. credentials, mode 0640 root:$account, then re-run this script:
       $etc/credentials/{$(
    IFS=,
    echo "${provider_keys[*]}"
  )}
       $etc/credentials/s3-writer.ini, s3-reader.ini (AWS shared-credentials format)
  3. authorize the worker's key on the git server: $home/.ssh/id_ed25519.pub
     and trust the server: sudo -u $account ssh-keyscan -p PORT HOST >> $home/.ssh/known_hosts
  4. check what the host lacks, as the worker sees it: $0 --doctor
  5. start: $0 --components $components --start
NEXT
fi
