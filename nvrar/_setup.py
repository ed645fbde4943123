"""Setting a Communicator up: the agreement of every rank on its settings (over the bootstrap),
then the CPU executor (shared-memory segments inside a host, UCX between hosts) or the GPU
executor (NVSHMEM).

Every step that can fail on one rank alone exchanges its verdict before the next collective
step, so that every rank raises at construction and none waits for another. Every executor
value is passed by keyword from nvrar.settings: the native executors have no defaults.
"""

from __future__ import annotations

import array
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import NvrarError
from .settings import AGREED, SECRET_BYTES, STREAM_STAGING_CODES, Settings

__all__ = ["exchange", "agree", "setup_cpu", "setup_gpu", "cuda_device", "find_ucx", "preload_ucx",
           "route_device", "sweep_dead_segments", "KILL_POINTS", "NATIVE_KILL_POINTS", "kill_point", "die_at"]

UCX_EXTRA = "pip install 'nvrar[ucx]'"

_log = logging.getLogger("nvrar")

# Testing (tests/test_setup_faults.py): the points of a CPU communicator's set-up, in the order a
# rank passes them, where NVRAR_TEST_KILL_AT=<point> makes it SIGKILL itself. NATIVE_KILL_POINTS
# lie in csrc/cpu (ShmHeap's constructor between shm_open, ftruncate, posix_fallocate and mmap;
# the executor's constructor; attach with the first peer mapped), the others in Communicator's
# constructor and here, around every exchange. From "after-attach-status" on, the other ranks
# may complete their set-up (the dead rank is then met by their first call).
KILL_POINTS = ("bootstrap", "before-settings", "after-settings", "before-executor", "shm-opened", "shm-sized",
               "shm-reserved", "shm-mapped", "executor-built", "before-segment", "after-segment", "attach-mapped",
               "before-attach-status", "after-attach-status", "after-unlink", "before-close", "constructed")
NATIVE_KILL_POINTS = frozenset({"shm-opened", "shm-sized", "shm-reserved", "shm-mapped", "executor-built",
                                "attach-mapped"})


def kill_point() -> Tuple[str, str]:
    """(the point NVRAR_TEST_KILL_AT names, "") or ("", why it is bad); "" where it is unset. Read
    once per set-up (Communicator's constructor): nothing of it is left on the call path."""
    from . import env

    point = (env.get_str("NVRAR_TEST_KILL_AT") or "").strip()
    if point and point not in KILL_POINTS:
        return "", f"NVRAR_TEST_KILL_AT={point!r}: expected one of {', '.join(KILL_POINTS)}"
    return point, ""


def die_at(armed: str, point: str) -> None:
    """Testing: SIGKILL this process where ``armed`` (kill_point()) names ``point``."""
    if armed == point:
        os.kill(os.getpid(), signal.SIGKILL)


def exchange(boot: Any, settings: Optional[Settings], env_error: str, single_host: bool,
             kill_at: str = "") -> Tuple[int, bytes]:
    """Exchange every rank's settings (or its error in them), host and launcher; returns the
    ranks per node every rank agrees on and rank 0's session secret (ValueError / NvrarError,
    alike on every rank, if they do not agree). ``kill_at``: kill_point()."""
    mine = {
        "host": socket.gethostname(),
        "launcher": boot.launcher_local_size,
        "error": env_error,
        "settings": settings.agreed() if settings is not None else None,
        # The session secret every rank's segment carries and every attaching rank checks.
        "secret": os.urandom(SECRET_BYTES).hex() if boot.rank == 0 else "",
    }
    die_at(kill_at, "before-settings")
    infos = boot.allgather_json(mine, "settings")
    die_at(kill_at, "after-settings")
    boot.hosts = [str(i["host"]) for i in infos]  # for setup_cpu: which ranks share a host
    bad = [(r, i["error"]) for r, i in enumerate(infos) if i["error"]]
    if bad:
        raise ValueError("Communicator: bad settings on " + "; ".join(f"rank {r}: {e}" for r, e in bad))
    return agree(infos, single_host), bytes.fromhex(infos[0]["secret"])


