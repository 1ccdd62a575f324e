#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs them.
#   * redis-server and redis-cli (Debian package redis-server) when missing; the tests start
#     their own instances on free loopback ports and never touch one already running.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "== installing redis-server from Debian"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (lib, bin, tests, bench)"
cargo clippy --all-targets --locked -- -D warnings
echo "== cargo test"
cargo test --locked
