#include "shm_heap.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "../common/error.h"

namespace nvrar {

namespace {

// Names carry the creator's pid: /nvrar-<pid>-<128 random bits>. The random part keeps them
// unguessable; the pid lets a later process recognise a segment whose creator died during setup
// (after setup every name is unlinked at once, so only a crash inside setup can leave one).
std::string random_name() {
  unsigned char buf[16];
  size_t got = 0;
  while (got < sizeof(buf)) {
    ssize_t r = getrandom(buf + got, sizeof(buf) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      NVRAR_CHECK_ERRNO(false, "getrandom failed while naming a shared-memory segment");
    }
    got += static_cast<size_t>(r);
  }
  char hex[33];
  for (int i = 0; i < 16; ++i) std::snprintf(hex + 2 * i, 3, "%02x", buf[i]);
  return std::string("/nvrar-") + std::to_string(static_cast<long long>(getpid())) + "-" + hex;
}

constexpr time_t kOrphanAgeS = 3600;  // an unlinked-not-yet segment this old outlived any setup

// Unlink segments that a process of this user created and left behind by dying during setup:
// its pid is gone and the segment is older than any setup lasts.
void sweep_orphans() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  const time_t now = time(nullptr);
  while (struct dirent* ent = readdir(dir)) {
    const std::string name = ent->d_name;
    if (name.rfind("nvrar-", 0) != 0) continue;
    const size_t dash = name.find('-', 6);
    if (dash == std::string::npos) continue;
    const long long pid = std::atoll(name.substr(6, dash - 6).c_str());
    struct stat st;
    if (pid <= 0 || fstatat(dirfd(dir), ent->d_name, &st, 0) != 0) continue;
    if (st.st_uid != geteuid() || now - st.st_mtime < kOrphanAgeS) continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

char* map_fd(int fd, size_t bytes, const std::string& what) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  NVRAR_CHECK_ERRNO(p != MAP_FAILED, "mmap of ", what, " (", bytes, " bytes) failed");
  return static_cast<char*>(p);
}

}  // namespace

ShmHeap::ShmHeap(int rank, int world, size_t bytes)
    : rank_(rank), world_(world), bytes_(bytes), bases_(static_cast<size_t>(world), nullptr) {
  NVRAR_CHECK(rank >= 0 && rank < world, "ShmHeap: rank ", rank, " out of range for world ", world);
  // Segments are sparse: pages are taken on first touch. Say so now if /dev/shm cannot hold them
  // all, instead of dying of SIGBUS in the middle of a call.
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) == 0) {
    unsigned long long avail = static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize;
    NVRAR_CHECK(avail >= bytes, "nvrar: /dev/shm has ", avail, " bytes free but this rank's segment needs ",
                bytes, "; enlarge /dev/shm (docker: --shm-size) or lower max_bytes / heap_bytes");
  }
  sweep_orphans();
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    name_ = random_name();
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR);
    if (fd < 0 && errno != EEXIST) NVRAR_CHECK_ERRNO(false, "shm_open(", name_, ") failed");
  }
  NVRAR_CHECK(fd >= 0, "shm_open: could not find a free segment name");
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    close(fd);
    unlink();
    errno = err;
    NVRAR_CHECK_ERRNO(false, "ftruncate of shared-memory segment to ", bytes, " bytes failed");
  }
  try {
    bases_[rank_] = map_fd(fd, bytes, "my shared-memory segment");
  } catch (...) {
    close(fd);
    unlink();
    throw;
  }
  close(fd);
}

ShmHeap::~ShmHeap() {
  unlink();
  release();
}

void ShmHeap::attach(const std::vector<std::string>& names) {
  NVRAR_CHECK(static_cast<int>(names.size()) == world_, "ShmHeap::attach: got ", names.size(),
              " segment names for a world of ", world_);
  NVRAR_CHECK(names[rank_] == name_, "ShmHeap::attach: rank ", rank_, " found another name at its own index");
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    int fd = shm_open(names[r].c_str(), O_RDWR, 0);
    NVRAR_CHECK_ERRNO(fd >= 0, "rank ", rank_, ": cannot open rank ", r,
                      "'s shared-memory segment (all ranks of the CPU executor must run on one host "
                      "and as one user)");
    struct stat st;
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
      close(fd);
      NVRAR_CHECK(false, "rank ", rank_, ": rank ", r, "'s segment has ", static_cast<long long>(st.st_size),
                  " bytes, expected ", bytes_, " (ranks were configured differently)");
    }
    try {
      bases_[r] = map_fd(fd, bytes_, "a peer's shared-memory segment");
    } catch (...) {
      close(fd);
      throw;
    }
    close(fd);
  }
  attached_ = true;
}

void ShmHeap::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmHeap::release() {
  for (auto& b : bases_) {
    if (b != nullptr) {
      munmap(b, bytes_);
      b = nullptr;
    }
  }
  attached_ = false;
}

}  // namespace nvrar
