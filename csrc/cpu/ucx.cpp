// HostLink over UCX active messages (see ucx.h and the NOTEs of host_link.h).
#include "ucx.h"

#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <list>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "../common/error.h"

#ifndef NVRAR_NO_UCX
#include <ucp/api/ucp.h>
#endif

namespace nvrar {

#ifdef NVRAR_NO_UCX

bool ucx_compiled() { return false; }

std::unique_ptr<HostLink> open_ucx_link(const std::string&, int, const std::vector<bool>&, char*, size_t,
                                        const std::string&, const RemoteWriteCheck&, std::string*) {
  NVRAR_CHECK(false, "nvrar was built without UCX's headers, so the CPU executor cannot reach other hosts; "
              "reinstall it with the libucx-cu12 wheel in the build environment (pip install 'nvrar[ucx]')");
  return nullptr;
}

#else

bool ucx_compiled() { return true; }

namespace {

// The UCX functions nvrar calls, looked up in libucp (and, through its dependencies, libucs).
#define NVRAR_UCX_FUNCTIONS(X)                                                                              \
  X(ucp_config_read) X(ucp_config_release) X(ucp_config_modify) X(ucp_init_version) X(ucp_cleanup)         \
  X(ucp_worker_create) X(ucp_worker_destroy) X(ucp_worker_get_address) X(ucp_worker_release_address)      \
  X(ucp_worker_progress) X(ucp_worker_set_am_recv_handler) X(ucp_am_send_nbx) X(ucp_am_data_release)       \
  X(ucp_ep_create) X(ucp_ep_close_nbx) X(ucp_ep_flush_nbx) X(ucp_request_check_status) X(ucp_request_free) \
  X(ucp_ep_query) X(ucs_status_string) X(ucp_worker_get_efd) X(ucp_worker_arm)

struct Api {
#define NVRAR_UCX_FIELD(f) decltype(&::f) f = nullptr;
  NVRAR_UCX_FUNCTIONS(NVRAR_UCX_FIELD)
#undef NVRAR_UCX_FIELD
  void* handle = nullptr;
};

// Loaded once per process and never closed (UCX keeps global state, its own threads and hooks).
const Api& api(const std::string& path) {
  static std::mutex mu;
  static Api a;
  static std::string loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (a.handle != nullptr) return a;
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  NVRAR_CHECK(h != nullptr, "nvrar: cannot load UCX (", path, "): ", dlerror(),
              "; the CPU executor needs it across hosts: pip install 'nvrar[ucx]'");
  Api t;
#define NVRAR_UCX_LOOKUP(f)                                                                    \
  t.f = reinterpret_cast<decltype(&::f)>(dlsym(h, #f));                                        \
  NVRAR_CHECK(t.f != nullptr, "nvrar: UCX at ", path, " lacks ", #f, " (UCX 1.12 or newer needed)");
  NVRAR_UCX_FUNCTIONS(NVRAR_UCX_LOOKUP)
#undef NVRAR_UCX_LOOKUP
  t.handle = h;
  a = t;
  loaded = path;
  return a;
}

using clock_type = std::chrono::steady_clock;

constexpr unsigned kAmId = 0x4e56;        // the active-message id of nvrar's messages
constexpr size_t kCellTail = 48;          // Cell (segment.h): aux0, aux1 and the call description after the word
constexpr size_t kCellBytes = 8 + kCellTail;
constexpr size_t kDescBytes = 32;         // the call description, the last bytes of the cell image

// NOTE [pieces]: a put goes as messages of at most kPieceBytes of data each, every one a single
// fragment of the transport (tcp: segments of kSegBytes, set unless the user set UCX_TCP_*_SEG_SIZE),
// so UCX hands the handler a pointer into its receive buffer and the data is copied once, into
// the zone; a message of several fragments would first be reassembled into a buffer of UCX's
// (one more pass over the data). Every piece carries the cell image; the receiver counts the
// bytes that arrived for the cell and stores the cell (tail, then flag word) with the last one,
// whatever order the pieces arrive in. At most one put is in flight per cell (the partner sends
// to a cell again only two rounds later, after it received my data of the round between).
constexpr size_t kSegBytes = 64 << 10;
constexpr size_t kPieceBytes = kSegBytes - 1024;

// The header of every message: where its piece lands in the receiver's segment. The payload is
// the piece (data bytes [piece_off, piece_off + piece length) of the put), then the cell image
// (kCellBytes): word, aux words, call description.
struct MsgHeader {
  uint64_t dst_off;    // the zone the put fills
  uint64_t bytes;      // the put's data, all pieces
  uint64_t piece_off;  // this piece's place in it
  uint64_t cell_off;
  int32_t sender;
  uint32_t magic;
};
constexpr uint32_t kMsgMagic = 0x4e565232u;  // "NVR2"

struct Peer {
  ucp_ep_h ep = nullptr;
  std::atomic<int> status{0};        // ucs_status_t the error handler reported (0: none)
  std::atomic<bool> answered{false};  // its wire-up flush completed
};

struct Pending {
  void* req;
  ucp_dt_iov_t iov[2];  // read by UCX until the send completes
};

class UcxLink final : public HostLink {
 public:
  UcxLink(const Api& a, int rank, const std::vector<bool>& remote, char* seg, size_t bytes, const std::string& dev,
          const RemoteWriteCheck& accept, std::string* blob)
      : a_(a), rank_(rank), remote_(remote), seg_(seg), bytes_(bytes), accept_(accept), peers_(remote.size()),
        creator_(getpid()) {
    try {
      open(dev, blob);
    } catch (...) {
      release();  // a constructor that throws runs no destructor
      throw;
    }
  }

  ~UcxLink() override {
    if (getpid() != creator_) return;  // a forked child: UCX's state is the creator's
    stop_wireup();
    drain_for(0.2);
    release();
  }

 private:
  void open(const std::string& dev, std::string* blob) {
    ucp_config_t* cfg = nullptr;
    check(a_.ucp_config_read(nullptr, nullptr, &cfg), "reading its configuration");
    // The device that reaches the rendezvous host, unless the user chose (UCX_NET_DEVICES).
    if (!dev.empty() && getenv("UCX_NET_DEVICES") == nullptr) a_.ucp_config_modify(cfg, "NET_DEVICES", dev.c_str());
    // tcp segments that hold a whole piece (NOTE [pieces]).
    const std::string seg = std::to_string(kSegBytes);
    if (getenv("UCX_TCP_TX_SEG_SIZE") == nullptr) a_.ucp_config_modify(cfg, "TCP_TX_SEG_SIZE", seg.c_str());
    if (getenv("UCX_TCP_RX_SEG_SIZE") == nullptr) a_.ucp_config_modify(cfg, "TCP_RX_SEG_SIZE", seg.c_str());
    ucp_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    // Wake-up events for blocking waits (NOTE [blocking waits]); where UCX cannot offer them, the
    // link works without (block() then yields).
    p.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    ucs_status_t st = a_.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &p, cfg, &ctx_);
    if (st != UCS_OK) {
      p.features = UCP_FEATURE_AM;
      st = a_.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &p, cfg, &ctx_);
    }
    a_.ucp_config_release(cfg);
    check(st, "initializing");
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the caller's thread, or the wire-up thread alone
    check(a_.ucp_worker_create(ctx_, &wp, &worker_), "creating a worker");
    // The worker's event fd (NOTE [blocking waits]); without one, block() yields.
    if (a_.ucp_worker_get_efd(worker_, &efd_) != UCS_OK) efd_ = -1;
    ucp_am_handler_param_t hp;
    std::memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = kAmId;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    hp.cb = &UcxLink::on_message;
    hp.arg = this;
    check(a_.ucp_worker_set_am_recv_handler(worker_, &hp), "setting the message handler");
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    check(a_.ucp_worker_get_address(worker_, &addr, &addr_len), "reading the worker's address");
    blob->assign(reinterpret_cast<const char*>(addr), addr_len);
    a_.ucp_worker_release_address(worker_, addr);
    std::memset(&send_prm_, 0, sizeof(send_prm_));
    send_prm_.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    // Eager only: a rendezvous would make the receiver answer, and an answer to a host that died
    // is what UCX 1.22 cannot fail gracefully (NOTE [active messages], host_link.h).
    send_prm_.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    send_prm_.datatype = UCP_DATATYPE_IOV;
  }

  void release() {
    for (auto& q : pending_) a_.ucp_request_free(q.req);
    pending_.clear();
    std::vector<void*> closing;
    for (auto& p : peers_) {
      if (p.ep == nullptr) continue;
      ucp_request_param_t prm;
      std::memset(&prm, 0, sizeof(prm));
      prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = UCP_EP_CLOSE_FLAG_FORCE;  // never wait for a peer that is gone
      void* r = a_.ucp_ep_close_nbx(p.ep, &prm);
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
      p.ep = nullptr;
    }
    const auto until = clock_type::now() + std::chrono::milliseconds(200);
    for (void* r : closing) {
      while (a_.ucp_request_check_status(r) == UCS_INPROGRESS && clock_type::now() < until)
        a_.ucp_worker_progress(worker_);
      a_.ucp_request_free(r);
    }
    if (worker_ != nullptr) a_.ucp_worker_destroy(worker_);
    if (ctx_ != nullptr) a_.ucp_cleanup(ctx_);
    worker_ = nullptr;
    ctx_ = nullptr;
  }

 public:
  void connect(const std::vector<std::string>& blobs) override {
    NVRAR_CHECK(blobs.size() == remote_.size(), "nvrar: got ", blobs.size(), " UCX addresses for ", remote_.size(),
                " ranks");
    for (size_t r = 0; r < blobs.size(); ++r) {
      if (!remote_[r]) continue;
      NVRAR_CHECK(!blobs[r].empty(), "nvrar: rank ", rank_, ": rank ", r, " sent no UCX address");
      Peer& p = peers_[r];
      ucp_ep_params_t ep;
      std::memset(&ep, 0, sizeof(ep));
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(blobs[r].data());
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead host or a broken link is reported, not hung on
      ep.err_handler.cb = &UcxLink::on_error;
      ep.err_handler.arg = &p;
      const ucs_status_t st = a_.ucp_ep_create(worker_, &ep, &p.ep);
      if (st == UCS_ERR_UNREACHABLE) {
        const char* tls = getenv("UCX_TLS");
        const char* devs = getenv("UCX_NET_DEVICES");
        NVRAR_CHECK(false, "nvrar: rank ", rank_, ": no UCX transport reaches rank ", r,
                    "'s host (UCX: ", a_.ucs_status_string(st), "): across hosts nvrar needs a network transport "
                    "with peer failure handling (tcp, or an RDMA one); check UCX_TLS (",
                    tls != nullptr ? tls : "unset", ") and UCX_NET_DEVICES (", devs != nullptr ? devs : "unset",
                    "; each rank's must name a device that reaches the other hosts)");
      }
      check(st, "making an endpoint to rank " + std::to_string(r));
    }
  }

  // NOTE [wire-up]: UCX connects an endpoint on its first operation, and over tcp the peer's
  // side only answers inside its own progress calls. The ranks meet in the store's barrier
  // meanwhile, not in UCX; so a thread of the link drives the worker during set-up: it flushes
  // every endpoint (which completes once the peer answered) and keeps progressing for the
  // peers that are still connecting to me, until the barrier is behind everyone.
  void start_wireup() override {
    if (thread_.joinable()) return;
    stop_.store(false);
    thread_ = std::thread([this] { wireup_loop(); });
  }

  std::string wait_wired(double timeout_s) override {
    const auto until = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                               std::chrono::duration<double>(timeout_s));
    for (;;) {
      bool all = true;
      for (size_t r = 0; r < peers_.size(); ++r) {
        if (!remote_[r]) continue;
        if (peers_[r].status.load() != 0)
          return "rank " + std::to_string(r) + " cannot be reached: " + peer_error(static_cast<int>(r));
        all = all && peers_[r].answered.load();
      }
      if (all) return "";
      if (clock_type::now() >= until) {
        std::ostringstream os;
        os << "no answer over UCX within " << timeout_s << " s from rank(s)";
        for (size_t r = 0; r < peers_.size(); ++r)
          if (remote_[r] && !peers_[r].answered.load()) os << " " << r;
        os << " (check the network interface: UCX_NET_DEVICES, UCX_TLS)";
        return os.str();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  void stop_wireup() override {
    if (!thread_.joinable()) return;
    stop_.store(true);
    thread_.join();
  }

  bool put_signal(int rank, size_t dst_off, const void* src, size_t bytes, size_t cell_off, const void* cell) override {
    return send(rank, dst_off, src, bytes, cell_off, cell);
  }

  bool progress() override {
    a_.ucp_worker_progress(worker_);
    return reap();
  }

  // NOTE [blocking waits]: a waiter that spun in vain progresses the worker until it has nothing
  // left, arms it and sleeps in poll() on its event fd; UCX answers "busy" instead of arming
  // while it still has events to progress, and
  // the fd wakes on a message or on room for a pending send. The timeout bounds how late the
  // caller sees what arrives without an event (its abort cell, written by local peers).
  void block(long timeout_ns) override {
    if (efd_ < 0) {
      sched_yield();
      return;
    }
    // UCX arms only a worker progressed until it has nothing left: an event it already consumed
    // from a socket would wake no one. Anything done here returns at once (the caller checks).
    if (a_.ucp_worker_progress(worker_) != 0) return;
    if (a_.ucp_worker_arm(worker_) != UCS_OK) return;  // UCS_ERR_BUSY: progress first
    struct pollfd pfd = {efd_, POLLIN, 0};
    const struct timespec ts = {0, timeout_ns};
    ppoll(&pfd, 1, &ts, nullptr);
  }

  void expect(size_t cell_off, const LinkLanding& lg) override { expected_.emplace_back(cell_off, lg); }

  void settle(size_t cell_off, std::vector<std::pair<size_t, size_t>>* in_zone) override {
    for (auto it = expected_.begin(); it != expected_.end(); ++it) {
      if (it->first != cell_off) continue;
      const auto a = arrivals_.find(cell_off);
      if (a != arrivals_.end() && a->second.word == it->second.word)
        in_zone->insert(in_zone->end(), a->second.in_zone.begin(), a->second.in_zone.end());
      expected_.erase(it);
      return;
    }
  }

  void forget_expected() noexcept override { expected_.clear(); }

  std::pair<uint64_t, uint64_t> landings() const override { return {on_arrival_, in_zone_}; }

  bool peer_failed(int rank) const override { return peers_[static_cast<size_t>(rank)].status.load() != 0; }

  std::string peer_error(int rank) const override {
    const int s = peers_[static_cast<size_t>(rank)].status.load();
    return s == 0 ? std::string() : std::string("UCX reported ") + a_.ucs_status_string(static_cast<ucs_status_t>(s));
  }

  void post_cell(int rank, size_t cell_off, const void* cell, double timeout_s) noexcept override {
    try {
      if (send(rank, 0, nullptr, 0, cell_off, cell)) drain_for(timeout_s);
    } catch (...) {
    }
  }

  uint64_t refused() const override { return dropped_.load(std::memory_order_relaxed); }

  bool forge(int rank, size_t dst_off, size_t bytes, size_t piece_off, size_t cell_off, size_t piece_len,
             uint64_t word) override {
    forged_.push_back(std::vector<char>(piece_len + kCellBytes, 0));  // kept until the link closes
    std::vector<char>& buf = forged_.back();
    std::memcpy(buf.data() + piece_len, &word, 8);
    const bool ok = send_piece(rank, MsgHeader{dst_off, bytes, piece_off, cell_off, rank_, kMsgMagic}, buf.data(),
                               piece_len, buf.data() + piece_len);
    drain_for(1.0);
    return ok;
  }

  std::string transports(int rank) override {
    Peer& p = peers_[static_cast<size_t>(rank)];
    if (p.ep == nullptr) return "";
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    if (a_.ucp_ep_query(p.ep, &attr) != UCS_OK) return "";
    std::string out;
    for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
      if (!out.empty()) out += ",";
      out += std::string(entries[i].transport_name) + "/" + entries[i].device_name;
    }
    return out;
  }

 private:
  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<Peer*>(arg)->status.store(static_cast<int>(status) == 0 ? -1 : static_cast<int>(status));
  }

  // Runs inside my own progress calls (the waiting rank's thread, or the wire-up thread during
  // set-up): lands the data, then the cell's tail, then its flag word, in that order. Anything
  // outside an inter-node zone and cell (or the abort cell) is dropped: a message cannot write
  // anywhere else in my segment, whoever sent it.
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxLink*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      self->a_.ucp_am_data_release(self->worker_, data);  // never sent by nvrar (eager only)
      self->dropped_.fetch_add(1);
      return UCS_OK;
    }
    MsgHeader h;
    if (header_length != sizeof(h) || length < kCellBytes) {
      self->dropped_.fetch_add(1);
      return UCS_OK;
    }
    std::memcpy(&h, header, sizeof(h));
    const size_t piece = length - kCellBytes;
    if (h.magic != kMsgMagic || h.piece_off > h.bytes || piece > h.bytes - h.piece_off ||
        (piece == 0) != (h.bytes == 0) || !self->accept_.fn(self->accept_.ctx, h.dst_off, h.bytes, h.cell_off)) {
      self->dropped_.fetch_add(1);
      return UCS_OK;
    }
    const char* in = static_cast<const char*>(data);
    char* seg = self->seg_;
    uint64_t word;
    std::memcpy(&word, in + piece, 8);
    if (h.bytes != 0) {
      Arrival& a = self->arrivals_[h.cell_off];
      if (a.got == 0) {
        a.word = word;
        a.in_zone.clear();
      }
      if (a.word != word || piece > h.bytes - a.got) {  // pieces of two puts into one cell
        self->dropped_.fetch_add(1);
        return UCS_OK;
      }
      const LinkLanding* x = self->expected(h, piece, word, in + piece);
      ++(x == nullptr ? self->in_zone_ : self->on_arrival_);
      if (x == nullptr) {
        std::memcpy(seg + h.dst_off + h.piece_off, in, piece);
        a.in_zone.emplace_back(h.piece_off, piece);
      } else {
        Apply ap{x->fn};
        apply_landing(ap, x->lg, in, h.piece_off, piece);
      }
      a.got += piece;
      if (a.got < h.bytes) return UCS_OK;
      a.got = 0;
    }
    std::memcpy(seg + h.cell_off + 8, in + piece + 8, kCellTail);
    __atomic_store_n(reinterpret_cast<uint64_t*>(seg + h.cell_off), word, __ATOMIC_RELEASE);
    return UCS_OK;
  }

