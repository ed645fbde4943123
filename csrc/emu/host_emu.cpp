// The host half of the emulation layer (host_emu.h, host/cuda_runtime.h, host/nvshmem.h,
// host/nvshmemx.h): the CUDA runtime and NVSHMEM host API that csrc/cuda/runtime.cu and the
// launch units call, on emulated PEs whose kernels run on the device half (emu.h). Nothing here
// knows nvrar's protocol.
#include "host_emu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "host/cuda_runtime.h"
#include "host/nvshmem.h"
#include "host/nvshmemx.h"

namespace nvrar {
namespace emu {
namespace host {

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "emulated host: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

constexpr double kStreamWaitS = 60;  // work that never drains: a hazard after this long

struct Pe;
struct Stream;
struct Event;

struct Dep {
  Stream* s;
  uint64_t ticket;
};

struct Op {
  std::function<void()> fn;  // empty: a marker (an event record, a wait)
  std::vector<Dep> deps;
};

// A captured graph's node.
struct Node {
  enum Kind { kKernel, kMemcpy, kWaitExternal, kRecord } kind = kKernel;
  int blocks = 0, threads = 0;
  bool cooperative = false;
  std::function<void()> fn;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  Event* ev = nullptr;
};

}  // namespace
}  // namespace host
}  // namespace emu
}  // namespace nvrar

struct CUgraph_st {
  std::vector<nvrar::emu::host::Node> nodes;
};
struct CUgraphExec_st {
  std::vector<nvrar::emu::host::Node> nodes;
};

namespace nvrar {
namespace emu {
namespace host {
namespace {

struct Stream {
  Pe* pe = nullptr;
  bool legacy = false;
  bool blocking = true;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> q;
  uint64_t issued = 0, completed = 0;
  bool stop = false;
  std::thread worker;
  // Graph capture (guarded by the PE's mutex).
  bool capturing = false, invalidated = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  CUgraph_st* graph = nullptr;
};

struct Event {
  std::mutex mu;
  Stream* s = nullptr;  // the last record: a point in s's work
  uint64_t ticket = 0;
  CUgraph_st* recorded_in = nullptr;  // recorded inside this capture
};

// One collective of a World's PEs in progress: who came, to what.
struct Coll {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t gen = 0;
  int count = 0;
  std::string name;
  std::vector<std::string> detail;  // per arrival (sizes of nvshmem_malloc)
};

// The bootstrap of one unique id.
struct Boot {
  int nranks = 0, arrived = 0;
  World* world = nullptr;
  size_t segment_bytes = 0;
};

struct WorldRec {
  std::unique_ptr<World> world;
  std::unique_ptr<Coll> coll;
  int n = 0;
};

}  // namespace

struct Machine::Impl {
  MachineConfig cfg;
  std::vector<std::unique_ptr<Pe>> pes;
  std::mutex mu;  // boots, worlds, hazards
  std::condition_variable cv;
  std::map<std::string, Boot> boots;
  std::vector<WorldRec> worlds;
  std::vector<std::string> hazards;
  std::atomic<uint64_t> uid_counter{1};

  void hazard(const std::string& h) {
    std::lock_guard<std::mutex> lock(mu);
    hazards.push_back(h);
  }
  WorldRec* rec(World* w) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& r : worlds)
      if (r.world.get() == w) return &r;
    return nullptr;
  }
};

namespace {

struct Pe {
  Machine::Impl* m = nullptr;
  int index = 0;
  std::mutex mu;  // streams and capture state
  std::vector<std::unique_ptr<Stream>> streams;
  Stream* legacy = nullptr;
  std::atomic<int> sticky{0};
  std::atomic<int> last_error{cudaSuccess};
  std::map<std::string, int> faults;
  std::set<std::string> lasting;  // faults that hold for every call (pe_numbering, version)
  std::map<std::string, std::string> env;
  // NVSHMEM
  int status = NVSHMEM_STATUS_NOT_INITIALIZED;
  int refs = 0;
  World* world = nullptr;
  int rank = -1, nranks = 0;
  std::vector<std::pair<size_t, size_t>> allocs;  // symmetric heap: (offset, bytes), a stack
  std::atomic<uint64_t> launches{0};
};

thread_local Pe* t_pe = nullptr;

Pe& bound(const char* what) {
  if (t_pe == nullptr) die(std::string(what) + " called from a thread bound to no emulated PE");
  return *t_pe;
}

// Whether an injected failure of `what` fires now on this PE.
bool fault(Pe& P, const std::string& what) {
  std::lock_guard<std::mutex> lock(P.mu);
  if (P.lasting.count(what)) return true;
  auto it = P.faults.find(what);
  if (it == P.faults.end()) return false;
  if (--it->second > 0) return false;
  P.faults.erase(it);
  return true;
}

cudaError_t fail(Pe& P, cudaError_t e) {
  P.last_error.store(e);
  return e;
}

void worker_main(Stream* s) {
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      s->cv.wait(lock, [&] { return s->stop || !s->q.empty(); });
      if (s->q.empty()) return;
      op = std::move(s->q.front());
    }
    for (const Dep& d : op.deps) {
      std::unique_lock<std::mutex> lock(d.s->mu);
      if (!d.s->cv.wait_for(lock, std::chrono::duration<double>(kStreamWaitS),
                            [&] { return d.s->completed >= d.ticket; })) {
        lock.unlock();
        s->pe->m->hazard("PE " + std::to_string(s->pe->index) + ": a stream waited " +
                         std::to_string(static_cast<int>(kStreamWaitS)) + " s for work of another stream");
      }
    }
    if (op.fn) op.fn();
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->q.pop_front();
      ++s->completed;
    }
    s->cv.notify_all();
  }
}

