#!/usr/bin/env bash
# Install lm-evaluation-harness (with its API-client extra) into the active virtual environment, for
# tests/e2e/test_lm_eval.py and the evaluation recipe in docs/server.md. It is heavy (datasets, pandas,
# scikit-learn, ...), so it is not part of the dev extra; .ci/run calls this script.
set -euo pipefail
LM_EVAL_VERSION="0.4.13"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    echo "activate the project's virtual environment first (. .venv/bin/activate)" >&2
    exit 1
fi
pip install "lm-eval[api]==${LM_EVAL_VERSION}"
