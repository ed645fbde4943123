// The CPU executor's link between hosts: the interface its transport (transport.h) uses for the
// ranks of other hosts; UCX implements it (ucx.cpp).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace nvrar {

// NOTE [put-with-signal across hosts]
// A rank on another host is reached by one-sided puts into its registered segment, with the
// ordering NVSHMEM's put-with-signal gives: the step's data into the partner's zone, then the
// step's inter cell after its flag word (aux words and the 32-byte call description, protocol/
// desc.h), a fence (ucp_worker_fence), and the flag word last, one cell per message as in shared
// memory. The segment layout keeps no room in front of a zone, so the description rides in the
// cell's own words rather than in front of the data; the fence orders it before the flag all
// the same, and the receiver's wait compares it (same_call) before it uses any data, exactly as
// for a flag stored through shared memory. Each put's source may be reused once it completed
// locally: the sender drives the worker until then, under the wait's deadline.
//
// Progress is driven by the waiting rank: every wait of a round polls the worker while it
// spins (over tcp a put lands only inside the target's progress calls). UCX's peer error
// handling is on, so a host that died or a link that broke fails the wait that needs it, naming
// rank, peer, phase and step; a peer that is merely silent (stopped, link down without a reset)
// meets the wait's deadline. LL packets (protocol/ll.h) never cross hosts: whether a put's
// 8-byte words land atomically depends on the UCX transport (tcp gives no such promise), so a
// communicator across hosts has ll_max_bytes 0 (nvrar/_setup.py) and uses put-with-signal.
//
// The link between hosts: one-sided puts into the segments of the ranks on other hosts, their
// local completion, and the liveness UCX reports. Owned by the executor when ranks span hosts.
class HostLink {
 public:
  virtual ~HostLink() = default;
  // Endpoints and remote keys from every rank's blob (index: rank; ranks of my host ignored).
  virtual void connect(const std::vector<std::string>& blobs) = 0;
  // NOTE [wire-up] (ucx.cpp): a thread drives the worker while the ranks meet in the store.
  virtual void start_wireup() = 0;
  virtual std::string wait_wired(double timeout_s) = 0;  // "" once every peer answered, else why not
  virtual void stop_wireup() = 0;
  // Issues the put-with-signal above (the cell image at `cell`: Cell of segment.h); false if the
  // peer's endpoint failed.
  virtual bool put_signal(int rank, size_t dst_off, const void* src, size_t bytes, size_t cell_off,
                          const void* cell) = 0;
  // Progresses the worker once; true when every put issued has completed locally.
  virtual bool progress() = 0;
  virtual bool peer_failed(int rank) const = 0;
  virtual std::string peer_error(int rank) const = 0;
  // The cell alone, best effort, for at most timeout_s (abort records); never throws.
  virtual void post_cell(int rank, size_t cell_off, const void* cell, double timeout_s) noexcept = 0;
  // The transports and devices UCX chose for the endpoint to `rank` ("tcp/veth1,...").
  virtual std::string transports(int rank) = 0;
};

}  // namespace nvrar
