// The wire ledger (docs/gpu/emulation.md, "Wire ledger"): the raw operations that the emulation
// logged during one call (emu.h WireOp: who issued what, to which PE and offset) attributed to
// chunks, phases and steps through the segment layout (protocol/plan.h SegmentLayout), counted per
// PE and step, and written as one JSON document (schema nvrar.wire-ledger/1). Host only; used by
// the emulated device driver (driver.cpp: --ledger and the wire_budget cases).
//
// Attribution. An operation with an address names its place: a flag cell's index gives its kind
// (abort, ready, final, inter), parity, slot and slice; a zone or LL zone its parity, slot and
// slice; the slot is an inter-node step of the issuer's schedule (InterSchedule). In-node release
// stores to ready cells end stage-in (one_shot for the one-shot algorithm), to final cells belong
// to the all-gather. An operation without an address (a fence) counts in the context of the next
// addressed operation of the same PE and block (the fence before a flag or a put belongs to that
// flag's step); where the block issues nothing after it, in the block's last context. Chunks: a
// block's addressed operations switch parity when it starts the next chunk.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../protocol/plan.h"
#include "../protocol/round.h"
#include "emu.h"

namespace nvrar {
namespace emu {
namespace ledger {

// The counters, in the order of the JSON (names are the schema's contract).
enum Ctr : int {
  kMessagesMaxPerPeer,
  kPuts,
  kPutSignals,
  kLLPuts,
  kSignalOps,
  kRemoteAtomics,
  kFences,
  kQuiets,
  kFencesBeforeData,
  kSignalOpsBeforeData,
  kProxyFencesIbgda,
  kProxyFencesIbrc,
  kProxyFencesLibfabric,
  kConsistencyWaits,
  kInterNodeBytes,
  kReleaseChainMax,
  kSysFences,
  kDeviceFences,
  kReleaseStores,  // (added) st.release.sys stores, all targets
  kDirectStores,   // (added) system-scope stores into another node's segment (direct mode)
  kNumCtr
};
inline const char* const kCtrName[kNumCtr] = {
    "messages_max_per_peer", "puts", "put_signals", "ll_puts", "signal_ops", "remote_atomics", "fences", "quiets",
    "fences_before_data", "signal_ops_before_data", "proxy_fences_ibgda", "proxy_fences_ibrc",
    "proxy_fences_libfabric", "consistency_waits", "inter_node_bytes", "release_chain_max", "sys_fences",
    "device_fences", "release_stores", "direct_stores"};
// Counters that combine by maximum (over steps of a call); the others add up.
inline bool ctr_is_max(int c) { return c == kMessagesMaxPerPeer || c == kReleaseChainMax; }

struct PeerStat {
  uint64_t puts = 0, put_signals = 0, ll_puts = 0, bytes = 0;
  uint64_t messages() const { return puts + put_signals + ll_puts; }
};

struct Counters {
  uint64_t v[kNumCtr] = {};
  std::map<int, PeerStat> peers;
  void finish() {
    uint64_t m = 0;
    for (const auto& kv : peers) m = std::max(m, kv.second.messages());
    v[kMessagesMaxPerPeer] = m;
  }
  void add(const Counters& o) {  // o finished
    for (int c = 0; c < kNumCtr; ++c) v[c] = ctr_is_max(c) ? std::max(v[c], o.v[c]) : v[c] + o.v[c];
  }
};

enum PhaseId : int { kStageIn, kReduceScatter, kOneShot, kInterNode, kAllGather, kAbort, kNone };
inline const char* const kPhaseName[] = {"stage_in", "reduce_scatter", "one_shot", "inter_node", "all_gather", "abort"};

struct StepKey {
  int chunk = 0, phase = kNone, step = 0;
  bool operator<(const StepKey& o) const { return std::tie(chunk, phase, step) < std::tie(o.chunk, o.phase, o.step); }
  bool operator==(const StepKey& o) const { return chunk == o.chunk && phase == o.phase && step == o.step; }
};

struct StepLedger {
  StepKey key;
  std::vector<Counters> pe;  // per PE
  uint64_t ll_msgs = 0, ps_msgs = 0, ll_bytes = 0, ps_bytes = 0;
  const char* protocol() const {
    if (ll_msgs + ps_msgs == 0) return nullptr;
    if (ll_msgs == 0) return "put_signal";
    if (ps_msgs == 0) return "ll";
    return ps_bytes >= ll_bytes ? "put_signal" : "ll";  // mixed: the one carrying the payload
  }
};

struct Ledger {
  std::vector<StepLedger> steps;  // in (chunk, phase, step) order
  std::vector<Counters> call;     // per PE
  std::vector<Counters> abort;    // per PE (operations of fail(), or of an abort's handling)
  bool any_abort = false;
  size_t raw_ops = 0;
};

// Where an offset of a segment lies.
struct Place {
  enum Kind { kOther, kAbortCell, kReady, kFinal, kInter, kGather, kZone, kLLZone, kLLOut } kind = kOther;
  int parity = -1, slot = -1, b = -1;
};

inline Place decode(const SegmentLayout& L, uint64_t off) {
  Place p;
  const uint64_t B = static_cast<uint64_t>(L.B), G = static_cast<uint64_t>(L.G), S = static_cast<uint64_t>(L.S);
  if (off >= L.cells_off && off < L.staging_off) {
    const uint64_t idx = (off - L.cells_off) / L.cell_stride;
    if (idx == 0) {
      p.kind = Place::kAbortCell;
      return p;
    }
    const uint64_t i = idx - 1, j = i / B;
    p.b = static_cast<int>(i % B);
    if (j < 2 * G) {
      p.kind = Place::kReady;
      p.parity = static_cast<int>(j / G);
    } else if (j < 4 * G) {
      p.kind = Place::kFinal;
      p.parity = static_cast<int>((j - 2 * G) / G);
    } else if (j < 4 * G + 2 * S) {
      p.kind = Place::kInter;
      p.parity = static_cast<int>((j - 4 * G) / S);
      p.slot = static_cast<int>((j - 4 * G) % S);
    } else if (j < 4 * G + 2 * S + 2 * (S - 2)) {
      p.kind = Place::kGather;
      p.parity = static_cast<int>((j - 4 * G - 2 * S) / (S - 2));
    }
    return p;
  }
  // Slots at the layout's places, slices at the call's stride (NOTE [slot strides], plan.h).
  auto zoned = [&](size_t base, size_t slot_bytes, size_t per, Place::Kind k) {
    if (per == 0 || off < base || off >= base + 2 * S * slot_bytes) return false;
    const uint64_t idx = (off - base) / slot_bytes;
    p.kind = k;
    p.b = static_cast<int>((off - base) % slot_bytes / per);
    p.slot = static_cast<int>(idx % S);
    p.parity = static_cast<int>(idx / S);
    return true;
  };
  if (zoned(L.zones_off, L.zone_bytes, L.zone_slice_bytes, Place::kZone)) return p;
  if (zoned(L.llzones_off, L.ll_bytes, L.ll_slice_bytes, Place::kLLZone)) return p;
  if (zoned(L.llout_off, L.ll_bytes, L.ll_slice_bytes, Place::kLLOut)) return p;
  return p;
}

// The issuer's inter-node step that uses `slot` (-1: none).
inline int step_of_slot(int N, int node, int slot) {
  const InterSchedule s = InterSchedule::make(N, node);
  for (int i = 0; i < s.num_steps(); ++i)
    if (s.step(i).slot == slot) return i;
  return -1;
}

struct Context {
  int phase = kNone, step = 0, parity = -1;
};

// The attribution of one call's raw operations (sorted by seq).
inline Ledger attribute(const std::vector<WireOp>& ops, const SegmentLayout& L, int N, int G, bool one_shot) {
  const int W = N * G;
  Ledger led;
  led.raw_ops = ops.size();
  auto node = [&](int pe) { return pe / G; };
  // The context an addressed operation names.
  auto context_of = [&](const WireOp& op) {
    Context c;
    if (op.target < 0) return c;
    const Place p = decode(L, op.kind == WireKind::kPutSignal && op.bytes == 0 && op.sig_offset >= 0
                                  ? static_cast<uint64_t>(op.sig_offset)
                                  : op.offset);
    switch (p.kind) {
      case Place::kAbortCell: c.phase = kAbort; break;
      case Place::kReady: c.phase = one_shot ? kOneShot : kStageIn; break;
      case Place::kFinal: c.phase = kAllGather; break;
      case Place::kInter:
      case Place::kZone:
      case Place::kLLZone:
      case Place::kGather:
        c.phase = kInterNode;
        c.step = p.slot >= 0 ? std::max(0, step_of_slot(N, node(op.pe), p.slot)) : 0;
        break;
      default: break;
    }
    c.parity = p.parity;
    return c;
  };
  // Per (pe, block): the op indices in order, then each op's context.
  std::map<std::pair<int, int>, std::vector<size_t>> by_block;
  for (size_t i = 0; i < ops.size(); ++i) by_block[{ops[i].pe, ops[i].block}].push_back(i);
  std::vector<StepKey> key(ops.size());
  for (auto& kv : by_block) {
    const std::vector<size_t>& idx = kv.second;
    std::vector<Context> ctx(idx.size());
    for (size_t k = 0; k < idx.size(); ++k) ctx[k] = context_of(ops[idx[k]]);
    // Chunks: the parity of the block's addressed (non-abort) operations.
    int chunk = 0, parity = -1;
    std::vector<int> chunk_of(idx.size(), 0);
    for (size_t k = 0; k < idx.size(); ++k) {
      if (ctx[k].phase != kNone && ctx[k].phase != kAbort && ctx[k].parity >= 0) {
        if (parity >= 0 && ctx[k].parity != parity) ++chunk;
        parity = ctx[k].parity;
      }
      chunk_of[k] = chunk;
    }
    // Unaddressed operations: the next addressed one's context, else the last one's.
    Context next;
    int next_chunk = 0;
    bool have_next = false;
    std::vector<Context> fill(idx.size());
    std::vector<int> fill_chunk(idx.size(), 0);
    for (size_t k = idx.size(); k-- > 0;) {
      if (ctx[k].phase != kNone) {
        next = ctx[k];
        next_chunk = chunk_of[k];
        have_next = true;
      }
      fill[k] = have_next ? next : Context{};
      fill_chunk[k] = have_next ? next_chunk : 0;
    }
    Context last;
    int last_chunk = 0;
    bool have_last = false;
    for (size_t k = 0; k < idx.size(); ++k) {
      Context c = ctx[k];
      int ch = chunk_of[k];
      if (c.phase == kNone) {
        if (fill[k].phase != kNone) {
          c = fill[k];
          ch = fill_chunk[k];
        } else if (have_last) {
          c = last;
          ch = last_chunk;
        } else {
          c.phase = one_shot ? kOneShot : kStageIn;  // a block that names no place at all
        }
      } else {
        last = c;
        last_chunk = ch;
        have_last = true;
      }
      key[idx[k]] = StepKey{c.phase == kAbort ? 0 : ch, c.phase, c.phase == kInterNode ? c.step : 0};
    }
  }
  // Words written by an operation from another node (a wait on them needs a consistency step).
  std::set<std::pair<int, uint64_t>> remote_words;
  for (const WireOp& op : ops) {
    if (op.target < 0 || node(op.target) == node(op.pe)) continue;
    if (op.kind == WireKind::kPutSignal && op.sig_offset >= 0)
      remote_words.insert({op.target, static_cast<uint64_t>(op.sig_offset)});
    if (op.kind == WireKind::kSignalOp || op.kind == WireKind::kAtomic || op.kind == WireKind::kStoreRelaxed ||
        op.kind == WireKind::kStoreRelease)
      remote_words.insert({op.target, op.offset});
  }
  std::map<StepKey, StepLedger> steps;
  led.abort.assign(static_cast<size_t>(W), Counters{});
  std::set<std::tuple<int, int, StepKey>> data_seen;  // (pe, block, step): its first data message went
  struct Chain {
    StepKey key;
    uint64_t run = 0;
    bool open = false;
  };
  std::map<std::tuple<int, int, int>, Chain> chains;  // per (pe, block, thread)
  for (size_t i = 0; i < ops.size(); ++i) {
    const WireOp& op = ops[i];
    const StepKey& k = key[i];
    Counters* cp;
    StepLedger* sl = nullptr;
    if (k.phase == kAbort) {
      cp = &led.abort[static_cast<size_t>(op.pe)];
      led.any_abort = true;
    } else {
      auto it = steps.find(k);
      if (it == steps.end()) {
        it = steps.emplace(k, StepLedger{}).first;
        it->second.key = k;
        it->second.pe.assign(static_cast<size_t>(W), Counters{});
      }
      sl = &it->second;
      cp = &sl->pe[static_cast<size_t>(op.pe)];
    }
    Counters& c = *cp;
    const bool remote = op.target >= 0 && op.target != op.pe;
    const bool cross = op.target >= 0 && node(op.target) != node(op.pe);
    const auto seen_key = std::make_tuple(op.pe, op.block, k);
    const bool seen = data_seen.count(seen_key) != 0;
    Chain& ch = chains[std::make_tuple(op.pe, op.block, op.thread)];
    bool keeps_chain = false;
    switch (op.kind) {
      case WireKind::kPut:
      case WireKind::kPutSignal: {
        if (!remote) break;
        const Place p = decode(L, op.offset);
        PeerStat& ps = c.peers[op.target];
        const uint64_t wire = op.bytes + (op.kind == WireKind::kPutSignal ? 8 : 0);
        if (op.kind == WireKind::kPutSignal) {
          ++c.v[kPutSignals];
          ++ps.put_signals;
          if (cross) ++c.v[kProxyFencesLibfabric];  // between the data and the signal
          if (sl) {
            ++sl->ps_msgs;
            sl->ps_bytes += op.bytes;
          }
        } else if (p.kind == Place::kLLZone) {
          ++c.v[kLLPuts];
          ++ps.ll_puts;
          if (sl) {
            ++sl->ll_msgs;
            sl->ll_bytes += op.bytes;
          }
        } else {
          ++c.v[kPuts];
          ++ps.puts;
        }
        ps.bytes += wire;
        if (cross) c.v[kInterNodeBytes] += wire;
        data_seen.insert(seen_key);
        break;
      }
      case WireKind::kSignalOp:
      case WireKind::kAtomic:
        if (!remote) break;
        ++c.v[op.kind == WireKind::kSignalOp ? kSignalOps : kRemoteAtomics];
        if (!seen) ++c.v[kSignalOpsBeforeData];
        if (cross) c.v[kInterNodeBytes] += 8;
        c.peers[op.target].bytes += 8;
        break;
      case WireKind::kFence:
      case WireKind::kQuiet:
        ++c.v[op.kind == WireKind::kFence ? kFences : kQuiets];
        if (!seen) ++c.v[kFencesBeforeData];
        break;
      case WireKind::kWaitUntil:
        if (remote_words.count({op.pe, op.offset})) ++c.v[kConsistencyWaits];
        break;
      case WireKind::kStoreRelaxed:
      case WireKind::kStoreRelease:
        if (cross) {
          ++c.v[kDirectStores];
          c.v[kInterNodeBytes] += 8;
          const Place p = decode(L, op.offset);
          if (p.kind == Place::kLLZone && sl) {  // direct LL packets
            ++sl->ll_msgs;
            sl->ll_bytes += 8;
          }
        }
        keeps_chain = true;
        if (op.kind == WireKind::kStoreRelease) {
          ++c.v[kReleaseStores];
          if (ch.open && ch.key == k)
            ++ch.run;
          else
            ch.run = 1;
          ch.open = true;
          ch.key = k;
          c.v[kReleaseChainMax] = std::max(c.v[kReleaseChainMax], ch.run);
        }
        break;
      case WireKind::kSysFence: ++c.v[kSysFences]; break;
      case WireKind::kDevFence: ++c.v[kDeviceFences]; break;
    }
    if (!keeps_chain) ch.open = false;  // anything else a thread does ends its run of stores
  }
  led.call.assign(static_cast<size_t>(W), Counters{});
  for (auto& kv : steps) {
    for (int p = 0; p < W; ++p) {
      kv.second.pe[static_cast<size_t>(p)].finish();
      led.call[static_cast<size_t>(p)].add(kv.second.pe[static_cast<size_t>(p)]);
    }
    led.steps.push_back(kv.second);
  }
  for (auto& a : led.abort) a.finish();
  return led;
}

inline Counters max_over(const std::vector<Counters>& v) {
  Counters m;
  for (const Counters& c : v)
    for (int k = 0; k < kNumCtr; ++k) m.v[k] = std::max(m.v[k], c.v[k]);
  return m;
}

inline void write_counters(std::ostringstream& os, const Counters& c) {
  for (int k = 0; k < kNumCtr; ++k) os << (k ? ", " : "") << "\"" << kCtrName[k] << "\": " << c.v[k];
}

// What the call ran as (the "plan" object).
struct InterStepPlan {
  int step;
  const char* kind;      // fold_in | exchange | fold_out
  const char* protocol;  // ll | put_signal (of the slice carrying the most bytes)
  uint64_t payload_bytes;  // per PE, all slices
  int ll_slices;           // slices whose step goes by LL packets
};

struct PlanInfo {
  const char* algorithm;
  uint64_t chunks, blocks, chunk_bytes, max_bytes, pool_bytes, ll_max_bytes, oneshot_max;
  int channels;  // < 0: null (one message per block)
  std::vector<uint64_t> slice_bytes;  // per slice of the first chunk
  std::vector<InterStepPlan> inter_steps;
};

inline std::string to_json(const Ledger& led, const std::string& kernel, int N, int G, uint64_t size, const char* dtype,
                           int threads, const PlanInfo& plan, const std::string& extra = "") {
  const int W = N * G;
  std::ostringstream os;
  os << "{\"schema\": \"nvrar.wire-ledger/1\", \"kernel\": \"" << kernel << "\", \"layout\": \"" << N << "x" << G
     << "\", \"nodes\": " << N << ", \"gpus_per_node\": " << G << ", \"pes\": " << W << ", \"size\": " << size
     << ", \"dtype\": \"" << dtype << "\", \"threads\": " << threads << ",\n";
  os << " \"plan\": {\"algorithm\": \"" << plan.algorithm << "\", \"chunks\": " << plan.chunks
     << ", \"blocks\": " << plan.blocks << ", \"chunk_bytes\": " << plan.chunk_bytes << ", \"max_bytes\": "
     << plan.max_bytes << ", \"pool_bytes\": " << plan.pool_bytes << ", \"channels\": ";
  if (plan.channels < 0)
    os << "null";
  else
    os << plan.channels;
  os << ", \"ll_max_bytes\": " << plan.ll_max_bytes << ", \"oneshot_max\": " << plan.oneshot_max
     << ", \"slice_bytes\": [";
  for (size_t i = 0; i < plan.slice_bytes.size(); ++i) os << (i ? ", " : "") << plan.slice_bytes[i];
  os << "], \"inter_steps\": [";
  for (size_t i = 0; i < plan.inter_steps.size(); ++i) {
    const InterStepPlan& s = plan.inter_steps[i];
    os << (i ? ", " : "") << "{\"step\": " << s.step << ", \"kind\": \"" << s.kind << "\", \"protocol\": \""
       << s.protocol << "\", \"payload_bytes\": " << s.payload_bytes << ", \"ll_slices\": " << s.ll_slices << "}";
  }
  os << "]},\n \"steps\": [";
  for (size_t i = 0; i < led.steps.size(); ++i) {
    const StepLedger& s = led.steps[i];
    os << (i ? ",\n  " : "\n  ") << "{\"chunk\": " << s.key.chunk << ", \"phase\": \"" << kPhaseName[s.key.phase]
       << "\", \"step\": " << s.key.step << ", \"protocol\": ";
    if (s.protocol() != nullptr)
      os << "\"" << s.protocol() << "\"";
    else
      os << "null";
    os << ", \"max\": {";
    write_counters(os, max_over(s.pe));
    os << "},\n   \"per_pe\": [";
    for (int p = 0; p < W; ++p) {
      const Counters& c = s.pe[static_cast<size_t>(p)];
      os << (p ? ",\n    " : "\n    ") << "{\"pe\": " << p << ", ";
      write_counters(os, c);
      os << ", \"peers\": {";
      bool first = true;
      for (const auto& kv : c.peers) {
        os << (first ? "" : ", ") << "\"" << kv.first << "\": {\"puts\": " << kv.second.puts
           << ", \"put_signals\": " << kv.second.put_signals << ", \"ll_puts\": " << kv.second.ll_puts
           << ", \"bytes\": " << kv.second.bytes << "}";
        first = false;
      }
      os << "}}";
    }
    os << "]}";
  }
  os << "],\n \"call\": {\"max\": {";
  write_counters(os, max_over(led.call));
  os << "}, \"per_pe\": [";
  for (int p = 0; p < W; ++p) {
    os << (p ? ",\n    " : "\n    ") << "{\"pe\": " << p << ", ";
    write_counters(os, led.call[static_cast<size_t>(p)]);
    os << "}";
  }
  os << "]},\n \"abort\": ";
  if (led.any_abort) {
    os << "{";
    write_counters(os, max_over(led.abort));
    os << "}";
  } else {
    os << "null";
  }
  os << ", \"raw_ops\": " << led.raw_ops << extra << "}\n";
  return os.str();
}

}  // namespace ledger
}  // namespace emu
}  // namespace nvrar
