// The NVRAR plan: who reduces what, who sends to whom, and where every slot and flag lives for
// a given epoch. Pure code, no I/O, usable from host and device; the CPU executor
// (csrc/cpu/executor.cpp), the CUDA kernels and the symbolic tests (tests/test_plan.py, through
// the bindings) all follow this one header.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/hd.h"

namespace nvrar {

// NOTE [epoch protocol]
// =====================
// Ranks: W = N nodes x G ranks per node, rank = node * G + local. One protocol *round* reduces one
// chunk of at most `max_bytes`; a call on more data runs several rounds. Round e (e = 1, 2, ...) is
// the e-th round this rank ever ran on this communicator; every rank runs the same sequence of
// rounds, so e names the same round everywhere. Epochs only increase; nothing is ever reset.
//
// Algorithms (chosen identically on every rank, see nvrar/selector.py):
//   two-shot:  stage-in -> intra-node reduce-scatter (local rank g reduces shard g) -> inter-node
//              recursive doubling of shard g among the N ranks with local index g -> all-gather.
//   one-shot:  stage-in -> every rank reduces the whole chunk from all G local peers -> inter-node
//              recursive doubling of the whole chunk -> copy out. No all-gather.
//
// Residency (GPU). A chunk is cut into B slices, one per CUDA block, each with its own flags, so
// a block never waits for another block of its own rank -- except across nodes when slices are
// gathered into fewer channels than blocks (NOTE [channels], csrc/cuda/device.cuh): a channel's
// message leaves when its last block's part is written, and every block of the channel waits for
// the partner's channel message, so all blocks must be resident at once. Such a launch is
// cooperative (csrc/cuda/allreduce_inst.cu: it fails rather than runs part of the grid; a
// cooperative kernel node can be captured in a CUDA graph). A launch with one block per channel
// progresses whichever of its blocks are resident, provided they start in blockIdx order.
//
// Memory. Each rank owns one segment of the symmetric heap, laid out identically on every rank
// (SegmentLayout). Slots that peers read or write:
//   staging[p]   my staged input (whole chunk); read by local peers in the reduce phase.
//   result[p]    my intra-node result (shard g, or whole chunk for one-shot); read by my own
//                inter-node sends and, when N == 1, by local peers in the all-gather.
//   zone[p][s]   landing zone of inter-node step s, written by exactly one remote partner per round
//                (put), then combined in place by me; read by my next send and, when it holds my
//                final shard, by local peers in the all-gather.
//   llzone[p][s] the same for small shards sent as LL packets (protocol/ll.h); the payload is
//                unpacked into zone[p][s] and the packets zeroed (NOTE [LL zones], round.h).
//   user data    a zero-copy input living in my pool (Communicator.empty), or (CPU, cross-memory
//                access) my private input: read by local peers in the reduce phase, shard h by
//                peer h; written (in place) by me and by the peers' pushes in the all-gather.
//   user output  where my result goes: written by me, and (push all-gather) by each local peer h,
//                shard h, when my ready flag offers it (aux1: OutRef shm = in my pool, cma = in my
//                private memory through process_vm_writev); else I pull shard h from h's segment.
// with p = e % 2 (parity). Flags, each a 64-bit word in a cell of the *receiver's* segment (a
// sender "pushes" a flag, so every rank polls only its own memory):
//   ready[p][h]  local peer h staged its input for round e (aux0: where to read it, an offset in h's
//                segment, or (CPU) a private address for a cross-memory read; aux1: OutRef)
//   final[p][h]  local peer h holds its final shard of round e (aux: byte offset of that shard)
//   inter[p][s]  my partner of step s put its data into my zone[p][s]
//   abort        some rank failed; aux names it (never cleared: the communicator is dead)
// A flag word is (epoch << 16) | signature, signature being a 16-bit hash of the call (count, dtype,
// op, algorithm). A sender writes the slot's data, then stores the word with release semantics; a
// receiver waits with acquire loads until word >= (e << 16) (so epoch >= e), then checks that the
// epoch is exactly e and the signature equals its own: a mismatch is a call mismatch between ranks,
// an epoch > e a protocol violation; both abort instead of using the data. 16 bits cannot tell
// every pair of calls apart (count 100000 and 131409, float32 two-shot, share a signature): the
// CPU executor also carries the full call description in every flag cell and compares it, and
// bounds every cross-memory transfer by the buffer the peer advertised (NOTE [call description]
// in csrc/cpu/segment.h); the GPU transport carries it in every message too (NOTE [gpu call
// description] in csrc/cuda/device.cuh).
//
// Why parity slots are enough. Write "A(e) -> B(e')" for "A cannot pass point X of round e before B
// reached point Y of round e'". Three facts hold for every rank r:
//   (F1) r starts round e+1 only after finishing round e (rounds are sequential per rank).
//   (F2) r finishes round e only after receiving every flag it waits for in round e, and every
//        such flag was stored after its sender had finished reading everything of r that it
//        reads in round e (see the per-slot list below) -- except the zone reads, covered by F3.
//   (F3) each inter-node step is a rendezvous: r's partner in step s of round e+1 receives r's
//        data of round e+1, which r sends only after its own reduce phase of e+1, which needs the
//        ready(e+1) flag of every local peer of r, which each peer stores only after finishing
//        round e (F1), including its all-gather reads of r's slots. This holds for empty shards
//        too: a 0-byte step still carries its flag (a put-with-signal of no data, or one LL packet).
// A slot of parity p is written in rounds e and e+2 only. Take any writer w of a slot of rank r
// and any reader x of it in round e; we need: x finished reading before w writes in round e+2.
//   staging[p] of r: writer r (stage-in e+2); readers: local peers of r (reduce phase of e). r
//     stages e+2 only after round e+1's reduce phase, which waited for ready(e+1) of every local
//     peer; a peer stores ready(e+1) only after finishing round e (F1).
//   result[p] of r: writer r (reduce phase of e+2); readers: r itself (its sends in e: done, F1) and
//     local peers (all-gather of e when N == 1): same argument as staging, one phase later.
//   zone[p][s] of r: writer: r's step-s partner q in e+2, and r (combine, in e+2, after q's put).
//     Readers: r (send of the next step in e: done, F1) and r's local peers (all-gather of e).
//     q puts in e+2 only after finishing e+1 (F1), which needed r's step-s data of e+1 (every step
//     kind is a rendezvous or a chain ending at q: fold-in senders wait for the fold-out reply of
//     their receiver, fold-out senders first got the fold-in of their receiver), and by F3 every
//     local peer of r had finished round e by then.
//   flags: a flag cell of parity p is stored once per round e, e+2, ...; its one receiver consumed
//     the round-e value before the sender can store round e+2's, by the same three arguments (the
//     sender of ready(e+2)/final(e+2)/inter(e+2) is past round e+1, which needed the receiver's own
//     round-(e+1) flags, stored after the receiver finished round e). So the receiver never sees an
//     epoch above e in a parity-p cell while it waits in round e; if it does, it is a violation.
//   user data of r (zero-copy, not parity-indexed): readers: local peer h reads shard h in the
//     two-shot reduce phase of e; writer: r's all-gather of e (in place) and the user after the
//     call returns. r writes shard h only after final(e) from h, stored after h's reduce phase;
//     r returns only after every local peer's final(e). The one-shot algorithm never reads a user
//     buffer of a peer: it always stages, since there all-gather flags do not exist.
//   user output of r (pushed into by local peers): peer h writes only shard h, only after it saw
//     ready(e) from r (r stores it once its input is staged, so an in-place input is no longer
//     read where h writes; shard h of a zero-copy in-place input is read by h alone, tile by tile
//     before h stores that tile), and before it stores final(e) to r. r returns only after every
//     final(e), so no push lands after the call returned.
// Deadlines: every wait above is bounded (NVRAR_TIMEOUT_S). On expiry, on a mismatch or a
// violation, the rank writes an abort record into every peer's abort cell and raises; a waiting
// rank that sees its abort cell set raises too. A failed communicator stays failed: no later round
// can run on slots whose state is unknown. Nothing is ever read from a slot whose flag did not
// match exactly, so a failure is never wrong data.
// Determinism: shard g is reduced by exactly one rank per node, in local-rank order h = 0..G-1
// with fp32 accumulation for 16-bit types; every inter-node combine evaluates op(lower node's
// operand, higher node's operand) and both partners of an exchange evaluate the same expression;
// fold-out copies a finished result. So every rank ends with the same bits.

// The all-reduce algorithms. The one definition of their codes: Python reads them from
// nvrar._C.ALGORITHM_CODES (bindings.cpp); never renumber. kAuto applies the
// communicator's one-shot threshold.
enum class Algorithm : int32_t { kAuto = 0, kTwoShot = 1, kOneShot = 2 };

NVRAR_HD const char* algorithm_name(Algorithm v) {
  switch (v) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kTwoShot: return "two-shot";
    case Algorithm::kOneShot: return "one-shot";
  }
  return "?";
}

