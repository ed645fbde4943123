"""The MPI libraries whose MPI_Allreduce nvrar-bench (and benchmarks/latency_check.py) measure
beside the default one: MPICH (the ``mpich`` wheel) and Intel MPI (the ``impi-rt`` wheel).

One process loads one MPI library, so each library runs as a job of its own, under its own
``mpiexec``, with mpi4py bound to it through the mpi4py wheel's MPI-ABI support: the wheel
carries one ``mpi4py.MPI`` extension per ABI (``MPI.openmpi*.so``, ``MPI.mpich*.so``) and picks
the one matching the library it finds; ``MPI4PY_LIBMPI`` names that library (a path), so the
job's ranks load exactly the library whose ``mpiexec`` started them. Intel MPI is MPICH-ABI
compatible, so it runs through ``MPI.mpich*.so`` too.

Where a library is found: ``NVRAR_MPICH_PREFIX`` / ``NVRAR_IMPI_PREFIX`` (the directory given
to ``pip install --prefix``, or any installation prefix with ``lib/libmpi.so.12`` and
``bin/mpiexec``), else the wheel's metadata on ``sys.path`` (its RECORD names the files): the
environment it was installed into, or ``DIR/lib/pythonX.Y/site-packages`` of a ``--prefix DIR``
install on ``PYTHONPATH``. Not ``pip install --target``: it leaves out a wheel's ``lib/`` data
files, where both wheels keep ``libmpi.so.12``. Nothing here loads an MPI library: the launching process stays
free of MPI (docs/configuration.md, "Other MPI libraries").
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from .. import env as _env

__all__ = ["MpiLibrary", "PEERS", "find", "mpi4py_mpich_abi", "job_environment"]

LIBMPI = "libmpi.so.12"  # the MPICH ABI's soname: MPICH's and Intel MPI's library


@dataclass(frozen=True)
class Peer:
    name: str  # the backend's name in nvrar-bench (--backends) and the column in latency_check
    title: str  # what its MPI_Get_library_version() names
    dist: str  # the wheel's distribution name
    variable: str  # NVRAR_*_PREFIX
    install: str  # the command that installs it
    marker: str  # a string its library version must contain
    foreign: Tuple[str, ...]  # strings it must not contain (another library under the same soname)
    env: Dict[str, str] = field(default_factory=dict)  # what its ranks need (docs/configuration.md)


PEERS: Dict[str, Peer] = {
    "mpich": Peer("mpich", "MPICH", "mpich", "NVRAR_MPICH_PREFIX", "pip install mpich", "MPICH Version", ("Intel",)),
    "impi": Peer(
        "impi", "Intel MPI", "impi-rt", "NVRAR_IMPI_PREFIX", "pip install impi-rt==2021.16.1", "Intel(R) MPI", (),
        # One host: shared memory only (no libfabric provider to pick, none probed), hydra
        # starting its proxies by fork (no ssh), and no pinning of the ranks to cores that the
        # benchmark's other jobs do not pin either.
        {"I_MPI_FABRICS": "shm", "I_MPI_HYDRA_BOOTSTRAP": "fork", "I_MPI_PIN": "0"},
    ),
}


@dataclass
class MpiLibrary:
    peer: Peer
    prefix: str
    libmpi: str
    mpiexec: str

    @property
    def name(self) -> str:
        return self.peer.name


def _prefix_variable(peer: Peer) -> Optional[str]:
    if peer.variable == "NVRAR_MPICH_PREFIX":
        return _env.get_str("NVRAR_MPICH_PREFIX")
    return _env.get_str("NVRAR_IMPI_PREFIX")


def _in_prefix(prefix: str) -> Tuple[Optional[str], Optional[str]]:
    """(libmpi, mpiexec) under an installation prefix or a pip --target directory, where there."""
    lib = None
    for cand in (os.path.join(prefix, "lib", LIBMPI), os.path.join(prefix, "lib", "release", LIBMPI)):
        if os.path.isfile(cand):
            lib = cand
            break
    exe = None
    # mpiexec.hydra first: where two wheels share a bin/ (one environment), the plain name may be
    # the other library's launcher
    for cand in ("mpiexec.hydra", "mpiexec"):
        path = os.path.join(prefix, "bin", cand)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            exe = path
            break
    return lib, exe


def _distributions(dist: str) -> Iterator[str]:
    """Directories on sys.path holding the distribution's metadata (NAME-VERSION.dist-info)."""
    norm = dist.replace("-", "_").lower()
    seen = set()
    for entry in sys.path:
        entry = os.path.abspath(entry or os.getcwd())
        if entry in seen or not os.path.isdir(entry):
            continue
        seen.add(entry)
        for info in glob.glob(os.path.join(entry, "*.dist-info")):
            base = os.path.basename(info)[: -len(".dist-info")]
            if base.rsplit("-", 1)[0].replace("-", "_").lower() == norm:
                yield info


