// The CPU executor's link between hosts: the interface its transport (transport.h) uses for the
// ranks of other hosts; UCX implements it (ucx.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../protocol/round.h"
#include "reduce_kernels.h"

namespace nvrar {

// NOTE [put-with-signal across hosts]
// A rank on another host is reached with the semantics of NVSHMEM's put-with-signal: the step's
// data lands in the partner's zone, then the step's inter cell after its flag word (aux words and
// the 32-byte call description, protocol/desc.h), and the flag word last: one cell per message,
// as in shared memory. The receiver's wait compares the description (same_call) before it uses
// any data, exactly as for a flag stored through shared memory. The segment layout keeps no room
// in front of a zone, so the description rides in the cell's own words, in the same message.
//
// NOTE [active messages]
// A put is UCX active messages (ucp_am_send_nbx, eager), one per piece of at most 63 KB (NOTE
// [pieces], ucx.cpp): header {dst_off, bytes, piece_off, cell_off}, payload = the piece, then the
// cell image; the receiver stores the cell once every piece arrived. The receiver's handler,
// inside its own progress call, copies the piece into the zone (or, where the waiting round
// expects the put, combines or delivers it straight from UCX's receive buffer: NOTE [landings]
// below); with the last one the cell's tail, then the flag word with a release:
// the order of a put, a fence and the signal put, without the fence's round trip. Why not RMA
// (ucp_put_nbx into the registered segment, ucp_worker_fence, the flag put), as first built:
//   * over tcp UCX emulates RMA with active messages anyway (the data lands inside the target's
//     progress), and every emulated put makes the target send a completion back; when the origin
//     host has died that send fails and UCX 1.22 aborts the whole target process (ucs_fatal
//     "unexpected error: Endpoint timeout" in ucp_request_try_send, from the RMA completion of
//     ucp/rma/rma_sw.c), which the host-kill test met: a survivor must raise, not die. An eager
//     active message needs no answer (rendezvous would, so it is never used).
//   * a remote key lets its holder write anywhere in the segment (the pool holds user data); a
//     message can only land where the receiver's check allows: the inter-node zones and cells
//     (and the abort cell), within a zone's size (CpuExecutor::accept_remote_write). No remote key
//     exists at all.
// On RDMA hardware a true one-sided put would skip the receiver's copy; that path (RMA when UCX
// reports native RMA lanes) is not built yet.
//
// Progress is driven by the waiting rank: every wait of a round polls the worker while it spins
// (a message lands only inside the receiver's progress calls), then sleeps on the worker's event
// fd between polls (NOTE [blocking waits], ucx.cpp). UCX's peer error handling is on
// (UCP_ERR_HANDLING_MODE_PEER), so a host that died or a link that broke fails the wait that
// needs it, naming rank, peer, phase and step; a peer that is merely silent (stopped, link down
// without a reset) meets the wait's deadline. LL packets (protocol/ll.h) never cross hosts:
// whether 8-byte words of a message land atomically depends on the transport (tcp promises
// nothing), so a communicator across hosts has ll_max_bytes 0 (nvrar/_setup.py).

// Where a message from another host may land in my segment: dst_off/bytes (its data, bytes may
// be 0) and the cell at cell_off.
struct RemoteWriteCheck {
  bool (*fn)(void* ctx, size_t dst_off, size_t bytes, size_t cell_off);
  void* ctx;
};

// NOTE [landings] (protocol/round.h) across hosts: the put of `word` into my zone at zone_off
// (`bytes` in all) flagged in a cell is applied piece by piece as it arrives, from UCX's receive
// buffer, by the round's own apply_landing (the same operands in the same order). A piece is
// applied only if its put matches the expectation exactly (word, zone, size, the call
// description in its cell image, element alignment); any other lands in the zone as always, and
// the waiting rank checks it there (a mismatched call is raised, never combined).
struct LinkLanding {
  uint64_t word;
  Landing lg;
  ReduceFn fn;       // the call's reduction (dtype, op)
  const void* desc;  // the call description my cells must carry (32 bytes, protocol/desc.h)
};

// The link between hosts: messages into the segments of the ranks on other hosts, their local
// completion, and the liveness UCX reports. Owned by the executor when ranks span hosts.
class HostLink {
 public:
  virtual ~HostLink() = default;
  // Endpoints and remote keys from every rank's blob (index: rank; ranks of my host ignored).
  virtual void connect(const std::vector<std::string>& blobs) = 0;
  // NOTE [wire-up] (ucx.cpp): a thread drives the worker while the ranks meet in the store.
  virtual void start_wireup() = 0;
  virtual std::string wait_wired(double timeout_s) = 0;  // "" once every peer answered, else why not
  virtual void stop_wireup() = 0;
  // Sends the put-with-signal above (the cell image at `cell`: Cell of segment.h, sent whole);
  // false if the peer's endpoint failed. `src` and `cell` must stay until progress() is true.
  virtual bool put_signal(int rank, size_t dst_off, const void* src, size_t bytes, size_t cell_off,
                          const void* cell) = 0;
  // Progresses the worker once; true when every put issued has completed locally.
  virtual bool progress() = 0;
  // Gives the core away until the worker has something to progress (a message arrived, a send
  // can go on) or timeout_ns passed: UCX's event fd where the transports offer one, else one
  // sched_yield. The caller progresses and checks its condition again after it.
  virtual void block(long timeout_ns) = 0;
  // NOTE [landings]: expects the put flagged in cell_off (until settle); settle ends it and
  // appends the pieces of that put that landed in the zone instead (they came first), as
  // (offset in the put, bytes); forget_expected ends every expectation (a call that failed: no
  // put may land outside the zones any more).
  virtual void expect(size_t cell_off, const LinkLanding& lg) = 0;
  virtual void settle(size_t cell_off, std::vector<std::pair<size_t, size_t>>* in_zone) = 0;
  virtual void forget_expected() noexcept = 0;
  // Data pieces received so far: applied as they arrived, and landed in a zone (testing).
  virtual std::pair<uint64_t, uint64_t> landings() const = 0;
  virtual bool peer_failed(int rank) const = 0;
  virtual std::string peer_error(int rank) const = 0;
  // The cell alone, best effort, for at most timeout_s (abort records); never throws.
  virtual void post_cell(int rank, size_t cell_off, const void* cell, double timeout_s) noexcept = 0;
  // Messages refused since the link opened (they named a place outside the zones and cells, or
  // were malformed): a protocol violation, which the waiting rank raises.
  virtual uint64_t refused() const = 0;
  // The transports and devices UCX chose for the endpoint to `rank` ("tcp/veth1,...").
  virtual std::string transports(int rank) = 0;
  // Testing (tests/test_hosts.py): one message with exactly this header, piece_len zero bytes
  // and a cell image whose flag word is `word`, as a faulty or hostile peer could send; waits
  // up to 1 s for it to leave. False if the endpoint failed.
  virtual bool forge(int rank, size_t dst_off, size_t bytes, size_t piece_off, size_t cell_off, size_t piece_len,
                     uint64_t word) = 0;
};

}  // namespace nvrar
