// GPU executor runtime: NVSHMEM initialization (or joining an existing one), the symmetric
// segment, peer mappings, the device state and the host-mapped error record, and the host side
// of every call (algorithm, chunking, slices, signature; then one kernel launch).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "../common/error.h"
#if defined(NVRAR_EMULATE)
#include "../emu/host_emu.h"  // the host half of the emulation: per-PE environment
#endif
#include "../protocol/call.h"
#include "../protocol/epilogue.h"
#include "device.cuh"
#include "fused_launch.h"
#include "gpu_api.h"
#include "launch.h"
#include "launch_params.h"

#define NVRAR_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                  \
    cudaError_t nvrar_e_ = (expr);                                                                      \
    NVRAR_CHECK(nvrar_e_ == cudaSuccess, #expr, " failed: ", cudaGetErrorString(nvrar_e_), " (", \
                static_cast<int>(nvrar_e_), ")");                                                       \
  } while (0)

namespace nvrar {
namespace gpu {

namespace {

// The process's NVSHMEM state as this library holds it. In the host emulation (csrc/emu/host_emu.h)
// each emulated PE is a thread of one process, so the state is per thread there (NVRAR_PER_PROCESS
// is thread_local), and so is the environment; the GPU build is unchanged (one process, one PE).
#if defined(NVRAR_EMULATE)
#define NVRAR_PER_PROCESS thread_local
const char* env_get(const char* name) { return ::nvrar::emu::host::env_get(name); }
void env_set(const char* name, const std::string& value) { ::nvrar::emu::host::env_set(name, value.c_str()); }
#else
#define NVRAR_PER_PROCESS
const char* env_get(const char* name) { return std::getenv(name); }
void env_set(const char* name, const std::string& value) { ::setenv(name, value.c_str(), 0); }
#endif

// g_mu guards the rest; it is never held across a collective NVSHMEM call (a PE holding it there
// would stall every other thread of its process that creates or closes a communicator, for as
// long as its peers take to arrive). An initialization in flight is g_initializing.
NVRAR_PER_PROCESS std::mutex g_mu;
NVRAR_PER_PROCESS std::condition_variable g_init_cv;
NVRAR_PER_PROCESS bool g_initializing = false;
NVRAR_PER_PROCESS bool g_registered = false;  // this library's own NVSHMEM registration
NVRAR_PER_PROCESS int g_users = 0;            // live executors of this process
NVRAR_PER_PROCESS std::vector<std::string> g_env_set;

// Set an NVSHMEM variable only where the user has not, and remember it for the log.
void setenv_default(const char* name, const std::string& value) {
  if (env_get(name) != nullptr) return;
  env_set(name, value);
  g_env_set.push_back(std::string(name) + "=" + value);
}


}  // namespace

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    cudaGetLastError();
    return 0;
  }
  if (why) *why = n > 0 ? "" : "no CUDA device";
  return n;
}

std::string nvshmem_header_version() {
  std::ostringstream os;
  os << NVSHMEM_VENDOR_MAJOR_VERSION << "." << NVSHMEM_VENDOR_MINOR_VERSION << "." << NVSHMEM_VENDOR_PATCH_VERSION;
  return os.str();
}

std::string nvshmem_library_version() {
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  std::ostringstream os;
  os << major << "." << minor << "." << patch;
  return os.str();
}

// The file this module's NVSHMEM host library calls resolve to (dladdr of one of its functions):
// nvshmem4py must have loaded the same one, else the process holds two NVSHMEM states.
std::string nvshmem_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&nvshmemx_vendor_get_version_info), &info) == 0 || info.dli_fname == nullptr)
    return "";
  return info.dli_fname;
}

std::vector<int> nvshmem_pes() {
  if (nvshmemx_init_status() < NVSHMEM_STATUS_IS_INITIALIZED) return {-1, -1};
  return {nvshmem_my_pe(), nvshmem_n_pes()};
}

std::vector<int> cuda_archs() {
  std::vector<int> out;
  std::istringstream is(NVRAR_CUDA_ARCHS);
  std::string tok;
  while (std::getline(is, tok, ';'))
    if (!tok.empty()) out.push_back(std::atoi(tok.c_str()));
  return out;
}

std::string unique_id() {
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  NVRAR_CHECK(nvshmemx_get_uniqueid(&uid) == 0, "nvshmemx_get_uniqueid failed");
  return std::string(reinterpret_cast<const char*>(&uid), sizeof(uid));
}

int nvshmem_init_status() { return nvshmemx_init_status(); }

