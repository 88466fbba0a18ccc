#!/usr/bin/env bash
# Installs the two coding-agent CLIs that tests/e2e/test_agents.py drives (Claude Code and Codex) into
# .agents/ of this repository (gitignored), never globally; Node comes from the system's packages when
# it is missing. The pinned versions below are the only place they are named.
set -euo pipefail
CLAUDE_CODE_VERSION=2.1.332
CODEX_VERSION=0.171.0

cd "$(dirname "$0")/.."
prefix="$PWD/.agents"

if ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
    $sudo apt-get update -q
    $sudo apt-get install -y -q --no-install-recommends nodejs npm
fi

want="@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION @openai/codex@$CODEX_VERSION"
if [ -f "$prefix/versions" ] && [ "$(cat "$prefix/versions")" = "$want" ] \
    && [ -x "$prefix/node_modules/.bin/claude" ] && [ -x "$prefix/node_modules/.bin/codex" ]; then
    echo "agents: $want already in $prefix"
    exit 0
fi
mkdir -p "$prefix"
[ -f "$prefix/package.json" ] || echo '{"private": true}' > "$prefix/package.json"
# --no-fund/--no-audit: nothing but the two packages is fetched.
npm install --prefix "$prefix" --no-fund --no-audit --no-save --loglevel=error $want
echo "$want" > "$prefix/versions"
"$prefix/node_modules/.bin/claude" --version
"$prefix/node_modules/.bin/codex" --version