Stream* new_stream(Pe& P, bool legacy, bool blocking) {
  auto s = std::make_unique<Stream>();
  s->pe = &P;
  s->legacy = legacy;
  s->blocking = blocking;
  Stream* raw = s.get();
  raw->worker = std::thread(worker_main, raw);
  std::lock_guard<std::mutex> lock(P.mu);
  P.streams.push_back(std::move(s));
  return raw;
}

void stop_stream(Stream* s) {
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->stop = true;
  }
  s->cv.notify_all();
  if (s->worker.joinable()) s->worker.join();
}

Stream* stream_of(Pe& P, cudaStream_t s) {
  return s == nullptr ? P.legacy : reinterpret_cast<Stream*>(s);
}

// Whether a stream of P captures in global mode (what forbids the legacy stream and unsafe calls).
// P.mu held.
bool global_capture(Pe& P) {
  for (auto& s : P.streams)
    if (s->capturing && !s->invalidated && s->mode == cudaStreamCaptureModeGlobal) return true;
  return false;
}
void invalidate_captures(Pe& P) {
  for (auto& s : P.streams)
    if (s->capturing) s->invalidated = true;
}

uint64_t tail(Stream* s) {
  std::lock_guard<std::mutex> lock(s->mu);
  return s->issued;
}

// Enqueues op on s with the legacy stream's implicit ordering; returns its ticket.
uint64_t enqueue(Stream* s, Op op) {
  Pe& P = *s->pe;
  std::vector<Stream*> others;
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (s->legacy) {
      for (auto& t : P.streams)
        if (t.get() != s && t->blocking) others.push_back(t.get());
    } else if (s->blocking) {
      others.push_back(P.legacy);
    }
  }
  for (Stream* t : others) {
    const uint64_t k = tail(t);
    if (k > 0) op.deps.push_back(Dep{t, k});
  }
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->q.push_back(std::move(op));
    ticket = ++s->issued;
  }
  s->cv.notify_all();
  return ticket;
}

bool wait_ticket(Stream* s, uint64_t ticket) {
  std::unique_lock<std::mutex> lock(s->mu);
  return s->cv.wait_for(lock, std::chrono::duration<double>(kStreamWaitS), [&] { return s->completed >= ticket; });
}

void drain(Pe& P, Stream* s) {
  if (!wait_ticket(s, tail(s)))
    P.m->hazard("PE " + std::to_string(P.index) + ": a stream did not drain in " +
                std::to_string(static_cast<int>(kStreamWaitS)) + " s");
}

// The capture state of s: kNone, or it captures (and whether validly).
enum class Cap { kNone, kActive, kInvalidated };
Cap capture_of(Pe& P, Stream* s) {
  std::lock_guard<std::mutex> lock(P.mu);
  if (!s->capturing) return Cap::kNone;
  return s->invalidated ? Cap::kInvalidated : Cap::kActive;
}

// Work for stream s: captured into its graph, or enqueued. Returns cudaSuccess or the error of
// using the legacy stream during a global capture (which invalidates that capture).
cudaError_t submit(Pe& P, Stream* s, Node node, std::function<void()> run) {
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (s->capturing) {
      if (s->invalidated) return cudaErrorStreamCaptureInvalidated;
      s->graph->nodes.push_back(std::move(node));
      return cudaSuccess;
    }
    if (s->legacy && global_capture(P)) {
      invalidate_captures(P);
      return cudaErrorStreamCaptureImplicit;
    }
  }
  enqueue(s, Op{std::move(run), {}});
  return cudaSuccess;
}

std::function<void()> kernel_run(Pe& P, int blocks, int threads, bool cooperative, std::function<void()> fn) {
  Pe* p = &P;
  return [p, blocks, threads, cooperative, fn]() {
    p->launches.fetch_add(1);
    if (p->sticky.load() != 0 || p->world == nullptr) return;  // a dead context runs nothing
    const int resident = cooperative ? 0 : p->m->cfg.resident;
    auto h = p->world->launch_pe(p->rank, blocks, threads, [fn](int) { fn(); }, resident);
    h->wait();
    if (p->world->trapped(p->rank)) p->sticky.store(cudaErrorLaunchFailure);
  };
}