void nvshmem_reduce(uintptr_t dst, uintptr_t src, size_t count, DType dtype, RedOp op, uintptr_t stream) {
  NVRAR_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "NVSHMEM is not initialized");
  NVRAR_CHECK(nvshmemx_init_status() != NVSHMEM_STATUS_LIMITED_MPG,
              "NVSHMEM's collectives are not allowed with several PEs per GPU without MPS");
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  int rc = -1;
#define NVRAR_NVSHMEM_REDUCE(NAME, T)                                                                                \
  switch (op) {                                                                                                      \
    case RedOp::kSum: rc = nvshmemx_##NAME##_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD, reinterpret_cast<T*>(dst),     \
                                                                  reinterpret_cast<const T*>(src), count, s); break; \
    case RedOp::kMax: rc = nvshmemx_##NAME##_max_reduce_on_stream(NVSHMEM_TEAM_WORLD, reinterpret_cast<T*>(dst),     \
                                                                  reinterpret_cast<const T*>(src), count, s); break; \
    case RedOp::kMin: rc = nvshmemx_##NAME##_min_reduce_on_stream(NVSHMEM_TEAM_WORLD, reinterpret_cast<T*>(dst),     \
                                                                  reinterpret_cast<const T*>(src), count, s); break; \
    default: NVRAR_CHECK(false, "NVSHMEM has no ", op_name(op), " reduction");                                      \
  }
  switch (dtype) {
    case DType::kFloat32: NVRAR_NVSHMEM_REDUCE(float, float) break;
    case DType::kFloat16: NVRAR_NVSHMEM_REDUCE(half, half) break;
    case DType::kBFloat16: NVRAR_NVSHMEM_REDUCE(bfloat16, __nv_bfloat16) break;
    case DType::kInt32: NVRAR_NVSHMEM_REDUCE(int, int) break;
  }
#undef NVRAR_NVSHMEM_REDUCE
  NVRAR_CHECK(rc == 0, "NVSHMEM reduce failed (code ", rc, ")");
}

// The symmetric heap NVSHMEM is asked for (only where the user set no NVSHMEM_SYMMETRIC_SIZE): room
// for two segments of this configuration, at least 1 GiB. Called before NVSHMEM initializes, by
// init_nvshmem and, before nvshmem4py's init, by nvrar/_setup.py.
void set_symmetric_size_default(const GpuConfig& cfg) {
  const Layout where = Layout::make(cfg.world, cfg.ranks_per_node, cfg.rank);
  const size_t max_bytes = std::max<size_t>(cfg.max_bytes / 64 * 64, 4096);
  const SegmentLayout layout = SegmentLayout::make(cfg.ranks_per_node, where.N, max_bytes, cfg.oneshot_max_bytes,
                                                   cfg.pool_bytes, kCellStride, cfg.max_blocks,
                                                   where.N > 1 ? cfg.ll_max_bytes : 0, kGpuDescRoom);
  std::lock_guard<std::mutex> lock(g_mu);
  setenv_default("NVSHMEM_SYMMETRIC_SIZE", std::to_string(std::max<size_t>(size_t{1} << 30, 2 * layout.total_bytes)));
}

std::vector<std::string> env_set_by_nvrar() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_env_set;
}

struct GpuExecutor::Impl {
  GpuConfig cfg;
  ExecutorGeometry geo;          // layout, segment, round (launch_params.h, shared with csrc/emu)
  Layout where;
  SegmentLayout layout;
  CallLimits limits;             // what the configuration fixes for every call (protocol/call.h)
  char* segment = nullptr;       // nvshmem_malloc'd, symmetric
  char** peers_dev = nullptr;    // device array [G]
  DeviceState* state = nullptr;  // device memory
  ErrorRecord* err_host = nullptr;
  ErrorRecord* err_dev = nullptr;
  std::string failure;
  bool closed = false;
  // Calls of one communicator must run one after the other (they share the device epoch). An
  // eager launch waits for the last eager launch (`last_launch`, where its stream differs) and for
  // the last graph replay (`last_replay`, once a call was captured), then records `last_launch`.
  // A captured launch becomes, at every replay, a wait for `last_launch` and a record of
  // `last_replay` (external event nodes: cudaEventWaitExternal / cudaEventRecordExternal), so a
  // replay on one stream and an eager call on another run in the order the host issued them.
  // Two graphs replayed on two streams are not ordered with each other: replay them on one stream.
  cudaEvent_t last_launch = nullptr;
  cudaEvent_t last_replay = nullptr;
  cudaStream_t last_stream = nullptr;
  bool launched = false;
  bool captured = false;  // a call was captured: a replay may run at any time on any stream
  int fused_threads = 0;  // threads per block of the fused kernel (0: none; set by the constructor)

