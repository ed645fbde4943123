// Protocol phases, named in every error. Host and device.
#pragma once

#include <cstdint>

#include "../common/hd.h"

namespace nvrar {

// Values are stable: they travel between ranks in abort records and through the GPU error record.
enum class Phase : uint32_t {
  kSetup = 0,
  kStageIn = 1,
  kReduceScatter = 2,
  kInterNode = 3,
  kAllGather = 4,
  kOneShot = 5,
};

NVRAR_HD const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kSetup: return "setup";
    case Phase::kStageIn: return "stage-in";
    case Phase::kReduceScatter: return "reduce-scatter";
    case Phase::kInterNode: return "inter-node";
    case Phase::kAllGather: return "all-gather";
    case Phase::kOneShot: return "one-shot-reduce";
  }
  return "unknown";
}

}  // namespace nvrar
