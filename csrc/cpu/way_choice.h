// NOTE [cross-memory or staged] (executor.cpp): the node leader's choice between the two ways of
// moving a private two-shot shard (staged through the segment, or cross-memory transfers), one
// per shard size class, from the times of the calls it made. Pure arithmetic on call times, so
// that the policy is tested on made-up times (nvrar._C.way_choice_trace) as well as on real calls.
#pragma once

#include <algorithm>
#include <cstdint>

#include "segment.h"

namespace nvrar {

constexpr uint32_t kWayProbeEvery = 32;  // the 32nd decision after the faster way changed tries the other way
constexpr uint32_t kWayProbeMax = 128;   // ... and the gap doubles after every trial, up to 128 decisions
constexpr uint32_t kWayTrial = 4;        // ... for this many calls in a row
constexpr uint32_t kWaySettle = 2;       // ... of which the first two are not timed
constexpr double kWayWeight = 0.25;      // each later timed call moves its way's average a quarter of the way
constexpr double kWayOutlier = 1.5;      // ... but one this many times the average is not counted,
constexpr uint32_t kWaySlowRun = 3;      // ... unless this many come in a row

struct WayChoice {
  double ns_per_byte[2] = {0, 0};  // [0] staged, [1] cross-memory
  int last = -1;                   // the way of the last call of this class
  uint32_t streak = 0;             // calls in a row that took it (the first kWaySettle are not averaged)
  int best = -1;                   // the faster way by the averages at the last decision
  uint32_t since = 0;              // decisions since the last trial began (or the faster way changed)
  uint32_t probe_every = 0;        // decisions from then to the next trial (set with `best`)
  uint32_t trial = 0;              // decisions left in a trial of the other way
  int trial_way = 0;               // the way on trial (fixed when the trial starts)
  uint32_t slow_in_row = 0;        // timed calls in a row slower than kWayOutlier times the average

  // After a call of this class that went `way` and took x ns per byte: the way of the calls from
  // two calls on (the leader publishes it with way_word; segment.h).
  int after_call(int way, double x) {
    // A way's first calls in a row are not averaged: the first meet the page faults of slots not
    // touched before, and later ones still pay for the caches the other way left (2-core AMD
    // EPYC KVM guest, 2026-12-03: a staged 1 MB call took 850-1150 us the first two times,
    // 160-190 us right after cross-memory calls, 100-120 us from the third in a row). So the
    // other way is tried kWayTrial calls in a row, and only calls from the (kWaySettle + 1)-th in
    // a row count. The first counted call of a streak replaces its way's average (at most twice
    // it: a slower one lost a time slice to another process) instead of moving it: that
    // average is as old as the last trial, and the host may have
    // changed since (same host, 2026-12-04, 2 ranks, cold, medians of 320 calls: the staged way
    // took 7.3 us a 64 KB call in one minute and 20.5 in another, cross-memory 11.6 and 14.1);
    // moved a quarter of the way per timed call, a stale 20.5 took three trials to fall under 11.6.
    streak = way == last ? streak + 1 : 1;
    last = way;
    double& avg = ns_per_byte[way];
    if (streak == 1) slow_in_row = 0;
    if (streak == kWaySettle + 1) {
      avg = avg == 0 ? x : std::min(x, 2 * avg);
    } else if (streak > kWaySettle) {
      // A call more than kWayOutlier times the average is not counted unless kWaySlowRun of them
      // come in a row (then the way did slow down, and the last of them is its average): beside
      // a busy process a call now and then loses a time slice, and counted at twice the average
      // each moved the average up by a quarter, so that two of them close together could make
      // the slower way look the faster (3% of the calls 50 times slower, 20 made-up runs of 3,000
      // calls, nvrar._C.way_choice_trace: with the other way 1.45 times as slow, 5.5% of the
      // calls on it; 1.1 times as slow, 32.5%; so, 4.0% both, against 3.2% with no slow calls).
      if (x > kWayOutlier * avg && ++slow_in_row < kWaySlowRun) return decide();
      avg = slow_in_row >= kWaySlowRun ? x : avg + (x - avg) * kWayWeight;
      slow_in_row = 0;
    }
    return decide();
  }

 private:
  int decide() {
    // One not yet averaged, else the faster, and now and then a trial of the other one
    // (kWayTrial decisions of the way that was the other when the trial began, whatever its timed
    // calls do to the averages meanwhile). The first trial comes kWayProbeEvery decisions after
    // the faster way changed, and each later one twice as far after the one before, up to
    // kWayProbeMax: every trial is kWayTrial calls of the slower way (a 64 KB call 1.6 times as
    // slow, as above), and with a trial every 32 decisions they were 10.5% of the calls (339 of
    // the 3,224 timed 64 KB-16 MB calls of one latency_check run). A way that slows down is seen
    // within kWaySlowRun calls (it is the one timed); one that speeds up while not taken waits
    // for the next trial.
    const double* a = ns_per_byte;
    int next = a[0] == 0 ? 0 : a[1] == 0 ? 1 : a[0] <= a[1] ? 0 : 1;
    if (a[0] != 0 && a[1] != 0) {
      if (next != best) {  // the faster way changed: trials at the first rate again
        best = next;
        probe_every = kWayProbeEvery;
        since = 0;
      }
      if (trial == 0 && ++since >= probe_every) {
        since = 0;
        probe_every = std::min(2 * probe_every, kWayProbeMax);
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

// The ways a class's calls take when call j takes times[j][way] ns per byte, as the executor runs
// it: call j goes the way the plan word gives it, and the decision after call j holds from call
// j + 2 on (NOTE [cross-memory or staged]).
template <typename Times>
void way_choice_trace(const Times& times, int* out, size_t n) {
  WayChoice wc;
  uint64_t word = 0;
  for (uint64_t j = 0; j < n; ++j) {
    const int way = way_of(word, j);
    out[j] = way;
    const int next = wc.after_call(way, times(j, way));
    word = next_way_word(word, j, next);
  }
}

}  // namespace nvrar
