// One protocol round of one slice, written once for every executor: the CPU executor runs it
// with a group of one and its shared-memory transport (csrc/cpu/executor.cpp), every CUDA block
// runs it for its own slice with the NVSHMEM transport (csrc/cuda/). See NOTE [epoch protocol] in
// plan.h for the rules it follows.
//
// A Transport provides (all of them group-collective: every member of the group calls them):
//   char* my() / char* base(int rank)      my segment / a local peer's segment (load-store access)
//   bool leader()                          the member that polls, signals and calls the system
//   void sync()                            barrier of the group (no-op for a group of one)
//   void signal(rank, cell, word, aux0, aux1)          after the group's writes: fence, store the flag
//   bool wait(cell, epoch, sig, Phase, step, peer, &aux0, &aux1)   deadline, abort and signature checks;
//                                          false: the round failed (GPU); the CPU transport throws
//   bool put_signal(rank, dst_off, src, bytes, cell, word)  inter-node put, then its flag
//   void set_inter_bytes(bytes)            (device transports only) the bytes of each inter-node
//                                          message of this round: where the receiver finds the
//                                          call description a put carries
//   void expect(cell, word, peer, Landing)  (before my own put) the put `peer` makes into my zone,
//                                          flagged in `cell`, is wanted as the Landing says
//   bool wait_land(cell, epoch, sig, Phase, step, peer, Landing)   wait() for that put, then its
//                                          data is at the Landing's dst (NOTE [landings])
//   bool put_ll(rank, dst_off, out_off, src, bytes, flag)  inter-node LL packets (protocol/ll.h) into
//                                          the peer's LL zone at dst_off (packed at my out_off first)
//   bool wait_ll(off, bytes, epoch, sig, step, peer)    until every LL packet at my `off` arrived
//   void ll_unpack(char* dst, off, bytes)   the payload of the LL packets at my `off` to dst, then
//                                          zero the packets (NOTE [LL zones])
//   void reduce(char* const* dst, nd, const char* const* src, ns, n, Scale)   typed, in this group
//   void copy(char* dst, const char* src, bytes)
//   bool remote_read(rank, dst, addr, bytes, Phase, peer) / remote_write(...)   private memory of a
//                                          local peer (CPU cross-memory access; never used on GPU)
//   void expose(epoch)                     this round advertised my private memory (CPU)
//   void jitter()                          testing delays (CPU)
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/hd.h"
#include "ll.h"
#include "phase.h"
#include "plan.h"
#include "types.h"

