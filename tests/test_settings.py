"""One definition of every code and default (issue 12): the Python tables are the native module's
codes, the defaults live in nvrar/settings.py only, and the old spellings of `algorithm` still work
(with a DeprecationWarning)."""

from __future__ import annotations

import ast
import os
import re
import warnings

import numpy as np
import pytest

import nvrar
from nvrar import _arrays, _C, env, selector, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "nvrar")


# -- codes: defined once, in C++, exported by the bindings -----------------------------------------

def test_python_tables_are_the_native_codes():
    assert _C.DTYPE_CODES == {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3}
    assert _C.OP_CODES == {"sum": 0, "max": 1, "min": 2, "avg": 3}
    assert _C.ALGORITHM_CODES == {"auto": 0, "two-shot": 1, "one-shot": 2}
    assert _arrays.DTYPE_CODES == _C.DTYPE_CODES and _arrays.OP_CODES == _C.OP_CODES
    assert selector.ALGORITHMS == _C.ALGORITHM_CODES
    assert _arrays.ELEMENT_SIZE == _C.ELEMENT_SIZES
    assert set(selector.SUPPORTED_DTYPES) == set(_C.DTYPE_CODES) and set(selector.SUPPORTED_OPS) == set(_C.OP_CODES)
    for name, code in _C.DTYPE_CODES.items():
        if name != "bfloat16":  # numpy has none
            assert _arrays.numpy_dtype_code(np.dtype(name)) == code
            assert np.dtype(name).itemsize == _C.ELEMENT_SIZES[code]
    torch = pytest.importorskip("torch")
    for name, code in _C.DTYPE_CODES.items():
        assert _arrays.torch_dtype_code(getattr(torch, name)) == code
        assert getattr(torch, name).itemsize == _C.ELEMENT_SIZES[code]
    for name, code in _C.OP_CODES.items():
        assert _arrays.op_code(name) == code == _arrays.op_code(getattr(torch.distributed.ReduceOp, name.upper()))
    for name, code in _C.ALGORITHM_CODES.items():
        assert selector.algorithm_code(name) == code and selector.algorithm_name(code) == name


def _package_sources():
    for base, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(base, f)
                with open(path) as fh:
                    yield os.path.relpath(path, ROOT), fh.read()


_CODE_NAMES = "|".join(re.escape(n) for n in [*_C.DTYPE_CODES, *_C.OP_CODES, *_C.ALGORITHM_CODES])
_SECOND_DEFINITIONS = [
    # an integer code spelled out: "two-shot": 1, "sum": 0, ...
    re.compile(rf"[\"']({_CODE_NAMES})[\"']\s*:\s*\d"),
    # DTYPE_FLOAT32, ... = 0, 1, 2, 3 / OP_SUM = 0 / VARIANT_AUTO = 0
    re.compile(r"^\s*(DTYPE|OP|VARIANT|ALGORITHM)\w*(\s*,\s*\w+)*\s*=\s*\d", re.M),
    re.compile(r"= 0, 1, 2, 3"),
]


def second_code_definitions(text):
    return [m.group(0) for rx in _SECOND_DEFINITIONS for m in rx.finditer(text)]


def test_no_code_is_written_out_in_python():
    found = {path: hits for path, text in _package_sources() if (hits := second_code_definitions(text))}
    assert not found, f"integer codes written out in Python (use nvrar._C's dicts): {found}"


# Byte sizes nvrar/*.py may spell out that are not settings: the size suffixes of the parser and
# the limits of the rendezvous store's wire protocol.
_BYTE_LITERALS_ALLOWED = {"env.py": re.compile(r"_SUFFIX = \{.*?\}", re.S), "_store.py": None}


def repeated_defaults(name, text):
    """Byte sizes (n << k) and the default timeout spelled out in a module other than settings.py."""
    if name == "settings.py":
        return []
    if name in _BYTE_LITERALS_ALLOWED:
        allowed = _BYTE_LITERALS_ALLOWED[name]
        if allowed is None:
            return []
        text = allowed.sub("", text)
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    hits = re.findall(r"\b\d+\s*<<\s*\d+\b", code)
    hits += re.findall(rf"(?<![\w.]){re.escape(repr(settings.TIMEOUT_S))}(?![\w.])", code)
    return hits


def test_no_default_is_repeated_outside_settings():
    found = {}
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py"):
            with open(os.path.join(PKG, name)) as f:
                hits = repeated_defaults(name, f.read())
            if hits:
                found[name] = hits
    assert not found, f"defaults spelled out outside nvrar/settings.py: {found}"


