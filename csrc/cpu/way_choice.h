// NOTE [cross-memory or staged] (executor.cpp): the node leader's choice between the two ways of
// moving a private two-shot shard (staged through the segment, or cross-memory transfers), one
// per shard size class, from the times of the calls it made; the same for the store kind of a
// one-shot stage-in (NOTE [streaming stage-in]) and the algorithm of an auto call (NOTE [one-shot
// or two-shot]). Pure arithmetic on call times, so that the policy is tested on made-up times
// (nvrar._C.way_choice_trace) as well as on real calls.
#pragma once

#include <algorithm>
#include <cstdint>

#include "segment.h"

namespace nvrar {

constexpr uint32_t kWayProbeEvery = 32;  // the 32nd decision after the faster way changed tries the other way
constexpr uint32_t kWayProbeMax = 128;   // ... and the gap doubles after every trial, up to 128 decisions
constexpr uint32_t kWayTrial = 4;        // ... for this many calls in a row
constexpr uint32_t kWaySettle = 2;       // ... of which the first two are not timed
constexpr uint32_t kWayWindow = 8;       // a way's time: the least of its last this many timed calls
constexpr double kWayStaleNs = 100e6;    // the other way's time is stale once its newest timed call is this old

// The size class of a choice (each class has its own WayChoice and plan word): floor(log2(bytes)),
// at most classes - 1.
inline int size_class(size_t bytes, int classes) {
  int c = 0;
  while (c < classes - 1 && (size_t{2} << c) <= bytes) ++c;
  return c;
}

struct WayChoice {
  double recent[2][kWayWindow] = {};  // [0] staged, [1] cross-memory: ns per byte of timed calls (a ring)
  uint32_t filled[2] = {0, 0};        // how many of them hold a time (dropped when the newest is kWayStaleNs old)
  uint32_t head[2] = {0, 0};          // where its next time goes
  int last = -1;                      // the way of the last call of this class
  uint32_t streak = 0;                // calls in a row that took it (the first kWaySettle are not timed)
  int best = -1;                      // the faster way at the last decision
  uint32_t since = 0;                 // decisions since the last trial began (or the faster way changed)
  uint32_t probe_every = 0;           // decisions from then to the next trial (set with `best`)
  uint32_t trial = 0;                 // decisions left in a trial of the other way
  int trial_way = 0;                  // the way on trial (fixed when the trial starts)
  double timed_at[2] = {0, 0};        // when each way's newest timed call ended (ns, a steady clock)

  // A way's time: the least of its last kWayWindow timed calls (0: none yet). A call's time is
  // what the call costs plus whatever else held the core or the line meanwhile (a time slice lost
  // to another process, a peer that arrived late), never less: so the least of a few recent calls
  // is what the way costs now. Beside a busy process (2-core AMD EPYC KVM guest, 2026-12-04, the
  // leader's own times of its calls in a latency_check --busy run, 8-256 KB) half of a way's calls
  // took 1.15-2.7 times the 10th percentile of its times, a tenth of them 1.4-28 times; a moving
  // average of every call (as here until 2026-12-04: each timed call moved it a quarter of the
  // way, calls over 1.5 times it skipped unless three came in a row) took the slower way for 24%
  // of the calls where the ways were 1.3 times apart and 39% where 1.1 times, made-up calls of
  // which 40% took up to 6 times as long (20 seeded runs of 3,000 calls; tests/test_plan.py);
  // the least of eight, 9% and 14%.
  double time_of(int way) const {
    double t = 0;
    for (uint32_t k = 0; k < filled[way]; ++k)
      if (t == 0 || recent[way][k] < t) t = recent[way][k];
    return t;
  }

