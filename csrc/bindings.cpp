// nvrar._C: the module definition only. Raw pointers, counts and dtype/op codes in; no torch
// headers, so the module builds in seconds against any torch (or none). Python wraps it
// (nvrar/communicator.py); the signatures are listed in nvrar/_C.pyi.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>
#include <unistd.h>
#if defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23  // Linux 5.14+; an older kernel answers EINVAL (then /proc/self/maps decides)
#endif

#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "cpu/executor.h"
#include "cpu/line_probe.h"
#include "cpu/reduce_kernels.h"
#include "cpu/stream_copy.h"
#include "cpu/way_choice.h"
#include "protocol/ll.h"
#include "protocol/plan.h"
#include "protocol/types.h"

namespace py = pybind11;
using namespace nvrar;

namespace nvrar {
void register_error_translator();                 // bindings_common.cpp
void set_python_error(std::exception_ptr p);      // bindings_common.cpp
bool ucx_compiled();               // cpu/ucx.cpp
}

namespace {

unsigned long g_main_thread = 0;  // ident of the interpreter's main thread (the one that runs signal handlers)

// The exception a signal handler raised during a call, kept until the call has unwound.
struct PendingSignal {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};

// The GIL of a call, released on demand (at once for a large message, else when one of its
// waits stops spinning: see NOTE [waiting] in csrc/cpu/executor.cpp) and taken back when the
// call returns or unwinds, before pybind11 touches any Python object.
struct LazyGil {
  PyThreadState* saved = nullptr;
  void release() {
    if (saved == nullptr) saved = PyEval_SaveThread();
  }
  void take() {
    if (saved != nullptr) PyEval_RestoreThread(saved);
    saved = nullptr;
  }
  ~LazyGil() { take(); }
};

struct CallHooks {
  PendingSignal pending;
  LazyGil gil;
};

// Interrupt hook of the executor's waits (called on the main thread only, after the block hook
// released the GIL).
bool run_signal_handlers(void* ctx, std::string* why) {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  auto* pending = &static_cast<CallHooks*>(ctx)->pending;
  PyErr_Fetch(&pending->type, &pending->value, &pending->traceback);
  const char* name = pending->type != nullptr ? reinterpret_cast<PyTypeObject*>(pending->type)->tp_name : "an exception";
  *why = std::string("interrupted: a signal handler raised ") + name + " while this rank waited";
  return true;
}

void release_gil(void* ctx) { static_cast<CallHooks*>(ctx)->gil.release(); }

// Messages up to this size keep the GIL until a wait stops spinning: the whole call takes a few
// microseconds, less than a release and retake of the GIL cost a thread that waits for it.
constexpr size_t kLazyGilBytes = 64 << 10;

// CpuExecutor.all_reduce, called with the GIL held. The GIL is released while the call waits
// (NOTE [waiting]); on the main thread its waits come back to the interpreter about every 50 ms
// to run signal handlers. A handler that raises (SIGINT: KeyboardInterrupt) stops the call: the
// executor aborts the peers, then the handler's exception is what this call raises.
void cpu_all_reduce(CpuExecutor& ex, uintptr_t in, uintptr_t out, size_t count, int dtype, int op, int algorithm) {
  CallHooks hooks;
  const bool main_thread = PyThread_get_thread_ident() == g_main_thread;
  const Interrupt intr{main_thread ? &run_signal_handlers : nullptr, &hooks, &release_gil};
  const int es = dtype_size(static_cast<DType>(dtype));
  if (count > kLazyGilBytes / static_cast<size_t>(es > 0 ? es : 1)) hooks.gil.release();
  try {
    ex.all_reduce(reinterpret_cast<const void*>(in), reinterpret_cast<void*>(out), count, static_cast<DType>(dtype),
                  static_cast<RedOp>(op), static_cast<Algorithm>(algorithm), &intr);
  } catch (const ProtocolError&) {
    if (hooks.pending.type == nullptr) throw;
  }
  hooks.gil.take();
  if (hooks.pending.type != nullptr) {
    PyErr_Restore(hooks.pending.type, hooks.pending.value, hooks.pending.traceback);
    throw py::error_already_set();
  }
}

// nvrar._C.cpu_all_reduce(executor, in_ptr, out_ptr, count, dtype, op, algorithm): the same call
// as CpuExecutor.all_reduce, for Communicator.all_reduce's per-call path, without pybind11's
// argument dispatch, which cost about 170 of a one-rank 8 KB call's 1,230 ns (2026-12-04, AMD
// EPYC KVM guest: a pybind11 function took 57 ns with one int argument, 150 with four).
PyObject* cpu_all_reduce_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_Format(PyExc_TypeError, "cpu_all_reduce: 7 positional arguments, got %zd", nargs);
    return nullptr;
  }
  CpuExecutor* ex = nullptr;
  try {
    ex = py::handle(args[0]).cast<CpuExecutor*>();
  } catch (const py::cast_error&) {
    ex = nullptr;
  }
  if (ex == nullptr) {
    PyErr_SetString(PyExc_TypeError, "cpu_all_reduce: the first argument must be a CpuExecutor");
    return nullptr;
  }
  unsigned long long u[3];
  long v[3];
  for (int i = 0; i < 3; ++i) {
    u[i] = PyLong_AsUnsignedLongLong(args[1 + i]);
    if (u[i] == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
  }
  for (int i = 0; i < 3; ++i) {
    v[i] = PyLong_AsLong(args[4 + i]);
    if (v[i] == -1 && PyErr_Occurred()) return nullptr;
    if (v[i] < INT_MIN || v[i] > INT_MAX) {
      PyErr_SetString(PyExc_OverflowError, "cpu_all_reduce: a code out of range");
      return nullptr;
    }
  }
  try {
    cpu_all_reduce(*ex, static_cast<uintptr_t>(u[0]), static_cast<uintptr_t>(u[1]), static_cast<size_t>(u[2]),
                   static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[2]));
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef g_cpu_all_reduce_def = {"cpu_all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&cpu_all_reduce_fastcall)),
                                    METH_FASTCALL, "CpuExecutor.all_reduce without pybind11's dispatch (the per-call path)"};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nvrar native core: the CPU executor and the plan (see nvrar/_C.pyi)";
  register_error_translator();
  m.attr("cpu_all_reduce") = py::reinterpret_steal<py::object>(PyCFunction_New(&g_cpu_all_reduce_def, nullptr));
  // The codes of csrc/protocol/types.h and plan.h, for Python to derive its tables from (one definition).
  m.attr("DTYPE_CODES") = py::dict(py::arg("float32") = static_cast<int>(DType::kFloat32), py::arg("float16") = static_cast<int>(DType::kFloat16), py::arg("bfloat16") = static_cast<int>(DType::kBFloat16), py::arg("int32") = static_cast<int>(DType::kInt32));
  m.attr("OP_CODES") = py::dict(py::arg("sum") = static_cast<int>(RedOp::kSum), py::arg("max") = static_cast<int>(RedOp::kMax), py::arg("min") = static_cast<int>(RedOp::kMin), py::arg("avg") = static_cast<int>(RedOp::kAvg));
  m.attr("ALGORITHM_CODES") = py::dict(py::arg("auto") = static_cast<int>(Algorithm::kAuto), py::arg("two-shot") = static_cast<int>(Algorithm::kTwoShot), py::arg("one-shot") = static_cast<int>(Algorithm::kOneShot));
  {
    py::dict sizes;
    for (DType t : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32}) sizes[py::int_(static_cast<int>(t))] = dtype_size(t);
    m.attr("ELEMENT_SIZES") = sizes;
  }
  m.attr("UCX_COMPILED") = ucx_compiled();
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

  py::class_<CpuExecutor>(m, "CpuExecutor")
      .def(py::init([](int rank, int world, int ranks_per_node, size_t max_bytes, size_t pool_bytes,
                       size_t oneshot_max_bytes, double timeout_s, double jitter_us, uint64_t jitter_seed, bool cma,
                       size_t cma_min_bytes, size_t cma_piece_bytes, size_t ll_max_bytes, py::bytes secret,
                       size_t hd_min_bytes, const std::string& test_kill_at, bool cma_adapt,
                       bool cpu_spread, int stream_staging, size_t oneshot_adapt_max_bytes,
                       bool test_algorithm_flip) {
             if (stream_staging < -1 || stream_staging > 1)
               throw py::value_error("CpuExecutor: stream_staging must be -1 (chosen by call times), 0 or 1, got " +
                                     std::to_string(stream_staging));
             CpuConfig c;
             c.rank = rank;
             c.world = world;
             c.ranks_per_node = ranks_per_node;
             c.max_bytes = max_bytes;
             c.pool_bytes = pool_bytes;
             c.oneshot_max_bytes = oneshot_max_bytes;
             c.timeout_s = timeout_s;
             c.jitter_us = jitter_us;
             c.jitter_seed = jitter_seed;
             c.cma = cma;
             c.cma_min_bytes = cma_min_bytes;
             c.cma_piece_bytes = cma_piece_bytes;
             c.ll_max_bytes = ll_max_bytes;
             c.secret = secret;
             c.hd_min_bytes = hd_min_bytes;
             c.test_kill_at = test_kill_at;
             c.cma_adapt = cma_adapt;
             c.cpu_spread = cpu_spread;
             c.stream_staging = stream_staging;
             c.oneshot_adapt_max_bytes = oneshot_adapt_max_bytes;
             c.test_algorithm_flip = test_algorithm_flip;
             return new CpuExecutor(c);
           }),
           py::arg("rank"), py::arg("world"), py::arg("ranks_per_node"), py::arg("max_bytes"),
           py::arg("pool_bytes"), py::arg("oneshot_max_bytes"), py::arg("timeout_s"), py::arg("jitter_us"),
           py::arg("jitter_seed"), py::arg("cma"), py::arg("cma_min_bytes"), py::arg("cma_piece_bytes"),
           py::arg("ll_max_bytes"), py::kw_only(), py::arg("secret"), py::arg("hd_min_bytes"), py::arg("test_kill_at"),
           py::arg("cma_adapt"), py::arg("cpu_spread"), py::arg("stream_staging"),
           py::arg("oneshot_adapt_max_bytes") = 0, py::arg("test_algorithm_flip") = false)
      .def_property_readonly("segment_name", &CpuExecutor::segment_name)
      .def("attach", &CpuExecutor::attach, py::arg("names"))
      .def(
          "open_hosts",
          [](CpuExecutor& ex, const std::string& libucp, const std::vector<int>& host_of, const std::string& dev) {
            return py::bytes(ex.open_hosts(libucp, host_of, dev));
          },
          py::arg("libucp"), py::arg("host_of"), py::arg("net_device"))
      .def("connect_hosts", &CpuExecutor::connect_hosts, py::arg("blobs"))
      .def("start_wireup", &CpuExecutor::start_wireup)
      .def("wait_wired", &CpuExecutor::wait_wired, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
      .def("stop_wireup", &CpuExecutor::stop_wireup, py::call_guard<py::gil_scoped_release>())
      .def("link_transports", &CpuExecutor::link_transports, py::arg("rank"))
      .def("_debug_forge", &CpuExecutor::debug_forge, py::arg("rank"), py::arg("what"))
      .def("link_progress", &CpuExecutor::link_progress)
      .def("set_phase_timing", &CpuExecutor::set_phase_timing, py::arg("on"))
      .def("take_phase_times",
           [](CpuExecutor& ex) {
             const PhaseTimes t = ex.take_phase_times();
             py::dict d;
             d["calls"] = t.calls;
             d["call_ns"] = t.call_ns;
             d["wait_ns"] = t.wait_ns;
             d["reduce_ns"] = t.reduce_ns;
             d["copy_ns"] = t.copy_ns;
             d["cma_ns"] = t.cma_ns;
             d["signal_ns"] = t.signal_ns;
             d["remote_ns"] = t.remote_ns;
             return d;
           })
      .def("link_refused", &CpuExecutor::link_refused)
      .def("link_landings", &CpuExecutor::link_landings)
      .def("is_remote", &CpuExecutor::remote, py::arg("rank"))
      .def("unlink_segment", &CpuExecutor::unlink_segment)
      .def("unlink_segments", &CpuExecutor::unlink_segments)
      .def("probe_cma", &CpuExecutor::probe_cma)
      .def("enable_cma", &CpuExecutor::enable_cma, py::arg("on"))
      .def_property_readonly("cma_enabled", &CpuExecutor::cma_enabled)
      .def(
          "all_reduce",
          [](CpuExecutor& ex, uintptr_t in, uintptr_t out, size_t count, int dtype, int op, int algorithm) {
            cpu_all_reduce(ex, in, out, count, dtype, op, algorithm);
          },
          py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
          py::arg("algorithm"))
      .def("mark_closed", &CpuExecutor::mark_closed)
      .def(
          "all_reduce_add_rms_norm",
          [](CpuExecutor& ex, uintptr_t x, uintptr_t residual, uintptr_t weight, size_t rows, size_t h, int dtype,
             float eps, int algorithm) {
            ex.all_reduce_add_rms_norm(reinterpret_cast<void*>(x), reinterpret_cast<void*>(residual),
                                       reinterpret_cast<const void*>(weight), rows, h, static_cast<DType>(dtype), eps,
                                       static_cast<Algorithm>(algorithm));
          },
          py::arg("x_ptr"), py::arg("residual_ptr"), py::arg("weight_ptr"), py::arg("rows"), py::arg("h"),
          py::arg("dtype"), py::arg("eps"), py::arg("algorithm"), py::call_guard<py::gil_scoped_release>())
      .def("resolve",
           [](const CpuExecutor& ex, int algorithm, size_t bytes) {
             return static_cast<int>(ex.resolve(static_cast<Algorithm>(algorithm), bytes));
           })
      .def_property_readonly("pool_address", [](const CpuExecutor& ex) { return reinterpret_cast<uintptr_t>(ex.pool_base()); })
      .def_property_readonly("pool_bytes", &CpuExecutor::pool_bytes)
      .def_property_readonly("epoch", &CpuExecutor::epoch)
      .def_property_readonly("cpu_moves", &CpuExecutor::cpu_moves)
      .def_property_readonly("way_calls", &CpuExecutor::way_calls)
      .def_property_readonly("stage_calls", &CpuExecutor::stage_calls)
      .def_property_readonly("algorithm_calls", &CpuExecutor::algorithm_calls)
      .def_property_readonly("streamed_bytes", &CpuExecutor::streamed_bytes)
      .def_property_readonly("failed", &CpuExecutor::failed)
      .def_property_readonly("failure", &CpuExecutor::failure)
      .def_property_readonly("max_bytes", [](const CpuExecutor& ex) { return ex.config().max_bytes; })
      .def_property_readonly("segment_bytes", [](const CpuExecutor& ex) { return ex.segment_layout().total_bytes; })
      .def("close", &CpuExecutor::close, py::call_guard<py::gil_scoped_release>());

  // Address of a contiguous buffer-protocol object (numpy arrays): the per-call path's cheap
  // alternative to __array_interface__, which builds a dict on every access.
  m.def("sweep_dead_segments", &sweep_dead_segments,
        "Unlink the shared-memory segments of this user whose creator is dead; returns how many went");
  // The write probe of nvrar/_arrays.py (writable_range) for memory outside torch's allocator,
  // run on every call with such a tensor: madvise(MADV_POPULATE_WRITE) of its first and last
  // page (faults them in writable, writes nothing). True: both pages may be written. False: the
  // kernel refused or lacks the advice; Python then reads /proc/self/maps. From Python through
  // ctypes the two calls cost about 3.4 us on a KVM guest; here, two system calls.
  m.def("write_probe", [](uintptr_t ptr, size_t nbytes) {
#ifdef MADV_POPULATE_WRITE
    if (nbytes == 0) return true;
    static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t first = ptr & ~(page - 1), last = (ptr + nbytes - 1) & ~(page - 1);
    if (madvise(reinterpret_cast<void*>(first), page, MADV_POPULATE_WRITE) != 0) return false;
    return last == first || madvise(reinterpret_cast<void*>(last), page, MADV_POPULATE_WRITE) == 0;
#else
    (void)ptr;
    (void)nbytes;
    return false;
#endif
  }, py::arg("ptr"), py::arg("nbytes"));
  m.def("buffer_address", [](py::handle obj) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_ANY_CONTIGUOUS) != 0) throw py::error_already_set();
    const uintptr_t addr = reinterpret_cast<uintptr_t>(view.buf);
    PyBuffer_Release(&view);
    return addr;
  });

  // The plan, for the symbolic tests and for diagnostics.
  m.def("shard_range",
        [](size_t count, int elem_size, int G, int g) {
          Range r = shard_range(count, elem_size, G, g);
          return py::make_tuple(r.begin, r.end);
        },
        py::arg("count"), py::arg("elem_size"), py::arg("ranks_per_node"), py::arg("local"));
  m.def("inter_schedule",
        [](int N, int node) {
          InterSchedule s = InterSchedule::make(N, node);
          py::list steps;
          for (int i = 0; i < s.num_steps(); ++i) {
            InterStep st = s.step(i);
            py::dict d;
            d["partner"] = st.partner;
            d["send"] = st.send;
            d["recv"] = st.recv;
            d["combine"] = st.combine;
            d["mine_first"] = st.mine_first;
            d["slot"] = st.slot;
            steps.append(d);
          }
          return steps;
        },
        py::arg("num_nodes"), py::arg("node"));
  m.def("chunk_slice",
        [](size_t n, size_t chunk_elems, int elem_size, int B, int b) {
          Range r = SegmentLayout::chunk_slice(n, chunk_elems, elem_size, B, b);
          return py::make_tuple(r.begin, r.end);
        },
        py::arg("count"), py::arg("chunk_elems"), py::arg("elem_size"), py::arg("slices"), py::arg("slice"));
  m.def("inter_final_slot", [](int N, int node) { return InterSchedule::make(N, node).final_slot(); });
  m.def("inter_num_slots", [](int N) { return InterSchedule::num_slots_for(N); });
  // NOTE [cross-memory or staged]: the ways the executor's choice gives a run of calls of one
  // size class whose call j takes times[j] = (staged, cross-memory) ns per byte and ends at
  // ends_ns[j] (way_choice.h; none: call j ends at j us, calls close enough that no time is stale).
  m.def(
      "way_choice_trace",
      [](const std::vector<std::pair<double, double>>& times, const std::vector<double>& ends_ns) {
        NVRAR_CHECK(ends_ns.empty() || ends_ns.size() == times.size(), "way_choice_trace: ", ends_ns.size(),
                    " end times for ", times.size(), " calls");
        std::vector<int> out(times.size());
        way_choice_trace([&](uint64_t j, int way) { return way == 0 ? times[j].first : times[j].second; },
                         [&](uint64_t j) { return ends_ns.empty() ? 1e3 * static_cast<double>(j) : ends_ns[j]; },
                         out.data(), out.size());
        return out;
      },
      py::arg("times"), py::arg("ends_ns") = std::vector<double>{});
  // A mark of the host's state for benchmark records (line_probe.h): ns per cache-line round trip
  // between two CPUs, one figure per rep (each the mean of `trips` round trips).
  m.def("line_round_trip_ns",
        [](int cpu_a, int cpu_b, int trips, int reps, double deadline_s) {
          py::gil_scoped_release unlocked;
          return line_round_trip_ns(cpu_a, cpu_b, trips, reps, deadline_s);
        },
        py::arg("cpu_a"), py::arg("cpu_b"), py::arg("trips") = 2000, py::arg("reps") = 5, py::arg("deadline_s") = 5.0);
  // stream_copy (stream_copy.h) of `src` to byte `offset` of a fresh 64-byte-aligned buffer
  // pre-filled with 0xA5: the buffer's first offset + len(src) + 64 bytes, for a test of every
  // alignment and length (the bytes around the copy must stay 0xA5).
  m.attr("STREAM_STORES") = kHaveStreamStores;
  m.def("stream_copy_into", [](py::bytes src, size_t offset) {
    const std::string in = src;
    const size_t total = offset + in.size() + 64;
    std::vector<char> raw(total + 64);
    char* buf = raw.data() + ((64 - (reinterpret_cast<uintptr_t>(raw.data()) & 63)) & 63);
    std::memset(buf, 0xA5, total);
    stream_copy(buf + offset, in.data(), in.size());
    return py::bytes(buf, total);
  }, py::arg("src"), py::arg("offset"));
  m.def("segment_layout",
        [](int G, int N, size_t max_bytes, size_t min_zone_bytes, size_t pool_bytes, size_t cell_stride, int B,
           size_t ll_max_bytes) {
          SegmentLayout L = SegmentLayout::make(G, N, max_bytes, min_zone_bytes, pool_bytes, cell_stride, B, ll_max_bytes);
          py::dict d;
          py::list regions;  // (name, offset, bytes) of every cell and slot
          auto add = [&](const std::string& name, size_t off, size_t bytes) {
            regions.append(py::make_tuple(name, off, bytes));
          };
          add("abort", L.abort_cell(), L.cell_stride);
          for (int p = 0; p < 2; ++p) {
            const std::string ps = std::to_string(p);
            add("staging" + ps, L.staging(p), L.staging_bytes);
            for (int b = 0; b < B; ++b) {
              const std::string bs = "/" + std::to_string(b);
              add("result" + ps + bs, L.result(p, b), L.zone_slice_bytes);
              for (int h = 0; h < G; ++h) {
                add("ready" + ps + "/" + std::to_string(h) + bs, L.ready_cell(p, h, b), L.cell_stride);
                add("final" + ps + "/" + std::to_string(h) + bs, L.final_cell(p, h, b), L.cell_stride);
              }
              for (int sl = 0; sl < L.S; ++sl) {
                const std::string ss = "/" + std::to_string(sl);
                add("inter" + ps + ss + bs, L.inter_cell(p, sl, b), L.cell_stride);
                add("zone" + ps + ss + bs, L.zone(p, sl, b), L.zone_slice_bytes);
                if (L.ll_slice_bytes) {
                  add("llzone" + ps + ss + bs, L.llzone(p, sl, b), L.ll_slice_bytes);
                  add("llout" + ps + ss + bs, L.llout(p, sl, b), L.ll_slice_bytes);
                }
              }
              for (int k = 0; k < L.S - 2; ++k)
                add("gather" + ps + "/" + std::to_string(k) + bs, L.gather_cell(p, k, b), L.cell_stride);
            }
          }
          add("pool", L.pool_off, L.pool_bytes);
          d["regions"] = regions;
          d["staging_bytes"] = L.staging_bytes;
          d["zone_slice_bytes"] = L.zone_slice_bytes;
          d["zone_bytes"] = L.zone_bytes;
          d["ll_slice_bytes"] = L.ll_slice_bytes;
          d["ll_bytes"] = L.ll_bytes;
          d["oneshot_chunk_bytes"] = L.oneshot_chunk_bytes();
          d["total_bytes"] = L.total_bytes;
          return d;
        },
        py::arg("ranks_per_node"), py::arg("num_nodes"), py::arg("max_bytes"), py::arg("min_zone_bytes"),
        py::arg("pool_bytes"), py::arg("cell_stride") = 64, py::arg("slices") = 1, py::arg("ll_max_bytes") = 0);
  m.def("call_signature", &call_signature, py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("algorithm"));
  m.def("flag_word", &flag_word, py::arg("epoch"), py::arg("sig"));

  // The host reduction kernels on their own, to test their arithmetic against a reference.
  m.def(
      "reduce_into",
      [](const std::vector<uintptr_t>& dsts, const std::vector<uintptr_t>& srcs, size_t n, int dtype, int op,
         int world) {
        NVRAR_CHECK(!srcs.empty() && !dsts.empty(), "reduce_into: needs at least one source and one destination");
        std::vector<const void*> p(srcs.size());
        std::vector<void*> d(dsts.size());
        for (size_t i = 0; i < srcs.size(); ++i) p[i] = reinterpret_cast<const void*>(srcs[i]);
        for (size_t i = 0; i < dsts.size(); ++i) d[i] = reinterpret_cast<void*>(dsts[i]);
        cpu_reduce_fn(static_cast<DType>(dtype), static_cast<RedOp>(op))(
            d.data(), static_cast<int>(d.size()), p.data(), static_cast<int>(p.size()), n,
            make_scale(static_cast<RedOp>(op), world));
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("world") = 1);

  // LL packing of protocol/ll.h, quad by quad (the vector path the GPU kernel takes), to test it
  // against the packet-by-packet definition: packets of `bytes` payload bytes at `payload` into
  // `out` (ll_wire_bytes(bytes)), and back.
  m.def(
      "ll_pack_quads",
      [](uintptr_t payload, size_t bytes, uint32_t flag, uintptr_t out) {
        uint64_t* pk = reinterpret_cast<uint64_t*>(out);
        for (size_t q = 0; q < ll_quads(bytes); ++q) {
          uint64_t quad[kLLQuad];
          ll_make_quad(reinterpret_cast<const char*>(payload), bytes, q, flag, quad);
          for (size_t k = 0; k < ll_quad_size(bytes, q); ++k) pk[q * kLLQuad + k] = quad[k];
        }
        return ll_packets(bytes);
      },
      py::arg("payload"), py::arg("bytes"), py::arg("flag"), py::arg("out"));
  m.def(
      "ll_unpack_quads",
      [](uintptr_t packets, size_t bytes, uintptr_t dst) {
        const uint64_t* pk = reinterpret_cast<const uint64_t*>(packets);
        for (size_t q = 0; q < ll_quads(bytes); ++q) {
          uint64_t quad[kLLQuad] = {0, 0, 0, 0};
          for (size_t k = 0; k < ll_quad_size(bytes, q); ++k) quad[k] = pk[q * kLLQuad + k];
          ll_store_quad(reinterpret_cast<char*>(dst), bytes, q, quad);
        }
      },
      py::arg("packets"), py::arg("bytes"), py::arg("dst"));
}