  void init_nvshmem(const std::string& uid);
  // NOTE [symmetric buffers]: a buffer anywhere in NVSHMEM's symmetric heap (nvshmem4py's
  // nvshmem.core.tensor, another communicator's empty()) is zero-copy like this pool: the heap has
  // the same layout on every PE and nvshmem_ptr(p, pe) is pe's heap base + (p - my heap base), so
  // the offset of p from my segment (negative when p lies below it: plan.h's references are
  // signed) names the same buffer in every peer's mapping. 16-byte aligned buffers only, like the
  // pool's (its blocks start on 256 bytes). Each rank decides for its own buffers, as for the pool.
  bool symmetric(uintptr_t p, size_t bytes) const {
    return bytes > 0 && p % 16 == 0 && nvshmem_ptr(reinterpret_cast<const void*>(p), cfg.rank) != nullptr &&
           nvshmem_ptr(reinterpret_cast<const void*>(p + bytes - 1), cfg.rank) != nullptr;
  }
  int* verdict = nullptr;  // symmetric: the set-up verdict's slots (NOTE [set-up verdict])
  void agree(int failed, const std::string& what, int my_pe, int n_pes);
  void release_local();
  void raise_recorded();
  template <typename Launch>
  void enqueue(cudaStream_t s, const char* what, const Launch& launch);
  DeviceHandles handles() const { return DeviceHandles{segment, peers_dev, state, err_dev}; }
};

void GpuExecutor::Impl::init_nvshmem(const std::string& uid) {
  // The host library loaded now must be the one we were built against (same major.minor; nvrar/_gpu.py
  // refuses another at load time already, this is the last line before nvshmemi_init_thread).
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  NVRAR_CHECK(major == NVSHMEM_VENDOR_MAJOR_VERSION && minor == NVSHMEM_VENDOR_MINOR_VERSION,
              "nvrar was built against NVSHMEM ", nvshmem_header_version(), " but NVSHMEM ",
              nvshmem_library_version(), " is loaded; install nvidia-nvshmem-cu13==", nvshmem_header_version(),
              " or rebuild nvrar against the version installed");
  // A current CUDA context first: without one NVSHMEM only bootstraps and exits the process on a
  // failure inside its next call.
  NVRAR_CUDA_CHECK(cudaSetDevice(cfg.device));
  NVRAR_CUDA_CHECK(cudaFree(nullptr));
  // Room for every executor of this process in the symmetric heap (never overriding the user).
  set_symmetric_size_default(cfg);
  std::unique_lock<std::mutex> lock(g_mu);
  g_init_cv.wait(lock, [] { return !g_initializing; });  // another executor of this process initializes
  const int status = nvshmemx_init_status();
  NVRAR_CHECK(status != NVSHMEM_STATUS_IS_BOOTSTRAPPED, "NVSHMEM in this process is bootstrapped but not initialized "
              "(an initialization that did not finish, e.g. nvshmem4py's init without a usable GPU context); "
              "nvrar does not complete it");
  if (!g_registered) {
    // Initialized already (nvshmem4py, by the user or by nvrar/_gpu.py, or another library): the
    // call below only registers this module's device state and takes one reference; no unique id.
    // Else nvrar initializes it with the unique id (collective: the bootstrap), without g_mu.
    const bool joined = status >= NVSHMEM_STATUS_IS_INITIALIZED;
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    if (!joined) {
      NVRAR_CHECK(uid.size() == sizeof(nvshmemx_uniqueid_t), "unique id of ", uid.size(), " bytes, expected ",
                  sizeof(nvshmemx_uniqueid_t));
      std::memcpy(&id, uid.data(), sizeof(id));
      NVRAR_CHECK(nvshmemx_set_attr_uniqueid_args(cfg.rank, cfg.world, &id, &attr) == 0,
                  "nvshmemx_set_attr_uniqueid_args failed");
    }
    g_initializing = true;
    lock.unlock();
    // nvshmemi_init_thread is what the inline nvshmemx_init_attr calls, minus its exit(-1) on a
    // failure: a failed initialization becomes an exception, not the end of the process.
    // (Non-ABI entry point, present from 3.4 to 3.8; the version check above pins the major.)
    int provided = 0;
    nvshmemi_version_t ver = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                              NVSHMEM_VENDOR_PATCH_VERSION};
    const int rc = joined ? nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, ver)
                          : nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID,
                                                 &attr, ver);
    lock.lock();
    g_initializing = false;
    g_init_cv.notify_all();
    NVRAR_CHECK(rc == 0, joined ? "registering with the NVSHMEM initialized in this process failed (code "
                                : "NVSHMEM initialization failed (code ",
                rc, "); NVSHMEM_DEBUG=WARN says why");
    NVRAR_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "NVSHMEM did not finish initializing");
    g_registered = true;
  }
  // Several PEs on one GPU without MPS: NVSHMEM runs in its limited multi-process-per-GPU mode,
  // where it refuses collectives (the set-up verdict's nvshmem_int_max_reduce among them) by
  // ending the process. NVSHMEM decides the mode at initialization from every PE's GPU, so every
  // PE raises here alike, before any collective of the set-up.
  NVRAR_CHECK(nvshmemx_init_status() != NVSHMEM_STATUS_LIMITED_MPG, "several ranks share GPU ", cfg.device,
              " without MPS: NVSHMEM runs in its limited multi-process-per-GPU mode, which refuses the collectives "
              "that the set-up needs; start the MPS control daemon (nvidia-cuda-mps-control -d) with "
              "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE at most 100 / (ranks per GPU), or give each rank its own GPU");
}

