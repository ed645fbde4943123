"""tests/gpu needs a CUDA device and a build with the GPU executor; without them every test here
is skipped, with the reason (an error instead where NVRAR_GPU_REQUIRED=1, as scripts/gpu_check.sh
sets it)."""

import importlib.util
import os
import signal

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _why_not() -> str:
    import nvrar

    info = nvrar.build_info()
    if not info["cuda"] or not info["gpus"]:
        return f"needs a GPU and the GPU executor: {info['cuda_error']}"
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU-only torch?)"
    return ""


# pytest-timeout's --timeout where the plugin is not installed (it may be missing on the GPU
# machine; scripts/gpu_check.sh passes --timeout either way): the same signal method, per test call.
_TIMEOUT_STAND_IN = importlib.util.find_spec("pytest_timeout") is None


def pytest_addoption(parser):
    if _TIMEOUT_STAND_IN:
        parser.addoption("--timeout", type=float, default=0.0,
                         help="per-test timeout in seconds (tests/gpu/conftest.py's stand-in: pytest-timeout is not "
                              "installed)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = item.config.getoption("--timeout") if _TIMEOUT_STAND_IN else 0
    if not limit:
        yield
        return

    def expired(signum, frame):
        pytest.fail(f"Timeout (>{limit:g} s) in {item.nodeid} (tests/gpu/conftest.py's stand-in for pytest-timeout)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _stopped(signum, frame):
    raise KeyboardInterrupt("SIGTERM: scripts/gpu_check.sh stopped the step at its deadline")


def pytest_configure(config):
    # scripts/gpu_check.sh stops a step past its deadline with SIGTERM to its process group: pytest
    # then ends as on Ctrl-C (the test it was in named, its summary printed) instead of dying
    # silently, and the launcher writes every rank's output, Python stacks included, to the log.
    if os.environ.get("NVRAR_GPU_REQUIRED") == "1":
        signal.signal(signal.SIGTERM, _stopped)


def pytest_collection_modifyitems(config, items):
    why = _why_not()
    if why and os.environ.get("NVRAR_GPU_REQUIRED") == "1":
        # scripts/gpu_check.sh: on the GPU machine a skipped test would read as a pass
        raise pytest.UsageError(f"NVRAR_GPU_REQUIRED=1 but tests/gpu cannot run: {why}")
    if why:
        skip = pytest.mark.skip(reason=why)
        for item in items:
            if str(item.path).startswith(HERE + os.sep):
                item.add_marker(skip)