std::function<void()> copy_run(void* dst, const void* src, size_t bytes) {
  return [dst, src, bytes]() { std::memmove(dst, src, bytes); };
}

size_t parse_size(const char* v) {
  if (v == nullptr || *v == 0) return size_t{1} << 30;  // NVSHMEM's default heap: 1 GiB
  char* end = nullptr;
  double x = std::strtod(v, &end);
  switch (end != nullptr ? *end : 0) {
    case 'k': case 'K': x *= 1024; break;
    case 'm': case 'M': x *= 1024 * 1024; break;
    case 'g': case 'G': x *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return static_cast<size_t>(x);
}

// A collective of the bound PE's World: returns once every PE came (true), or after the deadline
// with a hazard (false). detail: what this PE brings (compared across PEs).
bool collective(Pe& P, const std::string& name, const std::string& detail = "") {
  WorldRec* r = P.m->rec(P.world);
  if (r == nullptr) die(name + " on PE " + std::to_string(P.index) + " before NVSHMEM is initialized");
  Coll& c = *r->coll;
  std::unique_lock<std::mutex> lock(c.mu);
  if (c.count == 0) {
    c.name = name;
    c.detail.clear();
  } else if (c.name != name) {
    P.m->hazard("rank " + std::to_string(P.rank) + " entered " + name + " while other PEs are in " + c.name);
  }
  c.detail.push_back(detail);
  const uint64_t gen = c.gen;
  if (++c.count == r->n) {
    for (const auto& d : c.detail)
      if (d != c.detail.front())
        P.m->hazard(name + ": the PEs disagree (" + c.detail.front() + " vs " + d + "): not symmetric");
    c.count = 0;
    ++c.gen;
    c.cv.notify_all();
    return true;
  }
  const bool ok = c.cv.wait_for(lock, std::chrono::duration<double>(P.m->cfg.collective_timeout_s),
                                [&] { return c.gen != gen; });
  if (!ok) {
    --c.count;
    std::ostringstream os;
    os << "rank " << P.rank << " left waiting " << P.m->cfg.collective_timeout_s << " s in " << name << ": "
       << (r->n - c.count - 1) << " of " << r->n << " PEs never came";
    lock.unlock();
    P.m->hazard(os.str());
  }
  return ok;
}

// The PEs that pass one unique id meet; the last creates their World.
int rendezvous(Pe& P, const std::string& uid, int rank, int nranks) {
  Machine::Impl& M = *P.m;
  if (rank < 0 || nranks < 1 || rank >= nranks) return 3;
  std::unique_lock<std::mutex> lock(M.mu);
  Boot& b = M.boots[uid];
  if (b.nranks == 0) b.nranks = nranks;
  if (b.nranks != nranks) return 4;
  b.segment_bytes = std::max(b.segment_bytes, parse_size(env_get("NVSHMEM_SYMMETRIC_SIZE")));
  if (++b.arrived == nranks) {
    WorldConfig wc;
    wc.pes = nranks;
    wc.G = nranks % M.cfg.G == 0 ? M.cfg.G : 1;
    wc.seed = M.cfg.seed;
    wc.segment_bytes = b.segment_bytes;
    wc.consistency_delay_us = M.cfg.consistency_delay_us;
    wc.max_piece_bytes = M.cfg.max_piece_bytes;
    WorldRec rec;
    rec.world = std::make_unique<World>(wc);
    rec.coll = std::make_unique<Coll>();
    rec.n = nranks;
    b.world = rec.world.get();
    M.worlds.push_back(std::move(rec));
    M.cv.notify_all();
  } else if (!M.cv.wait_for(lock, std::chrono::duration<double>(M.cfg.collective_timeout_s),
                            [&] { return b.world != nullptr; })) {
    --b.arrived;
    return 8;  // the bootstrap timed out: a PE never came
  }
  P.world = b.world;
  P.rank = rank;
  P.nranks = nranks;
  P.status = M.cfg.limited_mpg ? NVSHMEM_STATUS_LIMITED_MPG : NVSHMEM_STATUS_IS_INITIALIZED;
  P.refs = 1;
  P.allocs.clear();
  bind_host_thread(P.world, rank);
  return 0;
}

const char* error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation: return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureImplicit: return "operation not allowed on the legacy stream while capturing";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorCooperativeLaunchTooLarge: return "too many blocks in cooperative launch";
    case cudaErrorTimeout: return "timeout";
  }
  return "unknown error";
}