def _from_record(info: str) -> Tuple[Optional[str], Optional[str]]:
    """libmpi and mpiexec as the wheel's RECORD lists them (paths relative to its site directory)."""
    lib = exe = hydra = None
    try:
        with open(os.path.join(info, "RECORD")) as f:
            for line in f:
                rel = line.split(",", 1)[0]
                path = os.path.normpath(os.path.join(os.path.dirname(info), rel))
                base = os.path.basename(rel)
                if base == LIBMPI and lib is None and os.path.isfile(path):
                    lib = path
                elif base == "mpiexec.hydra" and os.path.isfile(path):
                    hydra = path
                elif base == "mpiexec" and exe is None and os.path.isfile(path):
                    exe = path
    except OSError:
        pass
    return lib, hydra or exe


def find(name: str) -> Tuple[Optional[MpiLibrary], Optional[str]]:
    """The library of peer ``name`` ("mpich", "impi"), or None and why not (naming what to install
    or set)."""
    peer = PEERS[name]
    how = f"{peer.install} --prefix DIR, then {peer.variable}=DIR"
    prefix = _prefix_variable(peer)
    if prefix is not None:
        lib, exe = _in_prefix(prefix)
        if lib is None or exe is None:
            missing = " and ".join(m for m, ok in ((f"lib/{LIBMPI}", lib), ("bin/mpiexec", exe)) if not ok)
            return None, f"{peer.variable}={prefix} has no {missing} ({how})"
        return MpiLibrary(peer, prefix, lib, exe), None
    for info in _distributions(peer.dist):
        site = os.path.dirname(info)
        lib, exe = _from_record(info)
        if lib is None or exe is None:
            # pip install --target moves the wheel's data files (bin/, lib/) beside its metadata,
            # which its RECORD does not follow; an environment keeps them in its prefix
            for prefix in (site, *_ancestors(site, 3)):
                lib2, exe2 = _in_prefix(prefix)
                if lib2 is not None and exe2 is not None:
                    lib, exe = lib2, exe2
                    break
        if lib is not None and exe is not None:
            return MpiLibrary(peer, os.path.dirname(os.path.dirname(lib)), lib, exe), None
        if os.path.isdir(os.path.join(site, "bin")) and not os.path.isdir(os.path.join(site, "lib")):
            return None, (f"the {peer.dist} wheel at {site} has no lib/{LIBMPI}: pip install --target leaves out "
                          f"a wheel's lib/ files ({how})")
        return None, (f"the {peer.dist} wheel's metadata is at {info} but its lib/{LIBMPI} or bin/mpiexec is "
                      f"not found ({how})")
    return None, f"the {peer.dist} wheel is not installed ({how})"


def _ancestors(path: str, n: int) -> List[str]:
    out = []
    for _ in range(n):
        parent = os.path.dirname(path)
        if parent == path:
            break
        out.append(parent)
        path = parent
    return out


def mpi4py_mpich_abi() -> Optional[str]:
    """None where the mpi4py of this Python can bind to an MPICH-ABI library at run time (the
    mpi4py wheel, 4.1.1 or newer: an ``MPI.mpich*.so`` beside ``MPI.openmpi*.so``), else why not.
    Does not import mpi4py.MPI (that would load an MPI library into this process)."""
    import importlib.util

    spec = importlib.util.find_spec("mpi4py")
    if spec is None or not spec.submodule_search_locations:
        return "mpi4py is not installed (pip install mpi4py)"
    here = list(spec.submodule_search_locations)[0]
    if glob.glob(os.path.join(here, "MPI.mpich.*")):
        return None
    if glob.glob(os.path.join(here, "MPI.*")):
        return (f"the mpi4py at {here} is bound to one MPI library (a build from source); the mpi4py wheel "
                "(pip install --force-reinstall --only-binary mpi4py 'mpi4py>=4.1.1') binds to MPICH and Intel "
                "MPI at run time")
    return f"the mpi4py at {here} has no MPI extension"


# Variables of other launchers that must not reach a job's ranks (a rank would take them for its own)
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "MPI_LOCAL", "HYDRA_", "I_MPI_", "MPICH_", "FI_",
                      "MPI4PY_LIBMPI", "MPI4PY_MPIABI", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def job_environment(lib: Optional[MpiLibrary], base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a job's launcher. ``lib``: a peer library (None: the default job, pip's
    Open MPI). Variables of any other launcher are removed; the user's own I_MPI_* / FI_* /
    MPICH_* settings are kept for the library they belong to."""
    src = dict(os.environ if base is None else base)
    out = {k: v for k, v in src.items()
           if not (k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_NAMES)}
    if lib is None:
        out.update({k: v for k, v in src.items() if k.startswith(("OMPI_MCA_", "OMPI_ALLOW_", "MPI4PY_"))})
        return out
    mine = ("I_MPI_", "FI_") if lib.name == "impi" else ("MPICH_", "MPIR_CVAR_", "HYDRA_", "FI_")
    out.update({k: v for k, v in src.items() if k.startswith(mine)})
    for k, v in lib.peer.env.items():
        out.setdefault(k, v)
    out["MPI4PY_LIBMPI"] = lib.libmpi
    bindir = os.path.dirname(lib.mpiexec)  # hydra finds its proxy (hydra_pmi_proxy) on PATH
    out["PATH"] = bindir + os.pathsep + out.get("PATH", "")
    if lib.name == "impi":
        out.setdefault("I_MPI_ROOT", lib.prefix)
    return out
