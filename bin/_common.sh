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

ensure_venv() {
  ensure_debian_packages
  phase "python environment"
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  # Re-install only when pyproject.toml changed since the last install.
  local stamp="$VENV/.pin-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e ".[dev]"
    touch "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