def test_the_checks_find_the_old_second_definitions():
    """The two checks above fail on the code as it was (the tables of nvrar/_arrays.py, selector.py
    and communicator.py before issue 12)."""
    old_arrays = "DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16, DTYPE_INT32 = 0, 1, 2, 3\nOP_SUM, OP_MAX = 0, 1\n"
    old_selector = 'VARIANTS = {"auto": 0, "two-shot": 1, "one-shot": 2}\n'
    old_comm = '_DEFAULT_MAX_BYTES = {"cpu": 4 << 20, "cuda": 16 << 20}\ntimeout = 60.0 if timeout is None else t\n'
    assert len(second_code_definitions(old_arrays)) >= 2
    assert len(second_code_definitions(old_selector)) == 3
    assert repeated_defaults("communicator.py", old_comm) == ["4 << 20", "16 << 20", "60.0"]


# -- defaults: one settings object ----------------------------------------------------------------

def test_environment_texts_are_the_settings_defaults():
    v = env.VARIABLES
    for name, per_device in (("NVRAR_MAX_BYTES", settings.MAX_BYTES), ("NVRAR_HEAP_BYTES", settings.HEAP_BYTES),
                             ("NVRAR_LL_MAX_BYTES", settings.LL_MAX_BYTES)):
        parts = dict(reversed(p.rstrip(")").split(" (")) for p in v[name].default.split(", "))
        assert {"cpu": env.parse_bytes(parts["CPU"]), "cuda": env.parse_bytes(parts["GPU"])} == per_device, name
    assert float(v["NVRAR_TIMEOUT_S"].default) == settings.TIMEOUT_S
    assert env.parse_bytes(v["NVRAR_CMA_MIN_BYTES"].default) == settings.CMA_MIN_BYTES
    assert v["NVRAR_ALGORITHM"].default == settings.ALGORITHM
    assert float(v["NVRAR_JITTER_US"].default) == settings.JITTER_US
    assert int(v["NVRAR_JITTER_SEED"].default) == settings.JITTER_SEED
    assert bool(int(v["NVRAR_CMA"].default)) == settings.CMA
    assert bool(int(v["NVRAR_CPU_SPREAD"].default)) == settings.CPU_SPREAD


def test_cpu_spread_setting(monkeypatch):
    # NOTE [moving apart] (csrc/cpu/executor.cpp): on by default, NVRAR_CPU_SPREAD=0 turns it off;
    # read for the CPU executor only.
    monkeypatch.delenv("NVRAR_CPU_SPREAD", raising=False)
    assert env.resolve("cpu").cpu_spread is settings.CPU_SPREAD is True
    monkeypatch.setenv("NVRAR_CPU_SPREAD", "0")
    assert env.resolve("cpu").cpu_spread is False
    assert env.resolve("cuda").cpu_spread is settings.CPU_SPREAD
    monkeypatch.setenv("NVRAR_CPU_SPREAD", "1")
    assert env.resolve("cpu").cpu_spread is True
    monkeypatch.setenv("NVRAR_CPU_SPREAD", "yes")
    with pytest.raises(ValueError, match="NVRAR_CPU_SPREAD"):
        env.resolve("cpu")


def test_stream_staging_setting(monkeypatch):
    # NOTE [streaming stage-in] (csrc/cpu/executor.cpp): auto by default, 0 / 1 fix the kind;
    # read for the CPU executor only; anything else raises, naming the variable.
    v = env.VARIABLES
    assert v["NVRAR_STREAM_STAGING"].default == settings.STREAM_STAGING == "auto"
    monkeypatch.delenv("NVRAR_STREAM_STAGING", raising=False)
    assert env.resolve("cpu").stream_staging == "auto"
    for value in ("0", "1", "auto"):
        monkeypatch.setenv("NVRAR_STREAM_STAGING", value)
        assert env.resolve("cpu").stream_staging == value
        assert settings.STREAM_STAGING_CODES[value] in (-1, 0, 1)
    monkeypatch.setenv("NVRAR_STREAM_STAGING", "yes")
    assert env.resolve("cuda").stream_staging == "auto"  # not read there
    with pytest.raises(ValueError, match="NVRAR_STREAM_STAGING"):
        env.resolve("cpu")


def test_gpu_channels_default_override_and_agreement(monkeypatch):
    # GPU_LAUNCH["channels"] is the default; NVRAR_GPU_CHANNELS overrides it (GPU only), 1 to 4, and
    # is one of the values every rank must agree on.
    assert 1 <= settings.GPU_LAUNCH["channels"] <= settings.GPU_MAX_CHANNELS == 4
    assert env.resolve("cuda").channels == settings.GPU_LAUNCH["channels"]
    assert env.VARIABLES["NVRAR_GPU_CHANNELS"].default == str(settings.GPU_LAUNCH["channels"])
    assert settings.AGREED["channels"] == "NVRAR_GPU_CHANNELS"
    for value in ("1", "3", "4"):
        monkeypatch.setenv("NVRAR_GPU_CHANNELS", value)
        st = env.resolve("cuda")
        assert st.channels == int(value) and st.agreed()["channels"] == int(value)
    for bad in ("0", "5", "-1", "two"):
        monkeypatch.setenv("NVRAR_GPU_CHANNELS", bad)
        with pytest.raises(ValueError, match="NVRAR_GPU_CHANNELS"):
            env.resolve("cuda")
    # The CPU executor sends per slice: it neither reads nor checks the variable.
    assert env.resolve("cpu").channels == settings.GPU_LAUNCH["channels"]