def agree(infos: Sequence[Dict[str, Any]], single_host: bool = True) -> int:
    """Ranks per node, identical on every rank (every rank evaluates the same list). Ranks may
    span hosts on either device (the CPU executor reaches other hosts over UCX, setup_cpu);
    ``single_host`` is kept for the callers' signature and no longer restricts anything."""
    W = len(infos)
    for key, name in AGREED.items():
        values = {json.dumps(i["settings"][key]) for i in infos}
        if len(values) > 1:
            per_rank = ", ".join(f"rank {r}: {i['settings'][key]}" for r, i in enumerate(infos))
            raise ValueError(f"Communicator: ranks disagree on {name} ({per_rank}); pass the same value everywhere")
    hosts = [i["host"] for i in infos]
    G = infos[0]["settings"]["ranks_per_node"]
    if G is None:
        launcher = {i["launcher"] for i in infos}
        G = launcher.pop() if len(launcher) == 1 and None not in launcher else hosts.count(hosts[0])
        if G is None or W % G != 0:
            G = W
    if G > W or W % G != 0:
        raise ValueError(f"ranks_per_node={G} must divide the world size {W}")
    # Node-major numbering: the ranks of one (real) node must form whole emulated nodes.
    for start in range(0, W, G):
        if len(set(hosts[start:start + G])) > 1:
            raise NvrarError(f"Communicator: ranks {start}..{start + G - 1} form one node but run on hosts "
                             f"{sorted(set(hosts[start:start + G]))}; number ranks node by node (rank = node * "
                             f"ranks_per_node + local rank)")
    return int(G)


def _raise_failed(statuses: Sequence[Dict[str, Any]]) -> None:
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if s["error"]]
    if failed:
        raise NvrarError("Communicator setup failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed))


def _loaded_ucs() -> List[str]:
    """The libucs files mapped into this process (from /proc/self/maps; [] where it cannot be read)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/libucs.so" in line}
    except (OSError, IndexError):
        return []
    return sorted(p for p in paths if p.startswith("/"))


def preload_ucx() -> None:
    """Load the libucx wheel's UCX now, if it is installed and mpi4py has not loaded MPI yet.

    Open MPI's wheel links its own, older UCX (libucs.so.0 & co. of the same sonames); loaded first,
    it takes the place of the wheel's for every later library that needs those sonames, and nvrar's
    UCX then fails to load or misbehaves. Loaded first, the wheel's UCX serves both (Open MPI's
    ob1/tcp path does not care). bootstrap.create calls it before importing mpi4py where the
    launcher says the ranks span hosts, nvrar-bench's ranks before theirs; never raises."""
    if "mpi4py.MPI" in sys.modules:
        return
    try:
        import libucx

        libucx.load_library()
    except Exception:  # not installed, or it does not load here: find_ucx says why, if UCX is needed
        pass


def find_ucx() -> Tuple[str, str]:
    """(path of libucp from the libucx-cu12 wheel, "") or ("", why not)."""
    from . import _C

    if not getattr(_C, "UCX_COMPILED", False):
        return "", (f"this nvrar was built without UCX's headers; reinstall it ({UCX_EXTRA}, with the "
                    "libucx-cu12 wheel in the build environment)")
    try:
        import libucx
    except ImportError:
        return "", f"UCX is not installed: {UCX_EXTRA}"
    lib = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
    if not os.path.isfile(lib):
        return "", f"the libucx wheel at {os.path.dirname(libucx.__file__)} has no lib/libucp.so.0: {UCX_EXTRA}"
    wheel_dir = os.path.realpath(os.path.dirname(lib))
    loaded = [os.path.dirname(os.path.realpath(p)) for p in _loaded_ucs()]
    if loaded and wheel_dir not in loaded:
        return "", (f"another UCX ({_loaded_ucs()[0]}, e.g. the one Open MPI's wheel bundles) was loaded into this "
                    "process before the libucx wheel's, and the two cannot share it (same sonames): load the wheel's "
                    "first (`import libucx; libucx.load_library()` before `from mpi4py import MPI`)")
    try:
        libucx.load_library()  # its libucs/libuct, loaded the way the wheel intends
    except OSError as exc:
        return "", f"UCX's libraries do not load ({exc}): {UCX_EXTRA}"
    return lib, ""


def _interface_of(ip: str) -> str:
    """The network interface that holds address ``ip`` (IPv4), or ""."""
    for _, name in socket.if_nameindex():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                req = struct.pack("256s", name.encode()[:15])
                addr = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
        except OSError:
            continue
        if socket.inet_ntoa(array.array("B", addr[20:24]).tobytes()) == ip:
            return name
    return ""