constexpr int kAlignBytes = 16;       // shard bounds and chunk starts keep 16-byte alignment (GPU vector loads)
constexpr int kSigBits = 16;          // low bits of a flag word: call signature
constexpr uint64_t kSigMask = (uint64_t{1} << kSigBits) - 1;

NVRAR_HD uint64_t flag_word(uint64_t epoch, uint32_t sig) { return (epoch << kSigBits) | (sig & kSigMask); }
NVRAR_HD uint64_t flag_epoch(uint64_t word) { return word >> kSigBits; }
NVRAR_HD uint32_t flag_sig(uint64_t word) { return static_cast<uint32_t>(word & kSigMask); }

// How a rank wants its local peers to deliver their result shards (second aux word of its ready
// flag): pull (the peer publishes the shard in its own segment and I copy it), shm (the peer
// stores it straight into my output, which lives in my segment at this offset), or cma (the peer
// writes it into my private output at this address with a cross-memory write, CPU only).
constexpr uint64_t kRefPull = 0, kRefShm = 1, kRefCma = 2;
// The value is 62 bits, signed: an offset from the owner's segment may be negative (a buffer
// elsewhere in the GPU's symmetric heap, below the segment: runtime.cu, NOTE [symmetric buffers]);
// base + ref_value(ref) then wraps to the right address. Addresses and CPU offsets are >= 0.
NVRAR_HD uint64_t make_ref(uint64_t kind, uint64_t value) { return (kind << 62) | (value & ((uint64_t{1} << 62) - 1)); }
NVRAR_HD uint64_t ref_kind(uint64_t ref) { return ref >> 62; }
NVRAR_HD uint64_t ref_value(uint64_t ref) { return static_cast<uint64_t>(static_cast<int64_t>(ref << 2) >> 2); }