def test_resolve_arguments_then_environment_then_defaults(monkeypatch):
    for device in ("cpu", "cuda"):
        st = env.resolve(device)
        assert (st.max_bytes, st.heap_bytes, st.ll_max_bytes) == (
            settings.MAX_BYTES[device], settings.HEAP_BYTES[device], settings.LL_MAX_BYTES[device])
        assert st.timeout_s == settings.TIMEOUT_S and st.algorithm == settings.ALGORITHM
        assert (st.cma_min_bytes, st.cma_piece_bytes) == (settings.CMA_MIN_BYTES, settings.CMA_PIECE_BYTES)
        assert (st.max_blocks, st.threads, st.block_bytes, st.channels) == tuple(settings.GPU_LAUNCH.values())
    assert env.resolve("cpu").oneshot_max(2) == settings.CPU_ONESHOT_MAX[2]
    assert env.resolve("cuda").oneshot_max(8) == settings.GPU_ONESHOT_MAX
    # Across nodes the GPU's threshold knows the node count (the wire model's choice): one-shot only
    # for the smallest messages, smaller with more nodes and GPUs per node; the CPU's does not.
    gpu = env.resolve("cuda")
    assert gpu.oneshot_max(4, 1) == settings.GPU_ONESHOT_MAX_SMALL_G
    assert gpu.oneshot_max(4, 2) == gpu.oneshot_max(8, 2) == settings.GPU_ONESHOT_MAX_NODES
    assert gpu.oneshot_max(2, 4) == settings.GPU_ONESHOT_MAX_NODES
    assert gpu.oneshot_max(4, 4) == gpu.oneshot_max(8, 16) == settings.GPU_ONESHOT_MAX_MANY_NODES_LARGE_G
    assert all(gpu.oneshot_max(g, n) < 128 << 10 for g in (2, 4, 8) for n in (2, 4, 8, 16))
    assert env.resolve("cpu").oneshot_max(2, 4) == settings.CPU_ONESHOT_MAX[2]
    monkeypatch.setenv("NVRAR_MAX_BYTES", "64K")
    monkeypatch.setenv("NVRAR_ONESHOT_MAX_BYTES", "2K")
    assert env.resolve("cpu").max_bytes == 65536
    assert env.resolve("cpu", max_bytes=4096).max_bytes == 4096
    assert env.resolve("cpu").oneshot_max(2) == 2048
    with pytest.raises(dataclasses_frozen_error()):
        env.resolve("cpu").max_bytes = 1  # type: ignore[misc]
    with nvrar.Communicator(heap_bytes=1 << 20) as c:
        assert c.settings == env.resolve("cpu", heap_bytes=1 << 20)
        assert c.max_bytes == 65536


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def _keywords_of_call(source_path, callee):
    with open(source_path) as f:
        tree = ast.parse(f.read())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(callee)]
    assert len(calls) == 1, (callee, len(calls))
    assert not calls[0].args, f"{callee} must be called with keyword arguments only"
    return {k.arg for k in calls[0].keywords}


def _stub_parameters(stub, cls):
    with open(os.path.join(PKG, stub)) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
            return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
    raise AssertionError(cls)


def test_executors_get_every_value_by_keyword():
    """The native executors have no defaults (csrc): _setup passes every parameter by name."""
    setup = os.path.join(PKG, "_setup.py")
    cpu = _keywords_of_call(setup, "CpuExecutor")
    assert cpu == _stub_parameters("_C.pyi", "CpuExecutor")
    doc = _C.CpuExecutor.__init__.__doc__
    assert all(f"{name}:" in doc for name in cpu), doc  # the binding's own names
    assert _keywords_of_call(setup, "GpuExecutor") == _stub_parameters("_cuda.pyi", "GpuExecutor")


# -- one name: algorithm (old spellings deprecated) ------------------------------------------------

