// The emulated device as a driver sees it (csrc/emu/driver.cpp): a world of PEs (thread groups of
// this process, each with a symmetric segment), kernel launches that start one OS thread per CUDA
// thread, and the adversarial NVSHMEM proxy. The device code sees only prim_emu.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace nvrar {
namespace emu {

struct WorldConfig {
  int pes = 1;
  int G = 1;                      // PEs per emulated node: nvshmem_ptr is non-null inside a node
  bool direct_remote = false;     // nvshmem_ptr non-null across nodes too (the direct-store path)
  uint64_t seed = 1;              // the proxy's choices (order, pieces, delays)
  double barrier_timeout_s = 60;  // a __syncthreads that not every thread reaches aborts after this
  int max_delay_us = 30;          // the proxy's random delays, at most this long
  size_t segment_bytes = 0;       // every PE's symmetric segment, zeroed
  size_t max_piece_bytes = 256;   // the proxy delivers a put in pieces of 8 to this many bytes
  // Proxy-consistency mode (IBRC without gdrcopy, NVSHMEM's init.cu): > 0: every write the proxy
  // delivers (a put's pieces, a signal) becomes visible to the target's loads only after a random
  // delay of up to this many microseconds, each on its own (a signal may be seen before its data),
  // or at once at the target's consistency point: nvshmem_uint64_wait_until.
  int consistency_delay_us = 0;
  // A stalled proxy: >= 0: the proxy neither delivers nor acknowledges any operation from or to
  // this PE (a dead NIC, a hung proxy thread); they stay queued. nvshmem_fence, which waits for
  // the delivery of the issuing PE's earlier operations (IBGDA's fence is a quiet), then never
  // returns for them.
  int stalled_pe = -1;
};

// The wire ledger's raw record (docs/gpu/emulation.md, "Wire ledger"): with recording on, every
// NVSHMEM device call, every system-scope store to another PE's segment, every release store and
// every fence of the device code is logged with who issued it and where it goes. Nothing here
// knows the protocol: the driver attributes the operations to phases and steps by their offsets.
enum class WireKind : uint8_t {
  kPut,           // nvshmemx_putmem_nbi_block (offset: destination)
  kPutSignal,     // nvshmemx_putmem_signal_nbi_block (offset: destination, sig_offset: the signal)
  kSignalOp,      // nvshmemx_signal_op (offset: the signal word)
  kAtomic,        // another NVSHMEM atomic to a PE
  kFence,         // nvshmem_fence
  kQuiet,         // nvshmem_quiet
  kWaitUntil,     // nvshmem_uint64_wait_until / nvshmem_signal_wait_until (target: me; offset: the word)
  kStoreRelaxed,  // st.relaxed.sys to another PE's segment (direct stores: NVLink, or nvshmem_ptr)
  kStoreRelease,  // st.release.sys to any PE's segment, mine included
  kSysFence,      // __threadfence_system
  kDevFence,      // __threadfence
};
const char* wire_kind_name(WireKind k);

struct WireOp {
  uint64_t seq = 0;  // global issue order
  WireKind kind = WireKind::kPut;
  int pe = 0, block = 0, thread = 0;
  int target = -1;          // the PE written (-1: none, for fences)
  uint64_t offset = 0;      // byte offset in the target's segment
  uint64_t bytes = 0;
  int64_t sig_offset = -1;  // put-with-signal: the signal word's offset in the target's segment
};

// A launch on one PE (World::launch_pe): its threads run until the kernel returns on each.
struct PeLaunch {
  virtual ~PeLaunch() = default;
  virtual void wait() = 0;        // until every thread of the launch has returned
  virtual bool done() const = 0;  // whether they have
};

struct ProxyStats {
  uint64_t puts = 0;
  uint64_t pieces = 0;
  uint64_t signals = 0;
  uint64_t reordered = 0;  // deliveries that overtook an earlier-issued operation
};

// Proxy-consistency mode over every world of this process: writes hidden, consistency points.
void consistency_totals(uint64_t* hidden, uint64_t* points);

class World {
 public:
  explicit World(const WorldConfig& cfg);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  const WorldConfig& config() const;
  char* segment(int pe) const;
  // Runs kernel(pe) in blocks[pe] x threads OS threads for every PE at once (blocks[pe] == 0: PE pe
  // launches nothing, it never arrives), and returns when every thread has returned (the proxy
  // keeps delivering in the background). resident[pe] (if given, and 0 < it < blocks[pe]): PE pe
  // runs in block waves, see launch_pe.
  void launch(const std::vector<int>& blocks, int threads, const std::function<void(int pe)>& kernel,
              const std::vector<int>& resident = {});
  // Runs kernel(pe) in blocks x threads OS threads of PE `pe`; returns a handle to wait on.
  // Launches of different PEs (and several of one PE) run concurrently. The handle's destructor
  // waits. resident 0 (or >= blocks): every block starts before it returns (a cooperative launch,
  // or a grid that fits); else block waves: at most `resident` blocks run at once, started in
  // blockIdx order, the next when one has ended (a grid larger than what the GPU runs at once).
  std::shared_ptr<PeLaunch> launch_pe(int pe, int blocks, int threads, std::function<void(int pe)> kernel,
                                      int resident = 0);
  // Until the proxy delivered everything issued so far.
  void quiet();
  // Whether PE pe's device code trapped (device_trap: the context's sticky error); reset() clears it.
  bool trapped(int pe) const;
  void reset_trapped(int pe);
  ProxyStats stats() const;
  // The wire ledger: while on (between launches only), the device code's operations are logged;
  // take_wire_ops returns them in issue order and empties the log.
  void set_recording(bool on);
  std::vector<WireOp> take_wire_ops();

  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  std::unique_ptr<Impl> impl_;
};

// Binds a host thread (the host half, host_emu.cpp) to PE pe of w, so that the host calls of
// NVSHMEM that device code shares (nvshmem_ptr) answer for that PE; w == nullptr unbinds.
void bind_host_thread(World* w, int pe);

}  // namespace emu
}  // namespace nvrar