// NOTE [set-up verdict]: a PE whose set-up step fails after NVSHMEM is initialized must not leave
// its peers in a collective (nvshmem_malloc, nvshmem_barrier_all wait for every PE, with no
// deadline). So every PE makes every collective call of the set-up whatever failed on it, skips
// only its local steps after a failure, and then all agree (one nvshmem_int_max_reduce over a
// slot per PE): each PE raises if any failed, naming the first failed rank and its step. A
// failure before the bootstrap (configuration, device, NVSHMEM version) is raised at once: the
// Python set-up exchanges those verdicts over its store before any rank initializes
// (nvrar/_setup.py setup_gpu).
namespace {

struct SetupSteps {
  int failed = 0;  // 1 + the index of the first step that failed (0: none)
  int index = 0;
  std::string what;
  template <typename F>
  void run(const char* name, F&& f) {
    ++index;
    if (failed != 0) return;
    try {
      f();
    } catch (const std::exception& e) {
      failed = index;
      what = std::string(name) + ": " + e.what();
    }
  }
};

}  // namespace

GpuExecutor::GpuExecutor(const GpuConfig& cfg, const std::string& uid) : impl_(new Impl) {
  Impl& I = *impl_;
  I.cfg = cfg;
  NVRAR_CHECK(cfg.world >= 1 && cfg.rank >= 0 && cfg.rank < cfg.world, "rank ", cfg.rank, " of ", cfg.world);
  NVRAR_CHECK(cfg.ranks_per_node >= 1 && cfg.world % cfg.ranks_per_node == 0, "ranks_per_node=", cfg.ranks_per_node,
              " must divide the world size ", cfg.world);
  NVRAR_CHECK(cfg.ranks_per_node <= kMaxLocal, "at most ", kMaxLocal, " ranks per node, got ", cfg.ranks_per_node);
  NVRAR_CHECK(cfg.max_blocks >= 1 && cfg.threads >= 32 && cfg.threads <= 1024 && cfg.block_bytes >= 1,
              "bad launch configuration: max_blocks=", cfg.max_blocks, ", threads=", cfg.threads,
              ", block_bytes=", cfg.block_bytes);
  NVRAR_CHECK(cfg.channels >= 1 && cfg.channels <= kMaxChannels, "channels must be 1 to ", kMaxChannels, ", got ",
              cfg.channels, " (NVRAR_GPU_CHANNELS)");
  NVRAR_CHECK(cfg.timeout_s > 0, "timeout must be > 0 s, got ", cfg.timeout_s);
  std::string why;
  NVRAR_CHECK(device_count(&why) > 0, "the GPU executor needs a CUDA device: ", why);
  I.geo = executor_geometry(cfg);
  I.cfg.max_bytes = I.geo.cfg.max_bytes;
  I.where = I.geo.where;
  I.layout = I.geo.layout;
  I.init_nvshmem(uid);

  // From here every PE makes the same collective calls (NOTE [set-up verdict]).
  SetupSteps st;
  int my_pe = -1, n_pes = 0;
  st.run("NVSHMEM's PE numbering", [&] {
    my_pe = nvshmem_my_pe();
    n_pes = nvshmem_n_pes();
    NVRAR_CHECK(my_pe == cfg.rank && n_pes == cfg.world, "NVSHMEM runs as PE ", my_pe, " of ", n_pes,
                " but this communicator is rank ", cfg.rank, " of ", cfg.world,
                "; create the communicator over the same ranks in the same order");
  });
  if (n_pes <= 0) {
    my_pe = nvshmem_my_pe();
    n_pes = nvshmem_n_pes();
  }
  I.verdict = static_cast<int*>(nvshmem_malloc(2 * static_cast<size_t>(n_pes) * sizeof(int)));  // collective
  I.segment = static_cast<char*>(nvshmem_malloc(I.layout.total_bytes));                           // collective
  st.run("nvshmem_malloc", [&] {
    NVRAR_CHECK(I.segment != nullptr && I.verdict != nullptr, "nvshmem_malloc of ", I.layout.total_bytes,
                " bytes failed; raise NVSHMEM_SYMMETRIC_SIZE");
  });
  st.run("zeroing the segment", [&] {
    NVRAR_CUDA_CHECK(cudaMemset(I.segment, 0, I.layout.pool_off));
    I.limits = call_limits(I.geo, I.segment);
  });
  st.run("the peer table", [&] {
    std::vector<char*> peers(static_cast<size_t>(cfg.ranks_per_node));
    for (int h = 0; h < cfg.ranks_per_node; ++h) {
      const int pe = I.where.rank_of(I.where.node, h);
      peers[static_cast<size_t>(h)] = static_cast<char*>(nvshmem_ptr(I.segment, pe));
      NVRAR_CHECK(peers[static_cast<size_t>(h)] != nullptr, "rank ", cfg.rank, " cannot load/store rank ", pe,
                  "'s memory (no NVLink or PCIe peer access); ranks of one node must be peer-accessible, or use "
                  "ranks_per_node=1 so that every exchange goes through NVSHMEM");
    }
    NVRAR_CUDA_CHECK(cudaMalloc(&I.peers_dev, peers.size() * sizeof(char*)));
    NVRAR_CUDA_CHECK(cudaMemcpy(I.peers_dev, peers.data(), peers.size() * sizeof(char*), cudaMemcpyHostToDevice));
  });
  st.run("the device state", [&] {
    NVRAR_CUDA_CHECK(cudaMalloc(&I.state, sizeof(DeviceState)));
    NVRAR_CUDA_CHECK(cudaMemset(I.state, 0, sizeof(DeviceState)));
  });
  st.run("the error record", [&] {
    NVRAR_CUDA_CHECK(cudaHostAlloc(&I.err_host, sizeof(ErrorRecord), cudaHostAllocMapped));
    std::memset(I.err_host, 0, sizeof(ErrorRecord));
    NVRAR_CUDA_CHECK(cudaHostGetDevicePointer(&I.err_dev, I.err_host, 0));
  });
  st.run("the kernels' launch limits", [&] {
    // Threads per block: what every instance of the kernel can launch with here (registers).
    const int limit = max_threads_per_block();
    NVRAR_CHECK(limit >= 32, "cannot query the all-reduce kernel's launch limits on this device");
    I.cfg.threads = std::min(I.cfg.threads, std::min(limit, kMaxThreads)) / 32 * 32;
    // The fused kernel's too, here and not at its first call: the query loads the kernel's module
    // (lazy loading), which a CUDA-graph capture in progress forbids. 0: no fused instance in this
    // module (NVRAR_CUDA_UNITS=smoke) or no answer; a fused call then raises.
    const int fused = max_threads_fused();
    I.fused_threads = fused >= 32 ? std::min(I.cfg.threads, std::min(fused, kMaxThreads)) / 32 * 32 : 0;
  });
  st.run("the ordering events", [&] {
    NVRAR_CUDA_CHECK(cudaEventCreateWithFlags(&I.last_launch, cudaEventDisableTiming));
    NVRAR_CUDA_CHECK(cudaEventCreateWithFlags(&I.last_replay, cudaEventDisableTiming));
  });
  st.run("cudaDeviceSynchronize", [&] { NVRAR_CUDA_CHECK(cudaDeviceSynchronize()); });
  nvshmem_barrier_all();  // collective: every segment is zeroed before anyone signals into it
  I.agree(st.failed, st.what, my_pe, n_pes);  // collective; raises on every PE if one failed
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_users;
}