namespace nvrar {

// Per-round scratch arrays, at least G entries each (CPU: vectors; GPU: shared memory).
struct Workspace {
  const char** srcs;        // reduce sources, local-rank order
  const char** piece_srcs;  // the same, advanced to the current piece (scratch for remote ones)
  char** dsts;              // reduce destinations
  char** piece_dsts;
  uint64_t* peer_out;       // per local rank: its OutRef (how it wants results delivered)
  uint64_t* src_remote;     // per local rank: address of its shard in its private memory, or 0
  char* scratch;            // landing space of remote reads: (G - 1) pieces (CPU only)
};

// What every round of an executor shares.
struct RoundConfig {
  Layout where;
  SegmentLayout L;
  bool cma;                  // cross-memory access to local peers' private memory (CPU)
  size_t cma_min_bytes;      // smallest shard worth a cross-memory transfer
  size_t cma_piece_bytes;    // cross-memory transfers go piece by piece
  size_t ll_max_bytes;       // inter-node steps on shards up to this size use LL packets (0: never)
  size_t hd_min_bytes = 0;   // inter-node shards from this size use halving-doubling (0: never)
  // One rank per node: the inter-node steps start from the input itself (NOTE [start from the
  // input]); an executor whose puts may read any local memory of the caller's sets it (CPU).
  bool start_from_input = false;
  // NOTE [rotating stage-in]: stage-ins of one slice per chunk go round the staging slot of
  // their parity instead of always to its start (CPU).
  bool rotate_staging = false;
};

// NOTE [landings]: what a rank does with a put it receives in halving-doubling: combine it with
// its own operand (the reduce-scatter steps), or have it somewhere else than the zone (the
// all-gather steps of one rank per node deliver into the output). A transport whose puts land in
// the zone (shared memory, NVSHMEM) waits, then applies the Landing from the zone: the same
// reduce or copy the round would make. The CPU link applies it to each piece as it arrives, from
// UCX's receive buffer, which saves a pass over the data (the zone is then not written); pieces
// that arrived before the Landing was expected landed in the zone and are applied from there
// (csrc/cpu/transport.h). Same operands in the same order: the same bits either way.
struct Landing {
  size_t zone_off;   // where the put's data lands in my segment (its first byte)
  size_t bytes;
  char* dst;         // where its result goes (may be the zone itself)
  const char* mine;  // nullptr: dst = data; else dst = op(mine, data), or op(data, mine)
  bool mine_first;   // mine is the left operand
  size_t es;
  Scale sc;
};

// Applies bytes [off, off + bytes) of a Landing whose data is at `data` (those bytes of the put).
template <typename TP>
NVRAR_HD void apply_landing(TP& tp, const Landing& lg, const char* data, size_t off, size_t bytes) {
  if (lg.mine == nullptr) {
    if (lg.dst + off != data) tp.copy(lg.dst + off, data, bytes);
    return;
  }
  const char* ops[2] = {lg.mine_first ? lg.mine + off : data, lg.mine_first ? data : lg.mine + off};
  char* dsts[1] = {lg.dst + off};
  tp.reduce(dsts, 1, ops, 2, bytes / lg.es, lg.sc);
}

// Whether the inter-node steps of an n-byte shard use LL packets (small enough for the selector
// and for the segment's LL zones).
//
// NOTE [LL zones]: LL packets land in LL zones, which nothing else ever writes, and the receiver
// zeroes the packets as soon as it has unpacked them. So an LL zone only ever holds zeros or the
// packets of the round in flight: a stale packet cannot be taken for a new one, whatever the
// epoch bits of its flag (16 bits wrap), and data of the put-with-signal path (any bit pattern)
// never sits where packets are read. The zeroing is safe: the partner writes this zone again only
// in round e+2, after it finished e+1, which needed my data of e+1, sent after this round.
// ll_max_bytes 0 means never, for every size, an empty slice's 0 bytes included: the GPU's
// call_strides turns LL off for a whole call that way, and a channel whose empty slices went by LL
// while its others went by put-with-signal would never send (NOTE [channels], device.cuh).
NVRAR_HD bool use_ll(const RoundConfig& cfg, size_t bytes) {
  return cfg.L.ll_slice_bytes > 0 && cfg.ll_max_bytes > 0 && bytes <= cfg.ll_max_bytes &&
         ll_wire_bytes(bytes) <= cfg.L.ll_slice_bytes;
}

// Whether the inter-node steps of an n-byte shard use halving-doubling (NOTE [halving-doubling]):
// large shards, at least 4 nodes in the power-of-two part (with 2 it sends no fewer bytes).
NVRAR_HD bool use_hd(const RoundConfig& cfg, size_t bytes, const InterSchedule& sched) {
  return cfg.hd_min_bytes > 0 && bytes >= cfg.hd_min_bytes && sched.K >= 2 && !use_ll(cfg, bytes);
}

// Halving-doubling: where exchange step k cuts the range [r0, r1) (64-byte cuts for float32),
// and the range of `node` before exchange step k (the lower half goes to the node whose bit j is
// 0 at each earlier step j).
NVRAR_HD size_t hd_mid(size_t r0, size_t r1) {
  const size_t half = (r1 - r0) / 2;
  return r0 + (half >= 32 ? half / 16 * 16 : half);
}
NVRAR_HD void hd_range(size_t n, int node, int k, size_t* r0, size_t* r1) {
  *r0 = 0;
  *r1 = n;
  for (int j = 0; j < k; ++j) {
    const size_t mid = hd_mid(*r0, *r1);
    if (((node >> j) & 1) == 0)
      *r1 = mid;
    else
      *r0 = mid;
  }
}

// One slice of one chunk: an independent protocol instance with its own flags and slot parts.
struct Slice {
  const char* in;    // this slice of the input (private memory, or my pool when in_pool)
  char* out;         // this slice of the output (private, or my pool when out_pool)
  size_t n;          // elements
  size_t es;         // element size
  size_t chunk_off;  // byte offset of this slice within its chunk (its place in staging)
  int b;             // slice index
  bool in_pool;
  bool out_pool;
};

// NOTE [halving-doubling]
// Recursive doubling sends the whole shard at each of its K = log2 N' exchange steps; for large
// shards the bandwidth-optimal schedule with the same pairs is recursive halving, then recursive
// doubling of the pieces (Rabenseifner): exchange step k (partner node ^ 2^k, the same order as
// recursive doubling) splits my current range in two halves, sends the half my partner keeps
// and combines the half I keep (the lower half goes to the lower node of the pair); after K steps
// my piece is final; the all-gather steps k = K-1 .. 0 then exchange pieces with the same
// partners until every rank has the whole shard. Bytes sent per rank: 2 (N'-1)/N' of the shard
// instead of K times it, and each element is reduced once per level instead of every rank
// reducing everything.
// Bitwise the same result as recursive doubling: at step k my partner's range equals mine (our
// node numbers differ only in bit k, so we kept the same halves before), so every element is
// combined from the same two operands, in the same order (mine_first: the lower node's value is
// the left operand) and scaled at the same last exchange. So whichever schedule serves a shard
// is invisible in its bits (tests/test_determinism.py compares them).
// Where the data lands: exchange step k puts into the partner's zone of that step, at the half's
// own offset; the last exchange's zone F then holds my final piece, and the all-gather steps put
// each rank's range into the partner's F at its offset, with the flag in a gather cell of its
// own (one message per cell and round). With `out` (one rank per node, NOTE [start from the
// input]) my result is assembled in the output instead: the last exchange combines into it, the
// all-gather steps send from it and deliver what they receive into it (NOTE [landings]); the
// puts still target the partner's F. F of round e is written by all-gather partners only in
// this round and, of round e + 2, only after they finished round e + 1, which needed my data of
// e + 1, sent after I copied F out: the parity argument of NOTE [epoch protocol]. Folding in and
// out (N not a power of two) moves the whole shard, as in recursive doubling.
template <typename TP>
NVRAR_HD bool inter_node_hd(TP& tp, const RoundConfig& cfg, size_t n, size_t es, uint64_t e, uint32_t sig,
                            Scale sc, int b, const char* start, char* out, size_t* final_off) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const Layout& w = cfg.where;
  const SegmentLayout& L = cfg.L;
  const InterSchedule sched = InterSchedule::make(w.N, w.node);
  const Scale none = make_scale(RedOp::kSum, 1);
  char* my = tp.my();
  const char* acc = start;  // my accumulator (the input, or a slot of my segment), then a zone
  int step = 0;
  if (sched.has_fold_partner()) {  // the folded node's whole shard, combined first (mine is the lower node)
    const int peer = w.rank_of(w.node + sched.Np, w.local);
    const size_t zone = L.zone(p, sched.fold_in_slot(), b);
    uint64_t a0, a1;
    if (!tp.wait(L.inter_cell(p, sched.fold_in_slot(), b), e, sig, Phase::kInterNode, step, peer, &a0, &a1))
      return false;
    const char* ops[2] = {acc, my + zone};
    char* dsts[1] = {my + zone};
    tp.reduce(dsts, 1, ops, 2, n, none);
    acc = my + zone;
    ++step;
  }
  // Where the result is assembled: F, the last exchange's zone, or the output itself (`out`).
  const size_t F = L.zone(p, sched.exchange_slot(sched.K - 1), b);
  char* res = out != nullptr ? out : my + F;
  size_t r0 = 0, r1 = n;  // my range
  for (int k = 0; k < sched.K; ++k, ++step) {
    const size_t mid = hd_mid(r0, r1);
    const bool lower = ((w.node >> k) & 1) == 0;
    const size_t keep0 = lower ? r0 : mid, keep1 = lower ? mid : r1;
    const size_t give0 = lower ? mid : r0, give1 = lower ? r1 : mid;
    const int peer = w.rank_of(w.node ^ (1 << k), w.local);
    const int slot = sched.exchange_slot(k);
    const size_t zone = L.zone(p, slot, b);
    const size_t cell = L.inter_cell(p, slot, b);
    const bool last = k == sched.K - 1;
    // The partner's half of my range lands at keep0 of this step's zone, combined with mine.
    const Landing lg{zone + keep0 * es, (keep1 - keep0) * es, (last ? res : my + zone) + keep0 * es, acc + keep0 * es,
                     lower, es, last ? sc : none};
    tp.expect(cell, word, peer, lg);
    tp.jitter();
    if (!tp.put_signal(peer, zone + give0 * es, acc + give0 * es, (give1 - give0) * es, cell, word)) return false;
    if (!tp.wait_land(cell, e, sig, Phase::kInterNode, step, peer, lg)) return false;
    acc = my + zone;
    r0 = keep0;
    r1 = keep1;
  }
  for (int k = sched.K - 1; k >= 0; --k, ++step) {  // all-gather into res, same partners backwards
    const int peer = w.rank_of(w.node ^ (1 << k), w.local);
    const size_t cell = L.gather_cell(p, k, b);
    size_t n0 = 0, n1 = 0;  // my range after this step: mine and my partner's
    hd_range(n, w.node, k, &n0, &n1);
    const size_t p0 = n0 == r0 ? r1 : n0, p1 = n0 == r0 ? n1 : r0;  // my partner's
    const Landing lg{F + p0 * es, (p1 - p0) * es, res + p0 * es, nullptr, false, es, none};
    tp.expect(cell, word, peer, lg);
    tp.jitter();
    if (!tp.put_signal(peer, F + r0 * es, res + r0 * es, (r1 - r0) * es, cell, word)) return false;
    if (!tp.wait_land(cell, e, sig, Phase::kInterNode, step, peer, lg)) return false;
    r0 = n0;
    r1 = n1;
  }
  if (sched.has_fold_partner()) {
    const int peer = w.rank_of(w.node + sched.Np, w.local);
    tp.jitter();
    if (!tp.put_signal(peer, L.zone(p, sched.fold_out_slot(), b), res, n * es,
                       L.inter_cell(p, sched.fold_out_slot(), b), word))
      return false;
  }
  *final_off = F;  // (with `out`, the result is there, not in F)
  return true;
}

