"""Communicator(device="cuda")'s set-up (nvrar/_setup.py: setup_gpu, _nvshmem_mode, the verdict
exchange) on real processes over the real store bootstrap, without a GPU: a stand-in replaces only
the native side (the GPU module's functions, nvshmem4py's nvshmem.core, cuda.core's Device) and
fails where each test says (tests/_gpu_setup_tasks.py). Every rank must come out of a failure on
any one rank with the same NvrarError, at once (none left waiting for a peer until its deadline),
and NVRAR_NVSHMEM_INIT must pick the initialization where NVSHMEM is not in force yet."""

import importlib.util

import pytest

from _launch import describe, launch

TIMEOUT = 30  # the communicators' deadline: a rank left waiting would raise only after it
FAST = 10  # every rank raises well before TIMEOUT (process start and imports included)


def _pathfinder_finds_nvshmem() -> str:
    if importlib.util.find_spec("cuda.pathfinder") is None:
        return "cuda.pathfinder (nvshmem4py's stack) is not installed"
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvshmem_host")
    except Exception as exc:  # noqa: BLE001 - whatever it raises, say it
        return f"cuda.pathfinder finds no NVSHMEM host library: {type(exc).__name__}: {exc}"
    return ""


# The nvshmem4py cases run library_mismatch for real: cuda.pathfinder must find the NVSHMEM wheel
# (installed with the test extra, as in CI).
needs_pathfinder = pytest.mark.skipif(bool(_pathfinder_finds_nvshmem()), reason=_pathfinder_finds_nvshmem() or "-")


def run(world, plans, inits):
    """Launch `world` ranks; plans[r] is rank r's stand-in plan, inits[r] its NVRAR_NVSHMEM_INIT
    (None: unset). Returns the reports, every rank having exited 0 with one."""
    res = launch(world, "gpusetup", {"timeout": TIMEOUT, "G": 1}, per_rank_args=[{"plan": p} for p in plans],
                 per_rank_env=[{} if i is None else {"NVRAR_NVSHMEM_INIT": i} for i in inits], timeout=90)
    bad = [r for r in res if r.returncode != 0 or r.report is None]
    assert not bad, describe(res)
    return [r.report for r in res]


def all_raise(reports, *needles):
    """Every rank raised NvrarError, fast, with the same message containing every needle."""
    for rep in reports:
        assert rep["raised"] == "NvrarError", rep
        assert rep["elapsed"] < FAST, rep  # from the exchanged verdicts, not from a peer's deadline
        for n in needles:
            assert n in rep["message"], (n, rep["message"])
    assert len({rep["message"] for rep in reports}) == 1, [rep["message"] for rep in reports]


def never_called(reports, *names):
    for rep in reports:
        assert not set(names) & set(rep["calls"]), rep["calls"]


N4P = {"n4p": "import"}
NO_N4P = {"n4p": "missing"}


# -- the rank-0 unique-id failure, by both paths: every rank raises, none waits ----------------------

def test_rank0_unique_id_failure_nvrar_path():
    reports = run(3, [dict(NO_N4P, fail=["unique_id"]), NO_N4P, NO_N4P], ["nvrar"] * 3)
    all_raise(reports, "setup failed on rank 0: NVSHMEM unique id: Planned: unique_id failed on rank 0")
    assert reports[0]["calls"].count("unique_id") == 1
    never_called(reports[1:], "unique_id")
    never_called(reports, "GpuExecutor")


@needs_pathfinder
def test_rank0_unique_id_failure_nvshmem4py_path():
    reports = run(3, [dict(N4P, fail=["n4p_unique_id"]), N4P, N4P], ["nvshmem4py"] * 3)
    all_raise(reports, "setup failed on rank 0: nvshmem4py unique id: Planned: n4p_unique_id failed on rank 0")
    never_called(reports, "n4p_init", "set_current", "GpuExecutor", "unique_id")
    assert all("set_symmetric_size_default" in rep["calls"] for rep in reports)  # before the unique id
    assert all(rep["n4p_live"] is False for rep in reports)