// Position of one rank in the node-major layout.
struct Layout {
  int world;  // W
  int G;      // ranks per node
  int N;      // nodes
  int rank;
  int node;
  int local;

  NVRAR_HD static Layout make(int world, int ranks_per_node, int rank) {
    Layout l;
    l.world = world;
    l.G = ranks_per_node;
    l.N = world / ranks_per_node;
    l.rank = rank;
    l.node = rank / ranks_per_node;
    l.local = rank % ranks_per_node;
    return l;
  }
  NVRAR_HD int rank_of(int node_, int local_) const { return node_ * G + local_; }
};

// Element range [begin, end) of shard g when `count` elements of `elem_size` bytes are cut into G
// shards: equal sizes rounded up to 16 bytes; the last shards may be short or empty.
struct Range {
  size_t begin;
  size_t end;
  NVRAR_HD size_t size() const { return end - begin; }
};

NVRAR_HD size_t shard_elems(size_t count, int elem_size, int G) {
  size_t per = ceil_div(count, static_cast<size_t>(G));
  size_t a = static_cast<size_t>(kAlignBytes / elem_size);
  return align_up(per, a);
}

// Part g of `total` items cut into parts of `per`, clamped to the total (the last parts may be
// short or empty).
NVRAR_HD Range part_range(size_t total, size_t per, int g) {
  const size_t b = per * static_cast<size_t>(g);
  const size_t e = b + per;
  Range r;
  r.begin = b < total ? b : total;
  r.end = e < total ? e : total;
  return r;
}

