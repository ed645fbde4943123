"""The dtype, op, algorithm and error-kind codes are defined once, in csrc/, and exported by the
bindings (nvrar._C.DTYPE_CODES, OP_CODES, ALGORITHM_CODES, ELEMENT_SIZES): no second definition
anywhere in csrc/, and the exported tables agree with the enums and with numpy."""

import re
from pathlib import Path

import numpy as np

from nvrar import _C

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"})
ENUMS = {"DType": "types.h", "RedOp": "types.h", "Algorithm": "plan.h"}
ENUMERATORS = ("kFloat32", "kFloat16", "kBFloat16", "kInt32", "kSum", "kMax", "kMin", "kAvg", "kAuto", "kTwoShot",
               "kOneShot", "kTimeout", "kMismatch", "kPeerAbort", "kViolation", "kInterrupted")


def _text(p: Path) -> str:
    return p.read_text()


def test_each_enum_is_defined_once():
    for name, home in ENUMS.items():
        where = [p.name for p in SOURCES if re.search(rf"enum class {name}\b", _text(p))]
        assert where == [home], f"enum class {name} defined in {where}, expected only in {home}"


def test_no_code_is_written_out_a_second_time():
    # An enumerator given a number outside its enum's definition, or a *Code constant set to a
    # literal (the device's copy of ProtocolError::Kind), is a second definition.
    assign = re.compile(r"\b(" + "|".join(ENUMERATORS) + r")\s*=\s*\d")
    literal_code = re.compile(r"\bk\w+Code\s*=\s*\d")
    enum_body = re.compile(r"enum class \w+\s*:\s*\w+\s*\{[^}]*\}")
    for p in SOURCES:
        # Enum bodies are the definitions; blank them out, keeping the line count.
        text = enum_body.sub(lambda m: "\n" * m.group(0).count("\n"), _text(p))
        for i, line in enumerate(text.splitlines(), 1):
            assert not assign.search(line), f"{p.name}:{i}: a code outside its enum: {line.strip()}"
            assert not literal_code.search(line), f"{p.name}:{i}: a code written as a literal: {line.strip()}"
            # Comparing a code with an integer cast of an enumerator keeps a second, untyped copy.
            assert not re.search(r"==\s*static_cast<int>\((DType|RedOp|Algorithm)::", line), f"{p.name}:{i}: {line.strip()}"


def _enum_values(name: str) -> dict:
    text = _text(CSRC / "protocol" / ENUMS[name])
    body = re.search(rf"enum class {name}\s*:\s*\w+\s*\{{([^}}]*)\}}", text).group(1)
    return {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}


def test_exported_tables_match_the_enums():
    dt = _enum_values("DType")
    assert _C.DTYPE_CODES == {"float32": dt["kFloat32"], "float16": dt["kFloat16"], "bfloat16": dt["kBFloat16"],
                              "int32": dt["kInt32"]}
    op = _enum_values("RedOp")
    assert _C.OP_CODES == {"sum": op["kSum"], "max": op["kMax"], "min": op["kMin"], "avg": op["kAvg"]}
    al = _enum_values("Algorithm")
    assert _C.ALGORITHM_CODES == {"auto": al["kAuto"], "two-shot": al["kTwoShot"], "one-shot": al["kOneShot"]}
    for name, code in _C.DTYPE_CODES.items():
        np_name = "uint16" if name == "bfloat16" else name  # numpy has no bfloat16: same width
        assert _C.ELEMENT_SIZES[code] == np.dtype(np_name).itemsize, name
    assert sorted(_C.ELEMENT_SIZES) == sorted(_C.DTYPE_CODES.values())