void GpuExecutor::Impl::agree(int failed, const std::string& what, int my_pe, int n_pes) {
  // Slot p holds PE p's verdict: (rank + 1) << 8 | (failed step); the max over PEs of each slot is
  // its owner's value.
  const size_t n = static_cast<size_t>(n_pes);
  std::vector<int> slots(n, 0);
  const int code = failed == 0 ? 0 : ((cfg.rank + 1) << 8) | std::min(failed, 255);
  if (my_pe >= 0 && static_cast<size_t>(my_pe) < n) slots[static_cast<size_t>(my_pe)] = code;
  bool exchanged = false;
  if (verdict != nullptr) {
    exchanged = cudaMemcpy(verdict, slots.data(), n * sizeof(int), cudaMemcpyHostToDevice) == cudaSuccess;
    const int rc = nvshmem_int_max_reduce(NVSHMEM_TEAM_WORLD, verdict + n, verdict, n);  // collective
    exchanged = exchanged && rc == 0 &&
                cudaMemcpy(slots.data(), verdict + n, n * sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  int first = 0;
  for (int v : slots)
    if (v != 0) {
      first = v;
      break;
    }
  if (failed == 0 && exchanged && first == 0) return;
  release_local();
  if (failed != 0)
    NVRAR_CHECK(false, "GPU executor set-up failed on rank ", cfg.rank, " (", what, "); every rank raises");
  NVRAR_CHECK(exchanged, "GPU executor set-up: the ranks' verdicts could not be exchanged (NVSHMEM reduce)");
  NVRAR_CHECK(false, "GPU executor set-up failed on rank ", (first >> 8) - 1, " (step ", first & 255,
              " of the set-up; that rank's error says why); every rank raises");
}

// Frees what this PE allocated for itself (not the symmetric memory: freeing it is collective, and
// after a failed set-up it stays to the end of the process).
void GpuExecutor::Impl::release_local() {
  cudaDeviceSynchronize();
  if (peers_dev != nullptr) cudaFree(peers_dev);
  if (state != nullptr) cudaFree(state);
  if (err_host != nullptr) cudaFreeHost(err_host);
  if (last_launch != nullptr) cudaEventDestroy(last_launch);
  if (last_replay != nullptr) cudaEventDestroy(last_replay);
  peers_dev = nullptr;
  state = nullptr;
  err_host = nullptr;
  err_dev = nullptr;
  last_launch = last_replay = nullptr;
}

// Not collective: a destructor (garbage collection, interpreter exit) must not wait for peers in
// nvshmem_free. An executor never closed leaves its memory to the end of the process.
GpuExecutor::~GpuExecutor() { abandon(); }

void GpuExecutor::abandon() {
  Impl& I = *impl_;
  if (I.closed) return;
  I.closed = true;
  // No kernel of this executor still in flight when the caller goes on (at interpreter exit: CUDA's
  // and NVSHMEM's teardown). Bounded: every wait of the kernel has its deadline; on a context a
  // trap left unusable this returns its error at once.
  cudaDeviceSynchronize();
  std::lock_guard<std::mutex> lock(g_mu);
  --g_users;
}

void GpuExecutor::close() {
  Impl& I = *impl_;
  if (I.closed) return;
  I.closed = true;
  cudaDeviceSynchronize();
  if (I.segment != nullptr) nvshmem_free(I.segment);  // collective
  if (I.verdict != nullptr) nvshmem_free(I.verdict);  // collective
  I.release_local();
  I.segment = nullptr;
  I.verdict = nullptr;
  bool finalize = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    finalize = --g_users == 0 && g_registered;
    if (finalize) g_registered = false;
  }
  // Ours: reference-counted by NVSHMEM when someone else initialized it. Collective, so outside g_mu.
  if (finalize) nvshmem_finalize();
}

const GpuConfig& GpuExecutor::config() const { return impl_->cfg; }
uintptr_t GpuExecutor::pool_address() const {
  return reinterpret_cast<uintptr_t>(impl_->segment + impl_->layout.pool_off);
}
size_t GpuExecutor::pool_bytes() const { return impl_->layout.pool_bytes; }
bool GpuExecutor::symmetric(uintptr_t p, size_t bytes) const {
  return !impl_->closed && (impl_->symmetric(p, bytes) || (p >= pool_address() && p + bytes <= pool_address() + pool_bytes()));
}

Algorithm GpuExecutor::resolve(Algorithm a, size_t bytes) const {
  return resolve_algorithm(a, bytes, impl_->cfg.oneshot_max_bytes);
}

uint64_t GpuExecutor::epoch() {
  unsigned long long e = 0;
  NVRAR_CUDA_CHECK(cudaDeviceSynchronize());
  NVRAR_CUDA_CHECK(cudaMemcpy(&e, &impl_->state->epoch, sizeof(e), cudaMemcpyDeviceToHost));
  return e;
}

namespace {
// What a call mismatch's record says differed (ErrorRecord::detail, got, want; params.h).
std::string mismatch_text(const ErrorRecord& r) {
  static const char* const kDescNames[] = {"count", "dtype/op/algorithm code", "round elements", "shape"};
  static const char* const kTrailerNames[] = {"count", "dtype/op/algorithm code", "round elements", "shape",
                                              "flag word", "sender's rank"};
  const unsigned what = r.detail & 0xffu, k = (r.detail >> 8) & 0xffu;
  auto hex = [](unsigned long long v) {
    char b[32];
    std::snprintf(b, sizeof(b), "0x%llx", v);
    return std::string(b);
  };
  auto word = [&](const char* where, const char* const* names, unsigned n) {
    if (k == 0xffu) return std::string(where) + " differed, then read the same on a second reading";
    const std::string name = k < n ? names[k] : "word " + std::to_string(k);
    return std::string(where) + "'s " + name + " is " + hex(r.got) + ", mine " + hex(r.want);
  };
  switch (what) {
    case kMismatchSignature:
      return "the flag's call signature is " + hex(r.got) + ", mine " + hex(r.want);
    case kMismatchCellDesc: return word("the flag cell's call description", kDescNames, 4);
    case kMismatchTrailer: return word("the put's trailer", kTrailerNames, 6);
    case kMismatchLLFlag: return "an LL packet's flag carries another call signature";
    case kMismatchLLDesc: {
      if (k == 0xffu) return "the LL description packets differed, then read the same on a second reading";
      return std::string("the LL description packet ") + std::to_string(k) + " (" + kDescNames[(k / 2) % 4] +
             (k % 2 ? ", high half" : ", low half") + ") is " + hex(r.got) + ", mine " + hex(r.want);
    }
    default: return "the flag's call signature or description differs";
  }
}
}  // namespace

void GpuExecutor::Impl::raise_recorded() {
  // The device claims `code` first, writes the fields, then sets `published`: wait (bounded) for
  // it, so the fields read are whole.
  volatile ErrorRecord* v = reinterpret_cast<volatile ErrorRecord*>(err_host);
  if (v->code == 0) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (v->published == 0 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  __sync_synchronize();
  ErrorRecord r;
  std::memcpy(&r, const_cast<const ErrorRecord*>(err_host), sizeof(r));
  const auto kind = static_cast<ProtocolError::Kind>(r.code);
  const char* what = kind == ProtocolError::Kind::kTimeout    ? "a timeout"
                     : kind == ProtocolError::Kind::kMismatch ? "a call mismatch"
                                                              : "a failure";
  std::string text;
  if (r.origin >= 0 && r.origin != cfg.rank) {
    text = "aborted by rank " + std::to_string(r.origin) + " after " + what + " there";
  } else if (r.origin < 0) {
    text = "aborted by another rank";
  } else {
    switch (kind) {
      case ProtocolError::Kind::kTimeout: text = timeout_text(cfg.timeout_s); break;
      case ProtocolError::Kind::kMismatch: text = "call mismatch (" + mismatch_text(r) + ")"; break;
      case ProtocolError::Kind::kViolation: text = "protocol violation: a flag arrived from a later round"; break;
      default: text = "aborted"; break;
    }
  }
  failure = failure_text(cfg.rank, text, static_cast<Phase>(r.phase), r.step, r.peer, r.epoch, r.observed);
  throw ProtocolError(kind, failure, cfg.rank, r.peer, static_cast<Phase>(r.phase), r.step, r.epoch, r.observed);
}

void GpuExecutor::check(uintptr_t stream) {
  Impl& I = *impl_;
  NVRAR_CHECK(!I.closed, "the communicator is closed");
  // Handle 0 is the legacy default stream (torch's default stream, and every launch of a caller
  // that names no stream), synchronized like any other: skipping it let check() return while a
  // call on it still waited for a peer, so its timeout went unreported.
  const cudaError_t st = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  // A graph replay that found its communicator failed at entry traps (NOTE [loud after failure],
  // device.cuh): the recorded failure (host-mapped, readable still) says why, before the CUDA
  // error that the trap left in the context.
  if (st != cudaSuccess) I.raise_recorded();
  NVRAR_CUDA_CHECK(st);
  I.raise_recorded();
}

// The stream ordering of every launch (Impl's NOTE on last_launch / last_replay) around one launch.
template <typename Launch>
void GpuExecutor::Impl::enqueue(cudaStream_t s, const char* what, const Launch& launch) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  const cudaError_t q = cudaStreamIsCapturing(s, &capturing);
  if (q == cudaErrorStreamCaptureImplicit) {
    cudaGetLastError();
    NVRAR_CHECK(false, what, ": called on the legacy default stream while a graph capture in global mode is in "
                "progress in this process (another thread's); pass the stream to use (e.g. "
                "torch.cuda.current_stream()), or capture in thread-local or relaxed mode");
  }
  NVRAR_CUDA_CHECK(q);
  const bool eager = capturing == cudaStreamCaptureStatusNone;
  NVRAR_CHECK(eager || capturing == cudaStreamCaptureStatusActive, what,
              ": the stream's graph capture was invalidated (an earlier operation on it failed)");
  if (eager) {
    if (launched && s != last_stream) NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_launch, 0));
    if (captured) NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_replay, 0));
  } else if (launched) {
    NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_launch, cudaEventWaitExternal));
  }
  NVRAR_CUDA_CHECK(launch(eager));
  if (eager) {
    NVRAR_CUDA_CHECK(cudaEventRecord(last_launch, s));
    last_stream = s;
    launched = true;
  } else {
    NVRAR_CUDA_CHECK(cudaEventRecordWithFlags(last_replay, s, cudaEventRecordExternal));
    captured = true;
  }
}