NVRAR_HD Range shard_range(size_t count, int elem_size, int G, int g) {
  return part_range(count, shard_elems(count, elem_size, G), g);
}

// Inter-node recursive doubling with fold-in / fold-out, for any N >= 1.
//   Np = largest power of two <= N, K = log2(Np).
//   Node n >= Np: send to n - Np (slot kFoldIn), then receive the result back (slot kFoldOut).
//   Node n < Np: if n + Np < N, receive n + Np's data (slot kFoldIn) and combine; then for
//   k = 0..K-1 exchange with n ^ 2^k (slot 1 + k) and combine; then send the result to n + Np
//   (slot kFoldOut) if it folded one in.
// Slots 0 (fold-in), 1..K (exchanges), K + 1 (fold-out): K + 2 landing zones per parity.
struct InterStep {
  int partner;      // partner node
  bool send;        // put my accumulator into the partner's zone[send_slot]
  bool recv;        // wait for my zone[recv_slot]
  bool combine;     // recv then acc = op(lower node first) into zone[recv_slot]; else acc = zone
  bool mine_first;  // my operand is the left one (my node is the lower)
  int slot;         // the zone this step writes at the partner and/or waits for here
};

struct InterSchedule {
  int N;
  int Np;
  int K;
  int node;

  NVRAR_HD static InterSchedule make(int num_nodes, int my_node) {
    InterSchedule s;
    s.N = num_nodes;
    s.node = my_node;
    s.Np = 1;
    s.K = 0;
    while (s.Np * 2 <= num_nodes) {
      s.Np *= 2;
      s.K += 1;
    }
    return s;
  }

  NVRAR_HD static int num_slots_for(int num_nodes) { return make(num_nodes, 0).K + 2; }
  NVRAR_HD int num_slots() const { return K + 2; }
  NVRAR_HD int fold_in_slot() const { return 0; }
  NVRAR_HD int exchange_slot(int k) const { return 1 + k; }
  NVRAR_HD int fold_out_slot() const { return K + 1; }

  NVRAR_HD bool folded_out() const { return node >= Np; }              // I am a fold-in sender
  NVRAR_HD bool has_fold_partner() const { return node < Np && node + Np < N; }

  NVRAR_HD int num_steps() const {
    if (folded_out()) return 2;
    return K + (has_fold_partner() ? 2 : 0);
  }

  NVRAR_HD InterStep step(int i) const {
    InterStep st;
    st.send = false;
    st.recv = false;
    st.combine = false;
    st.mine_first = true;
    if (folded_out()) {
      st.partner = node - Np;
      if (i == 0) {
        st.send = true;
        st.slot = fold_in_slot();
      } else {
        st.recv = true;
        st.slot = fold_out_slot();
      }
      return st;
    }
    int k = i;
    if (has_fold_partner()) {
      if (i == 0) {
        st.partner = node + Np;
        st.recv = true;
        st.combine = true;
        st.mine_first = true;  // node < node + Np
        st.slot = fold_in_slot();
        return st;
      }
      if (i == K + 1) {
        st.partner = node + Np;
        st.send = true;
        st.slot = fold_out_slot();
        return st;
      }
      k = i - 1;
    }
    st.partner = node ^ (1 << k);
    st.send = true;
    st.recv = true;
    st.combine = true;
    st.mine_first = node < st.partner;
    st.slot = exchange_slot(k);
    return st;
  }