# -- NVRAR_NVSHMEM_INIT, where NVSHMEM is not initialized yet -----------------------------------------

def _nvrar_init_ok(reports):
    gen = reports[0]["uids"]["generated"]
    for rep in reports:
        assert rep["raised"] is None, rep
        assert rep["uids"]["executor"] == gen, rep["uids"]  # rank 0's unique id reached every rank
        assert rep["calls"][-1] == "close", rep["calls"]
    assert reports[0]["calls"].count("unique_id") == 1
    never_called(reports[1:], "unique_id")
    never_called(reports, "n4p_unique_id", "n4p_init", "set_symmetric_size_default")


def _n4p_init_ok(reports):
    gen = reports[0]["uids"]["generated"]
    for rep in reports:
        assert rep["raised"] is None, rep
        assert rep["uids"]["n4p_init"] == gen, rep["uids"]  # into nvshmem.core.init on every rank
        assert rep["uids"]["executor"] == "", rep["uids"]  # the executor joins: no unique id of its own
        calls = rep["calls"]
        assert calls.index("set_symmetric_size_default") < calls.index("set_current") < calls.index("n4p_init") \
            < calls.index("GpuExecutor"), calls
        assert rep["n4p_live"] is True and rep["n4p_live_after_close"] is False, rep
        assert calls[-2:] == ["close", "n4p_finalize"], calls  # the last close finalizes nvshmem4py's init
    never_called(reports, "unique_id")


@needs_pathfinder
def test_init_nvrar_ignores_an_installed_nvshmem4py():
    _nvrar_init_ok(run(2, [N4P, N4P], ["nvrar", "nvrar"]))


def test_init_auto_without_nvshmem4py_is_nvrar():
    _nvrar_init_ok(run(2, [NO_N4P, NO_N4P], [None, "auto"]))


@needs_pathfinder
def test_init_auto_with_nvshmem4py_goes_through_it():
    _n4p_init_ok(run(2, [N4P, N4P], [None, "auto"]))


@needs_pathfinder
def test_init_nvshmem4py():
    _n4p_init_ok(run(2, [N4P, N4P], ["nvshmem4py", "nvshmem4py"]))


def test_init_nvshmem4py_without_it_fails_on_every_rank():
    reports = run(2, [NO_N4P, NO_N4P], ["nvshmem4py", "nvshmem4py"])
    all_raise(reports, "rank 0: device='cuda': NVRAR_NVSHMEM_INIT=nvshmem4py but nvshmem4py is not usable here",
              "rank 1: device='cuda': NVRAR_NVSHMEM_INIT=nvshmem4py", "not installed (stand-in)")
    never_called(reports, "unique_id", "GpuExecutor", "set_symmetric_size_default")


def test_init_bad_value_fails_on_every_rank():
    reports = run(2, [NO_N4P, NO_N4P], ["auto", "nvshmem"])
    all_raise(reports, "setup failed on rank 1: device='cuda': NVRAR_NVSHMEM_INIT='nvshmem': expected one of auto")
    assert "rank 0:" not in reports[0]["message"]
    never_called(reports, "unique_id", "GpuExecutor")


# -- an NVSHMEM in force is joined whatever NVRAR_NVSHMEM_INIT says ----------------------------------

@pytest.mark.parametrize("init", ["nvrar", "nvshmem4py"])
def test_nvshmem_in_force_is_joined_whatever_the_variable_says(init):
    reports = run(2, [dict(NO_N4P, status=2)] * 2, [init, init])
    for rep in reports:
        assert rep["raised"] is None, rep
        assert rep["uids"]["executor"] == "" and "nvshmem_pes" in rep["calls"], rep
    never_called(reports, "unique_id", "n4p_unique_id", "set_symmetric_size_default")


# -- a mixed-mode world ------------------------------------------------------------------------------