// Inter-node recursive doubling of n elements among the ranks with my local index, starting
// from the accumulator at `start` (my result slot, or the input itself: NOTE [start from the
// input]; nullptr: the result slot). Put-with-signal: the partner's data lands in a zone and
// is combined there in place. LL: the packets land in an LL zone and their payload is unpacked
// into the zone. On success *final_off is where my final result lives in my segment (every
// schedule receives at least once); or, where the caller passes `out`, the result is delivered
// there instead (one rank per node: no local peer reads it from my segment) and *final_off is
// not meaningful.
//
// NOTE [start from the input]: with one rank per node nothing reduces inside the node, and the
// result slot would only hold a copy of the input; so the first put reads the input itself and
// the first combine takes it as my operand (cfg.start_from_input). The input is read, never
// written, and the output is written only after the last step, when every put of mine has
// completed (a put returns once its source may be reused), so an in-place call is safe. The
// operands, their order and the schedule are unchanged: the bits are the same.
template <typename TP>
NVRAR_HD bool inter_node_round(TP& tp, const RoundConfig& cfg, size_t n, size_t es, uint64_t e, uint32_t sig,
                               Scale sc, int b, size_t* final_off, const char* start = nullptr,
                               char* out = nullptr) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const Layout& w = cfg.where;
  const SegmentLayout& L = cfg.L;
  const InterSchedule sched = InterSchedule::make(w.N, w.node);
  const Scale none = make_scale(RedOp::kSum, 1);
  const int last_exchange = sched.exchange_slot(sched.K - 1);
  const size_t bytes = n * es;
  char* my = tp.my();
  if (start == nullptr) start = my + L.result(p, b);