template <typename T, typename F>
void reduce_into(Pe& P, T* dest, const T* src, size_t n, F combine) {
  const char* mine = P.world->segment(P.rank);
  const size_t off = static_cast<size_t>(reinterpret_cast<const char*>(src) - mine);
  std::vector<T> acc(n);
  for (int pe = 0; pe < P.nranks; ++pe) {
    const T* s = reinterpret_cast<const T*>(P.world->segment(pe) + off);
    for (size_t i = 0; i < n; ++i) acc[i] = pe == 0 ? s[i] : combine(acc[i], s[i]);
  }
  collective(P, "reduce (read)");
  std::memcpy(dest, acc.data(), n * sizeof(T));
}

template <typename T, typename Op>
int reduce_on_stream(T* dest, const T* src, size_t n, cudaStream_t stream) {
  Pe& P = bound("nvshmemx_*_reduce_on_stream");
  if (P.world == nullptr) return 1;
  Pe* p = &P;
  Stream* s = stream_of(P, stream);
  auto run = [p, dest, src, n]() {
    if (!collective(*p, "reduce")) return;
    reduce_into(*p, dest, src, n, [](T a, T b) { return store_acc<T>(Op()(load_acc(a), load_acc(b))); });
  };
  Node node;
  node.kind = Node::kKernel;
  node.fn = run;
  return submit(P, s, node, run) == cudaSuccess ? 0 : 2;
}

}  // namespace

// ---- the driver's side ------------------------------------------------------------------------

Machine::Machine(const MachineConfig& cfg) : impl_(new Impl) {
  impl_->cfg = cfg;
  if (cfg.pes < 1 || cfg.G < 1) die("a machine needs pes >= 1 and G >= 1");
  for (int p = 0; p < cfg.pes; ++p) {
    auto pe = std::make_unique<Pe>();
    pe->m = impl_.get();
    pe->index = p;
    impl_->pes.push_back(std::move(pe));
    impl_->pes.back()->legacy = new_stream(*impl_->pes.back(), true, true);
  }
}

Machine::~Machine() {
  for (auto& p : impl_->pes)
    for (auto& s : p->streams) stop_stream(s.get());
  // Worlds go last: their proxies may still deliver the last puts.
  impl_->pes.clear();
  impl_->worlds.clear();
}

const MachineConfig& Machine::config() const { return impl_->cfg; }

void Machine::bind(int pe) {
  if (pe < 0 || pe >= impl_->cfg.pes) die("bind: no PE " + std::to_string(pe));
  t_pe = impl_->pes[static_cast<size_t>(pe)].get();
  bind_host_thread(t_pe->world, t_pe->rank);
}

void Machine::inject(int pe, const std::string& what, int nth) {
  Pe& P = *impl_->pes.at(static_cast<size_t>(pe));
  std::lock_guard<std::mutex> lock(P.mu);
  if (what == "pe_numbering" || what == "version") {
    P.lasting.insert(what);
  } else if (what == "bootstrapped") {
    P.status = NVSHMEM_STATUS_IS_BOOTSTRAPPED;
  } else {
    P.faults[what] = nth;
  }
}

std::vector<std::string> Machine::take_hazards() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> out;
  out.swap(impl_->hazards);
  return out;
}

World* Machine::world() { return t_pe != nullptr ? t_pe->world : nullptr; }

int bound_pe() { return t_pe != nullptr ? t_pe->index : -1; }

int init_external(const std::string& uid, int rank, int nranks) {
  Pe& P = bound("init_external");
  if (P.status >= NVSHMEM_STATUS_IS_INITIALIZED) {
    ++P.refs;
    return 0;
  }
  return rendezvous(P, uid, rank, nranks);
}

void finalize_external() { nvshmem_finalize(); }

int nvshmem_refs() { return bound("nvshmem_refs").refs; }

const char* env_get(const char* name) {
  if (t_pe == nullptr) return std::getenv(name);
  std::lock_guard<std::mutex> lock(t_pe->mu);
  auto it = t_pe->env.find(name);
  if (it != t_pe->env.end()) return it->second.c_str();
  return std::getenv(name);
}

void env_set(const char* name, const char* value) {
  Pe& P = bound("setenv");
  std::lock_guard<std::mutex> lock(P.mu);
  P.env[name] = value;
}

bool sticky_error() { return bound("sticky_error").sticky.load() != 0; }

uint64_t launches() { return bound("launches").launches.load(); }

uint64_t pending() {
  Pe& P = bound("pending");
  std::lock_guard<std::mutex> lock(P.mu);
  uint64_t n = 0;
  for (auto& s : P.streams) {
    std::lock_guard<std::mutex> sl(s->mu);
    n += s->issued - s->completed;
  }
  return n;
}