  // After a call of this class that went `way`, took x ns per byte and ended at now_ns (a steady
  // clock): the way of the calls from two calls on (the leader publishes it with way_word;
  // segment.h).
  int after_call(int way, double x, double now_ns) {
    // A way's first calls in a row are not timed: the first meet the page faults of slots not
    // touched before, and later ones still pay for the caches the other way left (2-core AMD
    // EPYC KVM guest, 2026-12-03: a staged 1 MB call took 850-1150 us the first two times,
    // 160-190 us right after cross-memory calls, 100-120 us from the third in a row). So the
    // other way is tried kWayTrial calls in a row, and only calls from the (kWaySettle + 1)-th in
    // a row count. The first counted call of a streak drops the way's older times where the
    // newest of them is kWayStaleNs old: the host may have changed since (same host, 2026-12-04,
    // 2 ranks, cold, medians of 320 calls: the staged way took 7.3 us a 64 KB call in one minute
    // and 20.5 in another, cross-memory 11.6 and 14.1). Younger ones stay: the way taken comes
    // back after every trial of the other, and dropping its times there left both ways with one
    // or two times each, so that noise decided (made-up calls of which 40% are slowed, in bursts
    // of 50 far apart, tests/test_plan.py: the slower way, 1.5 times as slow, took 14% of the
    // calls, 8% when they stay; 6% and 3% with the calls packed together). A way that slows
    // down while it is taken is left once all of its last kWayWindow calls are slower than the
    // other's time.
    streak = way == last ? streak + 1 : 1;
    last = way;
    if (streak == kWaySettle + 1 && now_ns - timed_at[way] >= kWayStaleNs) filled[way] = head[way] = 0;
    if (streak > kWaySettle) {
      timed_at[way] = now_ns;
      recent[way][head[way]] = x;
      head[way] = (head[way] + 1) % kWayWindow;
      if (filled[way] < kWayWindow) ++filled[way];
    }
    return decide(now_ns);
  }

 private:
  int decide(double now_ns) {
    // One not yet timed, else the faster, and now and then a trial of the other one
    // (kWayTrial decisions of the way that was the other when the trial began, whatever its timed
    // calls do meanwhile). The first trial comes kWayProbeEvery decisions after the faster way
    // changed, and each later one twice as far after the one before, up to kWayProbeMax: every
    // trial is kWayTrial calls of the slower way (a 64 KB call 1.6 times as slow, as above), and
    // with a trial every 32 decisions they were 10.5% of the calls (339 of the 3,224 timed 64
    // KB-16 MB calls of one latency_check run). A way that slows down is seen within kWayWindow
    // calls (it is the one timed); one that speeds up while not taken waits for the next trial.
    //
    // The gap between trials counts decisions, and a class's calls may come in bursts far apart
    // (a message size used now and then; latency_check's rounds, each size's calls in turn),
    // while the state of the host that decides which way is faster changes on a scale of seconds
    // to minutes (NOTE [streaming stage-in]): after a gap the other way's time may be that of
    // another state. On a 2-core AMD EPYC (family 25 model 17, AVX-512) KVM guest, 2026-12-04, a
    // 2 MB two-shot call took 205 us by cross-memory transfers and 90 staged (nvrar-bench, cold,
    // where a cache line crossed between the CPUs in about 100 ns); in latency_check runs whose
    // first round of 45 calls per size met the other state (about 500 ns) and the next two the
    // first, 83-90 of the 135 calls went cross-memory (median 203-206 us, against 84-88 where
    // most went staged): the first round's way, kept into the next, as trials came up to 128
    // decisions apart by then (on made-up times of that pattern, tests/test_plan.py, the whole
    // first burst of the new state went the old way). So a trial also starts once the other
    // way's newest timed call is kWayStaleNs old, when the way taken has been decided at least
    // kWayWindow times since the last trial or change: at most one such trial per 100 ms of a
    // class's calls, and none where its calls come often enough that the count comes first.
    const double a[2] = {time_of(0), time_of(1)};
    int next = a[0] == 0 ? 0 : a[1] == 0 ? 1 : a[0] <= a[1] ? 0 : 1;
    if (a[0] != 0 && a[1] != 0) {
      if (next != best) {  // the faster way changed: trials at the first rate again
        best = next;
        probe_every = kWayProbeEvery;
        since = 0;
      }
      const bool stale = since + 1 >= kWayWindow && now_ns - timed_at[1 - next] >= kWayStaleNs;
      if (trial == 0 && (++since >= probe_every || stale)) {
        if (since >= probe_every) probe_every = std::min(2 * probe_every, kWayProbeMax);
        since = 0;
        trial = kWayTrial;
        trial_way = 1 - next;
      }
      if (trial > 0) {
        --trial;
        next = trial_way;
      }
    }
    return next;
  }
};

// The ways a class's calls take when call j takes times[j][way] ns per byte and ends at ends(j)
// ns, as the executor runs it: call j goes the way the plan word gives it, and the decision after
// call j holds from call j + 2 on (NOTE [cross-memory or staged]).
template <typename Times, typename Ends>
void way_choice_trace(const Times& times, const Ends& ends, int* out, size_t n) {
  WayChoice wc;
  uint64_t word = 0;
  for (uint64_t j = 0; j < n; ++j) {
    const int way = way_of(word, j);
    out[j] = way;
    const int next = wc.after_call(way, times(j, way), ends(j));
    word = next_way_word(word, j, next);
  }
}

}  // namespace nvrar