@needs_pathfinder
def test_mixed_init_values_fail_on_every_rank():
    reports = run(3, [N4P, N4P, N4P], ["nvrar", "nvshmem4py", "nvshmem4py"])
    all_raise(reports, "the ranks do not come to NVSHMEM alike",
              "ranks [0] would initialize it without nvshmem4py", "ranks [1, 2] would initialize it through nvshmem4py",
              "NVRAR_NVSHMEM_INIT differs: rank 0: nvrar, rank 1: nvshmem4py, rank 2: nvshmem4py")
    never_called(reports, "unique_id", "n4p_unique_id", "GpuExecutor")


def test_one_rank_joining_the_others_initializing_fails_on_every_rank():
    reports = run(3, [NO_N4P, dict(NO_N4P, status=2), NO_N4P], ["nvrar"] * 3)
    all_raise(reports, "ranks [0, 2] would initialize it without nvshmem4py", "ranks [1] have NVSHMEM initialized")
    never_called(reports, "unique_id", "GpuExecutor")


# -- a native failure on one rank, at each step: every rank raises, naming it ------------------------

@pytest.mark.parametrize("step,needle", [
    ("device_count", "rank 2: device='cuda': Planned: device_count failed on rank 2"),
    ("nvshmem_init_status", "rank 2: device='cuda': Planned: nvshmem_init_status failed on rank 2"),
    ("GpuExecutor", "rank 2: GPU executor: Planned: GpuExecutor failed on rank 2"),
])
def test_native_failure_on_one_rank(step, needle):
    reports = run(3, [NO_N4P, NO_N4P, dict(NO_N4P, fail=[step])], ["nvrar"] * 3)
    all_raise(reports, "Communicator setup failed on " + needle)
    if step == "GpuExecutor":  # the ranks whose executor was made give it up (not collectively)
        assert reports[0]["calls"][-2:] == ["GpuExecutor", "abandon"], reports[0]["calls"]
        assert reports[1]["calls"][-2:] == ["GpuExecutor", "abandon"], reports[1]["calls"]
        never_called(reports, "close")
    else:
        never_called(reports, "unique_id", "GpuExecutor")


def test_no_device_on_one_rank():
    reports = run(2, [NO_N4P, dict(NO_N4P, devices=0)], ["nvrar"] * 2)
    all_raise(reports, "rank 1: device='cuda' needs a CUDA device: no CUDA device (stand-in)")
    never_called(reports[1:], "nvshmem_init_status")  # nothing of NVSHMEM without a device
    never_called(reports, "unique_id", "GpuExecutor")


@needs_pathfinder
@pytest.mark.parametrize("step", ["set_symmetric_size_default", "n4p_init"])
def test_nvshmem4py_step_failure_on_one_rank(step):
    reports = run(2, [N4P, dict(N4P, fail=[step])], ["nvshmem4py"] * 2)
    what = "nvshmem4py unique id" if step == "set_symmetric_size_default" else "nvshmem4py init"
    all_raise(reports, f"setup failed on rank 1: {what}: ")
    never_called(reports, "GpuExecutor")
    if step == "n4p_init":  # rank 0 initialized: it keeps NVSHMEM (finalizing would wait for rank 1)
        assert reports[0]["n4p_live"] is True and reports[1]["n4p_live"] is False, reports


# -- the launcher at its deadline (tests/_launch.py, as tests/gpu uses it) ---------------------------

def test_launcher_stops_hung_ranks_with_their_python_stacks():
    """Ranks still running at the launcher's deadline get SIGTERM at once, print every thread's
    Python stack (faulthandler, _worker.py) and end; the launcher says so in their stderr."""
    import signal

    res = launch(2, "fault", {"G": 1, "victim": 1, "mode": "absent", "at": 0, "timeout": 40}, timeout=15)
    for r in res:
        # SIGTERM ends it; SIGKILL only if it was still there KILL_GRACE_S later (a machine overloaded enough)
        assert r.returncode in (-signal.SIGTERM, -signal.SIGKILL), describe(res)
        # the stack of where it was (in the task normally; still importing on a machine overloaded enough)
        assert "(most recent call first):" in r.stderr and "_worker.py" in r.stderr, r.stderr[-3000:]
        assert f"[launch] rank {r.rank} still running at the 15 s test deadline: stopped (SIGTERM" in r.stderr
