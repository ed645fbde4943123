// The fused all-reduce + residual add + RMSNorm (Communicator.all_reduce_add_rms_norm), written
// once for host and device: the row-aligned shard math, the add + RMSNorm epilogue over a
// thread-group view, the call signature, and the two-shot round with the epilogue between the
// inter-node phase and the all-gather. The one-shot variant is the plain one_shot_round (round.h)
// followed by the epilogue on every row. See NOTE [fused add + RMSNorm].
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "../common/hd.h"
#include "phase.h"
#include "plan.h"
#include "round.h"
#include "slice.h"
#include "types.h"

namespace nvrar {

// NOTE [fused add + RMSNorm]
// ==========================
// x, residual: R rows of h elements; weight: h elements; one dtype T (fp32, fp16, bf16). Result:
//   s = all_reduce_sum(x)                      the plain all-reduce, rounded once to T
//   residual = T(float(residual) + float(s))   rounded once: the new residual
//   x = T(float(residual) * inv * float(w))    with inv = 1 / sqrt(ms + eps) in fp32, the norm of
//                                              the *rounded* new residual (vLLM's fused_add_rms_norm)
//   ms = (sum of float(residual)^2 over the row, in kNormLanes strided lanes, then a fixed
//         pairwise tree) / h
// The order of the mean of squares is fixed (lane j sums elements j, j + 32, ... in order; then
// lanes j and j + o are added for o = 16, 8, 4, 2, 1), so the host and a CUDA warp (butterfly
// shuffles: IEEE addition commutes exactly) compute the same bits. sqrt and the division are
// IEEE-rounded on both (no rsqrt approximation).
//
// Two-shot: shards are cut on row boundaries (row_range): local rank g owns rows [g*ceil(R/G),
// ...) of the chunk, and some ranks own none when R < G. After the reduce-scatter and the
// inter-node recursive doubling, rank g holds the finished sum of its rows; it applies the
// epilogue to them (so each row is normalized once per node, not on every rank), writes both
// outputs into its own x and residual, and pushes them into every local peer's staging slot of
// this round: x rows at their place in the chunk, residual rows at chunk_bytes + their place. This
// is safe: rows of shard g in a peer's staging are read by g alone (in its reduce phase, done by
// then), and the residual half lies past the chunk (chunks are at most half a staging slot). The
// final flag follows the pushes; each rank then copies the other shards' rows out of its own
// staging. Parity argument: as for the plain round (NOTE [epoch protocol]): staging[p] of r is
// written in round e by r (stage-in) and by its local peers (pushes, after ready(e) from r), read
// by r before it finishes e, and written next in round e+2.
// Residual precondition: residual and weight are the same on every rank (tensor parallelism
// replicates them). Each rank's rows come from its owner's residual, so every rank ends with the
// same bits even if the inputs differed; they are then not the sum a single rank would compute.
// One-shot: every rank reduces every row (same arithmetic, same order) and applies the epilogue
// to every row itself: the same bits as two-shot, with no all-gather.

constexpr int kNormLanes = 32;            // strided partial sums of the mean of squares (a warp)
// The op byte of a fused call's description and signature: past every RedOp, so that no
// all_reduce call carries it.
enum class FusedOp : int32_t { kAddRmsNorm = 16 };
constexpr int32_t kFusedOpCode = static_cast<int32_t>(FusedOp::kAddRmsNorm);

// Rows [begin, end) of local rank g's shard when R rows are cut into G shards.
NVRAR_HD Range row_range(size_t rows, int G, int g) {
  return part_range(rows, ceil_div(rows, static_cast<size_t>(G)), g);
}

// 16-bit signature of a fused call: count, dtype, algorithm, h and the bits of eps (another h or
// eps on one rank is a call mismatch, like another count).
NVRAR_HD uint32_t fused_signature(uint64_t count, int dtype, int algorithm, uint64_t h, float eps) {
  const uint64_t fields[6] = {count, static_cast<uint64_t>(dtype), static_cast<uint64_t>(kFusedOpCode),
                              static_cast<uint64_t>(algorithm), h, static_cast<uint64_t>(float_bits(eps))};
  return signature_of(fields, 6);
}

// fp32 multiply and add, each rounded (no contraction into an FMA on the device either; the host
// build turns contraction off).
NVRAR_HD float mul_rn(float a, float b) {
#if NVRAR_ON_DEVICE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
NVRAR_HD float add_rn(float a, float b) {
#if NVRAR_ON_DEVICE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Lanes of the mean of squares folded in the fixed order of NOTE [fused add + RMSNorm].
NVRAR_HD float fold_lanes(float (&p)[kNormLanes]) {
  for (int o = kNormLanes / 2; o > 0; o /= 2)
    for (int j = 0; j < o; ++j) p[j] = add_rn(p[j], p[j + o]);
  return p[0];
}

// One row: res = T(res_in + sum); out = T(res * inv * w). res may alias res_in, out may alias
// sum (each element is read before it is written).
template <typename T>
NVRAR_HD void add_rms_norm_row(T* out, T* res, const T* sum, const T* res_in, const T* w, size_t h, float eps) {
  float p[kNormLanes];
  for (int j = 0; j < kNormLanes; ++j) p[j] = 0.0f;
  size_t i = 0;
  for (; i + kNormLanes <= h; i += kNormLanes) {
    for (int j = 0; j < kNormLanes; ++j) {
      const T r = store_acc<T>(add_rn(load_acc(res_in[i + j]), load_acc(sum[i + j])));
      res[i + j] = r;
      const float rf = load_acc(r);
      p[j] = add_rn(p[j], mul_rn(rf, rf));
    }
  }
  for (int j = 0; i + static_cast<size_t>(j) < h; ++j) {
    const T r = store_acc<T>(add_rn(load_acc(res_in[i + j]), load_acc(sum[i + j])));
    res[i + j] = r;
    const float rf = load_acc(r);
    p[j] = add_rn(p[j], mul_rn(rf, rf));
  }
  const float ms = fold_lanes(p) / static_cast<float>(h);
  const float inv = 1.0f / sqrtf(add_rn(ms, eps));
  for (size_t k = 0; k < h; ++k) out[k] = store_acc<T>(mul_rn(mul_rn(load_acc(res[k]), inv), load_acc(w[k])));
}

// The epilogue on `rows` rows, rows spread over the members of the group (one member per row;
// the arithmetic of a row does not depend on who runs it).
template <typename T, typename Group>
NVRAR_HD void add_rms_norm_rows(const Group& grp, T* out, T* res, const T* sum, const T* res_in, const T* w,
                                size_t rows, size_t h, float eps) {
  for (size_t r = static_cast<size_t>(grp.index()); r < rows; r += static_cast<size_t>(grp.size()))
    add_rms_norm_row(out + r * h, res + r * h, sum + r * h, res_in + r * h, w, h, eps);
}

// One chunk of the fused call: rows x h elements of es bytes.
struct FusedSlice {
  const char* in;  // x (private), read in the reduce phase
  char* x_out;     // x, written with the normalized rows (may equal in)
  char* res;       // residual, read and written in place
  size_t rows;
  size_t h;
  size_t es;
  int b;
};

// Two-shot round of the fused call, following two_shot_round's flags (ready, inter, final) with
// row-aligned shards, always staged, and a push all-gather of two outputs (NOTE above). `epi`
// is called as epi(out, res, sum, res_in, rows) with byte pointers.
template <typename TP, typename Epi>
NVRAR_HD bool fused_two_shot_round(TP& tp, const RoundConfig& cfg, const Workspace& ws, const FusedSlice& s,
                                   uint64_t e, uint32_t sig, const Epi& epi) {
  const int p = static_cast<int>(e & 1);
  const uint64_t word = flag_word(e, sig);
  const Layout& w = cfg.where;
  const SegmentLayout& L = cfg.L;
  const int G = w.G;
  const int me = w.local;
  const int b = s.b;
  const size_t row_bytes = s.h * s.es;
  const size_t chunk_bytes = s.rows * row_bytes;
  char* my = tp.my();
  const Range mine = row_range(s.rows, G, me);
  const size_t mine_off = mine.begin * row_bytes;
  const size_t mine_bytes = mine.size() * row_bytes;
  const size_t staging = L.staging(p);
  const Scale none = make_scale(RedOp::kSum, 1);

  // Stage-in of every row but mine (those I read from my input).
  tp.copy(my + staging, s.in, mine_off);
  tp.copy(my + staging + mine_off + mine_bytes, s.in + mine_off + mine_bytes, chunk_bytes - mine_off - mine_bytes);
  tp.jitter();
  for (int g = 0; g < G; ++g)
    if (g != me) tp.signal(w.rank_of(w.node, g), L.ready_cell(p, me, b), word, make_ref(kRefShm, staging), 0);

  // Reduce-scatter of my rows, sources in local-rank order, into my result slot.
  for (int g = 0; g < G; ++g) {
    uint64_t a0 = 0, a1 = 0;
    if (g != me && !tp.wait(L.ready_cell(p, g, b), e, sig, Phase::kReduceScatter, 0, w.rank_of(w.node, g), &a0, &a1))
      return false;
    if (tp.leader())
      ws.srcs[g] = g == me ? s.in + mine_off : tp.base(w.rank_of(w.node, g)) + ref_value(a0) + mine_off;
  }
  const size_t res = L.result(p, b);
  if (tp.leader()) ws.dsts[0] = my + res;
  tp.sync();
  tp.reduce(ws.dsts, 1, ws.srcs, G, mine.size() * s.h, none);
  tp.sync();
  size_t final_off = res;
  if (w.N > 1 && !inter_node_round(tp, cfg, mine.size() * s.h, s.es, e, sig, none, b, &final_off)) return false;

  // The epilogue on my rows, then both outputs pushed into every local peer's staging.
  epi(s.x_out + mine_off, s.res + mine_off, my + final_off, s.res + mine_off, mine.size());
  tp.sync();
  for (int g = 0; g < G; ++g) {
    if (g == me) continue;
    const int peer = w.rank_of(w.node, g);
    tp.jitter();
    tp.copy(tp.base(peer) + staging + mine_off, s.x_out + mine_off, mine_bytes);
    tp.copy(tp.base(peer) + staging + chunk_bytes + mine_off, s.res + mine_off, mine_bytes);
  }
  tp.sync();
  for (int g = 0; g < G; ++g)
    if (g != me) tp.signal(w.rank_of(w.node, g), L.final_cell(p, me, b), word, 0, 0);
  for (int g = 0; g < G; ++g) {
    if (g == me) continue;
    uint64_t a0, a1;
    if (!tp.wait(L.final_cell(p, g, b), e, sig, Phase::kAllGather, 0, w.rank_of(w.node, g), &a0, &a1)) return false;
    const Range rg = row_range(s.rows, G, g);
    tp.copy(s.x_out + rg.begin * row_bytes, my + staging + rg.begin * row_bytes, rg.size() * row_bytes);
    tp.copy(s.res + rg.begin * row_bytes, my + staging + chunk_bytes + rg.begin * row_bytes, rg.size() * row_bytes);
  }
  return true;
}

// Rows per chunk of a fused call (0: a row does not fit, the call cannot run): two-shot chunks
// fill at most half a staging slot, and a shard of them fits a result slot; one-shot chunks fit
// a staging slot and, across nodes, a zone slice whole.
NVRAR_HD size_t fused_chunk_rows(const SegmentLayout& L, size_t max_bytes, int G, int N, size_t row_bytes,
                                 bool one_shot) {
  if (one_shot) {
    size_t lim = max_bytes;
    if (N > 1 && L.oneshot_chunk_bytes() < lim) lim = L.oneshot_chunk_bytes();
    return lim / row_bytes;
  }
  const size_t by_staging = (L.staging_bytes / 2) / row_bytes;
  const size_t by_slot = (L.zone_data_bytes() / row_bytes) * static_cast<size_t>(G);
  return by_staging < by_slot ? by_staging : by_slot;
}

}  // namespace nvrar
