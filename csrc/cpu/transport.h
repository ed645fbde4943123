// The CPU executor's transport: what protocol/round.h's Transport concept asks of it, for the
// CPU executor (csrc/cpu/executor.cpp). A round is run by one thread per rank (a group of one).
//
//   inside a host   shared memory: every rank on the host maps every other's segment (shm_heap.h);
//                   flags are stores into the peer's cells (segment.h), data is memcpy, private
//                   buffers of local peers are reached with process_vm_readv/writev
//   between hosts   put-with-signal over the executor's HostLink (host_link.h, UCX active messages
//                   in ucx.cpp): only inter-node steps cross hosts, only to ranks of other hosts
//
// Methods are inline: the round is a template over its transport, and the shared-memory path is
// the latency-critical one. The transport calls the executor's waits (signal, wait, wait_ll,
// spin_until, same_call) and never re-implements them. Failures throw (ProtocolError).
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "../protocol/ll.h"
#include "../protocol/round.h"
#include "../protocol/phase.h"
#include "executor.h"
#include "host_link.h"
#include "segment.h"
#include "stream_copy.h"

namespace nvrar {

// Adds the time of its scope to *acc when phase timing is on (PhaseTimes, executor.h).
struct PhaseTimer {
  uint64_t* acc;
  std::chrono::steady_clock::time_point t0;
  PhaseTimer(bool on, uint64_t* a) : acc(on ? a : nullptr) {
    if (acc != nullptr) t0 = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    if (acc != nullptr)
      *acc += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
};

// The CPU side of the Transport concept of protocol/round.h (see the file comment). A friend of
// CpuExecutor: it reaches the executor's segment, call description and waits.
struct CpuTransport {
  // Longest a wait for another host blocks on the link's event between checks of its abort cell
  // (which local peers write through shared memory, without an event), deadline and liveness.
  static constexpr long kBlockNs = 200 * 1000;
  // How long such a wait yields (progressing the link between yields) before it blocks: a small
  // message's wait ends within it; waking a blocked thread costs 100-200 us on this VM.
  static constexpr uint64_t kRemoteYieldNs = 300 * 1000;
  CpuExecutor* ex;
  ReduceFn fn;
  uint64_t epoch;

