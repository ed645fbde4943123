// Built instead of the CUDA part when nvcc is absent (or NVRAR_CUDA=0): the module reports that
// it has no GPU executor.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace nvrar {

void register_cuda(py::module_& m) {
  m.def("build_info", []() {
    py::dict d;
    d["cuda"] = false;
    d["nvshmem_version"] = py::none();
    d["cuda_archs"] = py::list();
    d["cpu_executor"] = true;
    return d;
  });
}

}  // namespace nvrar