  // The expectation this piece (header h, its cell image at `image`) meets exactly, or nullptr
  // (NOTE [landings], host_link.h).
  const LinkLanding* expected(const MsgHeader& h, size_t piece, uint64_t word, const char* image) const {
    for (const auto& e : expected_) {
      const LinkLanding& x = e.second;
      if (e.first != h.cell_off || x.word != word || x.lg.zone_off != h.dst_off || x.lg.bytes != h.bytes) continue;
      if (h.piece_off % x.lg.es != 0 || piece % x.lg.es != 0) return nullptr;
      if (std::memcmp(image + kCellBytes - kDescBytes, x.desc, kDescBytes) != 0) return nullptr;
      return &x;
    }
    return nullptr;
  }

  // What apply_landing (protocol/round.h) asks of a transport, for a piece in UCX's buffer.
  struct Apply {
    ReduceFn fn;
    void copy(char* dst, const char* src, size_t bytes) const { std::memcpy(dst, src, bytes); }
    void reduce(char* const* dst, int nd, const char* const* src, int ns, size_t n, Scale sc) const {
      fn(reinterpret_cast<void* const*>(dst), nd, reinterpret_cast<const void* const*>(src), ns, n, sc);
    }
  };

  void check(ucs_status_t st, const std::string& what) const {
    NVRAR_CHECK(st == UCS_OK, "nvrar: rank ", rank_, ": UCX failed ", what, ": ",
                a_.ucs_status_string != nullptr ? a_.ucs_status_string(st) : "?");
  }