#if !defined(__CUDA_ARCH__)  // (the GPU executor never enables it: hd_min_bytes 0)
  if (!sched.folded_out() && use_hd(cfg, bytes, sched))
    return inter_node_hd(tp, cfg, n, es, e, sig, sc, b, start, out, final_off);
#endif
  const bool ll = use_ll(cfg, bytes);
#if NVRAR_ON_DEVICE
  tp.set_inter_bytes(bytes);  // where a put's trailer lies (NOTE [gpu call description], device.cuh)
#endif
  const char* acc = start;  // where my accumulator lives
  for (int i = 0; i < sched.num_steps(); ++i) {
    const InterStep st = sched.step(i);
    const int peer = w.rank_of(st.partner, w.local);
    const size_t zone = L.zone(p, st.slot, b);
    if (st.send) {
      tp.jitter();
      const bool sent = ll ? tp.put_ll(peer, L.llzone(p, st.slot, b), L.llout(p, st.slot, b), acc, bytes,
                                       ll_flag(e, sig))
                           : tp.put_signal(peer, zone, acc, bytes, L.inter_cell(p, st.slot, b), word);
      if (!sent) return false;
    }
    if (st.recv) {
      const size_t data = zone;
      if (ll) {
        if (!tp.wait_ll(L.llzone(p, st.slot, b), bytes, e, sig, i, peer)) return false;
        tp.ll_unpack(my + data, L.llzone(p, st.slot, b), bytes);
      } else {
        uint64_t a0, a1;
        if (!tp.wait(L.inter_cell(p, st.slot, b), e, sig, Phase::kInterNode, i, peer, &a0, &a1)) return false;
      }
      // The last exchange's combine goes straight into `out` where the caller gave one.
      char* to = out != nullptr && st.combine && st.slot == last_exchange ? out : my + data;
      if (st.combine) {
        const char* mine = acc;
        const char* theirs = my + data;
        const char* ops[2] = {st.mine_first ? mine : theirs, st.mine_first ? theirs : mine};
        char* dsts[1] = {to};
        tp.reduce(dsts, 1, ops, 2, n, st.slot == last_exchange ? sc : none);
      }
      acc = to;
    }
  }
  if (out == nullptr) {
    *final_off = static_cast<size_t>(acc - my);
  } else if (acc != out) {
    tp.copy(out, acc, bytes);  // (a folded-out node: its result came from its partner)
  }
  return true;
}

