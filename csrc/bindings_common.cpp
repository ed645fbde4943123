// What both native modules (nvrar._C, nvrar._cuda) share: C++ errors become nvrar.errors
// exceptions with their structured fields.
#include <pybind11/pybind11.h>

#include "common/error.h"

namespace py = pybind11;

namespace nvrar {

namespace {

const char* kind_name(ProtocolError::Kind k) {
  switch (k) {
    case ProtocolError::Kind::kTimeout: return "timeout";
    case ProtocolError::Kind::kMismatch: return "mismatch";
    case ProtocolError::Kind::kPeerAbort: return "peer-abort";
    case ProtocolError::Kind::kViolation: return "violation";
    case ProtocolError::Kind::kInterrupted: return "interrupted";
  }
  return "unknown";
}

// Raise the Python exception class `cls` of nvrar.errors with a message and keyword fields.
void raise_python(const char* cls, const char* msg, const py::dict& fields) {
  py::object type = py::module_::import("nvrar.errors").attr(cls);
  py::object exc = type(msg, **fields);
  PyErr_SetObject(type.ptr(), exc.ptr());
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const ProtocolError& e) {
    py::dict f;
    f["rank"] = e.rank;
    f["peer"] = e.peer;
    f["phase"] = phase_name(e.phase);
    f["step"] = e.step;
    f["epoch"] = e.epoch;
    f["observed"] = e.observed;
    f["kind"] = kind_name(e.kind);
    raise_python(e.is_timeout() ? "NvrarTimeoutError" : "NvrarError", e.what(), f);
  } catch (const Error& e) {
    raise_python("NvrarError", e.what(), py::dict());
  }
}

}  // namespace

void register_error_translator() { py::register_exception_translator(&translate); }

// The Python error of a C++ exception, for functions bound without pybind11's dispatch (which
// applies `translate` and its own defaults): nvrar's errors as above, a pending Python error as
// it is, others as pybind11 maps them (MemoryError, RuntimeError).
void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const Error&) {
    translate(p);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "nvrar: unknown C++ exception");
  }
}

}  // namespace nvrar