  // Where my final result lives after the schedule: -1 = result slot, else the zone index.
  NVRAR_HD int final_slot() const {
    int loc = -1;
    for (int i = 0; i < num_steps(); ++i) {
      InterStep st = step(i);
      if (st.recv) loc = st.slot;
    }
    return loc;
  }
};

// Byte layout of one rank's segment (identical on every rank of a communicator).
// A chunk is processed as B independent slices (B = 1 on the CPU; one per CUDA block on the GPU),
// each with its own flags and its own part of every slot, so that slices never wait for each
// other. Slice b of every chunk of one call occupies the same byte range of staging (the slice
// geometry comes from the full chunk size, see chunk_slice), so the parity argument holds per
// slice; between calls, a kernel boundary orders all slices (a rank's next call starts after all
// its blocks finished, and any of its blocks waits for every local peer's ready flag).
// Cell indices: 0 abort; then ready[2][G][B], final[2][G][B], inter[2][S][B], gather[2][S-2][B]
// (the all-gather steps of halving-doubling, NOTE [halving-doubling] in round.h: cells only,
// their data lands in the zone of the last exchange).
struct SegmentLayout {
  int G;
  int S;                   // zones per parity (InterSchedule::num_slots)
  int B;                   // slices per chunk
  size_t cell_stride;      // bytes per flag cell (64: no false sharing between writers)
  size_t header_bytes;     // header + error text
  size_t cells_off;
  size_t staging_bytes;    // >= max chunk bytes
  size_t zone_slice_bytes; // one slice's part of a zone or result slot (a call's stride: see below)
  size_t zone_bytes;       // one zone or result slot: B * zone_slice_bytes as the layout cuts it
  size_t staging_off;      // staging[p] at staging_off + p * staging_bytes (slices at their chunk offsets)
  size_t result_off;       // result[p][b] at result_off + p * zone_bytes + b * zone_slice_bytes
  size_t zones_off;        // zone[p][s][b] at zones_off + (p * S + s) * zone_bytes + b * zone_slice_bytes
  size_t desc_room;        // bytes behind a slice's data in its zone and LL zone for the call
                           // description the GPU's inter-node messages carry (0: none, CPU)
  size_t ll_slice_bytes;   // one slice's LL zone (packets of the largest LL shard; 0: LL off; a call's stride)
  size_t ll_bytes;         // one LL zone or llout slot: B * ll_slice_bytes as the layout cuts it
  size_t llzones_off;      // llzone[p][s][b]: LL packets from the partner (protocol/ll.h), at
                           // llzones_off + (p * S + s) * ll_bytes + b * ll_slice_bytes
  size_t llout_off;        // llout[p][s][b]: my packets, packed before the put (GPU); as llzone
  size_t pool_off;         // user pool (Communicator.empty)
  size_t pool_bytes;
  size_t total_bytes;

  static constexpr size_t kPage = 4096;

  // NOTE [slot strides]: a GPU call may cut its slices' parts of the result, zone and LL slots at
  // a smaller stride than the layout's (zone_slice_bytes, ll_slice_bytes: launch_params.h,
  // call_strides), so that a channel's parts form one contiguous message. Only the slices move:
  // every slot (parity p, step slot s) keeps the bytes the layout gives it, [base, base +
  // zone_bytes) or ll_bytes, whatever the call's stride. The parity argument of NOTE [epoch
  // protocol] is about slots: a peer running one round ahead writes the other parity's slots,
  // which must not share a byte with the slots this rank still reads in its round. Were the
  // stride applied to the whole index ((p * S + s) * B + b), the calls of two sizes would place
  // the same parity's slots at different bytes: a 3x1 world, a call of 1 int32 (stride 128) at
  // an odd epoch, then a call of 1000 (stride 4160): node 2 finishes the first call once node 0's
  // fold-out arrived and puts its fold-in of the second call into node 0's zone[0][0], bytes
  // [0, 4048), while node 0 may still copy its result out of zone[1][1] of the first call, bytes
  // [2048, 2052). Rounds e and e + 2 of one slot may use different strides: a writer in e + 2 is
  // ordered after every read of round e in any byte of the slot (the per-slot arguments of NOTE
  // [epoch protocol]; between calls, a kernel boundary orders all slices).

