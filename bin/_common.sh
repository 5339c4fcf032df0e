# Sourced by bin/up and bin/test: a venv with the package, and phase timing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${PIN_VENV:-$ROOT/.venv}"

phase_start=0
phase() {
  local now; now=$(date +%s.%N)
  if [ "$phase_start" != 0 ]; then
    printf '[phase] %-28s %6.1fs\n' "$phase_name" "$(echo "$now - $phase_start" | bc)"
  fi
  phase_name="$1"; phase_start=$now
  [ "$1" = "done" ] || echo "[phase] >>> $1"
}

# Debian packages the scripts and tests call directly (services install their own in `pin stack up`).
ensure_debian_packages() {
  local missing=()
  command -v bc >/dev/null 2>&1 || missing+=(bc)
  for pkg in "$@"; do
    case "$pkg" in
      prometheus) command -v promtool >/dev/null 2>&1 || missing+=(prometheus) ;;
      chromium) command -v chromium >/dev/null 2>&1 || missing+=(chromium) ;;
      *) dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg") ;;
    esac
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[setup] installing Debian packages: ${missing[*]}"
    local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# uv, pinned: the tool that installs requirements.lock (ensure_venv) and writes it (bin/lock). A
# uv of this version on PATH is used as it is; else it is installed once from PyPI with pip into
# the user's cache, a folder per version.
UV_VERSION=0.13.8
ensure_uv() {
  if command -v uv >/dev/null 2>&1 && [ "$(uv --version | cut -d' ' -f2)" = "$UV_VERSION" ]; then
    UV=uv
    return
  fi
  local home="${XDG_CACHE_HOME:-$HOME/.cache}/pin-pipelines/uv-$UV_VERSION"
  UV="$home/bin/uv"
  if [ ! -x "$UV" ]; then
    echo "[setup] installing uv $UV_VERSION into $home"
    rm -rf "$home"
    mkdir -p "${home%/*}"
    local tmp; tmp=$(mktemp -d "$home.XXXXXX")
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
      --no-warn-script-location --target "$tmp" "uv==$UV_VERSION"
    # Whole or not at all; a set-up beside this one may have got there first.
    mv -T "$tmp" "$home" 2>/dev/null || rm -rf "$tmp"
  fi
}

# The venv: requirements.lock (every dependency, exact, hash-checked; bin/lock writes it) and the
# project itself, editable, installed by uv into a venv without pip (nothing here uses it;
# ensurepip alone took 3.4 CPU-s). Installed again only when requirements.lock or pyproject.toml
# changed since the last time.
# Bytecode is written at first import, not compiled whole at install: compiling the 157 MB of
# sources took 21 CPU-s, of which a process imports a fraction (pin serve's processes about 2 CPU-s
# each, once). Where PYTHONDONTWRITEBYTECODE is set no import would write it and every process
# would compile Dagster again, so the venv's own .pth lets imports write it whatever the
# environment says (into __pycache__ folders, which git ignores).
ensure_venv() {
  ensure_debian_packages
  phase "python environment"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --without-pip "$VENV"
  fi
  local stamp="$VENV/.pin-installed" inputs
  inputs=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$inputs" ]; then
    ensure_uv
    # sync: exactly the locked set (a package the lock no longer has goes).
    "$UV" pip sync --quiet --python "$VENV/bin/python" --require-hashes requirements.lock
    "$UV" pip install --quiet --python "$VENV/bin/python" --no-deps --editable .
    local purelib
    purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo 'import sys; sys.dont_write_bytecode = False' >"$purelib/pin_writes_bytecode.pth"
    echo "$inputs" >"$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
