// nvrar._cuda: the GPU executor's module definition (host compiler only; see gpu_api.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../common/error.h"
#include "gpu_api.h"

namespace py = pybind11;
using namespace nvrar;

namespace nvrar {
void register_error_translator();  // ../bindings_common.cpp
}

namespace {
// The fields of a GpuConfig that fix the segment's layout, as both the symmetric-size default and
// the executor take them from Python.
gpu::GpuConfig layout_config(int rank, int world, int ranks_per_node, size_t max_bytes, size_t pool_bytes,
                             size_t oneshot_max_bytes, size_t ll_max_bytes, int max_blocks) {
  gpu::GpuConfig c;
  c.rank = rank;
  c.world = world;
  c.ranks_per_node = ranks_per_node;
  c.max_bytes = max_bytes;
  c.pool_bytes = pool_bytes;
  c.oneshot_max_bytes = oneshot_max_bytes;
  c.ll_max_bytes = ll_max_bytes;
  c.max_blocks = max_blocks;
  return c;
}
}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "nvrar GPU executor (CUDA kernels over NVSHMEM); see nvrar/_cuda.pyi";
  register_error_translator();

  m.def("build_info", []() {
    py::dict d;
    d["cuda"] = true;
    d["nvshmem_version"] = gpu::nvshmem_header_version();
    d["cuda_archs"] = gpu::cuda_archs();
    return d;
  });
  m.def("nvshmem_library_version", &gpu::nvshmem_library_version);
  m.def("nvshmem_library_path", &gpu::nvshmem_library_path);
  m.def("nvshmem_pes", []() {
    const std::vector<int> p = gpu::nvshmem_pes();
    return py::make_tuple(p[0], p[1]);
  });
  m.def("device_count", []() {
    std::string why;
    const int n = gpu::device_count(&why);
    return py::make_tuple(n, why);
  });
  m.def("unique_id", []() { return py::bytes(gpu::unique_id()); });
  m.def("env_set_by_nvrar", &gpu::env_set_by_nvrar);
  m.def(
      "set_symmetric_size_default",
      [](int rank, int world, int ranks_per_node, size_t max_bytes, size_t pool_bytes, size_t oneshot_max_bytes,
         size_t ll_max_bytes, int max_blocks) {
        gpu::set_symmetric_size_default(layout_config(rank, world, ranks_per_node, max_bytes, pool_bytes,
                                                      oneshot_max_bytes, ll_max_bytes, max_blocks));
      },
      py::arg("rank"), py::arg("world"), py::arg("ranks_per_node"), py::arg("max_bytes"), py::arg("pool_bytes"),
      py::arg("oneshot_max_bytes"), py::arg("ll_max_bytes"), py::arg("max_blocks"));
  m.def("nvshmem_init_status", &gpu::nvshmem_init_status);
  m.def(
      "nvshmem_reduce",
      [](uintptr_t dst, uintptr_t src, size_t count, int dtype, int op, uintptr_t stream) {
        gpu::nvshmem_reduce(dst, src, count, static_cast<DType>(dtype), static_cast<RedOp>(op), stream);
      },
      py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"),
      py::call_guard<py::gil_scoped_release>());

  py::class_<gpu::GpuExecutor>(m, "GpuExecutor")
      .def(py::init([](int rank, int world, int ranks_per_node, int device, size_t max_bytes, size_t pool_bytes,
                       size_t oneshot_max_bytes, size_t ll_max_bytes, double timeout_s, int max_blocks, int threads,
                       size_t block_bytes, int channels, py::bytes uid) {
             gpu::GpuConfig c = layout_config(rank, world, ranks_per_node, max_bytes, pool_bytes, oneshot_max_bytes,
                                              ll_max_bytes, max_blocks);
             c.device = device;
             c.timeout_s = timeout_s;
             c.threads = threads;
             c.block_bytes = block_bytes;
             c.channels = channels;
             std::string id = uid;
             py::gil_scoped_release release;  // collective: the other ranks need the GIL-free time
             return new gpu::GpuExecutor(c, id);
           }),
           py::arg("rank"), py::arg("world"), py::arg("ranks_per_node"), py::arg("device"), py::arg("max_bytes"),
           py::arg("pool_bytes"), py::arg("oneshot_max_bytes"), py::arg("ll_max_bytes"), py::arg("timeout_s"),
           py::arg("max_blocks"), py::arg("threads"), py::arg("block_bytes"), py::arg("channels"), py::arg("uid"))
      .def(
          "all_reduce",
          [](gpu::GpuExecutor& ex, uintptr_t in, uintptr_t out, size_t count, int dtype, int op, int algorithm,
             uintptr_t stream) {
            ex.all_reduce(in, out, count, static_cast<DType>(dtype), static_cast<RedOp>(op),
                          static_cast<Algorithm>(algorithm), stream);
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("algorithm"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_add_rms_norm",
          [](gpu::GpuExecutor& ex, uintptr_t x, uintptr_t residual, uintptr_t weight, size_t rows, size_t h,
             int dtype, float eps, int algorithm, uintptr_t stream) {
            ex.all_reduce_add_rms_norm(x, residual, weight, rows, h, static_cast<DType>(dtype), eps,
                                       static_cast<Algorithm>(algorithm), stream);
          },
          py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("rows"), py::arg("h"), py::arg("dtype"),
          py::arg("eps"), py::arg("algorithm"), py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("check", &gpu::GpuExecutor::check, py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("resolve",
           [](const gpu::GpuExecutor& ex, int algorithm, size_t bytes) {
             return static_cast<int>(ex.resolve(static_cast<Algorithm>(algorithm), bytes));
           })
      .def_property_readonly("epoch", &gpu::GpuExecutor::epoch)
      .def_property_readonly("pool_address", &gpu::GpuExecutor::pool_address)
      .def_property_readonly("pool_bytes", &gpu::GpuExecutor::pool_bytes)
      .def("symmetric", &gpu::GpuExecutor::symmetric, py::arg("ptr"), py::arg("nbytes"))
      .def_property_readonly("max_bytes", [](const gpu::GpuExecutor& ex) { return ex.config().max_bytes; })
      .def("close", &gpu::GpuExecutor::close, py::call_guard<py::gil_scoped_release>())
      .def("abandon", &gpu::GpuExecutor::abandon);
}