// NOTE [rotating stage-in]
// A one-shot round stages its input in the staging slot of its parity, which the local peers read
// in their reduce phase (a staged two-shot round: the parts that are the peers' shards); two
// rounds later the same bytes are written again. Written always at the slot's start, those lines
// are still in the readers' caches then, so each store first takes its line back from a reader's
// cache (a read for ownership across the cores), and the readers' reads of the round fetch it
// back across once more; streaming stores (NOTE [streaming stage-in], csrc/cpu/executor.cpp)
// avoid the first by writing to memory, and the readers then read from memory. Where the message
// is smaller than the slot, the rounds of one parity instead take the slot's message-sized pieces
// in turn, (e / 2) mod pieces: a piece is written again only after the readers have read about a
// slot's worth since (2 x 1 MB over both parities, kRotateSpan), which has left their caches by
// then, so the stores find the lines in no other core's cache and the readers fetch them from the
// writer's. On a 2-core AMD EPYC (family 25 model 17, 1 MB L2 per core) KVM guest, 2026-12-04,
// where a cache line crossed between the CPUs in about 100 ns: a two-process model of the round
// (stage-in by memcpy, a flag, the reduce of the input and the peer's piece; medians of 1,800
// rounds) took 12.3 us at 64 KB with 2 slots in turn (memcpy 9.6 of it), 11.1 with streaming
// stores, 5.6 with 16 slots in turn and 3.9 with 32; at 128 KB 18.9, 19.7, 9.3 with 8 and 7.6
// with 16. nvrar's one-shot calls (2 ranks, cold, the leader's choice of stores; medians of 300,
// two runs each, alternated): 8 / 32 / 64 / 128 / 256 KB 2.5-3.6 / 5.2-5.4 / 8.5-8.9 / 15.1-16.0
// / 27.7 us before, 2.2 / 3.3 / 4.9-5.2 / 8.4-9.3 / 14.9-18.2 with the pieces. Where the line takes
// about 500 ns, a store into any line another core held costs more still and streaming stores
// stay the faster (the leader's choice finds it). Safety is that of the parity slots (NOTE [epoch
// protocol], plan.h): a piece of parity p written in round e is written next in a round e' >= e +
// 2, after every reader finished round e; the readers take the piece's offset from my ready flag
// (its ref), as they took the slot's. The result is the same bits: the same bytes, read in the
// same order.
// The pieces lie in the first kRotateSpan bytes of the slot (all of it at the CPU's default 1 MB
// max_bytes): what has to leave the readers' caches is about this much, and a larger max_bytes
// would only spread small calls over more pages.
constexpr size_t kRotateSpan = size_t{1} << 20;
NVRAR_HD size_t rotated_stage_off(const RoundConfig& cfg, size_t bytes, uint64_t e) {
  if (!cfg.rotate_staging || cfg.L.B != 1 || bytes == 0) return 0;
  const size_t stride = align_up(bytes, 64);
  const size_t span = cfg.L.staging_bytes < kRotateSpan ? cfg.L.staging_bytes : kRotateSpan;
  const size_t pieces = span / stride;
  return pieces > 1 ? static_cast<size_t>((e >> 1) % pieces) * stride : 0;
}