  // The put as pieces (NOTE [pieces]): data for my partner's dst_off, each piece followed by the
  // cell image for its cell_off.
  bool send(int rank, size_t dst_off, const void* src, size_t bytes, size_t cell_off, const void* cell) {
    size_t off = 0;
    do {
      const size_t piece = std::min(kPieceBytes, bytes - off);
      if (!send_piece(rank, MsgHeader{dst_off, bytes, off, cell_off, rank_, kMsgMagic},
                      static_cast<const char*>(src) + off, piece, cell))
        return false;
      off += piece;
    } while (off < bytes);
    return true;
  }

  bool send_piece(int rank, const MsgHeader& h, const char* src, size_t piece, const void* cell) {
    Peer& p = peers_[static_cast<size_t>(rank)];
    if (p.ep == nullptr || p.status.load(std::memory_order_relaxed) != 0) return false;
    pending_.push_back(Pending{nullptr, {{const_cast<char*>(src), piece}, {const_cast<void*>(cell), kCellBytes}}});
    Pending& q = pending_.back();
    ucp_dt_iov_t* iov = piece != 0 ? q.iov : q.iov + 1;
    const ucs_status_ptr_t sp = a_.ucp_am_send_nbx(p.ep, kAmId, &h, sizeof(h), iov, piece != 0 ? 2 : 1, &send_prm_);
    if (sp == nullptr) {
      pending_.pop_back();
      return true;
    }
    if (UCS_PTR_IS_ERR(sp)) {
      pending_.pop_back();
      int expected = 0;
      p.status.compare_exchange_strong(expected, static_cast<int>(UCS_PTR_STATUS(sp)));
      return false;
    }
    q.req = sp;
    return true;
  }

