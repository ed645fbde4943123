// The CPU symmetric heap: one POSIX shared-memory segment per rank, mapped by every rank of the
// communicator on this host.
//
// Lifecycle (driven by the Communicator's bootstrap):
//   1. ShmHeap(bytes): create my segment (O_EXCL, mode 0600, a 128-bit random name) and map it.
//   2. name() is exchanged between ranks (all-gather over the bootstrap).
//   3. attach(names): map every peer's segment.
//   4. unlink(), after a barrier: every rank has mapped every segment, so the names can go. From
//      then on nothing is left in /dev/shm, even if a process crashes.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace nvrar {

class ShmHeap {
 public:
  ShmHeap(int rank, int world, size_t bytes);
  ~ShmHeap();
  ShmHeap(const ShmHeap&) = delete;
  ShmHeap& operator=(const ShmHeap&) = delete;

  const std::string& name() const { return name_; }
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

  // Map every peer's segment; names[r] is rank r's name (mine is checked, not re-mapped).
  void attach(const std::vector<std::string>& names);
  void unlink();
  bool attached() const { return attached_; }

  char* base(int r) const { return bases_[r]; }
  char* mine() const { return bases_[rank_]; }

  // Unmap everything (idempotent; also done by the destructor).
  void release();

 private:
  int rank_;
  int world_;
  size_t bytes_;
  std::string name_;
  bool linked_ = false;
  bool attached_ = false;
  std::vector<char*> bases_;
};

}  // namespace nvrar
