// GPU executor runtime: NVSHMEM initialization (or joining an existing one), the symmetric
// segment, peer mappings, the device state and the host-mapped error record, and the host side
// of every call (algorithm, chunking, slices, signature; then one kernel launch).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "../common/error.h"
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

std::mutex g_mu;
bool g_registered = false;  // this library's own NVSHMEM registration (init_status is process-wide)
int g_users = 0;            // live executors of this process
std::vector<std::string> g_env_set;

// Set an NVSHMEM variable only where the user has not, and remember it for the log.
void setenv_default(const char* name, const std::string& value) {
  if (std::getenv(name) != nullptr) return;
  ::setenv(name, value.c_str(), 0);
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
  int fused_threads = 0;  // threads per block of the fused kernel (0: not queried yet)

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
  std::lock_guard<std::mutex> lock(g_mu);
  const int status = nvshmemx_init_status();
  NVRAR_CHECK(status != NVSHMEM_STATUS_IS_BOOTSTRAPPED, "NVSHMEM in this process is bootstrapped but not initialized "
              "(an initialization that did not finish, e.g. nvshmem4py's init without a usable GPU context); "
              "nvrar does not complete it");
  // Initialized already (nvshmem4py, by the user or by nvrar/_gpu.py, or another library): the
  // call below only registers this module's device state and takes one reference; no unique id.
  const bool joined = status >= NVSHMEM_STATUS_IS_INITIALIZED;
  if (!g_registered && joined) {
    int provided = 0;
    nvshmemi_version_t ver = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                              NVSHMEM_VENDOR_PATCH_VERSION};
    const int rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, ver);
    NVRAR_CHECK(rc == 0, "registering with the NVSHMEM initialized in this process failed (code ", rc,
                "); NVSHMEM_DEBUG=WARN says why");
    g_registered = true;
  }
  if (!g_registered) {
    NVRAR_CHECK(uid.size() == sizeof(nvshmemx_uniqueid_t), "unique id of ", uid.size(), " bytes, expected ",
                sizeof(nvshmemx_uniqueid_t));
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, uid.data(), sizeof(id));
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    NVRAR_CHECK(nvshmemx_set_attr_uniqueid_args(cfg.rank, cfg.world, &id, &attr) == 0,
                "nvshmemx_set_attr_uniqueid_args failed");
    // nvshmemi_init_thread is what the inline nvshmemx_init_attr calls, minus its exit(-1) on a
    // failure: a failed initialization becomes an exception, not the end of the process.
    // (Non-ABI entry point, present from 3.4 to 3.8; the version check above pins the major.)
    int provided = 0;
    nvshmemi_version_t ver = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                              NVSHMEM_VENDOR_PATCH_VERSION};
    const int rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, ver);
    NVRAR_CHECK(rc == 0, "NVSHMEM initialization failed (code ", rc, "); NVSHMEM_DEBUG=WARN says why");
    NVRAR_CHECK(nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED, "NVSHMEM did not finish initializing");
    g_registered = true;
  }
  // Joined an NVSHMEM someone else initialized (nvshmem4py, another library)? Then its PE
  // numbering is the one in force: it must be ours.
  NVRAR_CHECK(nvshmem_my_pe() == cfg.rank && nvshmem_n_pes() == cfg.world, "NVSHMEM runs as PE ", nvshmem_my_pe(),
              " of ", nvshmem_n_pes(), " but this communicator is rank ", cfg.rank, " of ", cfg.world,
              "; create the communicator over the same ranks in the same order");
  ++g_users;
}

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

  I.segment = static_cast<char*>(nvshmem_malloc(I.layout.total_bytes));  // collective
  NVRAR_CHECK(I.segment != nullptr, "nvshmem_malloc of ", I.layout.total_bytes,
              " bytes failed; raise NVSHMEM_SYMMETRIC_SIZE");
  NVRAR_CUDA_CHECK(cudaMemset(I.segment, 0, I.layout.pool_off));
  I.limits = call_limits(I.geo, I.segment);
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
  NVRAR_CUDA_CHECK(cudaMalloc(&I.state, sizeof(DeviceState)));
  NVRAR_CUDA_CHECK(cudaMemset(I.state, 0, sizeof(DeviceState)));
  NVRAR_CUDA_CHECK(cudaHostAlloc(&I.err_host, sizeof(ErrorRecord), cudaHostAllocMapped));
  std::memset(I.err_host, 0, sizeof(ErrorRecord));
  NVRAR_CUDA_CHECK(cudaHostGetDevicePointer(&I.err_dev, I.err_host, 0));
  // Threads per block: what every instance of the kernel can launch with here (registers).
  const int limit = max_threads_per_block();
  NVRAR_CHECK(limit >= 32, "cannot query the all-reduce kernel's launch limits on this device");
  I.cfg.threads = std::min(I.cfg.threads, std::min(limit, kMaxThreads)) / 32 * 32;
  NVRAR_CUDA_CHECK(cudaEventCreateWithFlags(&I.last_launch, cudaEventDisableTiming));
  NVRAR_CUDA_CHECK(cudaEventCreateWithFlags(&I.last_replay, cudaEventDisableTiming));
  NVRAR_CUDA_CHECK(cudaDeviceSynchronize());
  nvshmem_barrier_all();  // every segment is zeroed before anyone signals into it
}