// Two-shot round of one slice: stage-in, intra-node reduce-scatter (pushing finished shards
// straight into the outputs that peers expose), inter-node recursive doubling, all-gather.
template <typename TP>
NVRAR_HD bool two_shot_round(TP& tp, const RoundConfig& cfg, const Workspace& ws, const Slice& s, uint64_t e,
                             uint32_t sig, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const Layout& w = cfg.where;
  const SegmentLayout& L = cfg.L;
  const int G = w.G;
  const int me = w.local;
  const int b = s.b;
  const size_t es = s.es;
  char* my = tp.my();
  const Range mine = shard_range(s.n, static_cast<int>(es), G, me);
  const size_t mine_off = mine.begin * es;
  const size_t mine_bytes = mine.size() * es;
  const Scale none = make_scale(RedOp::kSum, 1);

  // Stage-in. Local peer h reads only shard h of my input; shard `me` is read by me alone, so it
  // stays where it is. A zero-copy input is read in place; with cross-memory access and a shard
  // worth a system call, the peers read my private input directly (one copy instead of two).
  const bool use_cma = cfg.cma && s.n * es / static_cast<size_t>(G) >= cfg.cma_min_bytes;
  uint64_t in_ref;
  if (s.in_pool) {
    in_ref = make_ref(kRefShm, static_cast<uint64_t>(s.in - my));
  } else if (use_cma) {
    in_ref = make_ref(kRefCma, reinterpret_cast<uint64_t>(s.in));
  } else {
    const size_t staging = L.staging(p) + s.chunk_off + rotated_stage_off(cfg, s.n * es, e);  // NOTE [rotating stage-in]
    in_ref = make_ref(kRefShm, staging);
    if (G > 1) {
      tp.copy(my + staging, s.in, mine_off);
      tp.copy(my + staging + mine.end * es, s.in + mine.end * es, (s.n - mine.end) * es);
    }
  }
  // How my peers deliver their result shards to me: straight into my output when they can reach
  // it (it is in my pool, or cross-memory writes are enabled and worth their system call).
  uint64_t out_ref = make_ref(kRefPull, 0);
  if (s.out_pool)
    out_ref = make_ref(kRefShm, static_cast<uint64_t>(s.out - my));
  else if (use_cma)
    out_ref = make_ref(kRefCma, reinterpret_cast<uint64_t>(s.out));
  if (ref_kind(in_ref) == kRefCma || ref_kind(out_ref) == kRefCma) tp.expose(e);
  if (G > 1) tp.jitter();
  for (int h = 0; h < G; ++h)
    if (h != me) tp.signal(w.rank_of(w.node, h), L.ready_cell(p, me, b), word, in_ref, out_ref);

  // Intra-node reduce-scatter of shard `me`, sources in local-rank order.
  bool any_pull = false;
  bool any_remote = false;
  for (int h = 0; h < G; ++h) {
    uint64_t a0 = 0, a1 = 0;
    if (h != me) {
      const int peer = w.rank_of(w.node, h);
      if (!tp.wait(L.ready_cell(p, h, b), e, sig, Phase::kReduceScatter, 0, peer, &a0, &a1)) return false;
    }
    if (tp.leader()) {
      ws.src_remote[h] = 0;
      if (h == me) {
        ws.srcs[h] = s.in + mine_off;
      } else if (ref_kind(a0) == kRefCma) {
        ws.src_remote[h] = ref_value(a0) + mine_off;  // read from h's private memory, below
      } else {
        ws.srcs[h] = tp.base(w.rank_of(w.node, h)) + ref_value(a0) + mine_off;
      }
      ws.peer_out[h] = h == me ? out_ref : a1;
    }
    if (h != me) {
      any_remote = any_remote || ref_kind(a0) == kRefCma;
      any_pull = any_pull || ref_kind(a1) == kRefPull;
    }
  }
  tp.sync();  // the leader's workspace entries are visible to the whole group
  const size_t res = L.result(p, b);
  // Destinations of the reduced shard. One node: my output, the outputs of the peers that take
  // pushes into their pool, and my result slot for the peers that pull. Several nodes: the result
  // slot, where the inter-node phase starts.
  int nd = 0;
  bool any_cma_push = false;
  if (w.N == 1) {
    if (tp.leader()) ws.dsts[0] = s.out + mine_off;
    nd = 1;
    for (int h = 0; h < G; ++h) {
      if (h == me) continue;
      const uint64_t ref = ws.peer_out[h];
      if (ref_kind(ref) == kRefShm) {
        if (tp.leader()) ws.dsts[nd] = tp.base(w.rank_of(w.node, h)) + ref_value(ref) + mine_off;
        ++nd;
      }
      any_cma_push = any_cma_push || ref_kind(ref) == kRefCma;
    }
    if (any_pull) {
      if (tp.leader()) ws.dsts[nd] = my + res;
      ++nd;
    }
  } else {
    if (tp.leader()) ws.dsts[0] = my + res;
    nd = 1;
  }
  tp.sync();
  // Piece by piece when cross-memory transfers are involved, so that each piece is fetched,
  // reduced and pushed while it is in cache; else in one go.
  const size_t piece = (any_remote || any_cma_push) ? cfg.cma_piece_bytes : mine_bytes;
  if (nd > 1 || any_cma_push) tp.jitter();
  // One rank per node: nothing to reduce here, the inter-node steps read the input itself.
  const bool from_input = G == 1 && w.N > 1 && cfg.start_from_input;
  for (size_t off = 0; off < mine_bytes && !from_input; off += piece) {
    const size_t len = mine_bytes - off < piece ? mine_bytes - off : piece;
    char* scratch = ws.scratch;
    for (int h = 0; h < G; ++h) {
      if (ws.src_remote[h] != 0) {
        if (!tp.remote_read(w.rank_of(w.node, h), scratch, ws.src_remote[h] + off, len, Phase::kReduceScatter))
          return false;
        if (tp.leader()) ws.piece_srcs[h] = scratch;
        scratch += align_up(len, 64);
      } else if (tp.leader()) {
        ws.piece_srcs[h] = ws.srcs[h] + off;
      }
    }
    if (tp.leader())
      for (int d = 0; d < nd; ++d) ws.piece_dsts[d] = ws.dsts[d] + off;
    tp.sync();
    tp.reduce(ws.piece_dsts, nd, ws.piece_srcs, G, len / es, w.N == 1 ? sc : none);
    tp.sync();  // every member is done with this piece's pointers before the next piece's
    if (!any_cma_push) continue;
    for (int h = 0; h < G; ++h) {
      if (h == me) continue;  // (see the delivery loop below)
      const uint64_t ref = ws.peer_out[h];
      if (ref_kind(ref) != kRefCma) continue;
      if (!tp.remote_write(w.rank_of(w.node, h), s.out + mine_off + off, ref_value(ref) + mine_off + off, len,
                           Phase::kAllGather))
        return false;
    }
  }
  size_t final_off = res;
  if (w.N > 1) {
    // Inter-node recursive doubling of shard `me`, then deliver the final shard.
    if (!inter_node_round(tp, cfg, mine.size(), es, e, sig, sc, b, &final_off, from_input ? s.in + mine_off : nullptr,
                          from_input ? s.out + mine_off : nullptr))
      return false;
    const char* fin = my + final_off;
    if (!from_input) tp.copy(s.out + mine_off, fin, mine_bytes);
    // Only entries of peers are read here: with no local peer (G == 1) no sync separates this
    // loop from the leader's write of ws.peer_out[me] in the next chunk, so that entry must not
    // be read after the round's last sync.
    for (int h = 0; h < G; ++h) {
      if (h == me) continue;
      const uint64_t ref = ws.peer_out[h];
      if (ref_kind(ref) == kRefPull) continue;
      tp.jitter();
      if (ref_kind(ref) == kRefShm) {
        tp.copy(tp.base(w.rank_of(w.node, h)) + ref_value(ref) + mine_off, fin, mine_bytes);
      } else if (!tp.remote_write(w.rank_of(w.node, h), fin, ref_value(ref) + mine_off, mine_bytes, Phase::kAllGather)) {
        return false;
      }
    }
  }

  // All-gather: my shard is delivered (or ready to pull); collect what was not pushed to me.
  for (int h = 0; h < G; ++h)
    if (h != me) tp.signal(w.rank_of(w.node, h), L.final_cell(p, me, b), word, final_off, 0);
  for (int h = 0; h < G; ++h) {
    if (h == me) continue;
    const int peer = w.rank_of(w.node, h);
    uint64_t a0, a1;
    if (!tp.wait(L.final_cell(p, h, b), e, sig, Phase::kAllGather, 0, peer, &a0, &a1)) return false;
    if (ref_kind(out_ref) == kRefPull) {
      const Range rh = shard_range(s.n, static_cast<int>(es), G, h);
      tp.copy(s.out + rh.begin * es, tp.base(peer) + a0, rh.size() * es);
    }
  }
  return true;
}