def test_algo_keyword_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="algo= is deprecated"):
        c = nvrar.Communicator(algo="two-shot")
    with c:
        assert c.algorithm_for(8) == "two-shot"
        with pytest.warns(DeprecationWarning, match="algo= is deprecated"):
            assert c.algorithm_for(8, algo="one-shot") == "one-shot"
        x = np.ones(16, np.float32)
        with pytest.warns(DeprecationWarning, match="all_reduce: algo= is deprecated"):
            c.all_reduce(x, algo="one-shot")
        with pytest.raises(ValueError, match="three-shot"), pytest.warns(DeprecationWarning):
            c.all_reduce(x, algo="three-shot")
        with pytest.raises(TypeError, match="disagree"):
            c.all_reduce(x, algorithm="two-shot", algo="one-shot")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c.all_reduce(x, algorithm="one-shot")
            assert c.algorithm_for(8, "one-shot") == "one-shot"
    with pytest.raises(TypeError, match="disagree"):
        nvrar.Communicator(algorithm="two-shot", algo="one-shot")


def test_nvrar_algo_variable_is_a_deprecated_alias(monkeypatch):
    monkeypatch.setenv("NVRAR_ALGORITHM", "one-shot")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nvrar.Communicator() as c:
            assert c.algorithm_for(1 << 20) == "one-shot" and c.settings.algorithm == "one-shot"
    monkeypatch.delenv("NVRAR_ALGORITHM")
    monkeypatch.setenv("NVRAR_ALGO", "two-shot")
    with pytest.warns(DeprecationWarning, match="NVRAR_ALGO is deprecated"):
        c = nvrar.Communicator()
    with c:
        assert c.algorithm_for(8) == "two-shot"
    monkeypatch.setenv("NVRAR_ALGORITHM", "one-shot")
    with pytest.warns(DeprecationWarning, match="NVRAR_ALGORITHM is set and wins"):
        c = nvrar.Communicator()
    with c:
        assert c.algorithm_for(8) == "one-shot"


def test_cross_memory_threshold_by_oversubscription(monkeypatch):
    """More ranks than cores: only large shards go by cross-memory transfer unless
    NVRAR_CMA_MIN_BYTES says otherwise; with enough cores, or set explicitly, the threshold is the
    setting's."""
    st = env.resolve("cpu")
    assert settings.cpu_cma_min_bytes(st, 2, 2, False) == st.cma_min_bytes == settings.CMA_MIN_BYTES
    assert settings.cpu_cma_min_bytes(st, 4, 2, False) == settings.CMA_MIN_BYTES_OVERSUBSCRIBED
    assert settings.CMA_MIN_BYTES < settings.CMA_MIN_BYTES_OVERSUBSCRIBED < st.max_bytes
    assert settings.cpu_cma_min_bytes(st, 4, 2, True) == st.cma_min_bytes
    monkeypatch.setenv("NVRAR_CMA_MIN_BYTES", "64")
    assert settings.cpu_cma_min_bytes(env.resolve("cpu"), 8, 2, True) == 64


def test_oneshot_adapt_range_by_layout_and_variables(monkeypatch):
    """NOTE [one-shot or two-shot]: the leader's choice covers 2 ranks on one node up to 1 MB by
    default; none with other G, several nodes or the GPU; NVRAR_ONESHOT_ADAPT_MAX_BYTES sets it (0
    off), and an explicit NVRAR_ONESHOT_MAX_BYTES turns it off unless that is set too. It is one
    of the values every rank must agree on."""
    for name in ("NVRAR_ONESHOT_ADAPT_MAX_BYTES", "NVRAR_ONESHOT_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    st = env.resolve("cpu")
    assert st.oneshot_adapt_max(2) == settings.CPU_ONESHOT_ADAPT_MAX[2] == 1 << 20
    assert st.oneshot_adapt_max(2) > st.oneshot_max(2)
    assert st.oneshot_adapt_max(4) == 0 and st.oneshot_adapt_max(2, nodes=2) == 0
    assert env.resolve("cuda").oneshot_adapt_max(2) == 0
    monkeypatch.setenv("NVRAR_ONESHOT_MAX_BYTES", "64K")
    assert env.resolve("cpu").oneshot_adapt_max(2) == 0
    monkeypatch.setenv("NVRAR_ONESHOT_ADAPT_MAX_BYTES", "512K")
    st = env.resolve("cpu")
    assert st.oneshot_adapt_max(2) == 512 << 10 and st.oneshot_adapt_max(4) == 512 << 10
    assert st.oneshot_adapt_max(4, nodes=2) == 0
    monkeypatch.setenv("NVRAR_ONESHOT_ADAPT_MAX_BYTES", "0")
    assert env.resolve("cpu").oneshot_adapt_max(2) == 0
    assert settings.AGREED["oneshot_adapt_max_bytes"] == "NVRAR_ONESHOT_ADAPT_MAX_BYTES"
    assert env.VARIABLES["NVRAR_TEST_ALGORITHM_FLIP"].meaning.startswith("Testing:")