  // Elements of slice b of a chunk of n elements, in a call whose full chunks have chunk_elems:
  // the cut is that of a full chunk (16-byte aligned), clipped to n, so that a short last chunk
  // keeps every slice in its place.
  NVRAR_HD static Range chunk_slice(size_t n, size_t chunk_elems, int elem_size, int B, int b) {
    const size_t ss = shard_elems(chunk_elems, elem_size, B);
    const size_t begin = ss * static_cast<size_t>(b) < n ? ss * static_cast<size_t>(b) : n;
    const size_t end = begin + ss < n ? begin + ss : n;
    Range r;
    r.begin = begin;
    r.end = end;
    return r;
  }

  NVRAR_HD static SegmentLayout make(int G, int num_nodes, size_t max_bytes, size_t min_zone_bytes,
                                     size_t pool_bytes, size_t cell_stride, int B = 1, size_t ll_max_bytes = 0,
                                     size_t desc_room = 0) {
    SegmentLayout L;
    L.desc_room = desc_room;
    L.G = G;
    L.S = InterSchedule::num_slots_for(num_nodes);
    L.B = B;
    L.cell_stride = cell_stride;
    L.header_bytes = kPage;
    L.cells_off = L.header_bytes;
    size_t ncells =
        1 + (4 * static_cast<size_t>(G) + 2 * static_cast<size_t>(L.S) + 2 * static_cast<size_t>(L.S - 2)) *
                static_cast<size_t>(B);
    L.staging_off = align_up(L.cells_off + ncells * cell_stride, kPage);
    L.staging_bytes = align_up(max_bytes, kPage);
    // A shard of one slice of a max_bytes chunk: ceil(ceil(max_bytes / B) / G) rounded up to 16
    // bytes, plus slack for the alignment of the slice and shard bounds.
    size_t slice = ceil_div(max_bytes, static_cast<size_t>(B)) + kAlignBytes;
    size_t shard = align_up(ceil_div(slice, static_cast<size_t>(G)) + kAlignBytes, kAlignBytes);
    size_t oneshot = ceil_div(min_zone_bytes, static_cast<size_t>(B)) + kAlignBytes;
    L.zone_slice_bytes = align_up((shard > oneshot ? shard : oneshot) + desc_room, 256);
    L.zone_bytes = L.zone_slice_bytes * static_cast<size_t>(B);
    L.result_off = L.staging_off + 2 * L.staging_bytes;
    L.zones_off = align_up(L.result_off + 2 * L.zone_bytes, kPage);
    L.ll_slice_bytes = ll_max_bytes > 0 ? align_up(ceil_div(ll_max_bytes + desc_room, 4) * 8, 256) : 0;
    L.ll_bytes = L.ll_slice_bytes * static_cast<size_t>(B);
    const size_t ll_region = 2 * static_cast<size_t>(L.S) * L.ll_bytes;
    L.llzones_off = align_up(L.zones_off + 2 * static_cast<size_t>(L.S) * L.zone_bytes, kPage);
    L.llout_off = align_up(L.llzones_off + ll_region, kPage);
    L.pool_off = align_up(L.llout_off + ll_region, kPage);
    L.pool_bytes = align_up(pool_bytes, kPage);
    L.total_bytes = L.pool_off + L.pool_bytes;
    return L;
  }