int launch(void* stream, int blocks, int threads, bool cooperative, std::function<void()> fn) {
  Pe& P = bound("a kernel launch");
  if (const int e = P.sticky.load()) return fail(P, static_cast<cudaError_t>(e));
  if (blocks < 1 || threads < 32 || threads > 1024 || threads % 32 != 0) return fail(P, cudaErrorInvalidValue);
  Stream* s = stream_of(P, static_cast<cudaStream_t>(stream));
  Node node;
  node.kind = Node::kKernel;
  node.blocks = blocks;
  node.threads = threads;
  node.cooperative = cooperative;
  node.fn = kernel_run(P, blocks, threads, cooperative, fn);
  const auto run = node.fn;
  const cudaError_t e = submit(P, s, std::move(node), run);
  return e == cudaSuccess ? cudaSuccess : fail(P, e);
}

}  // namespace host
}  // namespace emu
}  // namespace nvrar

// ---- CUDA runtime ----------------------------------------------------------------------------

using nvrar::emu::host::Node;
namespace H = nvrar::emu::host;

const char* cudaGetErrorString(cudaError_t e) { return H::error_name(e); }

cudaError_t cudaGetLastError() {
  H::Pe& P = H::bound("cudaGetLastError");
  if (const int e = P.sticky.load()) return static_cast<cudaError_t>(e);
  return static_cast<cudaError_t>(P.last_error.exchange(cudaSuccess));
}

cudaError_t cudaGetDeviceCount(int* n) {
  H::Pe& P = H::bound("cudaGetDeviceCount");
  if (H::fault(P, "cudaGetDeviceCount")) {
    *n = 0;
    return H::fail(P, cudaErrorNoDevice);
  }
  *n = P.m->cfg.G;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  H::Pe& P = H::bound("cudaSetDevice");
  if (H::fault(P, "cudaSetDevice") || device < 0 || device >= P.m->cfg.G) return H::fail(P, cudaErrorInvalidDevice);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  H::Pe& P = H::bound("cudaMalloc");
  if (H::fault(P, "cudaMalloc")) return H::fail(P, cudaErrorMemoryAllocation);
  void* m = std::aligned_alloc(256, std::max<size_t>((bytes + 255) / 256 * 256, 256));
  if (m == nullptr) return H::fail(P, cudaErrorMemoryAllocation);
  std::memset(m, 0xcd, bytes);  // device memory starts as garbage
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  H::Pe& P = H::bound("cudaDeviceSynchronize");
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureUnsupported);
    }
  }
  if (H::fault(P, "cudaDeviceSynchronize")) return H::fail(P, cudaErrorLaunchFailure);
  std::vector<H::Stream*> all;
  {
    std::lock_guard<std::mutex> lock(P.mu);
    for (auto& s : P.streams) all.push_back(s.get());
  }
  for (H::Stream* s : all) H::drain(P, s);
  return static_cast<cudaError_t>(P.sticky.load());
}