def route_device(host: Optional[str]) -> str:
    """The interface this host reaches ``host`` (MASTER_ADDR) through, for UCX_NET_DEVICES, or ""
    (then UCX picks among all devices)."""
    if not host:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # no packet is sent: the kernel picks the route
            local = s.getsockname()[0]
    except OSError:
        return ""
    return _interface_of(local)


def _host_indices(hosts: Sequence[str]) -> List[int]:
    order: Dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def setup_cpu(boot: Any, rank: int, world: int, G: int, st: Settings, secret: bytes, kill_at: str = "",
              cma_adapt: bool = False) -> Any:
    """The CPU executor, attached to every rank's segment on this host and, across hosts,
    connected over UCX to the ranks of the others. On failure this rank's segment is unlinked;
    those of ranks that died during the set-up go with sweep_dead_segments() (the Communicator
    runs it wherever its set-up failed). ``kill_at``: kill_point()."""
    from . import _C
    from . import env as _env

    if len(secret) != SECRET_BYTES:
        raise NvrarError(f"Communicator: rank 0 sent a session secret of {len(secret)} bytes, "
                         f"expected {SECRET_BYTES}")
    hosts: List[str] = list(getattr(boot, "hosts", None) or [socket.gethostname()] * world)
    host_of = _host_indices(hosts)
    multi = len(set(host_of)) > 1
    if multi:
        st = st.across_hosts()
    # Creating the segment can fail on one rank alone (/dev/shm full, UCX missing): the verdicts
    # travel with the names, so that every rank raises at construction and none waits for another.
    ex = None
    created = {"segment": "", "error": "", "link": ""}
    libucp, why = find_ucx() if multi else ("", "")
    if why:
        created["error"] = (f"ranks run on {len(set(hosts))} hosts ({', '.join(sorted(set(hosts)))}) and the CPU "
                            f"executor reaches other hosts over UCX, but {why}")
    try:
        die_at(kill_at, "before-executor")
        try:
            if not why:
                ex = _C.CpuExecutor(
                    rank=rank, world=world, ranks_per_node=G, max_bytes=st.max_bytes, pool_bytes=st.heap_bytes,
                    oneshot_max_bytes=st.oneshot_max(G), timeout_s=st.timeout_s, jitter_us=st.jitter_us,
                    jitter_seed=st.jitter_seed, cma=st.cma, cma_min_bytes=st.cma_min_bytes,
                    cma_piece_bytes=st.cma_piece_bytes, ll_max_bytes=st.ll_max_bytes, secret=secret,
                    hd_min_bytes=st.hd_min(multi), test_kill_at=kill_at if kill_at in NATIVE_KILL_POINTS else "",
                    cma_adapt=cma_adapt and not multi, cpu_spread=st.cpu_spread,
                    stream_staging=STREAM_STAGING_CODES[st.stream_staging],
                    oneshot_adapt_max_bytes=0 if multi else st.oneshot_adapt_max(G, world // G),
                    test_algorithm_flip=(_env.get_int("NVRAR_TEST_ALGORITHM_FLIP") or 0) != 0)
                created["segment"] = ex.segment_name
                if multi:
                    dev = route_device(os.environ.get("MASTER_ADDR"))
                    created["link"] = ex.open_hosts(libucp, host_of, dev).hex()
        except NvrarError as exc:
            created["error"] = str(exc)
        die_at(kill_at, "before-segment")
        everyone = boot.allgather_json(created, "segment")
        die_at(kill_at, "after-segment")
        _raise_failed(everyone)
        assert ex is not None
        mine = host_of[rank]
        if multi:
            _connect_hosts(boot, ex, [bytes.fromhex(s["link"]) if host_of[r] != mine else b""
                                      for r, s in enumerate(everyone)], st.timeout_s)
        names = [s["segment"] if host_of[r] == mine else "" for r, s in enumerate(everyone)]
        status = {"error": "", "cma": False}
        try:
            ex.attach(names)
            status["cma"] = bool(ex.probe_cma())
        except NvrarError as exc:
            status["error"] = str(exc)
        die_at(kill_at, "before-attach-status")
        statuses = boot.allgather_json(status, "attach status")
        die_at(kill_at, "after-attach-status")
        # Every rank has mapped every segment (or failed trying): the names go, this rank's and
        # every one it mapped, so that a rank killed now, before its own unlink, leaves nothing
        # (the others complete their set-up and meet its death in their first call).
        ex.unlink_segments()
        die_at(kill_at, "after-unlink")
        _raise_failed(statuses)
        # Cross-memory access only if every rank can reach every other (all decide alike).
        ex.enable_cma(all(s["cma"] for s in statuses))
    except BaseException:
        if ex is not None:
            ex.unlink_segment()
            ex.close()
        raise
    return ex


def sweep_dead_segments() -> None:
    """Unlink this user's segments in /dev/shm whose creator is dead: a rank killed during a set-up
    leaves its own (it never reached its unlink). Run by the ranks of a failed CPU set-up before
    they raise, so that nothing of it is left once they have (the next set-up would run it too)."""
    from . import _C

    removed = _C.sweep_dead_segments()
    if removed:
        _log.info("nvrar: removed %d shared-memory segment(s) of ranks that died during set-up", removed)


def _connect_hosts(boot: Any, ex: Any, blobs: List[bytes], timeout: float) -> None:
    """Endpoints to the ranks of other hosts, connected before the first call (NOTE [wire-up],
    csrc/cpu/ucx.cpp): a thread drives UCX until every rank passed the barrier behind it."""
    status = {"error": ""}
    try:
        ex.connect_hosts(blobs)
    except NvrarError as exc:
        status["error"] = str(exc)
    ex.start_wireup()
    try:
        if not status["error"]:
            status["error"] = ex.wait_wired(timeout)
        statuses = boot.allgather_json(status, "UCX wire-up")
    finally:
        ex.stop_wireup()
    _raise_failed(statuses)


def cuda_device(rank: int, G: int, count: int) -> int:
    """This rank's CUDA device: torch's current device when torch has set one up, else the
    launcher's local rank (LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK), else rank mod G."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value) % count
    return (rank % G) % count


# Testing: a stand-in for the native side of setup_gpu, called instead of nvrar._gpu's loaders:
# () -> ((GPU module or None, why not), (nvshmem.core or None, why not)). tests/_gpu_setup_tasks.py
# sets it inside real worker processes, so that the verdict exchange below runs over the real store
# without a GPU; None (the real modules) in every other use.
NATIVE_STANDIN: Optional[Callable[[], Tuple[Tuple[Any, Optional[str]], Tuple[Any, Optional[str]]]]] = None

INIT_CHOICES = ("auto", "nvrar", "nvshmem4py")


def _natives(choice: str) -> Tuple[Tuple[Any, Optional[str]], Tuple[Any, Optional[str]]]:
    """((GPU module, why not), (nvshmem.core, why not)). With NVRAR_NVSHMEM_INIT=nvrar, nvshmem4py is
    imported only where this process imported it already (its initialization may be in force, to be
    joined): nvrar's own initialization then depends on nothing of nvshmem4py's stack."""
    if NATIVE_STANDIN is not None:
        return NATIVE_STANDIN()
    from . import _gpu

    loaded = _gpu.load()
    if loaded[0] is None:
        return loaded, (None, None)
    if choice == "nvrar" and "nvshmem.core" not in sys.modules:
        return loaded, (None, "not imported (NVRAR_NVSHMEM_INIT=nvrar)")
    return loaded, _gpu.nvshmem4py()


def _init_choice() -> Tuple[str, str]:
    """(NVRAR_NVSHMEM_INIT, "") or ("", why it is bad)."""
    from . import env

    value = (env.get_str("NVRAR_NVSHMEM_INIT") or "auto").lower()
    if value not in INIT_CHOICES:
        return "", f"NVRAR_NVSHMEM_INIT={value!r}: expected one of {', '.join(INIT_CHOICES)}"
    return value, ""


def _verdict(boot: Any, what: str, step: Callable[[], Any], shared: bool = False) -> Any:
    """step() on this rank, its failure (any exception) exchanged with every rank's verdict: where
    no rank failed, returns what step() returned (``shared``: every rank's value, a JSON-able one,
    in rank order), else raises NvrarError naming every rank that failed, on every rank (none is
    left waiting in a later collective)."""
    out, mine = None, {"error": "", "value": None}
    try:
        out = step()
    except Exception as exc:  # noqa: BLE001 - native and nvshmem4py errors of any type travel as text
        mine["error"] = f"{what}: {exc if isinstance(exc, NvrarError) else f'{type(exc).__name__}: {exc}'}"
    if shared:
        mine["value"] = out
    everyone = boot.allgather_json(mine, what)
    _raise_failed(everyone)
    return [s["value"] for s in everyone] if shared else out


def setup_gpu(boot: Any, rank: int, world: int, G: int, st: Settings) -> Tuple[Any, int]:
    """(the GPU executor, this rank's CUDA device). NVSHMEM is joined where this process has it
    initialized already (nvshmem4py, by the user), else initialized as NVRAR_NVSHMEM_INIT says:
    through nvshmem4py where it is installed (auto) or always (nvshmem4py), or by nvrar itself
    (nvrar, or auto without nvshmem4py); docs/gpu/executor.md, "nvrar and nvshmem4py"."""
    from . import _gpu

    # Everything that can fail locally is checked, and the verdicts exchanged, before the
    # collective NVSHMEM setup: a rank must not leave the others waiting in it. No NVSHMEM call
    # is made before a CUDA device is known to be there (without one, NVSHMEM ends the process).
    choice, bad_choice = _init_choice()
    (mod, err), (core, core_err) = _natives(choice) if not bad_choice else ((None, bad_choice), (None, None))
    status: Dict[str, Any] = {"error": f"device='cuda': {err}" if mod is None else "", "device": -1, "mode": "",
                              "by": "", "init": choice}
    if mod is not None:
        try:
            n, why = mod.device_count()
            if n == 0:
                status["error"] = f"device='cuda' needs a CUDA device: {why}"
            else:
                status["device"] = cuda_device(rank, G, n)
                status.update(_nvshmem_mode(mod, core, rank, world, choice, core_err))
        except Exception as exc:  # noqa: BLE001 - a native failure here is this rank's verdict
            status["error"] = f"device='cuda': {type(exc).__name__}: {exc}"
    statuses = boot.allgather_json(status, "device status")
    _raise_failed(statuses)
    _check_modes(statuses)
    assert mod is not None
    device = int(status["device"])
    mode = status["mode"]
    uid = b""
    n4p_ref = False
    if mode == "nvrar":
        # Rank 0's unique id travels with every rank's verdict: its failure is raised on every rank.
        uid = bytes.fromhex(_verdict(boot, "NVSHMEM unique id", lambda: mod.unique_id().hex() if rank == 0 else "",
                                     shared=True)[0])
    elif mode == "nvshmem4py":
        def size_and_uid() -> str:
            # NVSHMEM sizes its heap when nvshmem4py initializes it: nvrar's default first.
            mod.set_symmetric_size_default(rank=rank, world=world, ranks_per_node=G, max_bytes=st.max_bytes,
                                           pool_bytes=st.heap_bytes, oneshot_max_bytes=st.oneshot_max(G, world // G),
                                           ll_max_bytes=st.ll_max_bytes, max_blocks=st.max_blocks)
            return _gpu.Nvshmem4pyInit.unique_id(core).hex() if rank == 0 else ""

        uid = bytes.fromhex(_verdict(boot, "nvshmem4py unique id", size_and_uid, shared=True)[0])
        # A rank that initialized keeps NVSHMEM when another failed (finalizing would wait for it).
        _verdict(boot, "nvshmem4py init", lambda: _gpu.Nvshmem4pyInit.init(core, device, rank, world, uid))
        n4p_ref = _gpu.Nvshmem4pyInit.acquire()
        uid = b""
    else:  # "join": over the NVSHMEM initialized in this process (by the user, or by an earlier communicator)
        n4p_ref = _gpu.Nvshmem4pyInit.acquire()

    def construct() -> Any:
        return mod.GpuExecutor(
            rank=rank, world=world, ranks_per_node=G, device=device, max_bytes=st.max_bytes, pool_bytes=st.heap_bytes,
            oneshot_max_bytes=st.oneshot_max(G, world // G), ll_max_bytes=st.ll_max_bytes, timeout_s=st.timeout_s,
            max_blocks=st.max_blocks, threads=st.threads, block_bytes=st.block_bytes, channels=st.channels, uid=uid)

    # The constructor is collective (NVSHMEM's init, nvshmem_malloc, a barrier): where it returned
    # on some ranks and raised on others, those holding an executor give it up (abandon: not
    # collective) and raise with the others, naming the ranks that failed.
    held: List[Any] = []
    try:
        _verdict(boot, "GPU executor", lambda: held.append(construct()))
    except BaseException:
        for ex in held:
            ex.abandon()
        if n4p_ref:
            _gpu.Nvshmem4pyInit.release(finalize=False)
        raise
    ex = held[0]
    for line in mod.env_set_by_nvrar():
        _log.info("nvrar: set %s (not set by the user)", line)
    if mode != "nvrar":
        _log.info("nvrar: NVSHMEM %s (%s)", "joined" if mode == "join" else "initialized through nvshmem4py",
                  status["by"] or "nvshmem4py")
    return _gpu.Executor(ex, n4p_ref), device


def _nvshmem_mode(mod: Any, core: Any, rank: int, world: int, choice: str = "auto",
                  core_error: Optional[str] = None) -> Dict[str, Any]:
    """How this rank comes to NVSHMEM ("join", "nvshmem4py" or "nvrar") and what is wrong with it, if
    anything: the same host library for nvrar and nvshmem4py, the PE numbering of an NVSHMEM in force.
    ``choice`` (NVRAR_NVSHMEM_INIT) decides only where NVSHMEM is not initialized yet: one in force
    is joined whatever it says."""
    from . import _gpu

    out: Dict[str, Any] = {"mode": "", "by": "", "error": ""}
    if core is not None:
        why = _gpu.library_mismatch(mod, core)
        if why:
            out["error"] = f"device='cuda': {why}"
            return out
    lib_status = mod.nvshmem_init_status()
    n4p = core is not None and _gpu.nvshmem4py_initialized(core)
    by = "nvshmem4py" if n4p else "another library in this process"
    if _gpu.Nvshmem4pyInit.live:
        by = "nvrar, through nvshmem4py"
    if lib_status == 1:
        out["error"] = (f"device='cuda': NVSHMEM in this process was bootstrapped but not initialized (status 1, by "
                        f"{by}); nvrar does not complete it")
    elif lib_status >= 2:
        pe, npes = mod.nvshmem_pes()
        out.update(mode="join", by=by)
        bound = _gpu.nvshmem4py_device(core) if n4p else None
        if bound is not None:
            out["device"] = bound  # the device nvshmem4py's init bound NVSHMEM to, not nvrar's own choice
        if (pe, npes) != (rank, world):
            out["error"] = (f"device='cuda': NVSHMEM (initialized by {by}) runs this process as PE {pe} of {npes}, but "
                            f"the communicator has it as rank {rank} of {world}; create the communicator over the "
                            f"same processes in the same order as NVSHMEM's PEs")
    elif n4p:
        out["error"] = "device='cuda': nvshmem4py says it is initialized but NVSHMEM's status is 0 (not initialized)"
    elif choice == "nvshmem4py" and core is None:
        out["error"] = (f"device='cuda': NVRAR_NVSHMEM_INIT=nvshmem4py but nvshmem4py is not usable here: "
                        f"{core_error or 'it does not import'}")
    elif choice == "nvrar":
        out["mode"] = "nvrar"
    else:
        out["mode"] = "nvshmem4py" if core is not None else "nvrar"
    return out


def _check_modes(statuses: Sequence[Dict[str, Any]]) -> None:
    """Every rank must come to NVSHMEM the same way: all joining one in force, or all initializing
    it, through nvshmem4py on every rank or on none."""
    modes = [s["mode"] for s in statuses]
    if len(set(modes)) <= 1:
        return
    by_mode: Dict[str, list] = {}
    for r, m in enumerate(modes):
        by_mode.setdefault(m, []).append(r)
    words = {"join": "have NVSHMEM initialized already", "nvshmem4py": "would initialize it through nvshmem4py",
             "nvrar": "would initialize it without nvshmem4py (not installed there, or NVRAR_NVSHMEM_INIT=nvrar)"}
    choices = [s.get("init", "auto") for s in statuses]
    differ = ("; NVRAR_NVSHMEM_INIT differs: " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(choices))
              if len(set(choices)) > 1 else "")
    raise NvrarError("Communicator(device='cuda'): the ranks do not come to NVSHMEM alike: " + "; ".join(
        f"ranks {rs} {words.get(m, m)}" for m, rs in sorted(by_mode.items())) + differ +
        "; initialize NVSHMEM on every rank or on none, install nvshmem4py on every rank or on none, and set "
        "NVRAR_NVSHMEM_INIT alike everywhere")