  NVRAR_HD size_t cell(size_t index) const { return cells_off + index * cell_stride; }
  NVRAR_HD size_t abort_cell() const { return cells_off; }
  NVRAR_HD size_t ready_cell(int parity, int src_local, int b = 0) const {
    return cell(1 + (static_cast<size_t>(parity) * G + src_local) * B + b);
  }
  NVRAR_HD size_t final_cell(int parity, int src_local, int b = 0) const {
    return cell(1 + (2 * static_cast<size_t>(G) + static_cast<size_t>(parity) * G + src_local) * B + b);
  }
  NVRAR_HD size_t inter_cell(int parity, int slot, int b = 0) const {
    return cell(1 + (4 * static_cast<size_t>(G) + static_cast<size_t>(parity) * S + slot) * B + b);
  }
  NVRAR_HD size_t gather_cell(int parity, int k, int b = 0) const {
    return cell(1 + (4 * static_cast<size_t>(G) + 2 * static_cast<size_t>(S) +
                     static_cast<size_t>(parity) * (S - 2) + k) * B + b);
  }
  NVRAR_HD size_t staging(int parity) const { return staging_off + static_cast<size_t>(parity) * staging_bytes; }
  // Slots at the layout's fixed places, slices at the call's stride (NOTE [slot strides]).
  NVRAR_HD size_t result(int parity, int b = 0) const {
    return result_off + static_cast<size_t>(parity) * zone_bytes + static_cast<size_t>(b) * zone_slice_bytes;
  }
  NVRAR_HD size_t zone(int parity, int slot, int b = 0) const {
    return zones_off + (static_cast<size_t>(parity) * S + slot) * zone_bytes + static_cast<size_t>(b) * zone_slice_bytes;
  }
  NVRAR_HD size_t llzone(int parity, int slot, int b = 0) const {
    return llzones_off + (static_cast<size_t>(parity) * S + slot) * ll_bytes + static_cast<size_t>(b) * ll_slice_bytes;
  }
  NVRAR_HD size_t llout(int parity, int slot, int b = 0) const {
    return llout_off + (static_cast<size_t>(parity) * S + slot) * ll_bytes + static_cast<size_t>(b) * ll_slice_bytes;
  }
  // The slot index p * S + s of an offset inside the LL zones (as llzone gives it).
  NVRAR_HD size_t llzone_slot(size_t off) const { return (off - llzones_off) / ll_bytes; }
  // Largest chunk (bytes) whose every slice fits a zone slice whole: the one-shot algorithm across
  // nodes sends whole slices, not shards.
  NVRAR_HD size_t oneshot_chunk_bytes() const {
    return (zone_data_bytes() - 2 * kAlignBytes) / 64 * 64 * static_cast<size_t>(B);
  }
  // Bytes of a zone or result slice that data may fill (the rest is the description's room).
  NVRAR_HD size_t zone_data_bytes() const { return zone_slice_bytes - desc_room; }
};

// 16-bit signature of a call description: FNV-1a over the fields, folded to 16 bits; 0 is
// avoided. Every flag carries it, so a mismatch between ranks is usually caught at the first flag
// they exchange (a quick check only: NOTE [call description] in csrc/cpu/segment.h).
NVRAR_HD uint32_t signature_of(const uint64_t* fields, int n) {
  uint64_t h = 1469598103934665603ull;
  for (int f = 0; f < n; ++f) {
    for (int b = 0; b < 8; ++b) {
      h ^= (fields[f] >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  uint32_t s = static_cast<uint32_t>((h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) & kSigMask);
  return s == 0 ? 1u : s;
}

NVRAR_HD uint32_t call_signature(uint64_t count, int dtype, int op, int algorithm) {
  const uint64_t fields[4] = {count, static_cast<uint64_t>(dtype), static_cast<uint64_t>(op),
                              static_cast<uint64_t>(algorithm)};
  return signature_of(fields, 4);
}

}  // namespace nvrar