cudaError_t cudaFree(void* p) {
  H::bound("cudaFree");
  if (p == nullptr) return cudaSuccess;  // the idiom that creates the context
  cudaDeviceSynchronize();              // cudaFree synchronizes the device
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  H::Pe& P = H::bound("cudaHostAlloc");
  if (H::fault(P, "cudaHostAlloc")) return H::fail(P, cudaErrorMemoryAllocation);
  void* m = std::aligned_alloc(256, std::max<size_t>((bytes + 255) / 256 * 256, 256));
  std::memset(m, 0xcd, bytes);
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned) {
  H::Pe& P = H::bound("cudaHostGetDevicePointer");
  if (H::fault(P, "cudaHostGetDevicePointer")) return H::fail(P, cudaErrorInvalidValue);
  *dev = host;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  H::bound("cudaFreeHost");
  cudaDeviceSynchronize();
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  H::Pe& P = H::bound("cudaMemset");
  if (H::fault(P, "cudaMemset")) return H::fail(P, cudaErrorInvalidValue);
  if (const int e = P.sticky.load()) return static_cast<cudaError_t>(e);
  // Asynchronous on the legacy stream, as CUDA's is for device memory.
  Node node;
  node.kind = Node::kMemcpy;
  const cudaError_t e = H::submit(P, P.legacy, node, [p, value, bytes]() { std::memset(p, value, bytes); });
  return e == cudaSuccess ? e : H::fail(P, e);
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  H::Pe& P = H::bound("cudaMemcpy");
  if (H::fault(P, "cudaMemcpy")) return H::fail(P, cudaErrorInvalidValue);
  if (const int e = P.sticky.load()) return static_cast<cudaError_t>(e);
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureImplicit);
    }
  }
  const uint64_t t = H::enqueue(P.legacy, H::Op{H::copy_run(dst, src, bytes), {}});
  if (!H::wait_ticket(P.legacy, t)) P.m->hazard("cudaMemcpy never completed on PE " + std::to_string(P.index));
  return static_cast<cudaError_t>(P.sticky.load());
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t stream) {
  H::Pe& P = H::bound("cudaMemcpyAsync");
  if (const int e = P.sticky.load()) return static_cast<cudaError_t>(e);
  Node node;
  node.kind = Node::kMemcpy;
  node.dst = dst;
  node.src = src;
  node.bytes = bytes;
  const cudaError_t e = H::submit(P, H::stream_of(P, stream), node, H::copy_run(dst, src, bytes));
  return e == cudaSuccess ? e : H::fail(P, e);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  H::Pe& P = H::bound("cudaStreamCreate");
  *s = reinterpret_cast<cudaStream_t>(H::new_stream(P, false, (flags & cudaStreamNonBlocking) == 0));
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  H::Pe& P = H::bound("cudaStreamDestroy");
  H::Stream* s = H::stream_of(P, stream);
  if (s->legacy) return H::fail(P, cudaErrorInvalidResourceHandle);
  H::drain(P, s);
  return cudaSuccess;  // the stream's thread ends with the machine (events may still name it)
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  H::Pe& P = H::bound("cudaStreamSynchronize");
  H::Stream* s = H::stream_of(P, stream);
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (s->capturing) {
      s->invalidated = true;
      return H::fail(P, cudaErrorStreamCaptureUnsupported);
    }
    if (s->legacy && H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureImplicit);
    }
  }
  H::drain(P, s);
  return static_cast<cudaError_t>(P.sticky.load());
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  H::Pe& P = H::bound("cudaStreamIsCapturing");
  H::Stream* s = H::stream_of(P, stream);
  std::lock_guard<std::mutex> lock(P.mu);
  if (s->legacy && H::global_capture(P)) return H::fail(P, cudaErrorStreamCaptureImplicit);
  *status = !s->capturing ? cudaStreamCaptureStatusNone
            : s->invalidated ? cudaStreamCaptureStatusInvalidated
                             : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  H::Pe& P = H::bound("cudaStreamBeginCapture");
  H::Stream* s = H::stream_of(P, stream);
  std::lock_guard<std::mutex> lock(P.mu);
  if (s->legacy || s->capturing) return H::fail(P, cudaErrorStreamCaptureUnsupported);
  s->capturing = true;
  s->invalidated = false;
  s->mode = mode;
  s->graph = new CUgraph_st;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  H::Pe& P = H::bound("cudaStreamEndCapture");
  H::Stream* s = H::stream_of(P, stream);
  std::lock_guard<std::mutex> lock(P.mu);
  if (!s->capturing) return H::fail(P, cudaErrorInvalidValue);
  s->capturing = false;
  if (s->invalidated) {
    delete s->graph;
    s->graph = nullptr;
    *graph = nullptr;
    return H::fail(P, cudaErrorStreamCaptureInvalidated);
  }
  *graph = s->graph;
  s->graph = nullptr;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  H::Pe& P = H::bound("cudaEventCreateWithFlags");
  if (H::fault(P, "cudaEventCreateWithFlags")) return H::fail(P, cudaErrorMemoryAllocation);
  *e = reinterpret_cast<cudaEvent_t>(new H::Event);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  H::bound("cudaEventDestroy");
  delete reinterpret_cast<H::Event*>(e);
  return cudaSuccess;
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned flags) {
  H::Pe& P = H::bound("cudaEventRecord");
  H::Event* e = reinterpret_cast<H::Event*>(event);
  H::Stream* s = H::stream_of(P, stream);
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (s->capturing) {
      if (s->invalidated) return H::fail(P, cudaErrorStreamCaptureInvalidated);
      Node node;
      node.kind = Node::kRecord;
      node.ev = e;
      s->graph->nodes.push_back(node);
      if ((flags & cudaEventRecordExternal) == 0) {
        std::lock_guard<std::mutex> el(e->mu);
        e->recorded_in = s->graph;
      }
      return cudaSuccess;
    }
    if (s->legacy && H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureImplicit);
    }
  }
  const uint64_t t = H::enqueue(s, H::Op{});
  std::lock_guard<std::mutex> el(e->mu);
  e->s = s;
  e->ticket = t;
  e->recorded_in = nullptr;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return cudaEventRecordWithFlags(e, s, 0); }

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  H::Pe& P = H::bound("cudaEventSynchronize");
  H::Event* e = reinterpret_cast<H::Event*>(event);
  H::Stream* s;
  uint64_t t;
  {
    std::lock_guard<std::mutex> el(e->mu);
    s = e->s;
    t = e->ticket;
  }
  if (s != nullptr && !H::wait_ticket(s, t)) P.m->hazard("an event never completed on PE " + std::to_string(P.index));
  return static_cast<cudaError_t>(P.sticky.load());
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags) {
  H::Pe& P = H::bound("cudaStreamWaitEvent");
  H::Event* e = reinterpret_cast<H::Event*>(event);
  H::Stream* s = H::stream_of(P, stream);
  {
    std::lock_guard<std::mutex> lock(P.mu);
    if (s->capturing) {
      if (s->invalidated) return H::fail(P, cudaErrorStreamCaptureInvalidated);
      if (flags & cudaEventWaitExternal) {
        Node node;
        node.kind = Node::kWaitExternal;
        node.ev = e;
        s->graph->nodes.push_back(node);
        return cudaSuccess;
      }
      std::lock_guard<std::mutex> el(e->mu);
      if (e->recorded_in == s->graph) return cudaSuccess;  // ordered inside the capture already
      // An internal wait on work outside the capture: CUDA refuses it and the capture is lost.
      s->invalidated = true;
      return H::fail(P, cudaErrorStreamCaptureIsolation);
    }
    if (s->legacy && H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureImplicit);
    }
  }
  H::Op op;
  {
    std::lock_guard<std::mutex> el(e->mu);
    if (e->s == nullptr) return cudaSuccess;  // never recorded: nothing to wait for
    op.deps.push_back(H::Dep{e->s, e->ticket});
  }
  H::enqueue(s, std::move(op));
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  H::bound("cudaGraphInstantiate");
  if (graph == nullptr) return cudaErrorInvalidValue;
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  H::Pe& P = H::bound("cudaGraphLaunch");
  if (const int e = P.sticky.load()) return static_cast<cudaError_t>(e);
  H::Stream* s = H::stream_of(P, stream);
  if (H::capture_of(P, s) != H::Cap::kNone) return H::fail(P, cudaErrorStreamCaptureUnsupported);
  for (const Node& n : exec->nodes) {
    switch (n.kind) {
      case Node::kKernel:
      case Node::kMemcpy: {
        auto run = n.kind == Node::kKernel ? n.fn : H::copy_run(n.dst, n.src, n.bytes);
        H::enqueue(s, H::Op{run, {}});
        break;
      }
      case Node::kWaitExternal: {
        H::Op op;
        {
          std::lock_guard<std::mutex> el(n.ev->mu);  // the event's last record before this launch
          if (n.ev->s != nullptr) op.deps.push_back(H::Dep{n.ev->s, n.ev->ticket});
        }
        H::enqueue(s, std::move(op));
        break;
      }
      case Node::kRecord: {
        const uint64_t t = H::enqueue(s, H::Op{});
        std::lock_guard<std::mutex> el(n.ev->mu);
        n.ev->s = s;
        n.ev->ticket = t;
        break;
      }
    }
  }
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t nvrar_emu_func_attributes(cudaFuncAttributes* a) {
  H::Pe& P = H::bound("cudaFuncGetAttributes");
  {
    // The first query of a kernel loads its module (lazy loading): not allowed while the PE
    // captures in global mode; the capture is invalidated.
    std::lock_guard<std::mutex> lock(P.mu);
    if (H::global_capture(P)) {
      H::invalidate_captures(P);
      return H::fail(P, cudaErrorStreamCaptureUnsupported);
    }
  }
  if (H::fault(P, "cudaFuncGetAttributes")) return H::fail(P, cudaErrorInvalidValue);
  a->maxThreadsPerBlock = 1024;
  a->numRegs = 64;
  return cudaSuccess;
}

