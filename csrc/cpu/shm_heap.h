// The CPU symmetric heap: one POSIX shared-memory segment per rank, mapped by every rank of the
// communicator on this host.
//
// Lifecycle (driven by the Communicator's bootstrap):
//   1. ShmHeap(bytes): sweep the segments of this user's dead processes, create my segment
//      (O_EXCL, mode 0600, named after its creator plus 128 random bits), reserve its space in
//      /dev/shm for real (posix_fallocate: a short /dev/shm fails here, not with SIGBUS in a
//      call) and map it.
//   2. name() is exchanged between ranks (all-gather over the bootstrap).
//   3. attach(names): map every peer's segment, each only if it is a file of this user with mode
//      0600 (checked on the open descriptor, before mapping).
//   4. unlink() and unlink_attached(), after a barrier: every rank has mapped every segment, so
//      the names can go, each rank unlinking its own and every one it mapped: a rank killed after
//      the barrier, before its own unlink(), leaves nothing behind either. From then on nothing is
//      left in /dev/shm, even if a process crashes.
//   A rank killed before the barrier leaves its segment; the survivors raise at construction and
//   sweep it (sweep_dead_segments), as does the next setup of this user (step 1).
//
// A process forked from the creator inherits the object but never unlinks or unmaps anything
// through it: those belong to the creator.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace nvrar {

// Field 22 (start time, clock ticks since boot) and field 3 (state) of /proc/<pid>/stat; {0, 0}
// if unreadable. The start time tells a live process from a later one that reuses its pid.
// `flags`, where given, receives field 9 (the kernel's PF_* flags of the process; 0 if unreadable).
std::pair<uint64_t, char> proc_stat(int64_t pid, uint64_t* flags = nullptr);

// Unlink the segments of this user whose creator is dead (it died inside setup: after setup every
// name is unlinked); returns how many went. Run by every new heap (step 1 below) and by the ranks
// of a setup that failed (nvrar.Communicator), so that a rank killed during setup leaves nothing
// behind once the survivors have raised.
int sweep_dead_segments();

// Testing (NVRAR_TEST_KILL_AT; the names in nvrar/_setup.py KILL_POINTS): SIGKILL this process
// where `armed` names `point`. `armed` is "" outside the tests: one comparison, at setup only.
void test_kill_point(const std::string& armed, const char* point);

class ShmHeap {
 public:
  // test_kill_at: the NVRAR_TEST_KILL_AT point, or "" (points inside this constructor and attach).
  ShmHeap(int rank, int world, size_t bytes, const std::string& test_kill_at);
  ~ShmHeap();
  ShmHeap(const ShmHeap&) = delete;
  ShmHeap& operator=(const ShmHeap&) = delete;

  const std::string& name() const { return name_; }
  size_t bytes() const { return bytes_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  // The process that created this heap; any other process (a forked child) must not use it.
  pid_t creator_pid() const { return creator_pid_; }
  bool in_creator() const;

  // Map every peer's segment; names[r] is rank r's name (mine is checked, not re-mapped). An
  // empty name: rank r is on another host; its base is set with set_image.
  void attach(const std::vector<std::string>& names);
  // base(r) of a rank on another host: a local image of its header and cells (not mapped here,
  // never unmapped by release).
  void set_image(int r, char* p) {
    bases_[static_cast<size_t>(r)] = p;
    images_[static_cast<size_t>(r)] = true;
  }
  void unlink();
  // Unlink the peers' segments that attach() mapped (a name already gone is fine). Only once
  // every rank has mapped every segment (the barrier of step 4).
  void unlink_attached();
  bool attached() const { return attached_; }

  char* base(int r) const { return bases_[r]; }
  char* mine() const { return bases_[rank_]; }

  // Unmap everything (idempotent; also done by the destructor).
  void release();

 private:
  int rank_;
  int world_;
  size_t bytes_;
  pid_t creator_pid_;
  std::string name_;
  std::string kill_at_;
  std::vector<std::string> mapped_names_;  // the peers' segments attach() mapped (unlink_attached)
  bool linked_ = false;
  bool attached_ = false;
  std::vector<char*> bases_;
  std::vector<bool> images_;
};

}  // namespace nvrar