  char* my() const { return ex->heap_.mine(); }
  char* base(int rank) const { return ex->heap_.base(rank); }
  bool leader() const { return true; }
  void sync() const {}
  void signal(int rank, size_t cell, uint64_t word, uint64_t aux0, uint64_t aux1) {
    const PhaseTimer t(ex->phase_timing_, &ex->times_.signal_ns);
    ex->signal(rank, cell, word, aux0, aux1);
  }
  bool wait(size_t cell, uint64_t e, uint32_t sig, Phase phase, int step, int peer, uint64_t* aux0, uint64_t* aux1) {
    const CpuExecutor::Site site{phase, step, peer};
    const PhaseTimer t(ex->phase_timing_, &ex->times_.wait_ns);
    if (ex->link_ != nullptr) {
      // Across hosts every wait drives the worker: a peer's puts land only inside my progress.
      const auto* c = reinterpret_cast<const Cell*>(my() + cell);
      const uint64_t target = flag_word(e, 0);
      HostLink* link = ex->link_.get();
      const auto ready = [&] { link->progress(); return load_acquire(&c->word) >= target || link->refused() != 0; };
      const auto observed = [&] { return flag_epoch(load_relaxed(&c->word)); };
      // A flag from another host comes with an event of the worker's fd; a local peer's comes
      // through shared memory, without one: that wait yields (NOTE [waiting]).
      if (ex->remote(peer))
        ex->spin_until(ready, observed, site, e, [link](uint64_t waited_ns) {
          if (waited_ns < kRemoteYieldNs)
            sched_yield();
          else
            link->block(kBlockNs);
        });
      else
        ex->spin_until(ready, observed, site, e);
      if (link->refused() != 0)
        ex->fail(ProtocolError::Kind::kViolation,
                 "protocol violation: a message from another host named a place outside the inter-node zones and "
                 "cells of this rank's segment (refused)", site, e, 0);
    }
    const auto aux = ex->wait(cell, e, sig, site);
    *aux0 = aux.first;
    *aux1 = aux.second;
    return true;
  }
  // NOTE [landings] (protocol/round.h): a put from another host is applied as it arrives
  // (HostLink::expect); one through shared memory is applied from the zone after the wait.
  void expect(size_t cell, uint64_t word, int peer, const Landing& lg) {
    if (ex->link_ != nullptr && ex->remote(peer))
      ex->link_->expect(cell, LinkLanding{word, lg, fn, &ex->desc_});
  }
  bool wait_land(size_t cell, uint64_t e, uint32_t sig, Phase phase, int step, int peer, const Landing& lg) {
    uint64_t a0, a1;
    wait(cell, e, sig, phase, step, peer, &a0, &a1);
    if (ex->link_ != nullptr && ex->remote(peer)) {
      auto& in_zone = ex->in_zone_;
      in_zone.clear();
      ex->link_->settle(cell, &in_zone);
      for (const auto& pc : in_zone) apply_landing(*this, lg, my() + lg.zone_off + pc.first, pc.first, pc.second);
    } else {
      apply_landing(*this, lg, my() + lg.zone_off, 0, lg.bytes);
    }
    return true;
  }
  bool put_signal(int rank, size_t dst_off, const char* src, size_t bytes, size_t cell, uint64_t word) {
    if (ex->remote(rank)) {
      const PhaseTimer t(ex->phase_timing_, &ex->times_.remote_ns);
      return remote_put_signal(rank, dst_off, src, bytes, cell, word);
    }
    {
      const PhaseTimer t(ex->phase_timing_, &ex->times_.copy_ns);
      std::memcpy(base(rank) + dst_off, src, bytes);
    }
    signal(rank, cell, word, 0, 0);
    return true;
  }
  // NOTE [put-with-signal across hosts]. base(rank) is the local image of the remote rank's
  // header and cells (CpuExecutor::attach): the cell is composed there by the executor's signal.
  bool remote_put_signal(int rank, size_t dst_off, const char* src, size_t bytes, size_t cell, uint64_t word) {
    HostLink* link = ex->link_.get();
    ex->signal(rank, cell, word, 0, 0);
    const CpuExecutor::Site site{Phase::kInterNode, ex->inter_step_of(cell), rank};
    if (!link->put_signal(rank, dst_off, src, bytes, cell, base(rank) + cell))
      ex->fail(ProtocolError::Kind::kTimeout, "cannot reach the peer's host: " + link->peer_error(rank), site, epoch,
               0);
    if (!link->progress())
      // (yields, never blocks: room in a full socket need not come with an event of the fd)
      ex->spin_until([&] { return link->progress(); }, [] { return uint64_t{0}; }, site, epoch);
    return true;
  }
  // LL packets go straight into the peer's LL zone, one 8-byte atomic store each. The call
  // description goes first into the step's inter cell (NOTE [call description]), the flag word
  // after the packets (a receiver that expects a put-with-signal sees the mismatch at once).
  bool put_ll(int rank, size_t dst_off, size_t /*out_off*/, const char* src, size_t bytes, uint32_t flag) {
    NVRAR_CHECK(!ex->remote(rank), "nvrar: LL packets never cross hosts (NOTE [put-with-signal across hosts])");
    auto* c = reinterpret_cast<Cell*>(base(rank) + ex->ll_desc_cell(dst_off));
    store_desc(&c->desc, ex->desc_);
    std::atomic_thread_fence(std::memory_order_release);
    auto* pk = reinterpret_cast<uint64_t*>(base(rank) + dst_off);
    const size_t n = ll_packets(bytes);
    for (size_t i = 0; i < n; ++i) {
      store_relaxed(&pk[i], ll_make_packet(src, bytes, i, flag));
      if ((i & 255) == 255) ex->jitter();
    }
    store_release(&c->word, flag_word(epoch, flag & static_cast<uint32_t>(kSigMask)));
    return true;
  }
  bool wait_ll(size_t off, size_t bytes, uint64_t e, uint32_t sig, int step, int peer) {
    ex->wait_ll(off, bytes, e, sig, CpuExecutor::Site{Phase::kInterNode, step, peer});
    return true;
  }
  void ll_unpack(char* dst, size_t off, size_t bytes) {
    auto* pk = reinterpret_cast<uint64_t*>(my() + off);
    const size_t n = ll_packets(bytes);
    for (size_t i = 0; i < n; ++i) {
      ll_store_payload(dst, bytes, i, load_relaxed(&pk[i]));
      store_relaxed(&pk[i], 0);  // NOTE [LL zones]
    }
  }
  void reduce(char* const* dst, int nd, const char* const* src, int ns, size_t n, Scale sc) const {
    const PhaseTimer t(ex->phase_timing_, &ex->times_.reduce_ns);
    fn(reinterpret_cast<void* const*>(dst), nd, reinterpret_cast<const void* const*>(src), ns, n, sc);
  }
  void copy(char* dst, const char* src, size_t bytes) const {
    const PhaseTimer t(ex->phase_timing_, &ex->times_.copy_ns);
    if (bytes == 0 || dst == src) return;
    // NOTE [streaming stage-in] (executor.cpp): into my staging slots, which only peers read
    if (ex->stream_ && in_my_staging(dst)) {
      stream_copy(dst, src, bytes);
      ex->streamed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    } else {
      std::memcpy(dst, src, bytes);
    }
  }
  bool in_my_staging(const char* p) const {
    const char* stage = my() + ex->layout_.staging_off;
    return p >= stage && p < stage + 2 * ex->layout_.staging_bytes;
  }
  bool remote_read(int rank, char* dst, uint64_t addr, size_t bytes, Phase phase) {
    const CpuExecutor::Site site{phase, 0, rank};
    const PhaseTimer t(ex->phase_timing_, &ex->times_.cma_ns);
    ex->check_remote_range(false, rank, addr, bytes, site, epoch);
    ex->cma_transfer(false, rank, dst, addr, bytes, site, epoch);
    return true;
  }
  bool remote_write(int rank, const char* src, uint64_t addr, size_t bytes, Phase phase) {
    ex->jitter();
    const CpuExecutor::Site site{phase, 0, rank};
    const PhaseTimer t(ex->phase_timing_, &ex->times_.cma_ns);
    ex->check_remote_range(true, rank, addr, bytes, site, epoch);
    ex->cma_transfer(true, rank, const_cast<char*>(src), addr, bytes, site, epoch);
    return true;
  }
  void expose(uint64_t e) { ex->exposed_epoch_ = e; }
  void jitter() { ex->jitter(); }
};

}  // namespace nvrar