// ---- NVSHMEM host API --------------------------------------------------------------------------

int nvshmemx_get_uniqueid(nvshmemx_uniqueid_t* id) {
  H::Pe& P = H::bound("nvshmemx_get_uniqueid");
  std::memset(id, 0, sizeof(*id));
  std::random_device rd;
  const uint64_t a = P.m->uid_counter.fetch_add(1), b = (static_cast<uint64_t>(rd()) << 32) | rd();
  std::memcpy(id->bytes, &a, 8);
  std::memcpy(id->bytes + 8, &b, 8);
  return 0;
}

int nvshmemx_set_attr_uniqueid_args(int rank, int nranks, const nvshmemx_uniqueid_t* id, nvshmemx_init_attr_t* attr) {
  attr->rank = rank;
  attr->nranks = nranks;
  attr->id = *id;
  return 0;
}

int nvshmemi_init_thread(int, int* provided, unsigned flags, nvshmemx_init_attr_t* attr, nvshmemi_version_t) {
  H::Pe& P = H::bound("nvshmemi_init_thread");
  if (provided) *provided = NVSHMEM_THREAD_SERIALIZED;
  if (H::fault(P, "nvshmem_init")) return 7;
  if (P.status >= NVSHMEM_STATUS_IS_INITIALIZED) {
    ++P.refs;  // a join: one more reference
    return 0;
  }
  if ((flags & NVSHMEMX_INIT_WITH_UNIQUEID) == 0 || attr == nullptr) return 5;
  return H::rendezvous(P, std::string(attr->id.bytes, sizeof(attr->id.bytes)), attr->rank, attr->nranks);
}