void GpuExecutor::all_reduce(uintptr_t in, uintptr_t out, size_t count, DType dtype, RedOp op, Algorithm algorithm,
                             uintptr_t stream) {
  Impl& I = *impl_;
  NVRAR_CHECK(!I.closed, "all_reduce: the communicator is closed");
  NVRAR_CHECK(I.failure.empty(), "all_reduce: this communicator failed earlier and cannot be used again: ", I.failure);
  I.raise_recorded();  // an earlier kernel's failure surfaces here at the latest
  if (count == 0) return;
  CallPlan c = plan_call(I.limits, in, out, count, dtype, op, algorithm);
  c.in_pool = c.in_pool || I.symmetric(in, c.bytes);  // NOTE [symmetric buffers]
  c.out_pool = c.out_pool || I.symmetric(out, c.bytes);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (I.cfg.world == 1) {
    if (in != out) NVRAR_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(out), reinterpret_cast<const void*>(in),
                                                    c.bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  KernelParams kp = allreduce_params(c, in, out, count, dtype, op, I.geo, I.handles());
  I.enqueue(s, "all_reduce", [&](bool eager) {
    kp.eager = eager;
    return launch_allreduce(kp, dtype, op, c.slices, I.cfg.threads, s);
  });
}


// The fused all-reduce + residual add + RMSNorm (protocol/epilogue.h, NOTE [fused add +
// RMSNorm]): the CPU executor's algorithm and chunking (fused_chunk_rows), one kernel launch of ONE
// block that runs the chunks one after the other (fused_kernel.cuh: the fused round's shards are
// cut on row boundaries across the local ranks, not further into per-block slices).
void GpuExecutor::all_reduce_add_rms_norm(uintptr_t x, uintptr_t residual, uintptr_t weight, size_t rows, size_t h,
                                          DType dtype, float eps, Algorithm requested, uintptr_t stream) {
  Impl& I = *impl_;
  const char* what = "all_reduce_add_rms_norm";
  NVRAR_CHECK(!I.closed, what, ": the communicator is closed");
  NVRAR_CHECK(I.failure.empty(), what, ": this communicator failed earlier and cannot be used again: ", I.failure);
  I.raise_recorded();
  NVRAR_CHECK(h >= 1, what, ": the hidden size h must be >= 1");
  NVRAR_CHECK(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, what, ": dtype ",
              dtype_name(dtype), " is not supported (float32, float16, bfloat16)");
  if (rows == 0) return;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  NVRAR_CHECK(I.fused_threads >= 32, what, ": no fused kernel in this module (NVRAR_CUDA_UNITS=smoke), or its "
              "launch limits could not be queried on this device");
  // The algorithm, the chunking and the parameters: launch_params.h (its checks name the call).
  FusedParams fp = fused_params(I.geo, I.handles(), x, residual, weight, rows, h, dtype, eps, requested);
  const int threads = I.fused_threads;
  I.enqueue(s, what, [&](bool eager) {
    fp.kp.eager = eager;
    return launch_fused(fp, dtype, threads, s);
  });
}

}  // namespace gpu
}  // namespace nvrar