// One-shot round of one slice: every rank reduces the whole slice from all local peers (no
// all-gather), then the inter-node recursive doubling runs on the whole slice.
template <typename TP>
NVRAR_HD bool one_shot_round(TP& tp, const RoundConfig& cfg, const Workspace& ws, const Slice& s, uint64_t e,
                             uint32_t sig, Scale sc) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const Layout& w = cfg.where;
  const SegmentLayout& L = cfg.L;
  const int G = w.G;
  const int me = w.local;
  const int b = s.b;
  char* my = tp.my();
  const size_t staging = L.staging(p) + s.chunk_off + rotated_stage_off(cfg, s.n * s.es, e);

  // Always staged (even a zero-copy input): without an all-gather, nothing tells me when my peers
  // are done reading, so the buffer they read must be a parity slot (NOTE [epoch protocol]).
  if (G > 1) {
    tp.copy(my + staging, s.in, s.n * s.es);
    tp.jitter();
    for (int h = 0; h < G; ++h)
      if (h != me) tp.signal(w.rank_of(w.node, h), L.ready_cell(p, me, b), word, make_ref(kRefShm, staging), 0);
  }
  for (int h = 0; h < G; ++h) {
    uint64_t a0 = 0, a1 = 0;
    if (h != me) {
      const int peer = w.rank_of(w.node, h);
      if (!tp.wait(L.ready_cell(p, h, b), e, sig, Phase::kOneShot, 0, peer, &a0, &a1)) return false;
    }
    if (tp.leader()) ws.srcs[h] = h == me ? s.in : tp.base(w.rank_of(w.node, h)) + ref_value(a0);
  }
  if (tp.leader()) ws.dsts[0] = w.N == 1 ? s.out : my + L.result(p, b);
  tp.sync();
  if (w.N == 1) {
    tp.reduce(ws.dsts, 1, ws.srcs, G, s.n, sc);
    return true;
  }
  // One rank per node: the inter-node steps read the input itself (NOTE [start from the input]).
  const bool from_input = G == 1 && cfg.start_from_input;
  if (!from_input) tp.reduce(ws.dsts, 1, ws.srcs, G, s.n, make_scale(RedOp::kSum, 1));
  size_t final_off = 0;
  if (!inter_node_round(tp, cfg, s.n, s.es, e, sig, sc, b, &final_off, from_input ? s.in : nullptr,
                        from_input ? s.out : nullptr))
    return false;
  if (!from_input) tp.copy(s.out, my + final_off, s.n * s.es);
  return true;
}

}  // namespace nvrar