  // Frees the completed sends; true when none is left.
  bool reap() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (a_.ucp_request_check_status(it->req) == UCS_INPROGRESS) {
        ++it;
      } else {
        a_.ucp_request_free(it->req);
        it = pending_.erase(it);
      }
    }
    return pending_.empty();
  }

  void drain_for(double timeout_s) {
    if (worker_ == nullptr) return;
    const auto until = clock_type::now() + std::chrono::duration_cast<clock_type::duration>(
                                               std::chrono::duration<double>(timeout_s));
    while (!progress() && clock_type::now() < until) {
    }
  }

  void wireup_loop() {
    ucp_request_param_t nocb;
    std::memset(&nocb, 0, sizeof(nocb));
    std::vector<std::pair<size_t, void*>> flushes;
    for (size_t r = 0; r < peers_.size(); ++r) {
      if (!remote_[r] || peers_[r].ep == nullptr) continue;
      void* f = a_.ucp_ep_flush_nbx(peers_[r].ep, &nocb);
      if (f == nullptr) {
        peers_[r].answered.store(true);
      } else if (UCS_PTR_IS_ERR(f)) {
        int expected = 0;
        peers_[r].status.compare_exchange_strong(expected, static_cast<int>(UCS_PTR_STATUS(f)));
      } else {
        flushes.emplace_back(r, f);
      }
    }
    while (!stop_.load()) {
      a_.ucp_worker_progress(worker_);
      for (auto& f : flushes) {
        if (f.second == nullptr) continue;
        const ucs_status_t st = a_.ucp_request_check_status(f.second);
        if (st == UCS_INPROGRESS) continue;
        if (st == UCS_OK) {
          peers_[f.first].answered.store(true);
        } else {
          int expected = 0;
          peers_[f.first].status.compare_exchange_strong(expected, static_cast<int>(st));
        }
        a_.ucp_request_free(f.second);
        f.second = nullptr;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    for (auto& f : flushes)
      if (f.second != nullptr) a_.ucp_request_free(f.second);  // completes, or fails, on its own
  }

  const Api& a_;
  int rank_;
  std::vector<bool> remote_;
  char* seg_;
  size_t bytes_;
  RemoteWriteCheck accept_;
  std::vector<Peer> peers_;
  pid_t creator_;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::list<Pending> pending_;
  ucp_request_param_t send_prm_;
  std::atomic<uint64_t> dropped_{0};  // messages refused by on_message
  struct Arrival {
    uint64_t word = 0;  // the flag word of the put being received
    uint64_t got = 0;   // its data bytes arrived so far
    std::vector<std::pair<size_t, size_t>> in_zone;  // its pieces that landed in the zone (NOTE [landings])
  };
  std::vector<std::pair<size_t, LinkLanding>> expected_;  // per cell offset (NOTE [landings])
  uint64_t on_arrival_ = 0, in_zone_ = 0;                  // pieces applied as they arrived / landed in a zone
  std::unordered_map<size_t, Arrival> arrivals_;  // per cell offset (NOTE [pieces])
  std::list<std::vector<char>> forged_;           // payloads of forge() (testing)
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace

std::unique_ptr<HostLink> open_ucx_link(const std::string& libucp, int rank, const std::vector<bool>& remote,
                                        char* segment, size_t segment_bytes, const std::string& net_device,
                                        const RemoteWriteCheck& accept, std::string* blob) {
  const Api& a = api(libucp);
  return std::unique_ptr<HostLink>(new UcxLink(a, rank, remote, segment, segment_bytes, net_device, accept, blob));
}

#endif  // NVRAR_NO_UCX

}  // namespace nvrar