int nvshmemx_init_status() { return H::bound("nvshmemx_init_status").status; }

void nvshmemx_vendor_get_version_info(int* major, int* minor, int* patch) {
  H::Pe& P = H::bound("nvshmemx_vendor_get_version_info");
  *major = NVSHMEM_VENDOR_MAJOR_VERSION;
  *minor = NVSHMEM_VENDOR_MINOR_VERSION + (H::fault(P, "version") ? 1 : 0);
  *patch = NVSHMEM_VENDOR_PATCH_VERSION;
}

int nvshmem_my_pe() {
  H::Pe& P = H::bound("nvshmem_my_pe");
  return H::fault(P, "pe_numbering") ? (P.rank + 1) % P.nranks : P.rank;
}

int nvshmem_n_pes() { return H::bound("nvshmem_n_pes").nranks; }

void* nvshmem_malloc(size_t bytes) {
  H::Pe& P = H::bound("nvshmem_malloc");
  if (P.world == nullptr) return nullptr;
  // The heap stays symmetric: the same sizes in the same order give the same offsets on every PE
  // (compared at the collective). An injected failure takes its part and its room, then answers
  // NULL on that PE alone.
  const size_t off = P.allocs.empty() ? 0 : (P.allocs.back().first + P.allocs.back().second + 255) / 256 * 256;
  const bool ok = H::collective(P, "nvshmem_malloc", std::to_string(bytes) + " bytes at offset " + std::to_string(off));
  if (!ok || off + bytes > P.world->config().segment_bytes) return nullptr;
  P.allocs.emplace_back(off, bytes);
  if (H::fault(P, "nvshmem_malloc")) return nullptr;
  return P.world->segment(P.rank) + off;
}

void nvshmem_free(void* p) {
  H::Pe& P = H::bound("nvshmem_free");
  if (P.world == nullptr || p == nullptr) return;
  cudaDeviceSynchronize();
  H::collective(P, "nvshmem_free");
  const size_t off = static_cast<size_t>(static_cast<char*>(p) - P.world->segment(P.rank));
  for (auto it = P.allocs.begin(); it != P.allocs.end(); ++it)
    if (it->first == off) {
      P.allocs.erase(it);
      break;
    }
}

void nvshmem_barrier_all() {
  H::Pe& P = H::bound("nvshmem_barrier_all");
  cudaDeviceSynchronize();
  P.world->quiet();
  H::collective(P, "nvshmem_barrier_all");
}

void nvshmem_finalize() {
  H::Pe& P = H::bound("nvshmem_finalize");
  if (P.refs <= 0) return;
  if (--P.refs > 0) return;
  cudaDeviceSynchronize();
  H::collective(P, "nvshmem_finalize");
  P.status = NVSHMEM_STATUS_NOT_INITIALIZED;
  P.world = nullptr;
  P.rank = -1;
  nvrar::emu::bind_host_thread(nullptr, 0);
}

int nvshmem_int_max_reduce(nvshmem_team_t, int* dest, const int* source, size_t nreduce) {
  H::Pe& P = H::bound("nvshmem_int_max_reduce");
  if (P.world == nullptr) return 1;
  cudaDeviceSynchronize();
  if (!H::collective(P, "nvshmem_int_max_reduce")) return 2;
  H::reduce_into(P, dest, source, nreduce, [](int a, int b) { return a > b ? a : b; });
  return 0;
}

#define NVRAR_EMU_DEF_REDUCE(NAME, T)                                                                         \
  int nvshmemx_##NAME##_sum_reduce_on_stream(nvshmem_team_t, T* d, const T* s, size_t n, cudaStream_t st) { \
    return H::reduce_on_stream<T, nvrar::OpSum>(d, s, n, st);                                                 \
  }                                                                                                           \
  int nvshmemx_##NAME##_max_reduce_on_stream(nvshmem_team_t, T* d, const T* s, size_t n, cudaStream_t st) { \
    return H::reduce_on_stream<T, nvrar::OpMax>(d, s, n, st);                                                 \
  }                                                                                                           \
  int nvshmemx_##NAME##_min_reduce_on_stream(nvshmem_team_t, T* d, const T* s, size_t n, cudaStream_t st) { \
    return H::reduce_on_stream<T, nvrar::OpMin>(d, s, n, st);                                                 \
  }
NVRAR_EMU_DEF_REDUCE(float, float)
NVRAR_EMU_DEF_REDUCE(half, half)
NVRAR_EMU_DEF_REDUCE(bfloat16, __nv_bfloat16)
NVRAR_EMU_DEF_REDUCE(int, int)
#undef NVRAR_EMU_DEF_REDUCE
