// The one error header of the native core: exception types carrying file:line and the
// structured fields of a protocol failure, plus host-side check macros.
//
// Python sees these as nvrar.NvrarError / nvrar.NvrarTimeoutError (bindings.cpp translates).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "../protocol/phase.h"

namespace nvrar {

// Base of every error the core raises on purpose. `what()` is the full, human message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A protocol wait that failed: deadline expired, a peer aborted, or a peer called with a
// different signature. Carries the fields the message names so Python can expose them.
class ProtocolError : public Error {
 public:
  // kInterrupted: a signal handler of the caller raised while the call waited (CPU).
  enum class Kind : uint32_t { kTimeout = 1, kMismatch = 2, kPeerAbort = 3, kViolation = 4, kInterrupted = 5 };

  ProtocolError(Kind kind, const std::string& msg, int rank, int peer, Phase phase, int step,
                uint64_t epoch, uint64_t observed)
      : Error(msg), kind(kind), rank(rank), peer(peer), phase(phase), step(step), epoch(epoch),
        observed(observed) {}

  // A timeout anywhere (ours, or one reported by the peer that aborted us) is a timeout for the
  // caller: every surviving rank of a dead peer raises NvrarTimeoutError.
  bool is_timeout() const { return kind == Kind::kTimeout; }

  Kind kind;
  int rank;
  int peer;
  Phase phase;
  int step;
  uint64_t epoch;
  uint64_t observed;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace nvrar

#define NVRAR_STRINGIFY_(x) #x
#define NVRAR_STRINGIFY(x) NVRAR_STRINGIFY_(x)

// Throws nvrar::Error with file:line and the streamed message when `cond` is false. Always on:
// a failed precondition in a collective must never turn into a silent hang.
#define NVRAR_CHECK(cond, ...)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      throw ::nvrar::Error(::nvrar::detail::concat(__VA_ARGS__, " [", __FILE__, ":",       \
                                                   __LINE__, "]"));                         \
    }                                                                                       \
  } while (0)

// Like NVRAR_CHECK for POSIX calls: appends strerror(errno).
#define NVRAR_CHECK_ERRNO(cond, ...)                                                        \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      int nvrar_err_ = errno;                                                               \
      throw ::nvrar::Error(::nvrar::detail::concat(__VA_ARGS__, ": ",                      \
                                                   ::std::strerror(nvrar_err_), " [",       \
                                                   __FILE__, ":", __LINE__, "]"));          \
    }                                                                                       \
  } while (0)