// Not collective: a destructor (garbage collection, interpreter exit) must not wait for peers in
// nvshmem_free. An executor never closed leaves its memory to the end of the process.
GpuExecutor::~GpuExecutor() { abandon(); }

void GpuExecutor::abandon() {
  Impl& I = *impl_;
  if (I.closed) return;
  I.closed = true;
  std::lock_guard<std::mutex> lock(g_mu);
  --g_users;
}

void GpuExecutor::close() {
  Impl& I = *impl_;
  if (I.closed) return;
  I.closed = true;
  cudaDeviceSynchronize();
  if (I.segment != nullptr) nvshmem_free(I.segment);  // collective
  if (I.peers_dev != nullptr) cudaFree(I.peers_dev);
  if (I.state != nullptr) cudaFree(I.state);
  if (I.err_host != nullptr) cudaFreeHost(I.err_host);
  if (I.last_launch != nullptr) cudaEventDestroy(I.last_launch);
  if (I.last_replay != nullptr) cudaEventDestroy(I.last_replay);
  I.segment = nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  if (--g_users == 0 && g_registered) {
    nvshmem_finalize();  // ours: reference-counted by NVSHMEM when someone else initialized it
    g_registered = false;
  }
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
      case ProtocolError::Kind::kMismatch: text = "call mismatch (the flag's call signature differs)"; break;
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
  if (stream != 0) {
    const cudaError_t st = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
    // A kernel that found its communicator failed at entry traps (NOTE [loud after failure],
    // device.cuh): the recorded failure (host-mapped, readable still) says why, before the CUDA
    // error that the trap left in the context.
    if (st != cudaSuccess) I.raise_recorded();
    NVRAR_CUDA_CHECK(st);
  }
  I.raise_recorded();
}

// The stream ordering of every launch (Impl's NOTE on last_launch / last_replay) around one launch.
template <typename Launch>
void GpuExecutor::Impl::enqueue(cudaStream_t s, const char* what, const Launch& launch) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  NVRAR_CUDA_CHECK(cudaStreamIsCapturing(s, &capturing));
  const bool eager = capturing == cudaStreamCaptureStatusNone;
  NVRAR_CHECK(eager || capturing == cudaStreamCaptureStatusActive, what,
              ": the stream's graph capture was invalidated (an earlier operation on it failed)");
  if (eager) {
    if (launched && s != last_stream) NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_launch, 0));
    if (captured) NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_replay, 0));
  } else if (launched) {
    NVRAR_CUDA_CHECK(cudaStreamWaitEvent(s, last_launch, cudaEventWaitExternal));
  }
  NVRAR_CUDA_CHECK(launch());
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
  const KernelParams kp = allreduce_params(c, in, out, count, dtype, op, I.geo, I.handles());
  I.enqueue(s, "all_reduce", [&]() { return launch_allreduce(kp, dtype, op, c.slices, I.cfg.threads, s); });
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
  if (I.fused_threads == 0) {
    const int limit = max_threads_fused();
    NVRAR_CHECK(limit >= 32, what, ": cannot query the fused kernel's launch limits on this device");
    I.fused_threads = std::min(I.cfg.threads, std::min(limit, kMaxThreads)) / 32 * 32;
  }
  // The algorithm, the chunking and the parameters: launch_params.h (its checks name the call).
  const FusedParams fp = fused_params(I.geo, I.handles(), x, residual, weight, rows, h, dtype, eps, requested);
  const int threads = I.fused_threads;
  I.enqueue(s, what, [&]() { return launch_fused(fp, dtype, threads, s); });
}

}  // namespace gpu
}  // namespace nvrar
